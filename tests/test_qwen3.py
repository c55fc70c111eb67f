"""Qwen3 (dense) through the one decoder: logits, the decode steps, the samplers' log-probs, the
HF export and the peft adapter against ``transformers``' ``Qwen3ForCausalLM`` on tiny random
checkpoints with QK-norm, GQA (4 heads, 2 kv heads), no q/k/v bias and a head_dim other than
hidden / heads (64 / 4 = 16): 24 untied, 32 tied (the 0.6B's 2x)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dapo_jax  # pylint: disable=g-import-not-at-top
from dapo_jax.checkpoints import hf as hf_io  # pylint: disable=g-import-not-at-top
from dapo_jax.models import Qwen2Config, default_positions  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout import Sampler, SamplingParams  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout import continuous  # pylint: disable=g-import-not-at-top
from tests import hf_fixtures  # pylint: disable=g-import-not-at-top

TOL = 1e-5  # fp32, the goal (measured: a few 1e-7)
HEAD_DIM = {False: 24, True: 32}


_WRITTEN: dict[bool, str] = {}


def _checkpoint(tmp_path_factory, tie: bool) -> str:
  """Each checkpoint written once per session (the fixtures below share them)."""
  if tie not in _WRITTEN:
    d = str(tmp_path_factory.mktemp("qwen3") / ("tied" if tie else "untied"))
    _WRITTEN[tie] = hf_fixtures.write_tiny_qwen2(d, tie=tie, seed=10 + int(tie), family="qwen3",
                                                 head_dim=HEAD_DIM[tie], rope_theta=1e6)
  return _WRITTEN[tie]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(request, tmp_path_factory):
  return _checkpoint(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
  return _checkpoint(tmp_path_factory, False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
  return _checkpoint(tmp_path_factory, True)


def _ids(b, t, seed=0):
  return np.random.RandomState(seed).randint(0, 128, (b, t)).astype(np.int32)


def _left_padded(seed=1):
  ids = _ids(3, 12, seed)
  mask = np.ones_like(ids)
  mask[0, :5], mask[1, :2] = 0, 0
  return np.where(mask == 1, ids, 0), mask


def test_config_json_reads_as_qwen3(ckpt):
  cfg = Qwen2Config.from_hf(ckpt)
  tie = os.path.basename(ckpt) == "tied"
  assert (cfg.qk_norm, cfg.attention_bias, cfg.dim_per_head, cfg.tie_word_embeddings,
          cfg.rope_theta) == (True, False, HEAD_DIM[tie], tie, 1e6)
  model = dapo_jax.load_pretrained(ckpt)
  attn = model.layers[0].self_attn
  assert attn.q_proj.bias is None and attn.q_norm.scale.value.shape == (HEAD_DIM[tie],)
  assert attn.q_norm.scale.get_metadata()["logical_axes"] == ("head_dim",)
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == cfg.num_params()


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_logits_match_transformers(ckpt, scan):
  model = dapo_jax.load_pretrained(ckpt, scan_layers=scan)
  ids, mask = _left_padded()
  ours = np.asarray(model(jnp.asarray(ids), attention_mask_BxT=jnp.asarray(mask)))
  pos = np.asarray(default_positions(jnp.asarray(mask)))
  ref = hf_fixtures.hf_logits(ckpt, ids, attention_mask=mask, positions=pos)
  real = mask.astype(bool)
  diff = np.abs(ours[real] - ref[real]).max()
  print(f"qwen3 {os.path.basename(ckpt)} {'scan' if scan else 'loop'}: max |logit diff| {diff:.2e}")
  assert diff <= TOL


def test_prefill_then_decode_step_matches_transformers(untied):
  ckpt = untied
  model = dapo_jax.load_pretrained(ckpt, scan_layers=True)
  ids, mask = _left_padded(seed=2)
  pos = np.asarray(default_positions(jnp.asarray(mask)))
  ref = hf_fixtures.hf_logits(ckpt, ids, attention_mask=mask, positions=pos)
  p = 6
  h, cache = model.prefill(jnp.asarray(ids[:, :p]), jnp.asarray(pos[:, :p]),
                           jnp.asarray(mask[:, :p]))
  cache = cache.grow(ids.shape[1] - p)
  step = jax.jit(lambda m, c, tok, ps: m.decode_step(tok, ps, c, same_slot=True))
  got = [np.asarray(model.logits_from_hidden(h))]
  for t in range(p, ids.shape[1]):
    logits_NxV, cache = step(model, cache, jnp.asarray(ids[:, t]), jnp.asarray(pos[:, t]))
    got.append(np.asarray(logits_NxV)[:, None])
  got = np.concatenate(got, axis=1)
  real = mask.astype(bool)
  assert np.abs(got[real] - ref[real]).max() <= TOL


def _hf_response_logprobs(ckpt, prompt_ids, prompt_mask, response_ids, temperature):
  """log softmax(logits / temperature) of the HF forward at each sampled token."""
  ids = np.concatenate([prompt_ids, response_ids], axis=1)
  mask = np.concatenate([prompt_mask, np.ones_like(response_ids)], axis=1).astype(np.int32)
  pos = np.asarray(default_positions(jnp.asarray(mask)))
  logits = hf_fixtures.hf_logits(ckpt, np.where(mask == 1, ids, 0), attention_mask=mask,
                                 positions=pos)
  p = prompt_ids.shape[1]
  logp = jax.nn.log_softmax(jnp.asarray(logits[:, p - 1:-1]) / temperature, axis=-1)
  return np.asarray(jnp.take_along_axis(logp, jnp.asarray(response_ids)[..., None], -1)[..., 0])


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_sampler_logprobs_are_the_hf_forwards(untied, tied, engine):
  """The sampled tokens' log-probs (rollout.use_sampler_logprobs) equal the HF forward's, from
  the static sampler (untied) and from the continuous engine over a paged cache (tied)."""
  ckpt = tied if engine == "paged" else untied
  model = dapo_jax.load_pretrained(ckpt, scan_layers=engine == "paged")
  graphdef, state = nnx.split(model)
  ids, mask = _left_padded(seed=3)
  params = SamplingParams(temperature=0.8, max_new_tokens=8, eos_ids=(), pad_id=0)
  if engine == "static":
    out = Sampler(graphdef).generate(state, ids, mask.astype(bool), jax.random.key(1), params,
                                     num_samples=2)
  else:
    sampler = continuous.ContinuousSampler(graphdef, num_slots=4, chunk_steps=4,
                                           max_prefill_length=16, kv_cache="paged", page_size=4,
                                           attention_impl="xla")
    out = sampler.generate(state, ids, mask.astype(bool), jax.random.key(1), params,
                           num_samples=2)
  out = jax.device_get(out)
  ref = _hf_response_logprobs(ckpt, np.asarray(out.prompt_ids),
                              np.asarray(out.prompt_mask).astype(np.int32),
                              np.asarray(out.response_ids), 0.8)
  m = np.asarray(out.response_mask)
  assert m.all()
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], ref[m], atol=2e-5, rtol=0)


def test_export_round_trips_as_qwen3(tied, tmp_path):
  """Tied: no lm_head tensor written, transformers ties it back."""
  ckpt = tied
  model = dapo_jax.load_pretrained(ckpt, scan_layers=True)
  out = hf_io.save_pretrained(model, tmp_path / "export", max_shard_bytes=20_000)
  written = json.load(open(os.path.join(out, "config.json")))
  assert (written["architectures"], written["model_type"], written["attention_bias"]) == (
      ["Qwen3ForCausalLM"], "qwen3", False)
  ids = _ids(2, 9, seed=4)
  ref = hf_fixtures.hf_logits(ckpt, ids)
  assert np.abs(hf_fixtures.hf_logits(out, ids) - ref).max() <= TOL
  assert np.abs(np.asarray(dapo_jax.load_pretrained(out)(jnp.asarray(ids))) - ref).max() <= TOL


def test_one_dapo_step_with_the_paged_engine_and_lora(tmp_path, monkeypatch):
  """dapo-train's loop on a Qwen3 checkpoint: continuous engine over a paged cache, LoRA
  adapters on the frozen base, scanned layers; with every group mixed (response 0 of each
  rewarded) the step moves the adapters' B factors off zero."""
  from dapo_jax.infra import curves  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import CharTokenizer  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  from tests import test_train_e2e  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(curves, "plot_curves", lambda *a, **k: [])
  monkeypatch.setattr(run_setup, "RewardScorer",
                      test_train_e2e._FirstOfEachGroupCorrect)  # pylint: disable=protected-access
  ckpt = hf_fixtures.write_tiny_qwen2(str(tmp_path / "qwen3"), family="qwen3", head_dim=24,
                                      num_hidden_layers=1, seed=5)
  CharTokenizer().save(ckpt)
  c = test_train_e2e._small_config(**{  # pylint: disable=protected-access
      "model.lora.rank": 2, "model.lora.alpha": 4.0, "optim.lr": 1e-2,
      "rollout.engine": "continuous", "rollout.kv_cache": "paged", "rollout.page_size": 4,
      "model.scan_layers": True, "num_steps": 1})
  c.model.checkpoint, c.model.overrides, c.tokenizer.kind = ckpt, {}, "auto"
  workdir = str(tmp_path / "run")
  m = train_and_evaluate(c, workdir)
  assert np.isfinite(m["actor/entropy"])
  adapters = test_train_e2e._params(workdir, 1)  # pylint: disable=protected-access
  assert len(adapters) == 2 * 7  # A and B of the 7 projections of the one (scanned) layer
  assert all(np.abs(a).max() > 0 for a in adapters)  # every B trained off its zero init
  assert json.load(open(os.path.join(workdir, "config.json")))["model"]["lora"]["rank"] == 2
  # dapo-export: the merged weights as a directory transformers loads as Qwen3, with the
  # logits of the policy dapo-eval restores; --peft: the adapters on Qwen3's module names.
  from dapo_jax.commands import export  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import policy as policy_lib  # pylint: disable=g-import-not-at-top
  merged, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
  export.main([f"--workdir={workdir}", f"--out={merged}"])
  assert json.load(open(os.path.join(merged, "config.json")))["architectures"] == [
      "Qwen3ForCausalLM"]
  pol = policy_lib.load_policy(RunSpec.from_config(c), workdir=workdir)
  ids = _ids(2, 9, seed=7)
  np.testing.assert_allclose(hf_fixtures.hf_logits(merged, ids),
                             np.asarray(pol.model(jnp.asarray(ids))), atol=2e-5, rtol=0)
  export.main([f"--workdir={workdir}", f"--out={peft_dir}", "--peft"])
  assert sorted(json.load(open(os.path.join(peft_dir, "adapter_config.json")))[
      "target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                             "v_proj"]


def test_load_straight_into_sharded_layout(untied):
  """The sharding rules place Qwen3's new parameters (q_norm / k_norm scales: logical axis
  head_dim, replicated) and the bias-free projections; the sharded model keeps HF's logits."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  mesh = shd.make_mesh([("data", 1), ("fsdp", 4), ("tensor", 2)])
  model = dapo_jax.load_pretrained(untied, mesh=mesh, scan_layers=True)
  attn = model.layers.self_attn
  assert attn.q_norm.scale.value.sharding.spec == jax.sharding.PartitionSpec(None, None)
  assert attn.q_proj.kernel.value.sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp", "tensor", None)
  ids = _ids(2, 9, seed=5)
  ref = hf_fixtures.hf_logits(untied, ids)
  assert np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max() <= TOL
