"""LoRA (dapo_jax/models/lora.py): adapters on the Dense projections, trained alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax import config as config_lib
from dapo_jax.trainer import train_step as ts
from dapo_jax.models import create_model, get_preset, lora
from dapo_jax.spec.run_spec import RunSpec

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
  """B = 0: the LoRA model's log-probs are the full model's, bit for bit (bf16); a step gives
  gradients to the adapters only (fp32 master), and the base is bitwise what it was."""
  cfg = ts.TrainConfig(lr=1e-2, warmup_steps=0, logit_chunk_size=0, num_micro_batches=2)
  model = create_model(get_preset("test", scan_layers=scan, param_dtype="bfloat16",
                                  dtype="bfloat16"), seed=0)
  full = nnx.clone(model)
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
  np.testing.assert_array_equal(  # the forward both share (the loss reads nothing else)
      np.asarray(_logp(nnx.merge(graphdef, state.params, state.rest), batch)),
      np.asarray(_logp(full, batch)))
  base_before = _host(state.rest)
  # Ahead of time (`compile`: the step's own call; the program takes the base apart).
  compiled = ts.TrainStep(graphdef, cfg).compile(state, batch)
  assert compiled.memory_analysis().argument_size_in_bytes > 0
  new, m_lora = compiled(state, batch, 0)
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
  from dapo_jax.models.logprobs import response_log_probs  # pylint: disable=g-import-not-at-top
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


TRAIN_MESH = [("data", 1), ("fsdp", 4), ("tensor", 2)]
ROLLOUT_MESH = [("data", 4), ("fsdp", 1), ("tensor", 2)]  # another layout than training's


def test_an_adapter_update_reaches_both_samplers():
  """The peers' silent bug: adapters trained but never sampled. Training on one mesh, the
  static sampler on another: after each of two adapter updates, the static sampler's and the
  continuous engine's log-probs are the adapted policy's (the training forward's of the same
  tokens), not the base's (the KL reference: zero adapters). Only adapters move per step: the
  base stays resident in the rollout layout and the merge there has no collectives."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampler import Sampler  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.weights import MergedRolloutWeights  # pylint: disable=g-import-not-at-top
  train_mesh, rollout_mesh = shd.make_mesh(TRAIN_MESH), shd.make_mesh(ROLLOUT_MESH)
  model = create_model(get_preset("test"), seed=0, mesh=train_mesh)
  sampler_graphdef, _ = nnx.split(model)
  lcfg = lora.LoRAConfig(rank=4, alpha=8.0)
  lora.add_adapters(model, lcfg, seed=1, mesh=train_mesh)
  cfg = ts.TrainConfig(logit_chunk_size=0)
  graphdef, state = ts.init_train_state(model, cfg, train_mesh)
  to_rollout = MergedRolloutWeights(jnp.float32, rollout_mesh, lcfg.scale, base=state.rest)
  rng = np.random.RandomState(5)  # host noise: JAX's RNG compiles slowly on CPU
  add = jax.jit(lambda t, n: jax.tree.map(jnp.add, t, n))
  noise = lambda t: add(t, jax.tree.map(
      lambda x: jax.device_put(0.3 * rng.standard_normal(x.shape).astype(x.dtype), x.sharding), t))
  zeros = jax.tree.map(jnp.zeros_like, state.params)  # reference.reference_policy under LoRA
  fwd = ts.LogProbForward(graphdef, cfg, rest=state.rest)
  sp = SamplingParams(max_new_tokens=R, eos_ids=(), pad_id=0)
  prompts = jnp.asarray(np.random.RandomState(2).randint(1, VOCAB, (2, P)), jnp.int32)
  mask = jnp.ones((2, P), bool)
  static = Sampler(sampler_graphdef, mesh=rollout_mesh, rules=shd.SAMPLE_RULES).generate
  engine = continuous.make_rollout_fn(sampler_graphdef, max_concurrent_decodes=4,
                                      max_prefill_length=P)
  adapters = state.params
  for update in range(2):  # the second update must reach the samplers too (nothing cached)
    adapters = noise(adapters)
    weights = to_rollout(adapters)
    one_device = jax.device_put(weights, jax.devices()[0])
    for name, generate, w in (("static", static, weights), ("continuous", engine, one_device)):
      out = generate(w, prompts, mask, jax.random.key(update), sp, 2)
      # Host rows: one placement for both engines' outputs, so one compiled forward.
      ids = np.concatenate([np.asarray(out.prompt_ids), np.asarray(out.response_ids)], 1)
      attn = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.response_mask)], 1)
      logp, _, ref = fwd(adapters, ids.astype(np.int32), attn.astype(np.int32), R,
                         ref_params=zeros)
      m, sampled, where = np.asarray(out.response_mask), np.asarray(out.logprobs), (name, update)
      np.testing.assert_allclose(sampled[m], np.asarray(logp)[m], atol=2e-4, err_msg=str(where))
      assert np.abs(sampled[m] - np.asarray(ref)[m]).max() > 1e-2, where  # not the base's
  # What moved: the base once (resident, in the rollout layout); per step the adapters only.
  base = to_rollout.rollout_base()
  for x, s in zip(jax.tree.leaves(base), jax.tree.leaves(to_rollout.rollout_shardings(base))):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  assert to_rollout.resident_bytes == shd.per_device_bytes(base, jax.tree.map(
      lambda x: x.sharding, base)) > 0
  kernels, _ = to_rollout.split_kernels(base, adapters)
  moved = to_rollout.send(adapters)
  hlo = to_rollout._fn.lower(moved, kernels).compile().as_text()  # pylint: disable=protected-access
  assert shd.collective_bytes(hlo) == 0  # the merge runs where the rollout reads it
  for x, s in zip(jax.tree.leaves(moved), jax.tree.leaves(to_rollout.rollout_shardings(moved))):
    assert x.sharding.is_equivalent_to(s, x.ndim)


def test_lora_run_trains_resumes_exactly_and_refuses_another_base(tmp_path, monkeypatch):
  """dapo-train with model.lora and the KL loss: checkpoints hold the adapters alone (and their
  base's fingerprint), a run resumed at step 1 reaches the uninterrupted run's step-2 adapters
  bit for bit, the reference is the base (nothing written); dapo-eval, dapo-serve and
  dapo-export read the run on its base, and refuse another base in one line, as a resume does."""
  import shutil  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import reference  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra import curves  # pylint: disable=g-import-not-at-top
  from tests.test_train_e2e import _params, _small_config  # pylint: disable=g-import-not-at-top
  # Time: every launch shares one compile cache, and none draws curves.png (seconds of CPU
  # each; test_train_e2e checks it).
  monkeypatch.setattr(curves, "plot_curves", lambda *a, **k: [])
  cfg = lambda n: _small_config(**{"model.lora.rank": 2, "model.lora.alpha": 4.0,
                                   "algorithm.use_kl_loss": True, "optim.lr": 1e-2,
                                   "rollout.engine": "static", "num_steps": n,
                                   "compilation_cache_dir": str(tmp_path / "jax_cache")})
  full, part = tmp_path / "full", tmp_path / "part"
  m = train_and_evaluate(cfg(2), str(full))  # checkpoints at steps 1 and 2
  assert np.isfinite(m["actor/kl"]) and m["actor/kl"] > 0  # moved away from the base
  assert not (full / reference.REFERENCE_DIR).exists()
  # A run stopped after step 1's checkpoint (its workdir, compile cache included), resumed.
  shutil.copytree(full, part)
  shutil.rmtree(part / "checkpoints" / "2")
  train_and_evaluate(cfg(2), str(part))
  a, b = _params(str(full), 2), _params(str(part), 2)
  n_layers = 1  # _small_config's model
  assert len(a) == len(b) == 2 * 7 * n_layers  # lora_a and lora_b of q k v o gate up down
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  merged = _check_policy_and_exports(cfg(2), str(part), b, tmp_path)
  other = cfg(3)
  other.model.checkpoint = merged  # another base: the run's own merged export
  _check_other_base_is_refused(other, str(part))


def _check_policy_and_exports(config, workdir, adapters, tmp_path):
  """dapo-eval / dapo-serve / dapo-export read a LoRA workdir as its merged weights: the ones
  the trainer's rollout read at that step, bit for bit, which sample other answers than the
  base's."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import evaluate, run_setup  # pylint: disable=g-import-not-at-top
  from dapo_jax.commands import export
  from dapo_jax.trainer import policy as policy_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.weights import MergedRolloutWeights  # pylint: disable=g-import-not-at-top
  spec = RunSpec.from_config(config)
  pol = policy_lib.load_policy(spec, workdir=workdir, mesh=policy_lib.sampling_mesh(
      spec.mesh, spec.rollout_mesh, spec.dcn_mesh))
  graphdef, base, _, restored, step = policy_lib.lora_parts(
      spec, pol.tokenizer, workdir, None, pol.mesh)
  assert pol.step == step == 2
  for x, y in zip(jax.tree.leaves(restored), adapters):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  differs = [not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(pol.params), jax.tree.leaves(base))]
  assert sum(differs) == 7  # the 7 adapted kernels of the one layer, nothing else
  # The trainer's rollout weights at step 2: its base in the training layout, the adapters
  # restored there, merged by the trainer's MergedRolloutWeights.
  mesh = run_setup.build_mesh(spec.mesh, spec.dcn_mesh)
  model = run_setup.build_model(spec.model, spec.tokenizer.kind, pol.tokenizer, mesh, spec.seed)
  train_base = nnx.state(model, nnx.Param)
  train_adapters, _ = policy_lib.restore_adapters(spec.model, spec.seed, model, workdir, None,
                                                  mesh, shd.TRAIN_RULES, base=train_base)
  scale = spec.model.lora.alpha / spec.model.lora.rank
  trainer = MergedRolloutWeights(model.config.jnp_param_dtype, run_setup.build_rollout_mesh(
      spec.rollout_mesh, spec.dcn_mesh, mesh), scale, base=train_base)(train_adapters)
  for x, y in zip(jax.tree.leaves(pol.params), jax.tree.leaves(trainer)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
  # dapo-eval's evaluation: its samples are the adapted model's, not the base's.
  records = run_setup.load_dataset(spec.data.eval, spec.data, spec.seed, "eval")
  lora_eval, ev = evaluate.evaluate_policy(spec, pol, records)
  texts = ev.last_texts
  base_eval, ev = evaluate.evaluate_policy(spec, pol._replace(params=base), records)
  assert lora_eval["eval/num_samples"] == base_eval["eval/num_samples"] == 32
  assert sum(x != y for x, y in zip(texts, ev.last_texts)) > len(texts) // 2
  line = evaluate.describe(evaluate.provenance(spec, pol, workdir))
  assert "step 2 of" in line and "LoRA adapters merged into preset" in line, line
  merged, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
  export.main([f"--workdir={workdir}", f"--out={merged}"])
  assert {"config.json", "model.safetensors"} <= set(os.listdir(merged))
  export.main([f"--workdir={workdir}", f"--out={peft_dir}", "--peft"])
  cfg = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
  assert (cfg["r"], cfg["lora_alpha"], len(cfg["target_modules"])) == (2, 4.0, 7)
  return merged


def _check_other_base_is_refused(config, workdir):
  """A resume, dapo-eval and dapo-serve on another base (an HF directory, ``config``'s) than the
  adapters trained on (the preset at seed 0): one line each, naming both bases."""
  from dapo_jax.trainer import evaluate  # pylint: disable=g-import-not-at-top
  from dapo_jax.commands import serve
  from dapo_jax.trainer.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  other = config.model.checkpoint
  launches = {
      "resume": lambda: train_and_evaluate(config, workdir,
                                           allow_config_change=("model.checkpoint",)),
      "dapo-eval": lambda: evaluate.main([f"--workdir={workdir}",
                                          f"--config.model.checkpoint={other}"]),
      "dapo-serve": lambda: serve.load_model(RunSpec.from_config(config), workdir=workdir)}
  for name, launch in launches.items():
    with pytest.raises(ValueError, match="holds LoRA adapters of the base") as err:
      launch()
    msg = str(err.value)
    assert "\n" not in msg and "seed 0" in msg and other in msg, (name, msg)


def test_lora_trains_on_unrolled_layers_under_remat():
  """The unrolled model's remat must not write the frozen base back from inside the gradient
  (nnx.remat did: TraceContextError); rematerialised gradients equal the kept ones."""
  cfg = ts.TrainConfig(lr=1e-2, warmup_steps=0, logit_chunk_size=0, num_micro_batches=1)
  batch = _batch(np.random.RandomState(0))
  out = {}
  for remat in ("none", "full"):
    model = create_model(get_preset("test", scan_layers=False, remat=remat), seed=0)
    lora.add_adapters(model, lora.LoRAConfig(rank=4, alpha=8.0), seed=1)
    graphdef, state = ts.init_train_state(model, cfg)
    new, m = ts.TrainStep(graphdef, cfg)(state, batch, 0)
    out[remat] = (float(m["grad_norm"]), _host(new.params))
  assert out["full"][0] == pytest.approx(out["none"][0], rel=1e-5) and out["full"][0] > 0
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7),
               out["full"][1], out["none"][1])
