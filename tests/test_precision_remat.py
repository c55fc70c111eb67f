"""Mixed precision (bf16 compute, fp32 master weights) and the remat policies selected by config."""

import contextlib
import io
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from dapo_jax.trainer import train_step as ts
from dapo_jax.models import create_model, get_preset
from dapo_jax.models.config import REMAT_POLICIES

B, P, R = 4, 4, 8


def _batch(vocab, seed=0):
  rng = np.random.RandomState(seed)
  attn = np.ones((B, P + R), np.int32)
  attn[0, :2] = 0  # a left-padded prompt
  attn[1, P + 5:] = 0  # a short response
  ids = np.where(attn == 1, rng.randint(1, vocab, (B, P + R)), 0).astype(np.int32)
  return ts.TrainBatch(
      input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
      response_mask=jnp.asarray(attn[:, P:], jnp.float32),
      old_log_probs=jnp.asarray(rng.normal(-4.0, 0.3, (B, R)), jnp.float32),
      advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5], jnp.float32))


def _step(model, cfg, batch):
  """One compiled update; returns (params before as numpy, new state, float metrics)."""
  graphdef, state = ts.init_train_state(model, cfg)
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = ts.TrainStep(graphdef, cfg)(state, batch, 0)
  return before, state, jax.tree.map(float, metrics)


def _saved_elements(model, ids):
  """Elements of the residuals the backward pass keeps (parameters excluded)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids)), params)
  shapes = [re.match(r"\w+\[([\d,]*)\]", line).group(1)
            for line in buf.getvalue().splitlines() if "from the argument" not in line]
  return sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)


def test_remat_policies_save_less_in_order_and_keep_gradients():
  ids = jnp.asarray(np.random.RandomState(1).randint(1, 128, (2, 16)))
  models = {p: create_model(get_preset("test", remat=p, num_hidden_layers=1), seed=0)
            for p in REMAT_POLICIES}
  saved = {p: _saved_elements(m, ids) for p, m in models.items()}
  # Each policy keeps strictly more than the one before it.
  order = ["full", "dots_no_batch", "dots_attn", "dots", "none"]
  assert sorted(order) == sorted(REMAT_POLICIES)
  assert [saved[p] for p in order] == sorted(saved.values()), saved
  assert len(set(saved.values())) == len(order), saved
  # Remat never changes the math (tests/test_sharding.py checks "full" too).
  grads = {}
  for policy in ("none", "dots_attn"):
    graphdef, params, rest = nnx.split(models[policy], nnx.Param, ...)
    loss = lambda p, g=graphdef, r=rest: jnp.sum(jnp.tanh(nnx.merge(g, p, r)(ids)))
    grads[policy] = jax.tree.leaves(jax.jit(jax.grad(loss))(params))
  for g, ref in zip(grads["dots_attn"], grads["none"]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-5)


def test_bf16_model_trains_fp32_master_weights_close_to_fp32():
  """A bf16 model (bf16 params and compute): fp32 master weights and Adam moments, a step
  close to the all-fp32 step from the same weights, and updates that bf16 would round away."""
  cfg = get_preset("test", num_hidden_layers=1)
  batch = _batch(cfg.vocab_size)
  tcfg = ts.TrainConfig(lr=1e-6, warmup_steps=0, logit_chunk_size=3)
  bf16_model = create_model(cfg.replace(param_dtype="bfloat16", dtype="bfloat16"), seed=0)
  graphdef, params = nnx.split(bf16_model)
  ref_model = nnx.merge(nnx.split(create_model(cfg))[0], ts.cast_params(params, "float32"))
  _, ref_state, ref = _step(ref_model, tcfg, batch)
  before, state, got = _step(bf16_model, tcfg, batch)
  assert got["skipped"] == 0.0
  assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state))} >= {
      jnp.dtype(jnp.float32)}
  assert jnp.dtype(jnp.bfloat16) not in {x.dtype for x in jax.tree.leaves(state.opt_state)}
  for name in ("loss", "grad_norm", "entropy"):
    assert got[name] == pytest.approx(ref[name], rel=3e-2, abs=1e-3), name
  new = jax.tree.leaves(state.params)
  for p, r in zip(new, jax.tree.leaves(ref_state.params)):
    assert p.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(p), np.asarray(r), atol=2e-6)  # Adam: |step| ~ lr
  old = np.concatenate([np.ravel(x) for x in jax.tree.leaves(before)])
  new = np.concatenate([np.ravel(x) for x in new])
  assert np.mean(new != old) > 0.9
  # The same updates applied to the bf16 weights themselves round away almost entirely.
  assert np.mean(new.astype(jnp.bfloat16) != old.astype(jnp.bfloat16)) < 0.05


def test_cast_params_for_rollout():
  _, state = ts.init_train_state(create_model(get_preset("test")), ts.TrainConfig())
  half = ts.cast_params(state.params, "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(half)} == {jnp.dtype(jnp.bfloat16)}
  assert jax.tree.structure(half) == jax.tree.structure(state.params)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_samplers_read_fp32_master_weights_as_the_model_dtype(engine, monkeypatch):
  """A bf16 model's fp32 master copy samples exactly as its own bf16 weights do."""
  from dapo_jax.rollout import Sampler, SamplingParams  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.continuous import ContinuousSampler  # pylint: disable=g-import-not-at-top
  cfg = get_preset("test").replace(param_dtype="bfloat16", dtype="bfloat16")
  graphdef, state = nnx.split(create_model(cfg))
  master = ts.cast_params(state, "float32")
  assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
  ids = np.random.RandomState(0).randint(1, cfg.vocab_size, (2, 5)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  params = SamplingParams(temperature=1.0, max_new_tokens=6)
  sampler = (Sampler(graphdef) if engine == "static"
             else ContinuousSampler(graphdef, num_slots=2, chunk_steps=4))
  # The samplers must cast the master copy down themselves (the model's Dense layers would
  # hide a missing cast from the outputs alone, at twice the weight bytes per decode step).
  module = sys.modules[Sampler.__module__ if engine == "static" else ContinuousSampler.__module__]
  casts = []
  real_cast = module.cast_params
  def spy(tree, dtype):
    casts.append(jnp.dtype(dtype))
    return real_cast(tree, dtype)
  monkeypatch.setattr(module, "cast_params", spy)
  out = [sampler.generate(s, ids, mask, jax.random.key(3), params, num_samples=2)
         for s in (state, master)]
  assert casts and set(casts) == {jnp.dtype(jnp.bfloat16)}
  np.testing.assert_array_equal(out[0].response_ids, out[1].response_ids)
  np.testing.assert_array_equal(out[0].logprobs, out[1].logprobs)


def test_master_params_gives_the_state_init_train_state_builds():
  """`dapo-plan` compiles against `master_params`' abstract state: it must match the real one."""
  cfg = get_preset("test").replace(param_dtype="bfloat16", dtype="bfloat16")
  tcfg = ts.TrainConfig()
  _, params, _ = nnx.split(create_model(cfg), nnx.Param, ...)
  abstract = jax.eval_shape(lambda p: ts.master_params(p, tcfg), params)
  _, state = ts.init_train_state(create_model(cfg), tcfg)
  real = jax.tree.map(lambda x: (x.shape, x.dtype), state.params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == real
  assert {x.dtype for x in jax.tree.leaves(abstract)} == {jnp.dtype(jnp.float32)}
