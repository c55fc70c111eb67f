"""The compiled DAPO update (dapo_jax.trainer.train_step) and chunked log-probs
(dapo_jax.models.logprobs)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.models import logprobs
from dapo_jax.trainer import objective as obj
from dapo_jax.infra import sharding as shd
from dapo_jax.trainer import train_step as ts
from dapo_jax.models import create_model, default_positions, get_preset

B, P, R = 16, 5, 13  # rows, prompt length (left-padded), response length (right-padded)
VOCAB = 128
TOL = 1e-5


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _fresh(tree):
  """A device copy (the step donates its input state)."""
  return jax.tree.map(lambda x: jnp.array(np.asarray(x)), tree)


@pytest.fixture(scope="module")
def setup():
  """The "test" model, its state and a batch with unequal prompt and response lengths."""
  model = create_model(get_preset("test"), seed=0)
  cfg = ts.TrainConfig(lr=1e-3, warmup_steps=0, logit_chunk_size=5)
  graphdef, state = ts.init_train_state(model, cfg)
  rng = np.random.RandomState(0)
  prompt_pad = rng.randint(0, P - 1, B)
  resp_len = rng.randint(1, R + 1, B)
  resp_len[:2] = (R, 1)  # the extremes, for sure
  ids = rng.randint(1, VOCAB, (B, P + R)).astype(np.int32)
  attn = np.ones((B, P + R), np.int32)
  for b in range(B):
    attn[b, :prompt_pad[b]] = 0
    attn[b, P + resp_len[b]:] = 0
  ids = np.where(attn == 1, ids, 0)
  resp_mask = attn[:, P:].astype(np.float32)
  adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32) * rng.uniform(0.5, 1.5, B)
  fwd = ts.LogProbForward(graphdef, cfg)
  logp, _ = fwd(state.params, jnp.asarray(ids), jnp.asarray(attn), R)
  # Off-policy by a little, so the clip branches are exercised; row 3 (A < 0)
  # by a lot: ratio e^3 > clip_ratio_c, the dual clip.
  old = np.asarray(logp) + rng.normal(0, 0.3, (B, R)).astype(np.float32)
  old[3] = np.asarray(logp)[3] - 3.0
  batch = ts.TrainBatch(input_ids=ids, attention_mask=attn, response_mask=resp_mask,
                        old_log_probs=old.astype(np.float32), advantages=adv.astype(np.float32))
  # Compiled once for the module: the tests below share them.
  step = ts.TrainStep(graphdef, cfg)
  return dict(step=step, fwd=fwd, cfg=cfg, graphdef=graphdef, state=_host(state),
              batch=jax.tree.map(jnp.asarray, batch), logp=np.asarray(logp))


@pytest.fixture(scope="module")
def single_device_run(setup):
  """Two steps on one device with 2 micro-batches: the reference for the sharded runs.

  Adam moves a parameter by lr * g / (|g| + eps): where the true gradient is ~0,
  float noise (~1e-9, from a different reduction order) moves it by up to
  lr * 1e-9 / eps. eps 1e-6 instead of 1e-8 bounds that under the 1e-5
  tolerance; real gradients (~1e-3) still move parameters by ~lr = 1e-3.
  """
  cfg = setup["cfg"].replace(num_micro_batches=2, eps=1e-6)
  step = ts.TrainStep(setup["graphdef"], cfg)
  state = _fresh(setup["state"])
  for s in range(2):
    state, metrics = step(state, setup["batch"], s)
  return cfg, _host(state.params), _host(metrics)


def _naive_stats(h, w, targets, temperature):
  z = jnp.einsum("brd,dv->brv", h, w) / temperature
  logp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), targets[..., None], -1)[..., 0]
  return logp, logprobs.entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [1, 4, 5, 0])
def test_chunked_stats_and_grads_match_full_logits(chunk):
  """Any chunk size (4 and 5 do not divide 13) gives the full-logits values and gradients."""
  k = jax.random.split(jax.random.PRNGKey(chunk), 3)
  h = jax.random.normal(k[0], (3, 13, 16))
  w = jax.random.normal(k[1], (16, 50)) * 0.5
  t = jax.random.randint(k[2], (3, 13), 0, 50)
  chunked = functools.partial(logprobs.chunked_token_stats, chunk_size=chunk, temperature=0.7,
                              entropy_grad=True)
  naive = functools.partial(_naive_stats, temperature=0.7)
  wts = jax.random.normal(k[0], (2, 3, 13))

  @jax.jit
  def values_and_grads(h, w):
    out = []
    for f in (chunked, naive):
      scalar = lambda h, w, f=f: sum(jnp.sum(x * c) for x, c in zip(f(h, w, t), wts))
      out.append((f(h, w, t), jax.grad(scalar, (0, 1))(h, w)))
    return out

  (vc, gc), (vn, gn) = values_and_grads(h, w)
  for a, b in zip(vc, vn):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL)
  for a, b in zip(gc, gn):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=1e-4)


def test_forward_log_probs_match_model_logits(setup):
  """Compiled micro-batched forward == log-softmax of the model's own logits / T."""
  cfg = setup["cfg"].replace(temperature=0.6, logit_chunk_size=4, forward_micro_batch_size=4)
  batch = setup["batch"]
  fwd = ts.LogProbForward(setup["graphdef"], cfg)
  logp, ent = fwd(_fresh(setup["state"]).params, batch.input_ids, batch.attention_mask, R)
  pos = default_positions(batch.attention_mask)
  full_logits = jax.jit(lambda s, *a: nnx.merge(setup["graphdef"], s.params, s.rest)(*a))
  z = full_logits(setup["state"], batch.input_ids, pos, batch.attention_mask)[:, P - 1:-1] / 0.6
  ref = jnp.take_along_axis(jax.nn.log_softmax(z, -1), batch.input_ids[:, P:, None], -1)[..., 0]
  np.testing.assert_allclose(logp, ref, atol=TOL, rtol=TOL)
  np.testing.assert_allclose(ent, logprobs.entropy_from_logits(z), atol=TOL, rtol=TOL)


def test_micro_batched_forward_with_rematerialisation(setup):
  """With remat on (the 32B config's "full"), the micro-batched no-grad forward (the trainer's
  old log-probs) runs and equals the one-pass forward; with the weights closed over by its
  loop it raised flax's TraceContextError."""
  graphdef, params, rest = nnx.split(create_model(get_preset("test", remat="full"), seed=0),
                                     nnx.Param, ...)
  batch = setup["batch"]
  whole = ts.LogProbForward(graphdef, setup["cfg"], rest=rest)
  micro = ts.LogProbForward(graphdef, setup["cfg"].replace(forward_micro_batch_size=4),
                            rest=rest)
  want = whole(params, batch.input_ids, batch.attention_mask, R)
  got = micro(params, batch.input_ids, batch.attention_mask, R)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL)


def _grads(setup, **overrides):
  cfg = setup["cfg"].replace(**overrides)
  fn = jax.jit(functools.partial(ts.loss_and_grads, setup["graphdef"], cfg))
  state = setup["state"]
  grads, metrics, _ = fn(state.params, state.rest, setup["batch"])
  return _host(grads), _host(metrics)


def test_micro_batches_give_the_exact_token_mean_gradient(setup):
  """1, 2 and 4 micro-batches: the same loss, metrics and gradients; verl's split differs."""
  g1, m1 = _grads(setup, num_micro_batches=1)
  for n in (2, 4):
    gn, mn = _grads(setup, num_micro_batches=n)
    for k in m1:
      np.testing.assert_allclose(mn[k], m1[k], atol=TOL, rtol=TOL, err_msg=k)
    # Gradients are O(1e-2); summation order moves them by O(1e-8).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=TOL), gn, g1)
  lengths = np.asarray(setup["batch"].response_mask).sum(1)
  assert m1["num_tokens"] == lengths.sum() and len(set(lengths)) > 3
  assert m1["pg_clipfrac"] > 0 and m1["pg_clipfrac_lower"] > 0  # every clip branch is live
  gv, mv = _grads(setup, num_micro_batches=4, micro_batch_loss="verl")
  rel = max(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)
            for a, b in zip(jax.tree.leaves(gv), jax.tree.leaves(g1)))
  assert rel > 1e-2, "verl's per-micro-batch mean should not equal the token mean here"
  assert abs(mv["loss"] - m1["loss"]) > 1e-4


def test_options_kl_entropy_overlong(setup):
  """k3 KL and entropy bonus add to the loss as token means; overlong filter drops rows."""
  batch = setup["batch"]
  truncated = np.zeros(B, bool)
  truncated[[0, 3]] = True  # row 0 has the full response length
  ref = batch.old_log_probs - 0.3
  b2 = batch.replace(ref_log_probs=ref, truncated=jnp.asarray(truncated))
  cfg = setup["cfg"].replace(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
                             overlong_filter=True, num_micro_batches=2)
  fn = jax.jit(functools.partial(ts.loss_and_grads, setup["graphdef"], cfg))
  _, m, finite = fn(setup["state"].params, setup["state"].rest, b2)
  mask = np.asarray(batch.response_mask) * ~truncated[:, None]
  assert bool(finite) and m["num_tokens"] == mask.sum()
  np.testing.assert_allclose(m["loss"], m["pg_loss"] + 0.1 * m["kl"] - 0.01 * m["entropy"],
                             rtol=1e-5)
  with pytest.raises(ValueError, match="ref_log_probs"):
    jax.eval_shape(functools.partial(ts.loss_and_grads, setup["graphdef"], cfg),
                   setup["state"].params, setup["state"].rest, b2.replace(ref_log_probs=None))


@pytest.mark.parametrize("axes", [
    [("data", 1), ("fsdp", 8), ("tensor", 1)],
    [("data", 1), ("fsdp", 4), ("tensor", 2)],
], ids=["fsdp8", "fsdp4xtensor2"])
def test_sharded_step_matches_single_device(setup, single_device_run, axes):
  cfg, ref_params, ref_metrics = single_device_run
  mesh = shd.make_mesh(axes)
  step = ts.TrainStep(setup["graphdef"], cfg, mesh)
  state = _fresh(setup["state"])
  state = jax.device_put(state, shd.state_shardings(state, mesh, shd.TRAIN_RULES))
  batch = jax.device_put(setup["batch"], shd.batch_sharding(mesh, shd.TRAIN_RULES, 1, B))
  traces = step.traces.total
  for s in range(2):
    state, metrics = step(state, setup["batch"] if s else batch, s)
  assert step.traces.total == traces + 1, "the second call retraced"
  q_kernel = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"]
  assert "fsdp" in str(q_kernel.get_value().sharding.spec)
  for k in ("loss", "grad_norm", "pg_clipfrac", "entropy", "num_tokens"):
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=TOL, atol=TOL, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL),
               _host(state.params), ref_params)
  if dict(axes)["tensor"] > 1:  # the no-grad forward, vocab split over `tensor`
    fwd = ts.LogProbForward(setup["graphdef"], setup["cfg"], mesh)
    logp, _ = fwd(_fresh(setup["state"]).params, batch.input_ids, batch.attention_mask, R)
    np.testing.assert_allclose(logp, setup["logp"], atol=TOL, rtol=TOL)


def test_non_finite_batch_skips_the_update(setup):
  step = setup["step"]
  state = _fresh(setup["state"])
  batch = setup["batch"]
  nan_adv = batch.replace(advantages=batch.advantages.at[3].set(jnp.nan))
  inf_logp = batch.replace(old_log_probs=batch.old_log_probs.at[0, 2].set(-jnp.inf))
  before = _host(state)
  traces = step.traces.total
  for i, bad in enumerate((nan_adv, inf_logp)):
    state, m = step(state, bad, 0)
    assert float(m["skipped"]) == 1.0 and int(state.num_skipped) == i + 1
    jax.tree.map(np.testing.assert_array_equal, _host(state.params), before.params)
    jax.tree.map(np.testing.assert_array_equal, _host(state.opt_state), before.opt_state)
  # -inf outside the response mask is padding, not poison.
  padded = batch.replace(old_log_probs=jnp.where(batch.response_mask > 0,
                                                 batch.old_log_probs, -jnp.inf))
  state, m = step(state, padded, 0)
  assert float(m["skipped"]) == 0.0 and int(state.num_skipped) == 2 and int(state.step) == 3
  assert np.isfinite(float(m["loss"]))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), _host(state.params), before.params)
  assert all(jax.tree.leaves(changed)[:3])
  assert step.traces.total <= traces + 1, "poisoned values must not change the compiled step"


def test_updates_follow_the_advantage_sign(setup):
  """A few on-policy updates: positive-advantage responses gain log-prob, negative lose it."""
  step, fwd = setup["step"], setup["fwd"]
  batch = setup["batch"].replace(old_log_probs=jnp.asarray(setup["logp"]))
  state = _fresh(setup["state"])
  mask = np.asarray(batch.response_mask)
  adv = np.asarray(batch.advantages)
  seq_logp = lambda lp: (np.asarray(lp) * mask).sum(1)
  start = seq_logp(setup["logp"])
  losses = []
  for s in range(3):
    state, m = step(state, batch, s)
    losses.append(float(m["loss"]))
  end = seq_logp(fwd(state.params, batch.input_ids, batch.attention_mask, R)[0])
  assert np.all(end[adv > 0] > start[adv > 0]), (end - start)[adv > 0]
  assert np.all(end[adv < 0] < start[adv < 0]), (end - start)[adv < 0]
  assert losses[2] < losses[1] < losses[0], losses


def test_warmup_schedule():
  paper = ts.TrainConfig(lr=1e-6, warmup_steps=20)
  verl = ts.TrainConfig(lr=1e-6, warmup_steps=10, warmup_style="verl")
  for cfg, steps, want in (
      (paper, (0, 9, 19, 20, 500), (5e-8, 5e-7, 1e-6, 1e-6, 1e-6)),
      (verl, (0, 1, 5, 10, 11), (0.0, 1e-7, 5e-7, 1e-6, 1e-6)),
      (ts.TrainConfig(lr=2e-6, warmup_steps=0), (0, 7), (2e-6, 2e-6)),
  ):
    got = [float(ts.lr_at(cfg, s)) for s in steps]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-15)
  with pytest.raises(ValueError, match="warmup_style"):
    ts.TrainConfig(warmup_style="cosine")


def test_reference_log_probs_in_the_old_log_prob_pass_and_zero_kl_at_the_start(setup):
  """Issue 17 D2: with the reference equal to the policy (step 0), the reference pass gives the
  old log-probs, the KL is 0 and so is its gradient (low_var_kl): the update is the no-KL one."""
  params = _fresh(setup["state"]).params
  ref_params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  batch = setup["batch"]
  fwd = ts.LogProbForward(setup["graphdef"], setup["cfg"])
  old, _, ref = fwd(params, batch.input_ids, batch.attention_mask, R, ref_params=ref_params)
  assert fwd.traces.total == 1  # policy and reference in one compiled program
  np.testing.assert_array_equal(old, ref)
  np.testing.assert_allclose(old, setup["logp"], atol=TOL, rtol=TOL)
  b = batch.replace(old_log_probs=old, ref_log_probs=ref)
  grads = {}
  for use_kl in (True, False):
    cfg = setup["cfg"].replace(use_kl_loss=use_kl, kl_loss_coef=1.0)
    fn = jax.jit(functools.partial(ts.loss_and_grads, setup["graphdef"], cfg))
    grads[use_kl], m, _ = fn(params, setup["state"].rest, b)
    if use_kl:
      assert float(m["kl"]) == 0.0
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-7), _host(grads[True]),
               _host(grads[False]))


@pytest.mark.parametrize("kind", obj.KL_PENALTY_KINDS)
def test_kl_loss_value_and_gradient_match_numpy(kind):
  """Each of verl's estimators, aggregated as the update does (token mean), against numpy."""
  rng = np.random.default_rng(1)
  logp = rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32)
  ref = (logp + rng.normal(0.0, 0.4, (4, 6))).astype(np.float32)
  mask = (np.arange(6)[None] < np.array([[6], [3], [1], [5]])).astype(np.float32)
  d = logp.astype(np.float64) - ref
  value, slope = {  # per token: estimate and its derivative in logp
      "k1": (d, np.ones_like(d)), "kl": (d, np.ones_like(d)), "abs": (np.abs(d), np.sign(d)),
      "k2": (0.5 * d * d, d), "mse": (0.5 * d * d, d),
      "k3": (np.exp(-d) + d - 1, 1 - np.exp(-d)),
      "low_var_kl": (np.exp(-d) + d - 1, 1 - np.exp(-d))}[kind]
  n = mask.sum()
  loss_fn = lambda lp: obj.agg_loss(obj.kl_penalty(lp, ref, kind), mask, "token-mean")
  loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
  assert float(loss) == pytest.approx((value * mask).sum() / n, rel=1e-5)
  np.testing.assert_allclose(grad, slope * mask / n, rtol=1e-4, atol=1e-7)


def test_kl_loss_gradient_matches_finite_differences(setup):
  """The whole compiled loss with only the KL term (advantages 0) and a reference that differs
  from the policy: the gradient's length equals the finite-difference slope along it."""
  params = _fresh(setup["state"]).params
  leaves = jax.tree.leaves(params)
  noise = jax.tree.unflatten(jax.tree.structure(params), [
      0.05 * jax.random.normal(jax.random.PRNGKey(i), x.shape) for i, x in enumerate(leaves)])
  ref_params = jax.tree.map(jnp.add, params, noise)
  batch = setup["batch"]
  fwd = ts.LogProbForward(setup["graphdef"], setup["cfg"])
  old, _, ref = fwd(params, batch.input_ids, batch.attention_mask, R, ref_params=ref_params)
  b = batch.replace(old_log_probs=old, ref_log_probs=ref,
                    advantages=jnp.zeros_like(batch.advantages))
  cfg = setup["cfg"].replace(use_kl_loss=True, kl_loss_coef=1.0, num_micro_batches=2)
  fn = jax.jit(functools.partial(ts.loss_and_grads, setup["graphdef"], cfg))
  grads, m, _ = fn(params, setup["state"].rest, b)
  assert float(m["pg_loss"]) == 0.0 and float(m["kl"]) > 1e-4
  norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
  loss_at = lambda eps: float(fn(jax.tree.map(lambda p, g: p + eps * g / norm, params, grads),
                                 setup["state"].rest, b)[1]["loss"])
  eps = 1e-2
  slope = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
  assert slope == pytest.approx(norm, rel=2e-2)
