"""Train-state checkpoints: round trip, sharded restore, retention, and surviving damaged steps."""

import gc
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dapo_jax.infra import sharding as shd
from dapo_jax.checkpoints import orbax as ock
from dapo_jax.models import abstract_model, get_preset

# Reading a damaged file on purpose leaves Orbax's pending read coroutines to be reaped after the
# error is raised; pytest reports those as unraisable. The error itself is asserted below.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _reap_abandoned_reads():
  yield
  gc.collect()  # Reaped here, under the filter above, not during some later module's test.


def _tree_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


def _small_state(seed: int):
  """A tiny params dict and its adamw state; a distinct seed per step so steps differ."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"w": jax.random.normal(k1, (64, 32)), "b": jax.random.normal(k2, (32,))}
  return params, optax.adamw(1e-3).init(params)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _restore_small(ck, step=None):
  params, opt = _small_state(0)
  return ck.restore(step, abstract_params=_abstract(params), abstract_opt_state=_abstract(opt))


def _save_steps(ck, steps):
  for s in steps:
    ck.save(s, *_small_state(s), {"s": s})
  ck.wait_until_finished()


def _largest_file(root):
  files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
  return max(files, key=os.path.getsize)


@pytest.fixture(scope="module")
def model_state():
  """Params of the "test" preset, 8-way FSDP, and an adamw state with non-initial values.

  Filled from numpy rather than by `create_model`: eager random init takes seconds on 2 cores.
  """
  cfg = get_preset("test")
  mesh = shd.make_mesh([("data", 1), ("fsdp", 8), ("tensor", 1)])
  abstract = nnx.state(abstract_model(cfg), nnx.Param)
  rs = np.random.RandomState(0)
  params = jax.tree.map(lambda a: rs.standard_normal(a.shape).astype(a.dtype), abstract)
  params = jax.device_put(params, shd.state_shardings(abstract, mesh, shd.TRAIN_RULES))
  opt_state = jax.jit(optax.adamw(1e-3, weight_decay=0.1).init)(params)
  opt_state = jax.tree.map(lambda x: x + 3 if x.dtype == jnp.int32 else x + 0.5, opt_state)
  return cfg, params, opt_state


def test_round_trip_nnx_params_adamw_and_meta(tmp_path, model_state):
  _, params, opt_state = model_state
  key = jax.random.key(7)
  config = ml_collections.ConfigDict({"lr": 1e-6, "mesh": (("fsdp", -1),), "name": "x"})
  meta = {"data": {"epoch": 2, "index": np.int64(17)}, "sampler": {"carried": []},
          "rng": ock.rng_to_json(key), "raw_rng": ock.rng_to_json(jax.random.PRNGKey(3)),
          "config": config.to_dict()}
  with ock.TrainCheckpointer(tmp_path) as ck:
    ck.save(5, params, opt_state, meta)
  # A fresh checkpointer, as after a restart.
  with ock.TrainCheckpointer(tmp_path) as ck:
    assert ck.latest_step() == 5
    r = ck.restore(abstract_params=jax.eval_shape(lambda: params),
                   abstract_opt_state=jax.eval_shape(lambda: opt_state))
  assert isinstance(r.params, nnx.State)
  assert _tree_equal(r.params, params)
  assert _tree_equal(r.opt_state, opt_state)
  assert r.step == 5 and r.meta["data"] == {"epoch": 2, "index": 17}
  assert r.meta["config"] == {"lr": 1e-6, "mesh": [["fsdp", -1]], "name": "x"}
  restored_key = ock.rng_from_json(r.meta["rng"])
  assert np.array_equal(jax.random.key_data(restored_key), jax.random.key_data(key))
  assert np.array_equal(jax.random.normal(restored_key, (3,)), jax.random.normal(key, (3,)))
  assert np.array_equal(ock.rng_from_json(r.meta["raw_rng"]), jax.random.PRNGKey(3))


def test_restore_into_requested_shardings(tmp_path, model_state):
  assert jax.device_count() == 8, "tests/conftest.py should force 8 CPU devices"
  cfg, params, opt_state = model_state
  with ock.TrainCheckpointer(tmp_path) as ck:
    ck.save(1, params, opt_state)
    # Restore into another layout: FSDP 2 x tensor 4 (saved as 8-way FSDP).
    mesh = shd.make_mesh([("data", 1), ("fsdp", 2), ("tensor", 4)])
    abs_params = nnx.state(abstract_model(cfg), nnx.Param)
    p_shard = shd.state_shardings(abs_params, mesh, shd.TRAIN_RULES)
    abs_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abs_params, p_shard)

    def opt_leaf(a):  # First axis over all 8 devices where it divides, else replicated.
      spec = PartitionSpec(("fsdp", "tensor")) if a.ndim and a.shape[0] % 8 == 0 else None
      return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                  sharding=NamedSharding(mesh, spec or PartitionSpec()))
    abs_opt = jax.tree.map(opt_leaf, jax.eval_shape(lambda: opt_state))
    r = ck.restore(abstract_params=abs_params, abstract_opt_state=abs_opt)
  assert _tree_equal(r.params, params) and _tree_equal(r.opt_state, opt_state)
  want = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, (abs_params, abs_opt)))
  got = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, (r.params, r.opt_state)))
  assert got == want
  # The layout is really split (and differs from the saved one), so the check is not vacuous.
  assert any("tensor" in str(s.spec) for s in got)
  assert any(not s.is_fully_replicated for s in got)


def test_keeps_last_n(tmp_path):
  with ock.TrainCheckpointer(tmp_path, max_to_keep=2) as ck:
    _save_steps(ck, [1, 2, 3, 4])
    assert ck.all_steps() == [3, 4]
    r = _restore_small(ck)
  assert sorted(os.listdir(tmp_path)) == ["3", "4"]
  assert r.step == 4 and _tree_equal(r.params, _small_state(4)[0])


def test_relative_directory_saves_and_restores(tmp_path, monkeypatch):
  """`--workdir workdirs/run` (the main job's own): Orbax refuses relative paths, so the
  checkpointer resolves them against the working directory."""
  monkeypatch.chdir(tmp_path)
  with ock.TrainCheckpointer("workdirs/run/checkpoints", max_to_keep=2) as ck:
    assert str(ck.directory) == str(tmp_path / "workdirs" / "run" / "checkpoints")
    _save_steps(ck, [1, 2])
    r = _restore_small(ck)
  assert r.step == 2 and _tree_equal(r.params, _small_state(2)[0])
  assert sorted(os.listdir(tmp_path / "workdirs" / "run" / "checkpoints")) == ["1", "2"]


def test_async_save_then_immediate_wait_survives_buffer_deletion(tmp_path):
  params, opt = _small_state(1)
  expected = jax.tree.map(np.asarray, params)
  with ock.TrainCheckpointer(tmp_path, async_save=True) as ck:
    ck.save(1, params, opt)
    # save() returns once arrays are on the host: the device buffers may be donated now.
    jax.tree.map(lambda x: x.delete(), params)
    ck.wait_until_finished()
    assert ck.all_steps() == [1]
    r = _restore_small(ck)
  assert _tree_equal(r.params, expected)


def test_partial_write_is_never_picked_and_is_cleaned(tmp_path):
  with ock.TrainCheckpointer(tmp_path) as ck:
    _save_steps(ck, [1, 2])
  # What a kill mid-write leaves: Orbax's tmp dir, not yet renamed, files truncated; one for the
  # step the resumed run will write again, one for a step it never writes again.
  for step in (3, 9):
    tmp = tmp_path / f"{step}.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "2", tmp)
    os.truncate(_largest_file(tmp / "params"), 10)
  assert ock.load_params_only(tmp_path, abstract_params=_abstract(_small_state(0)[0])) is not None
  assert (tmp_path / "9.orbax-checkpoint-tmp").exists(), "load_params_only must not clean up"
  with ock.TrainCheckpointer(tmp_path) as ck:
    assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
    assert _restore_small(ck).step == 2
    _save_steps(ck, [3])  # The step that was being written can be saved again.
    assert _tree_equal(_restore_small(ck).params, _small_state(3)[0])
  assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"], "leftovers of killed writes are deleted"


_KILLED_WRITER = """
import os, sys
import jax.numpy as jnp
from dapo_jax.checkpoints.orbax import TrainCheckpointer
ck = TrainCheckpointer(sys.argv[1])
x = jnp.ones((2048, 2048))
ck.save(1, {"w": x}, {"m": x})
ck.wait_until_finished()
ck.save(2, {"w": x * 2}, {"m": x})  # Async: returns before the files are written.
os._exit(1)  # Killed mid-write.
"""


def test_process_killed_mid_async_write(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], env=env,
                        capture_output=True, timeout=120, check=False)
  assert proc.returncode == 1, proc.stderr.decode()[-2000:]
  target = {"w": jax.ShapeDtypeStruct((2048, 2048), jnp.float32)}
  with ock.TrainCheckpointer(tmp_path) as ck:
    # Usually [1] with `2.orbax-checkpoint-tmp` left behind; [1, 2] if the write won the race.
    assert ck.all_steps() in ([1], [1, 2])
    r = ck.restore(abstract_params=target)
    assert float(r.params["w"].sum()) == r.step * 2048 * 2048


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "meta"])
def test_damaged_latest_step_falls_back_with_warning(tmp_path, caplog, damage):
  with ock.TrainCheckpointer(tmp_path) as ck:
    _save_steps(ck, [1, 2])
  if damage == "truncate":
    f = _largest_file(tmp_path / "2" / "params")
    os.truncate(f, os.path.getsize(f) // 2)
  elif damage == "bitflip":  # Read back without error by tensorstore: the fingerprint catches it.
    f = _largest_file(tmp_path / "2" / "params")
    with open(f, "r+b") as fh:
      fh.seek(os.path.getsize(f) // 2)
      b = fh.read(16)
      fh.seek(os.path.getsize(f) // 2)
      fh.write(bytes(x ^ 0x5A for x in b))
  else:
    os.truncate(tmp_path / "2" / "meta" / "metadata", 3)
  with caplog.at_level(logging.WARNING), ock.TrainCheckpointer(tmp_path) as ck:
    r = _restore_small(ck)
    assert r.step == 1 and _tree_equal(r.params, _small_state(1)[0])
    assert any("step 2" in m and "cannot be restored" in m for m in caplog.messages)
    # Moved aside (kept for inspection) and no longer listed, so step 2 can be saved again.
    assert ck.all_steps() == [1]
    assert len(os.listdir(tmp_path / ock.CORRUPT_SUBDIR)) == 1
    _save_steps(ck, [2])
    assert ck.all_steps() == [1, 2]


def test_requested_step_errors(tmp_path):
  with ock.TrainCheckpointer(tmp_path) as ck:
    assert _restore_small(ck) is None  # Empty directory: a fresh run.
    _save_steps(ck, [1, 2])
    with pytest.raises(ock.CheckpointNotFoundError, match=r"step 7.*available steps: \[1, 2\]"):
      _restore_small(ck, step=7)
    with pytest.raises(ock.CheckpointNotFoundError, match=r"available steps: \[1, 2\]"):
      ock.load_params_only(tmp_path, 9, abstract_params=_abstract(_small_state(0)[0]))
    os.truncate(_largest_file(tmp_path / "1" / "params"), 5)
    # An explicitly requested step never falls back.
    with pytest.raises(Exception):
      _restore_small(ck, step=1)
    assert _restore_small(ck, step=2).step == 2
  with pytest.raises(ock.CheckpointNotFoundError, match="does not exist"):
    ock.load_params_only(tmp_path / "nope", abstract_params={})


def test_every_step_unreadable_raises_and_moves_nothing(tmp_path):
  with ock.TrainCheckpointer(tmp_path) as ck:
    _save_steps(ck, [1, 2])
    # A target of another shape (another model config): a caller error, not damage, and said
    # so before any step is tried.
    wrong = {"w": jax.ShapeDtypeStruct((3, 3), jnp.float32),
             "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    with pytest.raises(ock.CheckpointConfigMismatchError,
                       match=r"step 2 .*saved with another model config; the files are not "
                       r"damaged"):
      ck.restore(abstract_params=wrong)
    with pytest.raises(ock.CheckpointConfigMismatchError, match="not damaged"):
      ock.load_params_only(tmp_path, abstract_params=wrong)
    assert ck.all_steps() == [1, 2]


def test_save_at_or_below_existing_step(tmp_path):
  with ock.TrainCheckpointer(tmp_path) as ck:
    _save_steps(ck, [1, 2, 3])
    # Orbax alone would skip this save silently; here it is an error naming the steps.
    with pytest.raises(ValueError, match=r"step\(s\) \[2, 3\] already exist"):
      ck.save(2, *_small_state(20))
    ck.save(2, *_small_state(20), force=True)
    ck.wait_until_finished()
    assert ck.all_steps() == [1, 2]
    assert _tree_equal(_restore_small(ck).params, _small_state(20)[0])
    with pytest.raises(ValueError, match="differs"):
      ck.save(4, *_small_state(4), {"step": 5})


def test_meta_must_be_json(tmp_path):
  with ock.TrainCheckpointer(tmp_path) as ck:
    with pytest.raises(TypeError, match=r"meta\.sampler\.obj is a object"):
      ck.save(1, *_small_state(1), {"sampler": {"obj": object()}})
    with pytest.raises(TypeError, match="rng_to_json"):
      ck.save(1, *_small_state(1), {"rng": jax.random.key(0)})
    assert ck.all_steps() == []


def test_load_params_only(tmp_path):
  with ock.TrainCheckpointer(tmp_path) as ck:
    _save_steps(ck, [1, 2])
  mesh = shd.make_mesh([("data", 1), ("fsdp", 8), ("tensor", 1)])
  target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                     sharding=NamedSharding(mesh, PartitionSpec("fsdp"))),
      _abstract(_small_state(0)[0]))
  params = ock.load_params_only(tmp_path, abstract_params=target)
  assert _tree_equal(params, _small_state(2)[0])
  assert params["w"].sharding == target["w"].sharding
  assert _tree_equal(ock.load_params_only(tmp_path, 1, abstract_params=target),
                     _small_state(1)[0])
