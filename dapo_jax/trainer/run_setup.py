"""Builds what a run needs from its spec (`RunSpec`, each builder the sections it reads): mesh,
tokenizer, model, datasets, step settings, and ``build_run``'s bundle of all of them for the
trainer.

One piece: the one place a run is assembled, in the order its parts depend on each other (the
tokenizer before the model's vocabulary check, the meshes before the model, the model before the
engines), which every command that builds part of a run (dapo-eval, dapo-serve, the rollout
process) reuses builder by builder."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import distributed
from dapo_jax.infra import run_files
from dapo_jax.infra import sharding as shd
from dapo_jax.checkpoints.hf import load_pretrained, read_hf_config
from dapo_jax.checkpoints.orbax import TrainCheckpointer
from dapo_jax.data import arithmetic
from dapo_jax.data.loaders import load_records
from dapo_jax.data.pipeline import PromptIterator, check_prompt_lengths
from dapo_jax.data.records import MathRecord
from dapo_jax.trainer.dynamic_sampling import DynamicSampler
from dapo_jax.trainer.skip_filter import SkipFilter
from dapo_jax.trainer.generation import Generator
from dapo_jax.models import (Qwen2Config, abstract_model, attention, create_model,
                             get_preset, lora)
from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.rollout.factory import make_rollout, make_stream_opener
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.weights import MergedRolloutWeights, RolloutWeights
from dapo_jax.spec.run_spec import (ArithmeticSpec, DataSpec, EvalSpec, ModelSpec, RolloutSpec,
                                   RunSpec, TokenizerSpec)
from dapo_jax.spec.run_spec import Mesh as MeshAxes
from dapo_jax.tokenizers.choice import check_vocabulary, choose_tokenizer
from dapo_jax.trainer.trajectories import ScoredGroup
from dapo_jax.trainer.train_step import (LogProbForward, TrainConfig, TrainState, TrainStep,
                                 init_train_state)

_log = logging.getLogger(__name__)
TFDS_NAMES = ("dapo_math_17k", "aime_2024")


def build_mesh(axes: MeshAxes, dcn_mesh: str = "", devices: Sequence[Any] | None = None
               ) -> Mesh | None:
  """The training mesh (``spec.mesh``, ``spec.dcn_mesh``) over ``devices`` (default: all);
  None on a single device (no sharding machinery at all)."""
  if devices is None and jax.device_count() == 1:
    return None
  return shd.make_mesh([tuple(a) for a in axes], devices=devices, dcn_axes=dcn_mesh)


def build_rollout_mesh(axes: MeshAxes, dcn_mesh: str, train_mesh: Mesh | None,
                       devices: Sequence[Any] | None = None) -> Mesh | None:
  """The rollout mesh: ``axes`` (``spec.rollout_mesh``) over the same devices, else (empty) the
  training mesh; with ``devices`` (`distributed.split_devices`), ``axes`` over those devices alone.

  Parameters move between the two layouts once per training step (``rollout.weights``;
  ``sharding.reshard_cost`` gives the peak memory of that move).
  """
  if devices is not None:
    return shd.make_mesh([tuple(a) for a in axes], devices=devices, dcn_axes=dcn_mesh)
  if train_mesh is None or not axes:
    return train_mesh
  return shd.make_mesh([tuple(a) for a in axes], dcn_axes=dcn_mesh)


def build_tokenizer(tok: TokenizerSpec, checkpoint: str = ""):
  """The tokenizer ``tok`` names; its files are ``tok.path``, else the model's ``checkpoint``.
  Logs which one it chose and why (`model_config` then checks the model's vocabulary fits it)."""
  tokenizer, line, fell_back = choose_tokenizer(tok.kind, tok.path, checkpoint)
  (_log.warning if fell_back else _log.info)(line)
  return tokenizer


def model_runtime(m: ModelSpec) -> dict[str, Any]:
  """The run-time `Qwen2Config` fields of ``m`` (not part of a HF checkpoint).

  A workdir config saved before ``model.scan_layers`` existed reads as the unscanned layout its
  checkpoints were written in (`run_spec.with_defaults`).
  """
  return dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat,
              attention_impl=m.attention_impl, scan_layers=bool(m.scan_layers))


def model_config(m: ModelSpec, tokenizer_kind: str, tokenizer) -> Qwen2Config:
  """The architecture: the checkpoint's config.json, else the preset plus overrides (the
  vocabulary: the tokenizer's for ``tokenizer_kind`` "char", else at least the preset's); a
  vocabulary the tokenizer does not fit is refused (`check_vocabulary`)."""
  if m.checkpoint:
    cfg = Qwen2Config.from_hf(read_hf_config(os.path.expanduser(m.checkpoint)),
                             **model_runtime(m))
    check_vocabulary(cfg.vocab_size, tokenizer, f"model.checkpoint={m.checkpoint}", True)
    return cfg
  overrides = dict(m.overrides)
  overrides.setdefault("vocab_size", max(tokenizer.vocab_size, get_preset(m.preset).vocab_size)
                       if tokenizer_kind != "char" else tokenizer.vocab_size)
  cfg = get_preset(m.preset, **model_runtime(m), **overrides)
  check_vocabulary(cfg.vocab_size, tokenizer, f"model.preset={m.preset}", False)
  return cfg


def build_model(m: ModelSpec, tokenizer_kind: str, tokenizer, mesh: Mesh | None, seed: int):
  """The model: ``m.checkpoint``'s weights, else `model_config`'s architecture drawn at
  ``seed``; either after `model_config` has checked the vocabulary (before any weight is
  read)."""
  cfg = model_config(m, tokenizer_kind, tokenizer)
  if m.checkpoint:
    return load_pretrained(os.path.expanduser(m.checkpoint), mesh=mesh, **model_runtime(m))
  return create_model(cfg, seed=seed, mesh=mesh)


def _arith_config(a: ArithmeticSpec) -> arithmetic.ArithmeticConfig:
  return arithmetic.ArithmeticConfig(min_digits=a.min_digits, max_digits=a.max_digits,
                                     min_operands=a.min_operands, max_operands=a.max_operands,
                                     ops=a.ops)


def load_dataset(name: str, d: DataSpec, seed: int, split: str) -> Sequence[MathRecord]:
  """A dataset by config name: "arithmetic", a TFDS name, or a parquet/JSONL path, read as
  ``d`` (the config's ``data``) says; ``seed`` (the run's) draws the arithmetic train split (its
  eval split is always seed 0)."""
  if name == "arithmetic":
    n = d.arithmetic.num_train if split == "train" else d.arithmetic.num_eval
    return arithmetic.make_records(n, split="train" if split == "train" else "test",
                                   seed=seed if split == "train" else 0,
                                   config=_arith_config(d.arithmetic))
  base = name.split("/")[0]
  if base in TFDS_NAMES:
    from dapo_jax.data.builders import load_split  # pylint: disable=g-import-not-at-top
    tfds_split = "train" if base == "dapo_math_17k" else "test"
    name = name if (not d.dedup or "/" in name) else f"{name}/dedup"
    return load_split(name, os.path.expanduser(d.data_dir), os.path.expanduser(d.manual_dir),
                      tfds_split)
  records, stats = load_records(os.path.expanduser(name), on_malformed=d.on_malformed,
                                dedup=d.dedup)
  if stats.malformed_skipped:
    _log.warning("%s: skipped %d malformed rows (data.on_malformed='skip').", name,
                 stats.malformed_skipped)
  return records


def sampling_params(r: RolloutSpec, e: EvalSpec, tokenizer, *, eval_mode: bool = False
                    ) -> SamplingParams:
  """The rollout's sampling settings (``e``'s temperature and top_p, no top_k, in
  ``eval_mode``)."""
  return SamplingParams(
      temperature=e.temperature if eval_mode else r.temperature,
      top_p=e.top_p if eval_mode else r.top_p, top_k=0 if eval_mode else r.top_k,
      max_new_tokens=r.max_response_length, eos_ids=stop_ids(r.stop_tokens, tokenizer),
      pad_id=tokenizer.pad_id)


def stop_ids(stop_tokens: str, tokenizer) -> tuple[int, ...]:
  """The ids that end a response under ``stop_tokens`` (``rollout.stop_tokens``)."""
  if stop_tokens == "checkpoint":
    return tuple(tokenizer.checkpoint_eos_ids)
  return tuple(tokenizer.eos_ids)


def for_rollout(model: Any, r: RolloutSpec) -> Any:
  """``model`` (changed in place) with its decode caches stored as ``r.kv_cache_dtype`` says
  (``rollout.kv_cache_dtype``; the config is static, so every engine split from it, and nothing
  else, builds its caches so: full-sequence passes never read it)."""
  model.config = model.config.replace(kv_cache_dtype=r.kv_cache_dtype)
  return model


def kv_cache_args(r: RolloutSpec) -> dict[str, Any]:
  """The continuous engine's KV-cache arguments in ``r`` (the run's ``rollout``)."""
  return dict(kv_cache=r.kv_cache, page_size=r.page_size, kv_pages=r.kv_pages,
              kv_hbm_fraction=r.kv_hbm_fraction, attention_impl=r.attention_impl)


def engine_args(r: RolloutSpec, max_prompt_length: int) -> dict[str, Any]:
  """`make_rollout`'s and `make_stream_opener`'s engine settings: ``r``'s (the run's
  ``rollout``) slots and KV cache, prompts of up to ``max_prompt_length`` tokens
  (``data.max_prompt_length``)."""
  return dict(max_prompt_length=max_prompt_length,
              max_concurrent_decodes=r.max_concurrent_decodes, **kv_cache_args(r))


def attention_fallback(max_length: int, mcfg: Qwen2Config, platform: str) -> str | None:
  """Why ``attention_impl="auto"`` runs the XLA einsums over the training rows of
  ``max_length`` tokens (``spec.sizes.max_length``: data.max_prompt_length +
  rollout.max_response_length) on an accelerator (their [B, heads, T, S] scores cost memory and
  time), or None when it does not."""
  t = max_length
  if mcfg.attention_impl != "auto" or attention.resolve_impl(
      "auto", platform=platform, dtype=mcfg.jnp_dtype, seq_len=t,
      head_dim=mcfg.dim_per_head) != "xla":
    return None
  fix = ("set data.max_prompt_length + rollout.max_response_length to a multiple of 128 (e.g. "
         f"{-(-t // 128) * 128})")
  if platform == "tpu":
    return (f"Training rows of {t} tokens run XLA attention on TPU, not the splash kernel: "
            f"{fix}.")
  if platform in ("gpu", "cuda"):
    return (f"Training rows run XLA attention on GPU, not cuDNN flash attention, which needs "
            f"bf16/fp16 compute (model.dtype={mcfg.dtype!r}), a head dim that is a multiple of 8 "
            f"up to 128 (here {mcfg.dim_per_head}) and an even length (here {t}).")
  return None


def describe(m: ModelSpec, model: Any) -> str:
  """One line naming ``model`` (``m.checkpoint``, else ``m.preset``), its size and the devices."""
  n = model.config.num_params()
  return (f"model {m.checkpoint or m.preset}: {n / 1e6:.2f}M params, "
          f"{jax.device_count()} devices ({jax.default_backend()})")


def commit(state: TrainState, mesh: Mesh | None) -> TrainState:
  """On one device, arrays restored from a checkpoint are committed to it and fresh ones are
  not, so jit would compile every program twice (a resumed run misses the persistent compile
  cache); committing both makes them the same programs."""
  return state if mesh is not None else jax.device_put(state, jax.devices()[0])


@dataclasses.dataclass
class Run:
  """Everything ``train_and_evaluate`` builds once from the run spec; ``close`` (or ``with``)
  waits for the last checkpoint write and ends the verifier's workers."""
  mesh: Mesh | None
  tokenizer: Any
  train_records: Sequence[MathRecord]
  eval_records: Sequence[MathRecord]
  rollout: Any  # (weights, ids, mask, key, SamplingParams, n) -> the same host RolloutBatch
  # Trained params -> the rollout's copy, once per step. A rollout process (``dapo-train
  # --role=rollout``) uses its ``receive`` half alone (a LoRA run's: the frozen base held here).
  to_rollout: RolloutWeights
  # The training side; None on a rollout process.
  train_config: TrainConfig | None
  graphdef: nnx.GraphDef | None
  step_fn: TrainStep | None
  logp_fn: LogProbForward | None
  iterator: PromptIterator  # this process's share of each generation batch
  checkpointer: TrainCheckpointer | None
  scorer: RewardScorer
  generator: Generator  # the training rollout: generate_and_score at rollout.* settings
  sampler: DynamicSampler
  # LoRA: the frozen base's source and fingerprint, saved with every checkpoint; None: no LoRA.
  lora_base: dict[str, Any] | None = None
  rollout_mesh: Mesh | None = None  # where the rollout's weights live (None: one device)

  def fresh_optimizer(self, state: TrainState) -> TrainState:
    """``state``'s weights with a new optimizer state (DAPO after the SFT warm start)."""
    model = nnx.merge(self.graphdef, state.params, state.rest)
    state = commit(init_train_state(model, self.train_config, self.mesh)[1], self.mesh)
    if isinstance(self.to_rollout, MergedRolloutWeights):
      self.to_rollout.base = state.rest
    return state

  def close(self) -> None:
    try:
      if self.checkpointer is not None:
        self.checkpointer.close()
    finally:
      self.scorer.close()

  def __enter__(self) -> Run:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def build_run(spec: RunSpec, workdir: str, role: str = "both") -> tuple[Run, TrainState | None]:
  """Model, data, rollout, compiled steps, checkpointer and verifier of a run of ``spec`` in
  ``workdir``, and the fresh train state (committed; a checkpoint in ``workdir`` replaces it).

  ``role`` (``dapo-train --role``, `rollout_process`): "both" (this process trains and rolls
  out), "train" or "rollout" (the other process does the other; this process's devices, all of
  them, are laid out as ``mesh`` and ``rollout_mesh`` say). A rollout process builds no train
  state (None), train step or checkpointer, and reads or draws no weights: the sampler's
  structure comes from the model's config alone (a LoRA run's frozen base aside)."""
  if role == "both":
    train_devices, rollout_devices = distributed.split_devices(spec.rollout_devices)
  else:  # both meshes over this side's devices, laid out as the one-process split lays them
    train_devices = rollout_devices = jax.devices()
  mesh = build_mesh(spec.mesh, spec.dcn_mesh, train_devices)
  tok = spec.tokenizer
  tokenizer, tokenizer_line, fell_back = choose_tokenizer(tok.kind, tok.path, spec.model.checkpoint)
  lcfg = lora.LoRAConfig.from_config(spec.model.lora)
  if role == "rollout" and not lcfg.rank:
    # The sampler's structure alone: the weights arrive from the training process each step,
    # so none is read or drawn here (a LoRA run's frozen base is: only adapters cross).
    model = abstract_model(model_config(spec.model, spec.tokenizer.kind, tokenizer))
  else:
    model = build_model(spec.model, spec.tokenizer.kind, tokenizer, mesh, spec.seed)
  (_log.warning if fell_back else _log.info)("%s; %s", describe(spec.model, model), tokenizer_line)
  fallback = attention_fallback(spec.sizes.max_length, model.config, jax.default_backend())
  if fallback:
    _log.warning(fallback)
  train_records = load_dataset(spec.data.train, spec.data, spec.seed, "train")
  eval_records = (load_dataset(spec.data.eval, spec.data, spec.seed, "eval") if spec.data.eval
                  else [])
  check_prompt_lengths(train_records, tokenizer, spec.data.max_prompt_length, spec.data.truncate)
  # A LoRA run samples the merged weights: no adapters. The KV caches as rollout.kv_cache_dtype.
  sampler_graphdef, _ = nnx.split(for_rollout(model, spec.rollout))
  # On several processes: host prompts in, the same host RolloutBatch out on every process.
  rollout_mesh = build_rollout_mesh(spec.rollout_mesh or spec.mesh if rollout_devices else
                                    spec.rollout_mesh, spec.dcn_mesh, mesh, rollout_devices)
  r, a = spec.rollout, spec.algorithm
  engine = engine_args(r, spec.data.max_prompt_length)
  rollout = make_rollout(r.engine, sampler_graphdef, rollout_mesh, tokenizer, **engine)
  base_record = None
  if role == "rollout":
    to_rollout, base_record = _rollout_side_weights(spec, model, rollout_mesh, lcfg)
    del model
    tcfg = graphdef = state = ckpt = None
  elif lcfg.rank:
    lora.add_adapters(model, lcfg, seed=spec.seed, mesh=mesh)
    to_rollout = MergedRolloutWeights(model.config.jnp_param_dtype, rollout_mesh, lcfg.scale)
  else:
    to_rollout = RolloutWeights(model.config.jnp_param_dtype, rollout_mesh)
  if role != "rollout":
    tcfg = spec.train_config()
    graphdef, state = init_train_state(model, tcfg, mesh)
    state = commit(state, mesh)
    if lcfg.rank:
      to_rollout.base = state.rest
    del model
  iterator = PromptIterator(train_records, a.gen_batch_size, spec.seed,
                            num_epochs=spec.data.num_epochs or None,
                            process_index=jax.process_index(),
                            process_count=jax.process_count())
  c = spec.checkpoint
  if role != "rollout":
    ckpt = TrainCheckpointer(run_files.resolve(workdir) / "checkpoints",
                             max_to_keep=c.max_to_keep, async_save=c.async_save,
                             max_consecutive_failed_saves=c.max_consecutive_failed_saves)
  w = spec.reward
  scorer = RewardScorer(w.verifier, max_response_length=r.max_response_length,
                        overlong_buffer_len=w.overlong_buffer_len,
                        overlong_penalty_factor=w.overlong_penalty_factor,
                        overlong_buffer_enable=w.overlong_buffer_enable, timeout_s=w.timeout_s,
                        num_workers=w.num_workers)
  generator = Generator(rollout, tokenizer, scorer,
                        sampling_params(r, spec.eval, tokenizer),
                        num_samples=r.n, max_prompt_length=spec.data.max_prompt_length,
                        prompts_per_call=r.prompts_per_call, truncate=spec.data.truncate,
                        open_stream=make_stream_opener(
                            r.engine, sampler_graphdef, rollout_mesh, rollout,
                            gen_batch_size=a.gen_batch_size,
                            prompts_per_call=r.prompts_per_call, **engine))
  sampler = DynamicSampler(
      train_batch_size=spec.optim.train_batch_size,
      max_num_gen_batches=a.max_num_gen_batches if a.dynamic_sampling else 0,
      keep_surplus=a.keep_surplus, enable=a.dynamic_sampling, group_type=ScoredGroup,
      prefilter=skip_filter(spec))
  run = Run(mesh=mesh, tokenizer=tokenizer, train_records=train_records,
            eval_records=eval_records, rollout=rollout, to_rollout=to_rollout,
            train_config=tcfg, graphdef=graphdef,
            step_fn=None if state is None else TrainStep(graphdef, tcfg, mesh),
            logp_fn=None if state is None else LogProbForward(graphdef, tcfg, mesh,
                                                              rest=state.rest),
            iterator=iterator, checkpointer=ckpt, scorer=scorer, generator=generator,
            sampler=sampler,
            lora_base=(lora_base(spec.model, spec.seed, state.rest) if lcfg.rank and state else
                       base_record),
            rollout_mesh=rollout_mesh)
  return run, state


def _rollout_side_weights(spec: RunSpec, model: Any, rollout_mesh: Mesh | None,
                          lcfg: lora.LoRAConfig) -> tuple[RolloutWeights, dict | None]:
  """A rollout process's `RolloutWeights` (its ``receive`` half) and, in a LoRA run, the
  record of the frozen base it holds: ``model``'s weights (loaded or drawn as the training
  process's are) cast and laid out for the rollout once, so only adapters cross per step."""
  dtype = model.config.jnp_param_dtype
  if not lcfg.rank:
    return RolloutWeights(dtype, rollout_mesh), None
  base = nnx.state(model)
  record = lora_base(spec.model, spec.seed, base)
  held = MergedRolloutWeights(dtype, rollout_mesh, lcfg.scale, base=base)
  held.base = held.rollout_base()  # the rollout copy alone: ``model`` is dropped by the caller
  return held, record


def skip_filter(spec: RunSpec) -> SkipFilter | None:
  """``algorithm.skip_filter``'s pre-rollout filter, this process's shard of the history."""
  a = spec.algorithm
  if not a.skip_filter:
    return None
  return SkipFilter(seed=spec.seed, group_size=spec.rollout.n, target=a.skip_target,
                    floor=a.skip_floor, adapt_rate=a.skip_adapt_rate,
                    max_prompts=a.skip_max_prompts, process_index=jax.process_index(),
                    process_count=jax.process_count())


def lora_base(m: ModelSpec, seed: int, base: Any) -> dict[str, Any]:
  """Where a LoRA run's frozen base comes from (``m``: the run's model; ``seed``: a preset's
  init) and the fingerprint of its weights ``base`` (a train state's ``rest``)."""
  from dapo_jax.checkpoints import lora_base as base_lib  # pylint: disable=g-import-not-at-top
  return base_lib.record(m, seed, base)


def check_lora_base(run: Run, meta: dict[str, Any]) -> None:
  """Refuses, in one line, adapters restored onto a base other than the one they trained on
  (or a LoRA checkpoint restored without LoRA, and the reverse)."""
  from dapo_jax.checkpoints import lora_base as base_lib  # pylint: disable=g-import-not-at-top
  base_lib.check(f"{run.checkpointer.directory} step {meta['step']}", meta.get("lora_base"),
                 run.lora_base, "relaunch with that base or start a new workdir")
