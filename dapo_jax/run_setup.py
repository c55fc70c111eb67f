"""Builds what a run needs from its config: mesh, tokenizer, model, datasets, step settings."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from dapo_jax import sharding as shd
from dapo_jax.char_tokenizer import CharTokenizer
from dapo_jax.checkpoints.hf import load_pretrained
from dapo_jax.data import arithmetic
from dapo_jax.data.loaders import load_records
from dapo_jax.data.records import MathRecord
from dapo_jax.models import Qwen2Config, attention, cast_params, create_model, get_preset
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.tokenizer import load_tokenizer
from dapo_jax.train_step import TrainConfig

_log = logging.getLogger(__name__)
TFDS_NAMES = ("dapo_math_17k", "aime_2024")


def build_mesh(config: ml_collections.ConfigDict) -> Mesh | None:
  """The training mesh; None on a single device (no sharding machinery at all)."""
  if jax.device_count() == 1:
    return None
  return shd.make_mesh([tuple(a) for a in config.mesh], dcn_axes=config.get("dcn_mesh"))


def build_rollout_mesh(config: ml_collections.ConfigDict, train_mesh: Mesh | None
                       ) -> Mesh | None:
  """The rollout mesh: ``config.rollout_mesh`` over the same devices, else the training mesh.

  Parameters move between the two layouts once per training step (``RolloutWeights``;
  ``sharding.reshard_cost`` gives the peak memory of that move).
  """
  axes = config.get("rollout_mesh") or []
  if train_mesh is None or not axes:
    return train_mesh
  return shd.make_mesh([tuple(a) for a in axes], dcn_axes=config.get("dcn_mesh"))


class RolloutWeights:
  """The policy as the rollout reads it: the trained params (fp32 master weights of a bf16
  model) cast to the model's dtype, then moved to the rollout layout.

  The cast happens first, on each device's training shard, so the move carries the model's
  bytes, never the fp32 copy: this is the reshard ``dapo-plan`` compiles and prices. The trainer
  makes one copy per step, shared by every rollout call (``rollout.prompts_per_call``) and
  evaluation of that step, and drops it before the update.
  """

  def __init__(self, dtype: Any, mesh: Mesh | None):
    self.dtype, self.mesh = dtype, mesh
    self._fn = None

  def __call__(self, params):
    floats = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    if self.mesh is None and all(x.dtype == self.dtype for x in floats):
      return params  # one device, already the model's dtype: nothing to cast or move
    if self._fn is None:
      cast = functools.partial(cast_params, dtype=self.dtype)
      out = (None if self.mesh is None else
             shd.state_shardings(params, self.mesh, shd.SAMPLE_RULES))
      self._fn = jax.jit(cast, out_shardings=out)
    return self._fn(params)


def build_tokenizer(config: ml_collections.ConfigDict):
  kind, path = config.tokenizer.kind, config.tokenizer.path or config.model.checkpoint
  if kind == "char":
    if path and os.path.exists(os.path.join(path, CharTokenizer.FILE_NAME)):
      return CharTokenizer.load(path)
    return CharTokenizer()
  if kind in ("qwen2.5", "qwen2.5-math"):
    return load_tokenizer(None, fallback=kind)
  if kind == "hf":
    return load_tokenizer(path, fallback=None)
  return load_tokenizer(path or None, fallback="qwen2.5")


def _runtime(config: ml_collections.ConfigDict) -> dict[str, Any]:
  m = config.model
  return dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat,
              attention_impl=m.attention_impl)


def model_config(config: ml_collections.ConfigDict, tokenizer) -> Qwen2Config:
  """The architecture: the checkpoint's config.json, else the preset plus overrides."""
  m = config.model
  if m.checkpoint:
    return Qwen2Config.from_hf(os.path.expanduser(m.checkpoint), **_runtime(config))
  overrides = dict(m.overrides.to_dict()) if m.overrides else {}
  overrides.setdefault("vocab_size", max(tokenizer.vocab_size, get_preset(m.preset).vocab_size)
                       if config.tokenizer.kind != "char" else tokenizer.vocab_size)
  cfg = get_preset(m.preset, **_runtime(config), **overrides)
  if cfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                     f"{tokenizer.vocab_size}; set config.model.overrides.vocab_size.")
  return cfg


def build_model(config: ml_collections.ConfigDict, tokenizer, mesh: Mesh | None):
  if config.model.checkpoint:
    return load_pretrained(os.path.expanduser(config.model.checkpoint), mesh=mesh,
                           **_runtime(config))
  return create_model(model_config(config, tokenizer), seed=config.seed, mesh=mesh)


def _arith_config(config) -> arithmetic.ArithmeticConfig:
  a = config.data.arithmetic
  return arithmetic.ArithmeticConfig(min_digits=a.min_digits, max_digits=a.max_digits,
                                     min_operands=a.min_operands, max_operands=a.max_operands,
                                     ops=a.ops)


def load_dataset(name: str, config: ml_collections.ConfigDict, split: str
                 ) -> Sequence[MathRecord]:
  """A dataset by config name: "arithmetic", a TFDS name, or a parquet/JSONL path."""
  d = config.data
  if name == "arithmetic":
    n = d.arithmetic.num_train if split == "train" else d.arithmetic.num_eval
    return arithmetic.make_records(n, split="train" if split == "train" else "test",
                                   seed=config.seed if split == "train" else 0,
                                   config=_arith_config(config))
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


def train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  """The compiled update's settings (spec 4 and 6)."""
  a, o = config.algorithm, config.optim
  rows = o.mini_batch_size * config.rollout.n
  return TrainConfig(
      num_micro_batches=max(1, rows // o.micro_batch_size), temperature=config.rollout.temperature,
      clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
      clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss,
      kl_loss_coef=a.kl_coef, kl_loss_type=a.kl_kind, entropy_coeff=a.entropy_coeff,
      overlong_filter=a.overlong_filter, lr=o.lr, warmup_steps=o.warmup_steps, b1=o.b1,
      b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.grad_clip,
      forward_micro_batch_size=o.micro_batch_size)


def sampling_params(config: ml_collections.ConfigDict, tokenizer, *, eval_mode: bool = False
                    ) -> SamplingParams:
  r, e = config.rollout, config.eval
  return SamplingParams(
      temperature=e.temperature if eval_mode else r.temperature,
      top_p=e.top_p if eval_mode else r.top_p, top_k=0 if eval_mode else r.top_k,
      max_new_tokens=r.max_response_length, eos_ids=tuple(tokenizer.eos_ids),
      pad_id=tokenizer.pad_id)


def attention_fallback(config: ml_collections.ConfigDict, mcfg: Qwen2Config,
                       platform: str) -> str | None:
  """Why ``attention_impl="auto"`` runs the XLA einsums over the training rows on an
  accelerator (their [B, heads, T, S] scores cost memory and time), or None when it does not."""
  t = config.data.max_prompt_length + config.rollout.max_response_length
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


def describe(config: ml_collections.ConfigDict, model: Any) -> str:
  n = model.config.num_params()
  return (f"model {config.model.checkpoint or config.model.preset}: {n / 1e6:.2f}M params, "
          f"{jax.device_count()} devices ({jax.default_backend()})")
