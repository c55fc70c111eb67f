"""One compiled, donated, sharded DAPO update per optimizer mini-batch (spec 6).

    graphdef, state = init_train_state(model, cfg, mesh)
    step = TrainStep(graphdef, cfg, mesh)            # compiled on first call
    state, metrics = step(state, batch, rollout_step)
    forward = LogProbForward(graphdef, cfg, mesh)    # old / reference log-probs
    old_logp_BxR, entropy_BxR = forward(state.params, ids, mask, response_len)

Inside the step: micro-batch gradient accumulation (a `lax.scan`) with the
whole mini-batch's loss denominator, so `token-mean` is the exact token mean
of the mini-batch (spec 4); global-norm clip in fp32; AdamW with the learning
rate of the rollout step the trainer passes (spec 6.5); non-finite updates
skipped. Nothing is random (Qwen2.5 has no dropout), so no RNG is carried.

One piece: the update's settings and state, the loss over micro-batches, the gradient accumulation,
clipping and AdamW are traced into one compiled program, and the compiled wrappers that call it hold
its donation and sharding contract.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dapo_jax.trainer import objective as obj
from dapo_jax.infra import sharding as shd
from dapo_jax.models.logprobs import (forward_log_probs, forward_packed_log_probs,
                                     forward_with_reference, packed_response_log_probs,
                                     response_log_probs, split_micro)
from dapo_jax.models import cast_params, default_positions  # noqa: F401  (tests use ts.cast_params)
from dapo_jax.models import lora
from dapo_jax.infra.tracing import TraceCounter


WARMUP_STYLES = ("paper", "verl")
MICRO_BATCH_LOSSES = ("exact", "verl")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loss and optimizer settings of one update; defaults are DAPO's (spec 1, 4, 6)."""
  # Gradient accumulation steps inside the update (packed batches: the batch's own count).
  num_micro_batches: int = 1
  temperature: float = 1.0  # rollout temperature: logits / T (spec 4)
  logit_chunk_size: int = 512  # response positions per logits chunk; 0: unchunked
  clip_ratio_low: float = 0.2
  clip_ratio_high: float = 0.28
  clip_ratio_c: float = 10.0
  loss_agg_mode: str = obj.TOKEN_MEAN
  micro_batch_loss: str = "exact"  # "verl": per-micro-batch mean x sequence share (spec 4)
  use_kl_loss: bool = False  # DAPO: no KL (spec 1)
  kl_loss_coef: float = 0.001
  kl_loss_type: str = "low_var_kl"  # k3
  entropy_coeff: float = 0.0
  overlong_filter: bool = False  # mask truncated responses out of the loss (spec 2)
  # Rollout correction towards the sampler's log-probs (objective.rollout_correction): "none"
  # (DAPO), "token_truncated" (weights capped at rollout_is_cap) or "sequence_mask" (sequences
  # whose weight leaves rollout_is_band leave the loss). Batches then carry sampler_log_probs.
  rollout_is: str = "none"
  rollout_is_cap: float = 2.0
  rollout_is_band: tuple[float, float] = (0.5, 2.0)
  lr: float = 1e-6
  warmup_steps: int = 20  # rollout steps (paper 20, verl script 10)
  warmup_style: str = "paper"  # "verl": lr * s / warmup (0 at step 0), as LambdaLR
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.1  # on every parameter, as torch AdamW in verl
  max_grad_norm: float = 1.0
  forward_micro_batch_size: int = 0  # rows per no-grad forward micro-batch; 0: all
  # Dtype of the trained (master) copy of the params, Adam moments alike; the forward casts to
  # the model's compute dtype. "float32" keeps bf16 models trainable at lr 1e-6 (a bf16 weight
  # near 0.02 moves in steps of 1e-4: smaller updates would round away). "": the model's own.
  master_dtype: str = "float32"

  def __post_init__(self):
    obj.validate_loss_agg_mode(self.loss_agg_mode)
    obj.validate_clip_ratios(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c)
    obj.validate_rollout_correction(self.rollout_is, self.rollout_is_cap, self.rollout_is_band)
    if self.micro_batch_loss not in MICRO_BATCH_LOSSES:
      raise ValueError(f"micro_batch_loss={self.micro_batch_loss!r}; use one of "
                       f"{MICRO_BATCH_LOSSES}.")
    if self.warmup_style not in WARMUP_STYLES:
      raise ValueError(f"warmup_style={self.warmup_style!r}; use one of {WARMUP_STYLES}.")
    if self.kl_loss_type not in obj.KL_PENALTY_KINDS:
      raise ValueError(f"kl_loss_type={self.kl_loss_type!r}; use one of {obj.KL_PENALTY_KINDS}.")
    if self.master_dtype not in ("", "float32", "bfloat16", "float16"):
      raise ValueError(f"master_dtype={self.master_dtype!r}; use 'float32' or '' (the params' "
                       f"own dtype).")
    if self.num_micro_batches < 1 or self.temperature <= 0 or self.logit_chunk_size < 0:
      raise ValueError("num_micro_batches must be >= 1, temperature > 0, logit_chunk_size >= 0.")

  def replace(self, **overrides) -> "TrainConfig":
    return dataclasses.replace(self, **overrides)


@flax.struct.dataclass
class TrainState:
  """Everything an update changes; donated to the compiled step."""
  # The trained variables: every nnx.Param, or with LoRA (models/lora.py) the adapters alone.
  params: nnx.State
  # Everything else, passed through unchanged and never donated: with LoRA the frozen base.
  rest: nnx.State
  opt_state: optax.OptState
  step: jax.Array  # int32: updates attempted (applied = step - num_skipped)
  num_skipped: jax.Array  # int32: updates skipped for non-finite values


@flax.struct.dataclass
class PackedRows:
  """A mini-batch's sequences packed into rows of Lb tokens (trainer/packing.py): B = Bp packed
  rows, and ``token_index`` maps the row-layout [C, R] response tokens into them. The rows are
  laid out for ``num_shards`` batch shards and ``num_micro`` micro-batches (`split_micro`)."""
  input_ids: jax.Array  # [Bp, Lb] int32
  positions: jax.Array  # [Bp, Lb] int32, restarting at 0 per sequence
  segment_ids: jax.Array  # [Bp, Lb] int32, 1.. per sequence of a row, 0 = padding
  token_index: jax.Array  # [C, R] int32, see models.logprobs.packed_response_log_probs
  num_shards: int = flax.struct.field(pytree_node=False, default=1)
  num_micro: int = flax.struct.field(pytree_node=False, default=1)


@flax.struct.dataclass
class TrainBatch:
  """One optimizer mini-batch. L = P + R: left-padded prompt, right-padded response.

  Packed (``packed`` set, optim.packing): ``input_ids`` and ``attention_mask`` are None, the
  tokens are in ``packed``, and the [B, R] / [B] arrays are its [C, R] / [C] sequence slots
  (empty slots fully masked)."""
  input_ids: jax.Array | None  # [B, L] int32
  attention_mask: jax.Array | None  # [B, L]
  response_mask: jax.Array  # [B, R], EOS included
  old_log_probs: jax.Array  # [B, R]
  advantages: jax.Array  # [B]
  positions: jax.Array | None = None  # [B, L]; None: default_positions(attention_mask)
  ref_log_probs: jax.Array | None = None  # [B, R]; needed when use_kl_loss
  truncated: jax.Array | None = None  # [B] bool; needed when overlong_filter
  sampler_log_probs: jax.Array | None = None  # [B, R]; needed when rollout_is != "none"
  packed: PackedRows | None = None


def lr_at(cfg: TrainConfig, rollout_step: jax.Array | int) -> jax.Array:
  """Learning rate at a 0-based rollout step: linear warmup, then constant (spec 6.5).

  "paper": lr * min(1, (s + 1) / warmup), so step 0 already trains.
  "verl": lr * min(1, s / warmup), LambdaLR stepped once per rollout step.
  """
  s = jnp.asarray(rollout_step, jnp.float32)
  if cfg.warmup_steps <= 0:
    return jnp.full((), cfg.lr, jnp.float32)
  num = s + 1.0 if cfg.warmup_style == "paper" else s
  return cfg.lr * jnp.clip(num / cfg.warmup_steps, 0.0, 1.0)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """optax.adamw without its learning rate, which `train_step` applies per rollout step.

  The global-norm clip runs before it, in fp32, in `train_step`.
  """
  return optax.chain(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
                     optax.add_decayed_weights(cfg.weight_decay))


def _below_master(x, cfg: TrainConfig) -> bool:
  return bool(cfg.master_dtype) and jnp.issubdtype(x.dtype, jnp.floating) and (
      jnp.finfo(x.dtype).bits < jnp.finfo(jnp.dtype(cfg.master_dtype)).bits)


def master_params(params: nnx.State, cfg: TrainConfig) -> nnx.State:
  """The trained copy: params of lower precision than `cfg.master_dtype` cast up to it.

  Pure, so `jax.eval_shape` gives the abstract state `dapo-plan` compiles against.
  """
  return jax.tree.map(
      lambda x: x.astype(cfg.master_dtype) if _below_master(x, cfg) else x, params)


def init_train_state(model: nnx.Module, cfg: TrainConfig, mesh: Mesh | None = None,
                     rules: shd.Rules = shd.TRAIN_RULES) -> tuple[nnx.GraphDef, TrainState]:
  """Splits the model once; AdamW moments are created in the params' layout.

  The state holds the model's own arrays (no copy), and `TrainStep` donates
  them: do not use `model` after the first step; `nnx.merge(graphdef,
  state.params, state.rest)` is the current model. Params of a lower precision
  than `cfg.master_dtype` are copied up to it (fp32 master weights of a bf16
  model); the forward still computes in the model's `dtype`. A model with LoRA adapters
  trains them alone: `params` holds the adapters, `rest` the frozen base in its own dtype.
  """
  trained = lora.Adapter if lora.has_adapters(model) else nnx.Param
  graphdef, params, rest = nnx.split(model, trained, ...)
  if any(_below_master(x, cfg) for x in jax.tree.leaves(params)):
    cast = functools.partial(master_params, cfg=cfg)
    out = None if mesh is None else shd.state_shardings(jax.eval_shape(cast, params), mesh, rules)
    params = jax.jit(cast, out_shardings=out)(params)
  init = make_optimizer(cfg).init
  if mesh is None:
    opt_state = jax.jit(init)(params)
  else:
    abstract = jax.eval_shape(init, params)
    opt_state = jax.jit(init, out_shardings=shd.state_shardings(abstract, mesh, rules))(params)
  # Two distinct buffers: donation rejects one buffer passed twice.
  return graphdef, TrainState(params, rest, opt_state, jnp.zeros((), jnp.int32),
                              jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------
# Loss and gradients of one mini-batch.
# ----------------------------------------------------------------------------


def _masked_inputs(cfg: TrainConfig, batch: TrainBatch):
  """Loss mask, and per-token inputs with padding zeroed so it cannot leak NaN."""
  r = batch.response_mask.shape[1]
  mask_BxR = batch.response_mask.astype(jnp.float32)
  if cfg.overlong_filter:
    if batch.truncated is None:
      raise ValueError("overlong_filter=True needs TrainBatch.truncated.")
    mask_BxR = obj.apply_overlong_filter(mask_BxR, batch.truncated)
  is_BxR, is_metrics = None, {}
  if cfg.rollout_is != "none":
    if batch.sampler_log_probs is None:
      raise ValueError(f"rollout_is={cfg.rollout_is!r} needs TrainBatch.sampler_log_probs.")
    before_BxR = mask_BxR
    is_BxR, mask_BxR = obj.rollout_correction(
        batch.old_log_probs, batch.sampler_log_probs, before_BxR, cfg.rollout_is,
        cap=cfg.rollout_is_cap, band=cfg.rollout_is_band)
    # Mean weight over the tokens before the correction: a dropped sequence's count 0, so under
    # "sequence_mask" it is the share of tokens kept.
    is_metrics = {"rollout_is_weight": obj.masked_mean(is_BxR, before_BxR)}
    if cfg.rollout_is == "token_truncated":  # the share of tokens whose weight hit the cap
      log_rho_BxR = (batch.old_log_probs.astype(jnp.float32)
                     - batch.sampler_log_probs.astype(jnp.float32))
      is_metrics["rollout_is_capped"] = obj.masked_mean(
          log_rho_BxR > math.log(cfg.rollout_is_cap), before_BxR)
    elif cfg.rollout_is == "sequence_mask":  # the share of tokens left out of the loss
      is_metrics["rollout_is_masked"] = 1.0 - obj.masked_mean(mask_BxR > 0, before_BxR)
  on_BxR = mask_BxR > 0
  on_B = jnp.any(on_BxR, axis=-1)
  old_BxR = jnp.where(on_BxR, batch.old_log_probs.astype(jnp.float32), 0.0)
  adv_B = jnp.where(on_B, batch.advantages.astype(jnp.float32), 0.0)
  finite = jnp.all(jnp.isfinite(old_BxR)) & jnp.all(jnp.isfinite(adv_B))
  ref_BxR = None
  if cfg.use_kl_loss:
    if batch.ref_log_probs is None:
      raise ValueError("use_kl_loss=True needs TrainBatch.ref_log_probs.")
    ref_BxR = jnp.where(on_BxR, batch.ref_log_probs.astype(jnp.float32), 0.0)
    finite &= jnp.all(jnp.isfinite(ref_BxR))
  if batch.packed is None:
    positions = batch.positions
    if positions is None:
      positions = default_positions(batch.attention_mask)
    per_row = dict(ids=batch.input_ids, attn=batch.attention_mask, pos=positions, mask=mask_BxR,
                   old=old_BxR, adv=adv_B)
  else:
    if cfg.micro_batch_loss != "exact":
      raise ValueError("Packed batches need micro_batch_loss='exact' (a packed micro-batch "
                       "is no set of whole rows verl's weighting could count).")
    pk = batch.packed
    per_row = dict(idx=pk.token_index, mask=mask_BxR, old=old_BxR, adv=adv_B)
  if ref_BxR is not None:
    per_row["ref"] = ref_BxR
  if is_BxR is not None:
    per_row["is_weights"] = is_BxR
  return per_row, r, finite, is_metrics


def _micro_loss(params, rest, graphdef, cfg: TrainConfig, mb: dict[str, jax.Array],
                response_len: int, denom: jax.Array, num_seqs: jax.Array,
                packed: dict[str, jax.Array] | None = None, num_shards: int = 1):
  """Loss of one micro-batch, scaled so micro-batch losses sum to the mini-batch loss.
  ``packed``: the micro-batch's packed rows (ids, pos, seg), ``mb`` then its sequence slots."""
  model = nnx.merge(graphdef, params, rest)
  kw = dict(temperature=cfg.temperature, chunk_size=cfg.logit_chunk_size,
            entropy_grad=cfg.entropy_coeff != 0.0)
  if packed is None:
    logp_BxR, ent_BxR = response_log_probs(model, mb["ids"], mb["attn"], mb["pos"],
                                           response_len, **kw)
  else:
    logp_BxR, ent_BxR = packed_response_log_probs(model, packed["ids"], packed["pos"],
                                                  packed["seg"], mb["idx"], num_shards, **kw)
  mask_BxR = mb["mask"]
  if cfg.micro_batch_loss == "exact":
    den, weight = denom, 1.0  # spec 4: normaliser of the WHOLE mini-batch.
  else:  # verl's approximation: this micro-batch's own mean x its sequence share.
    den, weight = None, obj.verl_microbatch_weight(mask_BxR, num_seqs)
  agg = lambda x: obj.agg_loss(x, mask_BxR, cfg.loss_agg_mode, den) * weight
  pg_loss, pg_metrics = obj.compute_policy_loss(
      mb["old"], logp_BxR, mb["adv"], mask_BxR, clip_ratio_low=cfg.clip_ratio_low,
      clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
      loss_agg_mode=cfg.loss_agg_mode, loss_denominator=den, is_weights=mb.get("is_weights"))
  pg_loss = pg_loss * weight
  loss = pg_loss
  n_tok = jnp.sum(mask_BxR)
  # Masked sums: divided by the mini-batch token count at the end, they give
  # the exact mini-batch masked means.
  sums = {k: v * n_tok for k, v in pg_metrics.items()}
  sums.update(pg_loss=pg_loss, num_tokens=n_tok,
              entropy=jnp.sum(jax.lax.stop_gradient(ent_BxR) * mask_BxR))
  if cfg.entropy_coeff != 0.0:
    loss = loss - cfg.entropy_coeff * agg(ent_BxR)
  if cfg.use_kl_loss:
    kl_BxR = obj.kl_penalty(logp_BxR, mb["ref"], cfg.kl_loss_type)
    loss = loss + cfg.kl_loss_coef * agg(kl_BxR)
    sums["kl"] = jnp.sum(jax.lax.stop_gradient(kl_BxR) * mask_BxR)
  sums["loss"] = loss
  return loss, sums


def loss_and_grads(graphdef: nnx.GraphDef, cfg: TrainConfig, params: nnx.State,
                   rest: nnx.State, batch: TrainBatch, param_shardings: Any = None):
  """Gradients of the mini-batch loss, accumulated over micro-batches.

  Returns:
    (grads like params: fp32 when accumulated over micro-batches, else in the
    params' dtype; metrics dict of scalars; inputs_finite).
  """
  per_row, r, finite, is_metrics = _masked_inputs(cfg, batch)
  mask_BxR = per_row["mask"]
  denom = obj.loss_denominator(mask_BxR, cfg.loss_agg_mode, r)
  num_seqs = jnp.sum(jnp.any(mask_BxR > 0, axis=-1).astype(jnp.float32))
  grad_fn = jax.grad(_micro_loss, has_aux=True)
  pk = batch.packed
  micro = functools.partial(grad_fn, params, rest, graphdef, cfg, response_len=r,
                            denom=denom, num_seqs=num_seqs,
                            num_shards=1 if pk is None else pk.num_shards)
  pin = lambda g: g if param_shardings is None else jax.lax.with_sharding_constraint(
      g, param_shardings)
  per_pack = None if pk is None else dict(ids=pk.input_ids, pos=pk.positions, seg=pk.segment_ids)
  inputs = (per_row, per_pack)

  # Packed: the micro-batches the packer cut (token-budget, trainer/packing.py).
  n = cfg.num_micro_batches if pk is None else pk.num_micro
  if n == 1:
    grads, sums = micro(per_row, packed=per_pack)
    grads = pin(grads)
  else:
    xs = jax.tree.map(lambda v: split_micro(v, n), inputs)

    def body(carry, mb_and_pk):
      mb, pk_mb = jax.tree.map(
          lambda v: shd.constrain(v, ("batch",) + (None,) * (v.ndim - 1)), mb_and_pk)
      g, s = micro(mb, packed=pk_mb)
      acc_g, acc_s = carry
      acc_g = pin(jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc_g, g))
      return (acc_g, jax.tree.map(jnp.add, acc_s, s)), None

    zeros_g = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    first_mb, first_pk = jax.tree.map(lambda x: x[0], xs)
    _, zeros_s = jax.eval_shape(functools.partial(micro, packed=first_pk), first_mb)
    zeros_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros_s)
    (grads, sums), _ = jax.lax.scan(body, (zeros_g, zeros_s), xs)

  n_tok = sums["num_tokens"]
  metrics = {k: (v if k in ("loss", "pg_loss", "num_tokens") else v / jnp.maximum(n_tok, 1.0))
             for k, v in sums.items()}
  metrics.update(is_metrics)
  return grads, metrics, finite


def train_step(graphdef: nnx.GraphDef, cfg: TrainConfig, state: TrainState, batch: TrainBatch,
               rollout_step: jax.Array, param_shardings: Any = None
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on a mini-batch; skipped if anything is non-finite (spec 6.4).

  `rollout_step` is the trainer's 0-based rollout step: every mini-batch of one
  rollout step gets the same learning rate (warmup counts rollout steps).
  """
  grads, metrics, inputs_finite = loss_and_grads(graphdef, cfg, state.params, state.rest, batch,
                                                 param_shardings)
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                           for g in jax.tree.leaves(grads)))
  ok = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"]) & inputs_finite
  lr = lr_at(cfg, rollout_step)
  # Global-norm clip on the fp32 gradients (optax's formula), then the params' dtype.
  scale = jnp.where(grad_norm < cfg.max_grad_norm, 1.0, cfg.max_grad_norm / grad_norm)
  grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, state.params)
  updates, new_opt = make_optimizer(cfg).update(grads, state.opt_state, state.params)
  updates = jax.tree.map(lambda u: -lr * u, updates)
  new_params = optax.apply_updates(state.params, updates)
  # A select, not a cond: both branches are already computed and the donated
  # buffers stay aliased.
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  skipped = jnp.logical_not(ok)
  new_state = TrainState(params=keep(new_params, state.params), rest=state.rest,
                         opt_state=keep(new_opt, state.opt_state), step=state.step + 1,
                         num_skipped=state.num_skipped + skipped.astype(jnp.int32))
  metrics.update(grad_norm=grad_norm, lr=lr, skipped=skipped.astype(jnp.float32))
  return new_state, metrics


# ----------------------------------------------------------------------------
# Compiled entry points.
# ----------------------------------------------------------------------------


class _Compiled:
  """A `jax.jit` per argument structure, with shardings from the mesh rules."""

  def __init__(self, mesh: Mesh | None, rules: shd.Rules):
    self.mesh, self.rules = mesh, rules
    self.traces = TraceCounter()  # traces of this object's functions; tests assert no retrace
    self._jits: dict[Any, Any] = {}

  @property
  def num_programs(self) -> int:
    """Distinct programs jitted so far (one per batch structure and shape; packed batches
    add one per (packed rows, sequence slots) bucket pair, trainer/packing.py)."""
    return len(self._jits)

  def _batch_shardings(self, tree: Any) -> Any:
    return jax.tree.map(
        lambda x: shd.batch_sharding(self.mesh, self.rules, x.ndim, x.shape[0]), tree)

  def _traced(self, fn):
    """Runs `fn` with activation constraints on (they apply at trace time)."""
    def wrapped(*args):
      self.traces.record()
      with shd.activation_sharding(self.mesh, self.rules):
        return fn(*args)
    return wrapped


class TrainStep(_Compiled):
  """`step(state, batch, rollout_step) -> (state, metrics)`; `state` is donated but for
  `state.rest` (a LoRA run's frozen base), which the step reads and hands back as it was."""

  def __init__(self, graphdef: nnx.GraphDef, cfg: TrainConfig, mesh: Mesh | None = None,
               rules: shd.Rules = shd.TRAIN_RULES):
    super().__init__(mesh, rules)
    self.graphdef, self.cfg = graphdef, cfg

  def jitted(self, state: TrainState, batch: TrainBatch):
    """The jitted function for this state / batch structure (`.lower()` it for AOT)."""
    key = (jax.tree.structure(batch), tuple(x.shape for x in jax.tree.leaves(batch)))
    if key not in self._jits:
      def fn(donated, rest, batch, rollout_step, param_shardings=None):
        new, metrics = train_step(self.graphdef, self.cfg, donated.replace(rest=rest), batch,
                                  rollout_step, param_shardings)
        return new.replace(rest=None), metrics
      if self.mesh is None:
        self._jits[key] = jax.jit(self._traced(fn), donate_argnums=0)
      else:
        state_sh = shd.state_shardings(state, self.mesh, self.rules)
        fn = functools.partial(fn, param_shardings=state_sh.params)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        donated_sh = state_sh.replace(rest=None)
        self._jits[key] = jax.jit(
            self._traced(fn), donate_argnums=0,
            in_shardings=(donated_sh, state_sh.rest, self._batch_shardings(batch), replicated),
            out_shardings=(donated_sh, replicated))
    return self._jits[key]

  def lower(self, state: TrainState, batch: TrainBatch):
    """Ahead-of-time lowering; `state` and `batch` may hold ShapeDtypeStructs. The compiled
    program takes `(state without rest, rest, batch, step)`: `compile` wraps it back into the
    step's own `(state, batch, step)` call."""
    step = jax.ShapeDtypeStruct((), jnp.int32)
    return self.jitted(state, batch).lower(state.replace(rest=None), state.rest, batch, step)

  def compile(self, state: TrainState, batch: TrainBatch) -> CompiledTrainStep:
    """Ahead-of-time compilation for this state / batch structure (either may be abstract):
    `compiled(state, batch, rollout_step) -> (state, metrics)` as `__call__`, plus the
    compiled program's `memory_analysis()`, `cost_analysis()` and `as_text()`."""
    return CompiledTrainStep(self.lower(state, batch).compile(), self)

  def __call__(self, state: TrainState, batch: TrainBatch, rollout_step: int | jax.Array
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    if self.mesh is not None:
      # Host or differently placed batches are moved first: an argument whose
      # sharding differs from the last call would make jit trace again.
      batch = jax.device_put(batch, self._batch_shardings(batch))
    return _call_split(self.jitted(state, batch), state, batch, rollout_step)


def _call_split(program, state: TrainState, batch: TrainBatch, rollout_step):
  """Calls a (jitted or compiled) step program, which takes the donated state without its
  `rest` apart from `rest`, and puts `rest` back into the new state."""
  new, metrics = program(state.replace(rest=None), state.rest, batch,
                         jnp.asarray(rollout_step, jnp.int32))
  return new.replace(rest=state.rest), metrics


class CompiledTrainStep:
  """`TrainStep.compile`'s program, called like the step: `(state, batch, rollout_step)`."""

  def __init__(self, compiled: Any, step: TrainStep):
    self.compiled, self._step = compiled, step

  def __call__(self, state: TrainState, batch: TrainBatch, rollout_step: int | jax.Array
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    step = self._step
    if step.mesh is not None:  # a compiled program takes exactly its input layout
      batch = jax.device_put(batch, step._batch_shardings(batch))  # pylint: disable=protected-access
    return _call_split(self.compiled, state, batch, rollout_step)

  def __getattr__(self, name: str) -> Any:  # memory_analysis, cost_analysis, as_text, ...
    return getattr(self.compiled, name)


class LogProbForward(_Compiled):
  """`forward(params, input_ids, attention_mask, response_len, positions=None, ref_params=None)`.

  Old log-probs and entropy with `params` by the training path (spec 6.2); with `ref_params`
  (the KL term's frozen reference, same graphdef) also the reference's log-probs, in the same
  compiled program: `(old, entropy, ref)`.
  """

  def __init__(self, graphdef: nnx.GraphDef, cfg: TrainConfig, mesh: Mesh | None = None,
               rules: shd.Rules = shd.TRAIN_RULES, rest: nnx.State | None = None):
    super().__init__(mesh, rules)
    self.graphdef, self.cfg = graphdef, cfg
    self.rest = nnx.State({}) if rest is None else rest

  def lower(self, params: nnx.State, input_ids_BxL: jax.Array, attention_mask_BxL: jax.Array,
            response_len: int, ref_params: nnx.State | None = None):
    """Ahead-of-time lowering; the arguments may be ShapeDtypeStructs."""
    rows = (input_ids_BxL, attention_mask_BxL, None)
    weights = (params,) if ref_params is None else (params, ref_params)
    return self.jitted(params, rows, response_len, ref_params).lower(*weights, self.rest, *rows)

  def __call__(self, params: nnx.State, input_ids_BxL: jax.Array, attention_mask_BxL: jax.Array,
               response_len: int, positions_BxL: jax.Array | None = None,
               ref_params: nnx.State | None = None) -> tuple[jax.Array, ...]:
    rows = (input_ids_BxL, attention_mask_BxL, positions_BxL)
    weights = (params,) if ref_params is None else (params, ref_params)
    if self.mesh is not None:
      rows = jax.device_put(rows, self._batch_shardings(rows))
    return self.jitted(params, rows, response_len, ref_params)(*weights, self.rest, *rows)

  def packed(self, params: nnx.State, rows: PackedRows, ref_params: nnx.State | None = None
             ) -> tuple[jax.Array, ...]:
    """`__call__` over packed rows (optim.packing): ``(old, entropy[, ref])`` [C, R] in the
    rows' sequence slots, in the ``rows.num_micro`` micro-batches the rows were packed for."""
    weights = (params,) if ref_params is None else (params, ref_params)
    if self.mesh is not None:
      rows = jax.device_put(rows, self._batch_shardings(rows))
    return self.jitted_packed(params, rows, ref_params)(*weights, self.rest, rows)

  def lower_packed(self, params: nnx.State, rows: PackedRows,
                   ref_params: nnx.State | None = None):
    """Ahead-of-time lowering of `packed`; the arguments may be ShapeDtypeStructs."""
    weights = (params,) if ref_params is None else (params, ref_params)
    return self.jitted_packed(params, rows, ref_params).lower(*weights, self.rest, rows)

  def jitted_packed(self, params: nnx.State, rows: PackedRows,
                    ref_params: nnx.State | None = None):
    """The jitted packed forward for these rows' structure and shapes."""
    weights = (params,) if ref_params is None else (params, ref_params)
    key = ("packed", jax.tree.structure(rows), tuple(x.shape for x in jax.tree.leaves(rows)),
           ref_params is not None)
    if key not in self._jits:
      cfg = self.cfg
      one = functools.partial(forward_packed_log_probs, self.graphdef,
                              num_shards=rows.num_shards, temperature=cfg.temperature,
                              chunk_size=cfg.logit_chunk_size, num_micro=rows.num_micro)

      def fn(*args):
        *ws, rest, pk = args
        leaves = (pk.input_ids, pk.positions, pk.segment_ids, pk.token_index)
        old, ent = one(ws[0], rest, *leaves)
        if len(ws) == 1:
          return old, ent
        return old, ent, one(ws[1], rest, *leaves)[0]

      if self.mesh is None:
        self._jits[key] = jax.jit(self._traced(fn))
      else:
        out = shd.batch_sharding(self.mesh, self.rules, 2, rows.token_index.shape[0])
        self._jits[key] = jax.jit(
            self._traced(fn),
            in_shardings=(*(shd.state_shardings(w, self.mesh, self.rules) for w in weights),
                          shd.state_shardings(self.rest, self.mesh, self.rules),
                          self._batch_shardings(rows)),
            out_shardings=(out,) * (3 if ref_params is not None else 2))
    return self._jits[key]

  def jitted(self, params: nnx.State, rows: tuple, response_len: int,
             ref_params: nnx.State | None = None):
    """The jitted forward for these rows' structure and shapes (and whether it has a reference)."""
    input_ids_BxL = rows[0]
    with_ref = ref_params is not None
    weights = (params, ref_params) if with_ref else (params,)
    key = (jax.tree.structure(rows), input_ids_BxL.shape, int(response_len), with_ref)
    if key not in self._jits:
      cfg = self.cfg
      fn = functools.partial(forward_with_reference if with_ref else forward_log_probs,
                             self.graphdef, response_len=int(response_len),
                             temperature=cfg.temperature, chunk_size=cfg.logit_chunk_size,
                             micro_batch_size=cfg.forward_micro_batch_size)
      if self.mesh is None:
        self._jits[key] = jax.jit(self._traced(fn))
      else:
        out = shd.batch_sharding(self.mesh, self.rules, 2, input_ids_BxL.shape[0])
        self._jits[key] = jax.jit(
            self._traced(fn),
            in_shardings=(*(shd.state_shardings(w, self.mesh, self.rules) for w in weights),
                          shd.state_shardings(self.rest, self.mesh, self.rules),
                          *self._batch_shardings(rows)),
            out_shardings=(out,) * (3 if with_ref else 2))
    return self._jits[key]
