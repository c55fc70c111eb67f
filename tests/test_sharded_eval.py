"""Sharded bf16/fp32 evaluation: params land in the sampling layout (tensor-split, one tensor at a
time or by an Orbax restore with target shardings) and avg@k equals the one-device result."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from dapo_jax.spec import cli
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer import evaluate
from dapo_jax.trainer import policy as policy_lib
from dapo_jax.tokenizers import CharTokenizer
from dapo_jax.checkpoints.orbax import TrainCheckpointer
from dapo_jax.data import arithmetic

pytest.importorskip("torch")
from tests import hf_fixtures  # pylint: disable=g-import-not-at-top,wrong-import-position

TENSOR = 4
MESH = [("data", 2), ("tensor", TENSOR)]
# Every weight matrix of the model: all split over `tensor` in the sampling layout (heads, KV
# heads, MLP columns, vocab); the embedding's hidden dim stays whole (no FSDP when sampling).
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "embed_tokens", "lm_head")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  # 4 KV heads so that k/v projections split over tensor=4 too (2 would stay replicated).
  out = hf_fixtures.write_tiny_qwen2(str(tmp_path_factory.mktemp("hf")), vocab_size=64,
                                     num_key_value_heads=4, seed=5)
  CharTokenizer().save(out)
  return out


def _sampling_mesh(spec):
  return policy_lib.sampling_mesh(spec.mesh, spec.rollout_mesh, spec.dcn_mesh)


def _spec(ckpt, *extra):
  """The spec dapo-eval reads from these flags."""
  fv = evaluate._parse([f"--config.model.checkpoint={ckpt}", "--config.data.eval=arithmetic",  # pylint: disable=protected-access
                        "--config.data.arithmetic.num_eval=8", "--config.eval.num_samples=4",
                        "--config.eval.batch_size=4", "--config.rollout.max_response_length=8",
                        "--config.data.max_prompt_length=16", "--config.tokenizer.kind=char",
                        "--config.mesh=data=2,tensor=4", *extra])
  return RunSpec.read(fv.config)


def _per_device_bytes(params):
  """{param path: (bytes on each device, total bytes)}; asserts every device holds the same."""
  out = {}
  for path, var in nnx.to_flat_state(params):
    x = var.value
    sizes = {s.data.nbytes for s in x.addressable_shards}
    assert len(x.addressable_shards) == jax.device_count() and len(sizes) == 1, path
    out["/".join(map(str, path))] = (sizes.pop(), x.nbytes)
  return out


def _check_layout(params):
  sizes = _per_device_bytes(params)
  split = {k: v for k, v in sizes.items() if v[0] * TENSOR == v[1]}
  whole = {k: v for k, v in sizes.items() if v[0] == v[1]}
  assert set(split) | set(whole) == set(sizes)
  for k, (dev, total) in sizes.items():
    if any(m in k for m in MATRICES) and not k.endswith("bias"):
      assert dev * TENSOR == total, (k, dev, total)  # each big matrix: 1/tensor per device
  assert all("norm" in k for k in whole), sorted(whole)  # only norm scales are replicated
  total = sum(t for _, t in sizes.values())
  per_device = sum(d for d, _ in sizes.values())
  norms = sum(t for _, t in whole.values())
  assert per_device == (total - norms) // TENSOR + norms
  return total, per_device


def _write_workdir(tmp_path, ckpt, policy):
  """A dapo-train workdir layout: config.json + checkpoints/<step> (params, fp32)."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints").mkdir(parents=True)
  c = cli.get_config()
  c.model.checkpoint = ckpt
  c.tokenizer.kind = "char"
  (workdir / "config.json").write_text(c.to_json_best_effort())
  params = jax.device_get(policy.params)  # written from host arrays: no layout of its own
  with TrainCheckpointer(workdir / "checkpoints", async_save=False) as saver:
    saver.save(3, params, {"mu": np.zeros(3, np.float32)})
  return str(workdir)


def test_hf_and_orbax_loads_land_tensor_split(ckpt, tmp_path):
  spec = _spec(ckpt)
  mesh = _sampling_mesh(spec)
  assert dict(mesh.shape) == {"data": 2, "tensor": TENSOR}
  hf_policy = policy_lib.load_policy(spec, mesh=mesh)
  total, per_device = _check_layout(hf_policy.params)
  print(f"params {total} B in total, {per_device} B per device (tensor={TENSOR})")

  workdir = _write_workdir(tmp_path, ckpt, policy_lib.load_policy(spec, mesh=None))
  for dtype in ("float32", "bfloat16"):  # bf16: the fp32 checkpoint is cast while read
    fv = evaluate._parse([f"--workdir={workdir}", "--config.mesh=data=2,tensor=4",  # pylint: disable=protected-access
                          f"--config.model.param_dtype={dtype}", f"--config.model.dtype={dtype}"])
    restored = policy_lib.load_policy(RunSpec.read(fv.config), workdir=fv.workdir, mesh=mesh)
    _check_layout(restored.params)
    ref = jax.tree.leaves(hf_policy.params)
    for a, b in zip(jax.tree.leaves(restored.params), ref):
      assert a.dtype == np.dtype(dtype) and a.sharding.is_equivalent_to(b.sharding, a.ndim)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))


def test_sharded_avg_at_k_equals_one_device(ckpt):
  spec = _spec(ckpt)
  records = arithmetic.make_records(8, split="test", seed=0)
  one = policy_lib.load_policy(spec, mesh=None)
  assert all(len(x.devices()) == 1 for x in jax.tree.leaves(one.params))
  sharded = policy_lib.load_policy(spec, mesh=_sampling_mesh(spec))
  ref, ref_ev = evaluate.evaluate_policy(spec, one, records)
  got, got_ev = evaluate.evaluate_policy(spec, sharded, records)
  assert got_ev.last_texts == ref_ev.last_texts  # the same samples, token for token
  assert got == ref and got["eval/num_samples"] == 32
  assert json.dumps(got_ev.last_rows, default=str) == json.dumps(ref_ev.last_rows, default=str)
