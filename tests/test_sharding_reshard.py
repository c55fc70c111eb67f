"""Training layout <-> rollout layout: an exact round trip, and the memory the move needs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout.weights import RolloutWeights

TRAIN_MESH = [("data", 1), ("fsdp", 4), ("tensor", 2)]
ROLLOUT_MESHES = {"same_devices_sample_rules": TRAIN_MESH,
                  "own_rollout_mesh": [("data", 4), ("fsdp", 1), ("tensor", 2)]}


@pytest.fixture(scope="module")
def train_state():
  cfg = get_preset("test", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
  mesh = shd.make_mesh(TRAIN_MESH)
  _, state = nnx.split(create_model(cfg, seed=3, mesh=mesh))
  return mesh, state


@pytest.mark.parametrize("rollout_axes", list(ROLLOUT_MESHES.values()), ids=list(ROLLOUT_MESHES))
def test_round_trip_is_exact(train_state, rollout_axes):
  mesh, state = train_state
  host = jax.device_get(state)
  train_sh = shd.state_shardings(state, mesh, shd.TRAIN_RULES)
  rollout_sh = shd.state_shardings(state, shd.make_mesh(rollout_axes), shd.SAMPLE_RULES)

  rolled = shd.reshard(state, rollout_sh)
  for x, s in zip(jax.tree.leaves(rolled), jax.tree.leaves(rollout_sh)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  back = shd.reshard(rolled, train_sh)
  for x, y, s in zip(jax.tree.leaves(back), jax.tree.leaves(host), jax.tree.leaves(train_sh)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
    np.testing.assert_array_equal(np.asarray(x), y)
  # [vocab, embed]: both layouts split vocab over tensor; only training splits embed over fsdp
  # (rollout replicates it: no all-gather on every decode step).
  v, d = state["embed_tokens"].value.shape
  assert state["embed_tokens"].value.addressable_shards[0].data.shape == (v // 2, d // 4)
  assert rolled["embed_tokens"].value.addressable_shards[0].data.shape == (v // 2, d)


def test_reshard_cost_matches_compiled_buffers(train_state):
  mesh, state = train_state
  train_sh = shd.state_shardings(state, mesh, shd.TRAIN_RULES)
  rollout_sh = shd.state_shardings(state, mesh, shd.SAMPLE_RULES)
  cost = shd.reshard_cost(state, train_sh, rollout_sh)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  mem = jax.jit(lambda t: t, out_shardings=rollout_sh).lower(abstract).compile().memory_analysis()
  assert cost.src == mem.argument_size_in_bytes
  # The output is one tuple: XLA adds its table of buffer pointers (8 bytes per leaf).
  assert 0 <= mem.output_size_in_bytes - cost.dst <= 8 * len(jax.tree.leaves(state))
  # Rollout replicates over fsdp what training splits 4 ways: it holds more per device.
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert total / 8 <= cost.src < cost.dst <= total
  assert cost.peak == cost.src + cost.dst + cost.temp


def test_rollout_weights_cast_before_they_move(train_state):
  """fp32 master weights in the training layout -> bf16 in the rollout layout; the collectives
  of the move carry bf16, so the reshard costs what `dapo-plan` prices (the model's bytes)."""
  mesh, state = train_state
  master = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(np.float32), t),
                   out_shardings=shd.state_shardings(state, mesh, shd.TRAIN_RULES))(state)
  rollout_mesh = shd.make_mesh(ROLLOUT_MESHES["own_rollout_mesh"])
  to_rollout = RolloutWeights(jnp.bfloat16, rollout_mesh)
  out = to_rollout(master)
  expected_sh = shd.state_shardings(state, rollout_mesh, shd.SAMPLE_RULES)
  for x, m, s in zip(jax.tree.leaves(out), jax.tree.leaves(master), jax.tree.leaves(expected_sh)):
    assert x.dtype == jnp.bfloat16 and x.sharding.is_equivalent_to(s, x.ndim)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(m).astype(jnp.bfloat16))
  # Every collective of the move reads a rounded (convert) value, never a parameter as is: the
  # cast runs on the training shard before anything moves. (XLA's CPU backend then carries the
  # rounded values in f32, having no bf16 collectives; TPUs and GPUs move them as bf16.)
  hlo = to_rollout._fn.lower(master).compile().as_text()  # pylint: disable=protected-access
  operands = re.findall(r"= \S+ (?:all-gather|all-to-all|collective-permute)(?:-start)?\((%[\w.]+)",
                        hlo)
  assert operands, "the layouts differ, so the move must have collectives"
  assert all("convert" in o for o in operands), operands
