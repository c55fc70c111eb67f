"""LoRA (dapo_jax/models/lora.py): adapters on the Dense projections, trained alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax import config as config_lib
from dapo_jax import train_step as ts
from dapo_jax.models import create_model, get_preset, lora

B, P, R = 8, 4, 6
VOCAB = 128


def _batch(rng, logp=None):
  ids = rng.randint(1, VOCAB, (B, P + R)).astype(np.int32)
  attn = np.ones((B, P + R), np.int32)
  attn[::2, :2] = 0  # left padding
  attn[1::3, P + 4:] = 0  # short responses
  ids = np.where(attn == 1, ids, 0)
  old = np.zeros((B, R), np.float32) - 4.0 if logp is None else np.asarray(logp)
  adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
  return ts.TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
                       response_mask=jnp.asarray(attn[:, P:].astype(np.float32)),
                       old_log_probs=jnp.asarray(old), advantages=jnp.asarray(adv))


def _model(rank=4, scan=False, targets=lora.ALL_TARGETS, dtype="float32"):
  model = create_model(get_preset("test", scan_layers=scan, param_dtype=dtype, dtype=dtype),
                       seed=0)
  return lora.add_adapters(model, lora.LoRAConfig(rank=rank, alpha=8.0, targets=targets), seed=1)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def test_fresh_adapters_leave_the_model_unchanged_and_train_alone(scan=True):
  """B = 0: the LoRA model's loss and log-probs are the full model's, bit for bit; a step gives
  gradients to the adapters only (fp32 master), and the base is bitwise what it was."""
  cfg = ts.TrainConfig(lr=1e-2, warmup_steps=0, logit_chunk_size=0, num_micro_batches=2)
  model = create_model(get_preset("test", scan_layers=scan, param_dtype="bfloat16",
                                  dtype="bfloat16"), seed=0)
  fg, fstate = ts.init_train_state(nnx.clone(model), cfg)
  lora.add_adapters(model, lora.LoRAConfig(rank=4, alpha=8.0), seed=1)
  graphdef, state = ts.init_train_state(model, cfg)
  # Only adapters are trained, in fp32; the base keeps the model's dtype.
  kinds = {type(v) for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(
      x, nnx.Variable))}
  assert kinds == {lora.Adapter}
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.rest))
  n_adapted = 7 * (1 if scan else get_preset("test").num_hidden_layers)
  assert len(jax.tree.leaves(state.params)) == 2 * n_adapted
  batch = _batch(np.random.RandomState(0))
  _, m_full = ts.TrainStep(fg, cfg)(fstate, batch, 0)
  base_before = _host(state.rest)
  new, m_lora = ts.TrainStep(graphdef, cfg)(state, batch, 0)
  assert float(m_lora["loss"]) == float(m_full["loss"])  # measured before the update
  assert float(m_lora["skipped"]) == 0 and float(m_lora["grad_norm"]) > 0
  # The optimizer state holds moments of the adapters alone (mu and nu: 2 per adapter).
  assert len(jax.tree.leaves(new.opt_state)) == 2 * len(jax.tree.leaves(state.params)) + 1
  # The base: the same arrays, bitwise unchanged (not donated, not copied).
  jax.tree.map(np.testing.assert_array_equal, _host(new.rest), base_before)
  assert all(a is b for a, b in zip(jax.tree.leaves(new.rest), jax.tree.leaves(state.rest)))
  # B = 0 gives A no loss gradient, but B gets one: every B moved.
  moved = [float(jnp.abs(x).max()) for p, x in nnx.to_flat_state(new.params) if p[-1] == "lora_b"]
  assert min(moved) > 0


@functools.partial(jax.jit, static_argnums=0)
def _logp_jit(graphdef, state, batch):
  from dapo_jax.logprobs import response_log_probs  # pylint: disable=g-import-not-at-top
  pos = ts.default_positions(batch.attention_mask)
  return response_log_probs(nnx.merge(graphdef, state), batch.input_ids, batch.attention_mask,
                            pos, R)[0]


def _logp(model, batch):
  return _logp_jit(*nnx.split(model), batch)


def test_targets_select_projections_and_merge_matches_the_adapted_forward():
  model = _model(rank=2, targets=("q", "*.mlp.down_proj"))
  paths = lora.target_paths(model, lora.LoRAConfig(rank=2, targets=("q", "*.mlp.down_proj")))
  assert paths and all(p.endswith(("self_attn.q_proj", "mlp.down_proj")) for p in paths)
  # Random B: the merged kernels compute what the adapters do (fp32, tight).
  _, adapters, base = nnx.split(model, lora.Adapter, ...)
  adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape),
                          adapters)
  graphdef = nnx.split(model, lora.Adapter, ...)[0]
  batch = _batch(np.random.RandomState(1))
  adapted = _logp(nnx.merge(graphdef, adapters, base), batch)
  plain = create_model(get_preset("test"), seed=0)
  pg, pstate = nnx.split(plain)
  merged = lora.merge_adapters(pstate, adapters, 8.0 / 2)
  np.testing.assert_allclose(np.asarray(_logp(nnx.merge(pg, merged), batch)),
                             np.asarray(adapted), atol=2e-5)


@pytest.mark.parametrize("field,value,words", [
    ("rank", -1, "must be >= 0"), ("alpha", 0.0, "must be > 0"),
    ("quantize_base", "int3", "choose one of"), ("targets", ("qq",), "matches no projection")])
def test_config_validation_is_one_line(field, value, words):
  c = config_lib.default_config()
  c.model.lora.rank = 8
  c.model.lora[field] = value
  with pytest.raises(ValueError, match=words) as err:
    config_lib.validate(c)
  assert "\n" not in str(err.value) and f"model.lora.{field}" in str(err.value)
  c.model.lora[field] = config_lib.default_config().model.lora[field]
  c.model.lora.targets = ("layers.3.mlp.up_proj", "*.self_attn.q_proj", "k")  # patterns pass
  config_lib.validate(c)


def test_an_adapter_update_reaches_both_samplers():
  """The peers' silent bug: adapters trained but never sampled. After an adapter update, the
  static sampler's and the continuous engine's log-probs are the adapted policy's (the training
  forward's of the same tokens), not the base's; the KL reference (zero adapters) is the base."""
  from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampler import Sampler  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.weights import MergedRolloutWeights  # pylint: disable=g-import-not-at-top
  model = create_model(get_preset("test"), seed=0)
  sampler_graphdef, _ = nnx.split(model)
  lcfg = lora.LoRAConfig(rank=4, alpha=8.0)
  lora.add_adapters(model, lcfg, seed=1)
  cfg = ts.TrainConfig(logit_chunk_size=0)
  graphdef, state = ts.init_train_state(model, cfg)
  to_rollout = MergedRolloutWeights(jnp.float32, None, lcfg.scale, base=state.rest)
  keys = iter(jax.random.split(jax.random.key(5), 100))
  updated = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), state.params)
  zeros = jax.tree.map(jnp.zeros_like, state.params)  # run_setup.reference_policy under LoRA
  fwd = ts.LogProbForward(graphdef, cfg, rest=state.rest)
  sp = SamplingParams(max_new_tokens=R, eos_ids=(), pad_id=0)
  prompts = jnp.asarray(np.random.RandomState(2).randint(1, VOCAB, (2, P)), jnp.int32)
  mask = jnp.ones((2, P), bool)
  engines = {"static": Sampler(sampler_graphdef).generate,
             "continuous": continuous.make_rollout_fn(sampler_graphdef, max_concurrent_decodes=4,
                                                      max_prefill_length=P)}
  for name, generate in engines.items():
    out = generate(to_rollout(updated), prompts, mask, jax.random.key(0), sp, 2)
    ids = jnp.concatenate([jnp.asarray(out.prompt_ids), jnp.asarray(out.response_ids)], 1)
    attn = jnp.concatenate([jnp.asarray(out.prompt_mask), jnp.asarray(out.response_mask)], 1)
    logp, _, ref = fwd(updated, ids.astype(jnp.int32), attn.astype(jnp.int32), R,
                       ref_params=zeros)
    m = np.asarray(out.response_mask)
    sampled = np.asarray(out.logprobs)
    np.testing.assert_allclose(sampled[m], np.asarray(logp)[m], atol=2e-4, err_msg=name)
    assert np.abs(sampled[m] - np.asarray(ref)[m]).max() > 1e-2, name  # not the base's


def test_lora_run_trains_resumes_exactly_and_refuses_another_base(tmp_path):
  """dapo-train with model.lora and the KL loss: checkpoints hold the adapters alone (and their
  base's fingerprint), a 1 + 1 step run resumes to the 2-step run's adapters bit for bit, the
  reference is the base (nothing written), and a launch on another base is refused."""
  from dapo_jax import run_setup  # pylint: disable=g-import-not-at-top
  from dapo_jax.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  from tests.test_train_e2e import _params, _small_config  # pylint: disable=g-import-not-at-top
  cfg = lambda n: _small_config(**{"model.lora.rank": 2, "model.lora.alpha": 4.0,
                                   "algorithm.use_kl_loss": True, "optim.lr": 1e-2,
                                   "num_steps": n})
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  m = train_and_evaluate(cfg(2), full)
  assert np.isfinite(m["actor/kl"]) and m["actor/kl"] > 0  # moved away from the base
  assert not (tmp_path / "full" / run_setup.REFERENCE_DIR).exists()
  train_and_evaluate(cfg(1), part)
  train_and_evaluate(cfg(2), part)
  a, b = _params(full, 2), _params(part, 2)
  n_layers = 1  # _small_config's model
  assert len(a) == len(b) == 2 * 7 * n_layers  # lora_a and lora_b of q k v o gate up down
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  _check_policy_and_exports(cfg(2), part, b, tmp_path)
  with pytest.raises(ValueError, match="holds LoRA adapters of the base") as err:
    c = cfg(3)
    c.seed = 1  # another random base
    train_and_evaluate(c, part, allow_config_change=("seed",))
  assert "\n" not in str(err.value)


def _check_policy_and_exports(config, workdir, adapters, tmp_path):
  """dapo-eval / dapo-serve / dapo-export read a LoRA workdir as its merged weights."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from dapo_jax import export  # pylint: disable=g-import-not-at-top
  from dapo_jax import policy as policy_lib  # pylint: disable=g-import-not-at-top
  pol = policy_lib.load_policy(config, workdir=workdir)
  graphdef, base, _, restored, step = policy_lib.lora_parts(
      config, pol.tokenizer, workdir, None, None)
  assert pol.step == step == 2
  for x, y in zip(jax.tree.leaves(restored), adapters):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  scale = config.model.lora.alpha / config.model.lora.rank
  want = lora.merge_adapters(base, restored, scale)
  jax.tree.map(np.testing.assert_array_equal, _host(pol.params), _host(want))
  differs = [not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(pol.params), jax.tree.leaves(base))]
  assert sum(differs) == 7  # the 7 adapted kernels of the one layer, nothing else
  merged, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
  export.main([f"--workdir={workdir}", f"--out={merged}"])
  assert {"config.json", "model.safetensors"} <= set(os.listdir(merged))
  export.main([f"--workdir={workdir}", f"--out={peft_dir}", "--peft"])
  cfg = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
  assert (cfg["r"], cfg["lora_alpha"], len(cfg["target_modules"])) == (2, 4.0, 7)
