"""The run spec: a config validated once into frozen, typed sections, with the derived sizes.

    spec = RunSpec.from_config(config, num_devices=jax.device_count())
    spec.optim.lr, spec.rollout.n, spec.sizes.rows_per_update, spec.train_config()

Users keep writing ml-collections config files and ``--config.x=y`` overrides
(`dapo_jax.config`); entry points turn the ``ConfigDict`` into a `RunSpec` once, and builders take
the section they use. The sections mirror ``default_config()`` key for key (a test holds them
equal), so a field has one name in a config file, in ``config.json`` and here. Keys missing from
an older ``config.json`` take today's defaults, so every saved run still reads.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import types
import typing
from typing import Any, Mapping

import ml_collections

from dapo_jax import config as config_lib
from dapo_jax.trainer.train_step import TrainConfig

_log = logging.getLogger(__name__)
Mesh = tuple[tuple[str, int], ...]  # ((axis, size), ...); one size may be -1


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  rank: int
  alpha: float
  targets: tuple[str, ...]
  quantize_base: str


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  preset: str
  checkpoint: str
  param_dtype: str
  dtype: str
  remat: str
  attention_impl: str
  scan_layers: bool
  overrides: Mapping[str, Any]  # extra Qwen2Config fields (tiny models), read-only
  lora: LoraSpec


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
  kind: str
  path: str


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
  num_train: int
  num_eval: int
  min_digits: int
  max_digits: int
  min_operands: int
  max_operands: int
  ops: str


@dataclasses.dataclass(frozen=True)
class DataSpec:
  train: str
  eval: str
  data_dir: str
  manual_dir: str
  dedup: bool
  on_malformed: str
  num_epochs: int
  max_prompt_length: int
  truncate: str
  arithmetic: ArithmeticSpec


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  n: int
  temperature: float
  top_p: float
  top_k: int
  max_response_length: int
  engine: str
  max_concurrent_decodes: int
  kv_cache: str
  page_size: int
  kv_pages: int
  kv_hbm_fraction: float
  attention_impl: str
  kv_cache_dtype: str
  stop_tokens: str
  use_sampler_logprobs: bool
  prompts_per_call: int


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  verifier: str
  overlong_buffer_enable: bool
  overlong_buffer_len: int
  overlong_penalty_factor: float
  timeout_s: float
  num_workers: int


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  norm_adv_by_std: bool
  clip_ratio_low: float
  clip_ratio_high: float
  clip_ratio_c: float
  loss_agg_mode: str
  dynamic_sampling: bool
  gen_batch_size: int
  max_num_gen_batches: int
  keep_surplus: bool
  sampling_loop: str
  overlong_filter: bool
  use_kl_loss: bool
  kl_loss_coef: float
  kl_loss_type: str
  entropy_coeff: float
  rollout_is: str
  rollout_is_cap: float
  rollout_is_band: tuple[float, ...]
  max_staleness: int
  allow_uncorrected_staleness: bool
  allow_uncorrected_kv_quantization: bool
  partial_rollouts: bool
  skip_filter: bool
  skip_target: float
  skip_floor: float
  skip_adapt_rate: float
  skip_max_prompts: int


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  train_batch_size: int
  mini_batch_size: int
  micro_batch_size: int
  ppo_epochs: int
  lr: float
  warmup_steps: int
  warmup_style: str
  micro_batch_loss: str
  packing: bool
  max_tokens_per_row: int
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip: float
  max_consecutive_skips: int


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  every: int
  num_samples: int
  temperature: float
  top_p: float
  max_examples: int
  batch_size: int


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  save_every: int
  max_to_keep: int
  async_save: bool
  max_consecutive_failed_saves: int
  storage_wait_s: float


@dataclasses.dataclass(frozen=True)
class WandbSpec:
  enable: bool
  project: str
  entity: str
  name: str
  mode: str
  tags: str


@dataclasses.dataclass(frozen=True)
class LoggingSpec:
  console: str
  samples_every: int
  wandb: WandbSpec


@dataclasses.dataclass(frozen=True)
class SFTSpec:
  steps: int
  batch_size: int
  lr: float
  warmup_steps: int


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Sizes derived from several sections, computed here and nowhere else."""
  rows_per_update: int  # trajectories per optimizer update: optim.mini_batch_size x rollout.n
  micro_batches_per_update: int  # forward/backward passes per update (exact token mean)
  updates_per_step: int  # optimizer updates per RL step, over all PPO epochs
  rows_per_step: int  # trajectories trained per RL step: optim.train_batch_size x rollout.n
  prompts_per_call: int  # prompts per static rollout call (the whole generation batch if 0)
  max_length: int  # prompt + response tokens of a training row


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Every setting of a run, typed and read-only; built by `RunSpec.from_config`."""
  seed: int
  num_steps: int
  model: ModelSpec
  tokenizer: TokenizerSpec
  data: DataSpec
  rollout: RolloutSpec
  reward: RewardSpec
  algorithm: AlgorithmSpec
  optim: OptimSpec
  eval: EvalSpec
  checkpoint: CheckpointSpec
  compilation_cache_dir: str
  tpu_windowed_einsum: bool
  mesh: Mesh
  rollout_mesh: Mesh  # () = the training mesh's devices
  rollout_devices: int  # 0 = rollout on the training devices
  dcn_mesh: str
  log_every: int
  num_sample_texts: int
  logging: LoggingSpec
  sft: SFTSpec
  sizes: Sizes = dataclasses.field(init=False)

  def __post_init__(self):
    o, r = self.optim, self.rollout
    rows = o.mini_batch_size * r.n
    object.__setattr__(self, "sizes", Sizes(
        rows_per_update=rows,
        micro_batches_per_update=max(1, rows // o.micro_batch_size),
        updates_per_step=o.train_batch_size // o.mini_batch_size * o.ppo_epochs,
        rows_per_step=o.train_batch_size * r.n,
        prompts_per_call=r.prompts_per_call or self.algorithm.gen_batch_size,
        max_length=self.data.max_prompt_length + r.max_response_length))

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, num_devices: int | None = None
                  ) -> RunSpec:
    """Validates ``config`` (`dapo_jax.config.validate`: one line naming a bad field), logs the
    choices it allows that change the run unasked (`config.notes`), and reads it into a spec.
    Keys an older ``config.json`` lacks take today's defaults."""
    config = with_defaults(config)
    config_lib.validate(config, num_devices)
    for note in config_lib.notes(config):
      _log.warning(note)
    return _read(cls, config, "")

  @classmethod
  def read(cls, config: ml_collections.ConfigDict) -> RunSpec:
    """The spec of a config without `from_config`'s validation: a workdir's ``config.json``
    (validated by the run that wrote it, perhaps on other devices) read by ``dapo-eval``,
    ``dapo-serve`` or ``dapo-export``; keys it lacks take today's defaults."""
    return _read(cls, with_defaults(config), "")

  def train_config(self) -> TrainConfig:
    """The compiled update's settings (spec 4 and 6)."""
    a, o = self.algorithm, self.optim
    return TrainConfig(
        num_micro_batches=self.sizes.micro_batches_per_update,
        temperature=self.rollout.temperature, clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
        overlong_filter=a.overlong_filter, rollout_is=a.rollout_is,
        rollout_is_cap=a.rollout_is_cap, rollout_is_band=a.rollout_is_band,
        micro_batch_loss=o.micro_batch_loss, lr=o.lr, warmup_steps=o.warmup_steps,
        warmup_style=o.warmup_style, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip, forward_micro_batch_size=o.micro_batch_size)

  def to_dict(self) -> dict[str, Any]:
    """Plain nested dicts and lists (JSON-ready): what wandb shows as the run's config."""
    return _plain(self)


def read_section(config: ml_collections.ConfigDict, name: str) -> Any:
  """One section of ``config`` as the spec reads it (``read_section(config, "model")`` is a
  `ModelSpec`; ``"mesh"`` the axis pairs), missing keys at today's defaults, without
  `RunSpec.from_config`'s validation: for code handed a config it does not check (a command
  that loads a workdir's ``config.json``, a test's partial one)."""
  return _value(typing.get_type_hints(RunSpec)[name], with_defaults(config)[name], name)


def _plain(value):
  if dataclasses.is_dataclass(value):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, collections.abc.Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  return value


def with_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of ``config`` with every key it lacks taken from ``default_config()`` (a workdir's
  ``config.json`` written before the key existed). Unknown keys stay, for `validate` to name.
  A config saved before ``model.scan_layers`` existed is the unscanned layout its checkpoints
  were written in."""
  merged = config_lib.default_config()
  _merge(merged, config)
  if "model" in config and "scan_layers" not in config.model:
    merged.model.scan_layers = False
  if "optim" in config and "packing" not in config.optim:  # trained padded, as it was then
    merged.optim.packing = False
  return merged


def _merge(into: ml_collections.ConfigDict, src: ml_collections.ConfigDict) -> None:
  for key in src.keys():
    value = src[key]
    if (key in into and isinstance(value, ml_collections.ConfigDict)
        and isinstance(into[key], ml_collections.ConfigDict) and key != "overrides"):
      _merge(into[key], value)
    else:
      with into.unlocked():
        into[key] = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def _read(cls, section, path: str):
  hints = typing.get_type_hints(cls)
  values = {}
  for field in dataclasses.fields(cls):
    if not field.init:
      continue
    values[field.name] = _value(hints[field.name], section[field.name], path + field.name)
  return cls(**values)


def _value(hint, value, path: str):
  if dataclasses.is_dataclass(hint):
    return _read(hint, value, path + ".")
  origin = typing.get_origin(hint)
  if hint == Mesh:
    return tuple((str(n), int(s)) for n, s in value)
  if origin is tuple:
    return tuple(value)
  if origin is collections.abc.Mapping:
    items = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else dict(value or {})
    return types.MappingProxyType(items)
  if hint is float:
    return float(value)
  if hint is int and not isinstance(value, bool):
    return int(value)
  return value

