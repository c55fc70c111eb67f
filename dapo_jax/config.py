"""The run configuration schema: every field a DAPO run reads, with the paper's defaults.

Config files in ``configs/`` start from ``default_config()`` and override fields; the CLI
overrides leaves with ``--config.x=y``. Values follow docs/algorithm.md ("spec N" = its section N).

One piece: the schema (`default_config`, every field with its default and comment) and the checks of
its values (`validate`) sit together, so a field and the rule that checks it are read side by side.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
from typing import Iterator

import ml_collections

from dapo_jax.spec import batch_rules
from dapo_jax.infra.console_log import CONSOLE_MODES
from dapo_jax.infra.logging_writers import WANDB_MODES
from dapo_jax.models import lora
from dapo_jax.models.kv_quant import QUANTIZED as _KV_QUANTIZED_DTYPES
from dapo_jax.models.config import ATTENTION_IMPLS, REMAT_POLICIES, Qwen2Config
from dapo_jax.models.paged_attention import PAGED_IMPLS
from dapo_jax.models.paged_kv import KV_CACHES
from dapo_jax.trainer.objective import KL_PENALTY_KINDS, LOSS_AGG_MODES, ROLLOUT_IS_KINDS
from dapo_jax.trainer.train_step import MICRO_BATCH_LOSSES, WARMUP_STYLES

KV_QUANTIZED = tuple(_KV_QUANTIZED_DTYPES)  # rollout.kv_cache_dtype's 8-bit choices

ROLLOUT_ENGINES = ("static", "continuous")
STOP_TOKENS = ("checkpoint_and_chat", "checkpoint")
SAMPLING_LOOPS = ("stream", "batch", "stream_eager")
VERIFIERS = ("strict", "symbolic")
TOKENIZER_KINDS = ("auto", "hf", "qwen2.5", "qwen2.5-math", "char")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A config value a run cannot use; the message names the field and a value that works."""


def sibling_config(config_file: str, name: str,
                   arg: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of ``name``.py beside ``config_file`` (a config built on another)."""
  path = os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def default_config() -> ml_collections.ConfigDict:
  """The paper's Qwen2.5-32B settings (spec section 8); smaller configs override."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_steps = 1000  # rollout steps (each: dynamic sampling, then mini-batch updates)

  c.model = ml_collections.ConfigDict()
  c.model.preset = "qwen2.5-32b"  # architecture when no checkpoint is given (random init)
  c.model.checkpoint = ""  # HF directory (config.json + safetensors); "" = random init
  c.model.param_dtype = "bfloat16"
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.model.attention_impl = "auto"
  # One stacked decoder layer under jax.lax.scan: the train step compiles in a time flat in the
  # depth (docs/scale.md, "Scanned layers"). Orbax checkpoints differ by layout; HF exports do not.
  c.model.scan_layers = True
  c.model.overrides = ml_collections.ConfigDict()  # extra Qwen2Config fields (tiny models)
  # Low-rank adapters (models/lora.py, docs/lora.md): rank 0 trains every parameter (the paper).
  c.model.lora = ml_collections.ConfigDict(dict(
      rank=0, alpha=16.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
      quantize_base="none"))

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.kind = "auto"  # the checkpoint's own files, else the offline Qwen2.5 BPE (logged; a
  # checkpoint whose vocabulary is not Qwen's is refused)
  c.tokenizer.path = ""

  c.data = ml_collections.ConfigDict()
  c.data.train = "dapo_math_17k"  # a TFDS name (dapo_math_17k, aime_2024), a parquet/jsonl path,
  c.data.eval = "aime_2024"  # or "arithmetic" (the CPU task)
  c.data.data_dir = "~/tensorflow_datasets"
  c.data.manual_dir = "~/dapo_data"
  c.data.dedup = False  # the paper trained on the file as published (~100x repeats)
  c.data.on_malformed = "raise"  # or "skip" (counted and logged)
  c.data.num_epochs = 0  # 0: endless; N: running out of data stops the run (with a checkpoint)
  c.data.max_prompt_length = 2048
  # A prompt that renders to more tokens: "left" cuts its start (spec 7: the end of the question
  # and the generation prompt survive), "right" its end, "error" stops the run. Counted either
  # way (data/prompts_truncated per step, a warning at start-up).
  c.data.truncate = "left"
  c.data.arithmetic = ml_collections.ConfigDict(dict(
      num_train=20000, num_eval=256, min_digits=1, max_digits=2, min_operands=2, max_operands=2,
      ops="+-*"))

  c.rollout = ml_collections.ConfigDict()
  c.rollout.n = 16  # responses per prompt (G)
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.max_response_length = 20480
  # "continuous" (rollout/continuous.py: slots refilled inside the compiled decode loop, any mesh
  # and process count) or "static" (rollout/sampler.py: one while_loop per batch of rows).
  c.rollout.engine = "continuous"
  c.rollout.max_concurrent_decodes = 256  # continuous engine slots (split over the batch axes)
  # The continuous engine's KV cache: "paged" (one page pool; a prompt's pages shared by its G
  # samples; attention reads only live pages; a full pool preempts the youngest sample, which
  # is decoded again and draws the same tokens), "dense" (every slot reserves prompt +
  # response positions and every step reads them), or "auto": paged where it is faster (TPU
  # and GPU, and on CPU from PAGED_MIN_CACHE_LENGTH positions per slot, bench/paged_engine.py).
  c.rollout.kv_cache = "auto"
  c.rollout.page_size = 64  # tokens per page
  c.rollout.kv_pages = 0  # pages in the pool; 0: kv_hbm_fraction of free memory (CPU: no limit)
  c.rollout.kv_hbm_fraction = 0.9
  # Paged decode attention: "auto" (TPU: Pallas paged_attention, GPU: Pallas/Triton
  # paged_attention, CPU: "xla", the pure-JAX reference), or one of those by name.
  c.rollout.attention_impl = "auto"
  # The decode KV caches' storage (dense and paged, every engine, dapo-eval, dapo-serve): ""
  # (the model's dtype, today's cache), model.dtype by name, or 8-bit: "int8" or
  # "float8_e4m3fn", a scale per token and KV head (models/kv_quant.py, docs/kv_int8.md). An
  # 8-bit cache makes the sampler's log-probs differ from the trainer's: it needs
  # algorithm.rollout_is on, unless algorithm.allow_uncorrected_kv_quantization says otherwise.
  c.rollout.kv_cache_dtype = ""
  # Tokens that end a response: "checkpoint_and_chat" the checkpoint's EOS ids plus the chat-end
  # markers <|im_end|> and <|endoftext|> when the vocabulary has them (a base model under a chat
  # template ends with either); "checkpoint" the checkpoint's own (eos_token and
  # generation_config's eos_token_id), as vLLM and so verl stop.
  c.rollout.stop_tokens = "checkpoint_and_chat"
  c.rollout.use_sampler_logprobs = False  # spec 6.2: recompute old log-probs by default
  # Prompts per compiled rollout call (static engine); 0 = the whole generation batch at once.
  # The KV cache grows with it: `dapo-plan` reports what fits.
  c.rollout.prompts_per_call = 0

  c.reward = ml_collections.ConfigDict()
  c.reward.verifier = "strict"
  c.reward.overlong_buffer_enable = True
  c.reward.overlong_buffer_len = 4096
  c.reward.overlong_penalty_factor = 1.0
  c.reward.timeout_s = 5.0
  c.reward.num_workers = 4

  c.algorithm = ml_collections.ConfigDict()
  c.algorithm.norm_adv_by_std = True
  c.algorithm.clip_ratio_low = 0.2
  c.algorithm.clip_ratio_high = 0.28
  c.algorithm.clip_ratio_c = 10.0
  c.algorithm.loss_agg_mode = "token-mean"
  c.algorithm.dynamic_sampling = True
  c.algorithm.gen_batch_size = 1536
  c.algorithm.max_num_gen_batches = 10
  c.algorithm.keep_surplus = False
  # How dynamic sampling drives the rollout: "stream" admits prompts only while they can still
  # be needed and keeps exactly the groups "batch" (whole generation batches) keeps, decoding
  # less; "stream_eager" takes groups as they finish (faster on the continuous engine, biased
  # toward short responses: see docs/fidelity.md).
  c.algorithm.sampling_loop = "stream"
  c.algorithm.overlong_filter = False
  # KL loss towards a frozen copy of the RL start's weights (after any SFT warm start), as
  # verl's actor.use_kl_loss; no reference model is built when off (spec 1).
  c.algorithm.use_kl_loss = False
  c.algorithm.kl_loss_coef = 0.001  # verl's default
  c.algorithm.kl_loss_type = "low_var_kl"  # verl's estimator names (objective.KL_PENALTY_KINDS)
  c.algorithm.entropy_coeff = 0.0
  # Rollout correction (objective.rollout_correction; the paper uses none): importance weights
  # from the sampler's log-probs (behaviour policy) to the recomputed old log-probs.
  # "token_truncated": per-token weight capped at rollout_is_cap (verl's Token-TIS, cap 2);
  # "sequence_mask": sequences whose product of weights leaves rollout_is_band leave the loss
  # (verl's Seq-MIS rejection, seq_sum_k1 "0.5_2.0").
  c.algorithm.rollout_is = "none"
  c.algorithm.rollout_is_cap = 2.0
  c.algorithm.rollout_is_band = (0.5, 2.0)
  # Overlapped rollout (trainer/experience.py, docs/overlap.md): the policy versions a kept
  # token may lag the update that trains it. 0: today's synchronous step; 1: one-step-off (step
  # t+1's batch is generated while step t trains); k: the rollout runs up to k versions ahead.
  # From 1 up the update is the decoupled objective: the ratio is clipped against the recomputed
  # old log-probs (the proximal policy) and weighted by algorithm.rollout_is's behaviour
  # correction, which must then be on, unless allow_uncorrected_staleness says otherwise.
  c.algorithm.max_staleness = 0
  c.algorithm.allow_uncorrected_staleness = False
  # Train on tokens an 8-bit KV cache sampled without the behaviour correction (a stress run).
  c.algorithm.allow_uncorrected_kv_quantization = False
  # Partial rollouts (max_staleness >= 1, the continuous engine, a streaming sampling loop):
  # samples in flight move on to each newer policy as it is handed over, keeping their KV, and
  # every token records its version. Fresher tokens; the run then depends on timing.
  c.algorithm.partial_rollouts = False
  # Pre-rollout skipping (trainer/skip_filter.py, docs/skip_filter.md; GRESO, arXiv 2506.02177):
  # a prompt whose last z groups were all-right (or all-wrong) is rolled out only with probability
  # max(skip_floor, explore[kind]^z); explore[kind] moves by skip_adapt_rate after every step
  # toward the kind holding skip_target / 2 of the decoded groups. Off: today's run, bit for bit.
  # skip_max_prompts bounds the per-prompt history (least recently updated prompts leave first).
  c.algorithm.skip_filter = False
  c.algorithm.skip_target = 0.25
  c.algorithm.skip_floor = 0.05
  c.algorithm.skip_adapt_rate = 0.05
  c.algorithm.skip_max_prompts = 200_000

  c.optim = ml_collections.ConfigDict()
  c.optim.train_batch_size = 512  # prompts per step
  c.optim.mini_batch_size = 32  # prompts per optimizer update -> 16 updates per step
  c.optim.micro_batch_size = 2  # trajectories per micro-batch (memory only; exact token mean)
  c.optim.ppo_epochs = 1
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 20  # rollout steps (the verl script used 10)
  c.optim.warmup_style = "paper"  # lr * (s + 1) / warmup; "verl": lr * s / warmup (0 at step 0)
  # "exact": the mini-batch's own normaliser in every micro-batch (spec 4); "verl": each
  # micro-batch's mean weighted by its share of sequences (verl's approximation).
  c.optim.micro_batch_loss = "exact"
  # Packed sequences (trainer/packing.py): the old log-probs, the KL reference and the update
  # compute on each row's real tokens, several sequences to a packed row of max_tokens_per_row
  # tokens (0: data.max_prompt_length + rollout.max_response_length, the longest sequence),
  # each attending within itself. False: every row P + R long, as before packing existed.
  c.optim.packing = True
  c.optim.max_tokens_per_row = 0
  c.optim.weight_decay = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.grad_clip = 1.0
  c.optim.max_consecutive_skips = 10  # non-finite updates in a row before the run stops

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 5  # rollout steps; 0 = never
  c.eval.num_samples = 1  # per row; the AIME parquet repeats each problem 32x -> avg@32
  c.eval.temperature = 1.0
  c.eval.top_p = 0.7
  c.eval.max_examples = 0  # 0 = all
  c.eval.batch_size = 64

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.save_every = 10
  c.checkpoint.max_to_keep = 3
  c.checkpoint.async_save = True
  # Storage outages (dapo_jax/infra/run_files.py): a failed save is retried at the next one;
  # this many failed in a row stop the run (one line naming the storage error).
  c.checkpoint.max_consecutive_failed_saves = 3
  # How long a launch waits for the workdir's storage (gs://) to answer before it fails.
  c.checkpoint.storage_wait_s = 300.0
  # JAX's persistent compilation cache (a relaunch loads its programs instead of compiling):
  # "auto" = $JAX_COMPILATION_CACHE_DIR if set, else <workdir>/compilation_cache; "off"; or a
  # directory (local or gs://). dapo-eval and dapo-serve use it too
  # (dapo_jax/infra/compile_cache.py).
  c.compilation_cache_dir = "auto"
  # libtpu's windowed einsum (collective matmul) for all-gathers/reduce-scatters: off by default,
  # as from fsdp 8 up its buffers stay live across all layers (dapo_jax/infra/libtpu_flags.py).
  c.tpu_windowed_einsum = False

  # Device meshes as data, [(axis, size), ...] over ("data", "fsdp", "tensor"); one size may be
  # -1 (the remaining devices). Training lays parameters out by sharding.TRAIN_RULES on `mesh`;
  # rollout by sharding.SAMPLE_RULES on `rollout_mesh` (empty: the same devices as `mesh`).
  c.mesh = [("data", 1), ("fsdp", -1), ("tensor", 1)]
  c.rollout_mesh = []
  # Devices that only roll out (the last N of jax.devices()); training uses the others, and
  # `rollout_mesh` lays the N out. 0: rollout and training share every device.
  c.rollout_devices = 0
  # Multislice (several TPU slices joined by the data-centre network, DCN): how many slices each
  # mesh axis spans, "axis=slices,...", e.g. "data=2" on 2 slices. `mesh` stays the whole mesh;
  # each slice holds mesh/dcn_mesh of it, so fsdp/tensor collectives stay on a slice's ICI links
  # (jax mesh_utils.create_hybrid_device_mesh). "": one slice. GPUs: one process = one slice.
  c.dcn_mesh = ""
  c.log_every = 1  # a log line every N rollout steps when stdout is not a terminal
  c.num_sample_texts = 2  # completions written to the logs per step
  c.logging = ml_collections.ConfigDict()
  # "auto": the tqdm bar on a terminal, one plain line per step in a file or pipe (SLURM, tee);
  # "bar" / "lines" force one.
  c.logging.console = "auto"
  c.logging.samples_every = 10  # decoded samples in the log (and wandb) every N steps; 0 = never
  c.logging.wandb = ml_collections.ConfigDict(dict(
      enable=False,  # needs `pip install wandb`; imported only when enabled
      project="dapo_jax", entity="", name="",  # "": wandb's default (your entity, a random name)
      mode="online",  # or "offline" (sync later with `wandb sync`), "disabled"
      tags=""))  # comma-separated, e.g. "dapo,qwen2.5-32b"
  c.sft = ml_collections.ConfigDict(dict(steps=0, batch_size=64, lr=1e-3, warmup_steps=20))
  return c


# Free-form sections: keys checked against another schema (or not at all).
_FREE_FORM = ("model.overrides",)


def unknown_keys(c: ml_collections.ConfigDict, reference: ml_collections.ConfigDict,
                 prefix: str = "") -> Iterator[tuple[str, list[str]]]:
  """(dotted key, close matches) for every key of ``c`` the reference schema lacks."""
  for key in c.keys():
    path = prefix + key
    if key not in reference:
      yield path, difflib.get_close_matches(key, list(reference.keys()), n=1)
    elif (isinstance(c[key], ml_collections.ConfigDict) and path not in _FREE_FORM
          and isinstance(reference[key], ml_collections.ConfigDict)):
      yield from unknown_keys(c[key], reference[key], path + ".")


def _check_keys(c: ml_collections.ConfigDict) -> None:
  """A misspelt key would otherwise be a silent no-op (the default stays in force)."""
  for path, close in unknown_keys(c, default_config()):
    hint = f" Did you mean {'.'.join(path.split('.')[:-1] + close)!r}?" if close else ""
    raise ConfigError(f"config.{path}: unknown config key.{hint} Config files and --config.x=y "
                     "may only set the fields of dapo_jax.config.default_config().")
  fields = [f.name for f in dataclasses.fields(Qwen2Config)]
  for key in (c.model.overrides or {}):
    if key not in fields:
      close = difflib.get_close_matches(key, fields, n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise ConfigError(f"config.model.overrides.{key}: not a Qwen2Config field.{hint}")


def _check_kv_cache(r: ml_collections.ConfigDict, bad) -> None:
  if r.kv_cache not in KV_CACHES:
    bad("rollout.kv_cache", r.kv_cache, f"choose one of {KV_CACHES}")
  if r.attention_impl not in PAGED_IMPLS:
    bad("rollout.attention_impl", r.attention_impl, f"choose one of {PAGED_IMPLS}")
  if r.page_size < 1:
    bad("rollout.page_size", r.page_size, "tokens per page must be >= 1 (e.g. 64)")
  if r.kv_pages < 0:
    bad("rollout.kv_pages", r.kv_pages, "must be >= 0 (0: sized by rollout.kv_hbm_fraction)")
  if not 0 < r.kv_hbm_fraction <= 1:
    bad("rollout.kv_hbm_fraction", r.kv_hbm_fraction, "must be in (0, 1]")


def _check_kv_cache_dtype(c: ml_collections.ConfigDict, bad) -> None:
  """``rollout.kv_cache_dtype`` and the correction an 8-bit cache needs (docs/kv_int8.md)."""
  kv, dtype = c.rollout.kv_cache_dtype, c.model.dtype
  if kv not in ("", dtype, *KV_QUANTIZED):
    bad("rollout.kv_cache_dtype", kv, f"choose '' (model.dtype, {dtype!r}), {dtype!r}, "
        f"{' or '.join(map(repr, KV_QUANTIZED))}")
  if (kv in KV_QUANTIZED and c.algorithm.rollout_is == "none"
      and not c.algorithm.allow_uncorrected_kv_quantization):
    bad("rollout.kv_cache_dtype", kv, "samples with log-probs that differ from the trainer's, "
        "which needs a behaviour correction: set algorithm.rollout_is='token_truncated' (or "
        "'sequence_mask'), or algorithm.allow_uncorrected_kv_quantization=True to train "
        "uncorrected")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises ValueError naming the field for values that would fail later or silently.

  With ``num_devices`` (the run's device count) the batch sizes are also checked against the
  batch axes of the meshes they are split over.
  """

  def bad(field, value, why):
    raise ConfigError(f"config.{field}={value!r}: {why}")

  _check_keys(c)
  if isinstance(c.num_steps, bool) or c.num_steps < 1:
    bad("num_steps", c.num_steps, "must be >= 1 (the rollout steps the run trains, in all)")

  _check_model(c.model, bad)
  if c.rollout.engine not in ROLLOUT_ENGINES:
    bad("rollout.engine", c.rollout.engine, f"choose one of {ROLLOUT_ENGINES}")
  if c.algorithm.sampling_loop not in SAMPLING_LOOPS:
    bad("algorithm.sampling_loop", c.algorithm.sampling_loop, f"choose one of {SAMPLING_LOOPS}")
  if c.reward.verifier not in VERIFIERS:
    bad("reward.verifier", c.reward.verifier, f"choose one of {VERIFIERS}")
  if c.tokenizer.kind not in TOKENIZER_KINDS:
    bad("tokenizer.kind", c.tokenizer.kind, f"choose one of {TOKENIZER_KINDS}")
  if c.algorithm.loss_agg_mode not in LOSS_AGG_MODES:
    bad("algorithm.loss_agg_mode", c.algorithm.loss_agg_mode, f"choose one of {LOSS_AGG_MODES}")
  if c.algorithm.kl_loss_type not in KL_PENALTY_KINDS:
    bad("algorithm.kl_loss_type", c.algorithm.kl_loss_type, f"choose one of {KL_PENALTY_KINDS}")
  if c.algorithm.kl_loss_coef < 0:
    bad("algorithm.kl_loss_coef", c.algorithm.kl_loss_coef, "must be >= 0")
  _check_rollout_is(c, bad)
  _check_overlap(c, num_devices, bad)
  _check_skip_filter(c.algorithm, bad)
  o = c.optim
  if o.warmup_style not in WARMUP_STYLES:
    bad("optim.warmup_style", o.warmup_style, f"choose one of {WARMUP_STYLES}")
  if o.micro_batch_loss not in MICRO_BATCH_LOSSES:
    bad("optim.micro_batch_loss", o.micro_batch_loss, f"choose one of {MICRO_BATCH_LOSSES}")
  _check_packing(c, bad)
  if o.train_batch_size <= 0 or o.mini_batch_size <= 0:
    bad("optim.train_batch_size", o.train_batch_size, "batch sizes must be positive")
  if c.rollout.get("stop_tokens", STOP_TOKENS[0]) not in STOP_TOKENS:
    bad("rollout.stop_tokens", c.rollout.stop_tokens, f"choose one of {STOP_TOKENS}")
  if c.rollout.n < 1:
    bad("rollout.n", c.rollout.n, "need at least one response per prompt")
  if not 0 < c.rollout.top_p <= 1:
    bad("rollout.top_p", c.rollout.top_p, "must be in (0, 1]")
  if c.rollout.temperature <= 0:
    bad("rollout.temperature", c.rollout.temperature, "training rollouts need temperature > 0")
  if c.reward.overlong_buffer_enable and not (
      0 < c.reward.overlong_buffer_len <= c.rollout.max_response_length):
    bad("reward.overlong_buffer_len", c.reward.overlong_buffer_len,
        f"must be in (0, rollout.max_response_length={c.rollout.max_response_length}]")
  if c.algorithm.gen_batch_size < 1:
    bad("algorithm.gen_batch_size", c.algorithm.gen_batch_size, "must be positive")
  if not c.algorithm.dynamic_sampling and c.algorithm.gen_batch_size < o.train_batch_size:
    bad("algorithm.gen_batch_size", c.algorithm.gen_batch_size,
        "without dynamic sampling one generation batch must hold optim.train_batch_size prompts")
  _check_kv_cache(c.rollout, bad)
  _check_kv_cache_dtype(c, bad)
  ppc = c.rollout.prompts_per_call
  if ppc < 0 or (0 < ppc < c.algorithm.gen_batch_size and c.algorithm.gen_batch_size % ppc):
    bad("rollout.prompts_per_call", ppc,
        f"must be 0 (all at once) or divide algorithm.gen_batch_size={c.algorithm.gen_batch_size}")
  for field in ("mesh", "rollout_mesh"):
    _check_mesh(field, c[field], bad)
  _check_dcn(c, bad)
  train_devices = None if num_devices is None else num_devices - c.rollout_devices
  train_split = (None if train_devices is None
                 else batch_rules.batch_shards(c.mesh, train_devices, "mesh", bad))
  batch_rules.check_mini_batch(c, train_split, bad)
  if num_devices is not None:
    batch_rules.check_batch_split(c, num_devices, bad)
  if c.optim.lr <= 0 or c.optim.grad_clip <= 0:
    bad("optim.lr", c.optim.lr, "learning rate and grad_clip must be positive")
  if c.data.truncate not in ("left", "right", "error"):
    bad("data.truncate", c.data.truncate, "choose 'left', 'right' or 'error'")
  if c.data.on_malformed not in ("raise", "skip"):
    bad("data.on_malformed", c.data.on_malformed, "choose 'raise' or 'skip'")
  if c.data.num_epochs < 0:
    bad("data.num_epochs", c.data.num_epochs, "must be >= 0 (0 = endless)")
  if c.checkpoint.save_every < 1:  # 0 stopped the loop after its first step (modulo by zero)
    bad("checkpoint.save_every", c.checkpoint.save_every,
        "must be >= 1 steps (a run also saves at its last step and on SIGTERM)")
  if c.checkpoint.max_consecutive_failed_saves < 1:
    bad("checkpoint.max_consecutive_failed_saves", c.checkpoint.max_consecutive_failed_saves,
        "must be >= 1 (1: the first failed save stops the run)")
  if c.checkpoint.storage_wait_s < 0:
    bad("checkpoint.storage_wait_s", c.checkpoint.storage_wait_s, "must be >= 0 seconds")
  _check_logging(c, bad)


def _check_packing(c: ml_collections.ConfigDict, bad) -> None:
  o = c.optim
  if not isinstance(o.packing, bool):
    bad("optim.packing", o.packing, "must be True or False")
  longest = c.data.max_prompt_length + c.rollout.max_response_length
  if not isinstance(o.max_tokens_per_row, int) or o.max_tokens_per_row < 0 or (
      0 < o.max_tokens_per_row < longest):
    bad("optim.max_tokens_per_row", o.max_tokens_per_row,
        f"must be 0 (the longest sequence) or at least data.max_prompt_length + "
        f"rollout.max_response_length = {longest}, so any sequence fits a packed row")
  if o.packing and o.micro_batch_loss != "exact":
    bad("optim.micro_batch_loss", o.micro_batch_loss,
        "packed micro-batches are no sets of whole rows for verl's per-micro-batch weighting; "
        "use 'exact' or optim.packing=False")


def _check_rollout_is(c: ml_collections.ConfigDict, bad) -> None:
  a = c.algorithm
  if a.rollout_is not in ROLLOUT_IS_KINDS:
    bad("algorithm.rollout_is", a.rollout_is, f"choose one of {ROLLOUT_IS_KINDS}")
  if not a.rollout_is_cap > 0:
    bad("algorithm.rollout_is_cap", a.rollout_is_cap, "must be > 0 (verl's default 2.0)")
  try:
    lo, hi = (float(x) for x in a.rollout_is_band)
  except (TypeError, ValueError):
    bad("algorithm.rollout_is_band", a.rollout_is_band, "expected (lo, hi), e.g. (0.5, 2.0)")
  if not 0 < lo <= 1 <= hi:
    bad("algorithm.rollout_is_band", a.rollout_is_band,
        "must satisfy 0 < lo <= 1 <= hi, e.g. (0.5, 2.0)")
  if a.rollout_is != "none" and c.rollout.use_sampler_logprobs:
    bad("algorithm.rollout_is", a.rollout_is,
        "corrects the recomputed old log-probs towards the sampler's, but "
        "rollout.use_sampler_logprobs=True makes them the sampler's (every weight 1); "
        "set one of the two off")


def _check_skip_filter(a: ml_collections.ConfigDict, bad) -> None:
  """``algorithm.skip_*`` (trainer/skip_filter.py)."""
  if not 0 <= a.skip_target <= 1:
    bad("algorithm.skip_target", a.skip_target,
        "must lie in [0, 1] (the share of zero-variance groups among those decoded)")
  if not 0 < a.skip_floor <= 1:
    bad("algorithm.skip_floor", a.skip_floor,
        "must lie in (0, 1]: the least probability of retrying a skipped prompt")
  if not 0 < a.skip_adapt_rate <= 1:
    bad("algorithm.skip_adapt_rate", a.skip_adapt_rate, "must lie in (0, 1], e.g. 0.05")
  n = a.skip_max_prompts
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    bad("algorithm.skip_max_prompts", n, "must be an integer >= 1 (prompts with a history)")
  if a.skip_filter and not a.dynamic_sampling:
    bad("algorithm.skip_filter", True, "needs algorithm.dynamic_sampling=True (it skips the "
        "prompts dynamic sampling would drop)")


def _check_overlap(c: ml_collections.ConfigDict, num_devices: int | None, bad) -> None:
  """``algorithm.max_staleness`` and ``rollout_devices`` (docs/overlap.md)."""
  a, k = c.algorithm, c.algorithm.max_staleness
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    bad("algorithm.max_staleness", k, "must be an integer >= 0 (0: synchronous)")
  if k and a.rollout_is == "none" and not a.allow_uncorrected_staleness:
    bad("algorithm.max_staleness", k,
        "trains on tokens up to that many policy versions old, which needs the behaviour "
        "correction of the decoupled objective: set algorithm.rollout_is='token_truncated' (or "
        "'sequence_mask'), or algorithm.allow_uncorrected_staleness=True to train uncorrected")
  if a.partial_rollouts and not k:
    bad("algorithm.partial_rollouts", True, "needs algorithm.max_staleness >= 1 (a rollout "
        "running ahead of the update)")
  if a.partial_rollouts and c.rollout.engine != "continuous":
    bad("algorithm.partial_rollouts", True, "needs rollout.engine='continuous' (the static "
        "engine decodes a call with one set of weights)")
  if a.partial_rollouts and a.sampling_loop == "batch":
    bad("algorithm.partial_rollouts", True, "needs a streaming algorithm.sampling_loop "
        "('stream' or 'stream_eager'): weights change between polls of the stream")
  n = c.rollout_devices
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    bad("rollout_devices", n, "must be an integer >= 0 (0: rollout on the training devices)")
  if n and num_devices is not None and n >= num_devices:
    bad("rollout_devices", n,
        f"leaves no device to train on ({num_devices} devices); on CPU simulate more with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N")


def notes(c: ml_collections.ConfigDict) -> list[str]:
  """Choices `validate` allows that change what a run does without an error, one line each
  (`RunSpec.from_config` logs them as warnings): the trainer would otherwise take them in
  silence."""
  a, k, n = c.algorithm, c.algorithm.max_staleness, c.rollout_devices
  out = []
  if k and c.rollout.use_sampler_logprobs:  # validate: then rollout_is is "none", uncorrected
    out.append(
        f"config.rollout.use_sampler_logprobs=True with algorithm.max_staleness={k}"
        f"{' (allow_uncorrected_staleness)' if a.allow_uncorrected_staleness else ''}: the "
        f"ratio is clipped against the sampler's log-probs, a behaviour policy up to {k} "
        "version(s) old, not against the proximal policy of the decoupled objective "
        "(docs/overlap.md); set rollout.use_sampler_logprobs=False for that.")
  if n and not k:
    out.append(
        f"config.rollout_devices={n} with algorithm.max_staleness=0: the last {n} device(s) "
        "only roll out and the others only train, one phase after the other, so each set "
        "idles while the other works; set algorithm.max_staleness >= 1 to overlap the two, or "
        "rollout_devices=0 to give both phases every device.")
  return out


def _check_model(m: ml_collections.ConfigDict, bad) -> None:
  """The model fields `Qwen2Config` checks too, here so dapo-train fails before any work."""
  from dapo_jax.models.presets import PRESETS  # pylint: disable=g-import-not-at-top
  for field in ("param_dtype", "dtype"):
    if m[field] not in DTYPES:
      bad(f"model.{field}", m[field], f"choose one of {DTYPES}")
  if m.remat not in REMAT_POLICIES:
    bad("model.remat", m.remat, f"choose one of {REMAT_POLICIES}")
  if m.attention_impl not in ATTENTION_IMPLS:
    bad("model.attention_impl", m.attention_impl, f"choose one of {ATTENTION_IMPLS}")
  if m.get("lora"):
    why = lora.validate(lora.LoRAConfig.from_config(m.lora))
    if why:
      raise ConfigError(f"config.model.lora.{why}")
  if not m.checkpoint and m.preset.lower() not in PRESETS:
    close = difflib.get_close_matches(m.preset.lower(), list(PRESETS), n=1)
    bad("model.preset", m.preset, f"not a preset{f'; did you mean {close[0]!r}' if close else ''}"
        f" (dapo_jax/models/presets.py lists them), or set model.checkpoint=<HF directory>")


def _check_logging(c: ml_collections.ConfigDict, bad) -> None:
  if c.log_every < 1:
    bad("log_every", c.log_every, "must be >= 1 (a log line every N rollout steps)")
  if c.num_sample_texts < 0:
    bad("num_sample_texts", c.num_sample_texts, "must be >= 0")
  if c.logging.console not in CONSOLE_MODES:
    bad("logging.console", c.logging.console, f"choose one of {CONSOLE_MODES}")
  if c.logging.samples_every < 0:
    bad("logging.samples_every", c.logging.samples_every, "must be >= 0 (0 = never)")
  wb = c.logging.wandb
  if wb.mode not in WANDB_MODES:
    bad("logging.wandb.mode", wb.mode, f"choose one of {WANDB_MODES}")
  if wb.enable:
    if not wb.project:
      bad("logging.wandb.project", wb.project, "name the wandb project")
    try:  # here, before the model is built, rather than after minutes of start-up
      import wandb  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      bad("logging.wandb.enable", wb.enable, "the wandb package is not installed: pip install "
          "wandb (or set --config.logging.wandb.enable=False)")


def _check_mesh(field: str, axes, bad) -> None:
  """[(name, size), ...] with known axis names and at most one -1 (device counts checked later)."""
  valid = ("data", "fsdp", "tensor")
  try:
    pairs = [(str(n), int(s)) for n, s in axes]
  except (TypeError, ValueError):
    bad(field, axes, "expected a list of (axis, size) pairs, e.g. [('fsdp', -1), ('tensor', 4)]")
  names = [n for n, _ in pairs]
  if any(n not in valid for n in names) or len(set(names)) != len(names):
    bad(field, axes, f"axis names must be distinct and among {valid}")
  sizes = [s for _, s in pairs]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    bad(field, axes, "sizes must be positive, with at most one -1 (the remaining devices)")


def check_mesh(field: str, axes, num_devices: int) -> None:
  """``config.<field>`` (``mesh``, ``rollout_mesh``) laid over ``num_devices``, one device
  included: dapo-train's checks of it, for the commands that read a saved run's config without
  validating it again (dapo-eval, dapo-serve, dapo-export)."""

  def bad(field, value, why):
    raise ConfigError(f"config.{field}={value!r}: {why}")

  _check_mesh(field, axes, bad)
  batch_rules.batch_shards(axes, num_devices, field, bad)


def _check_dcn(c: ml_collections.ConfigDict, bad) -> None:
  """``dcn_mesh``: "axis=slices,..." over axes of ``mesh``, slice counts >= 1."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  try:
    pairs = shd.parse_dcn(c.dcn_mesh)
  except (TypeError, ValueError):
    bad("dcn_mesh", c.dcn_mesh, "expected 'axis=slices,...', e.g. 'data=2'")
  mesh_names = [str(n) for n, _ in c.mesh]
  if any(n not in mesh_names for n, _ in pairs) or any(k < 1 for _, k in pairs):
    bad("dcn_mesh", c.dcn_mesh, f"axes must be among config.mesh's {mesh_names}, slice counts "
        ">= 1")
