"""The model under FSDP and FSDP x tensor layouts on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.models import create_model, get_preset, shard_model


@pytest.fixture(scope="module")
def model_and_ids():
  assert jax.device_count() == 8, "tests/conftest.py should force 8 CPU devices"
  cfg = get_preset("test", vocab_size=256, hidden_size=128, intermediate_size=256,
                   num_attention_heads=8, num_key_value_heads=4)
  model = create_model(cfg, seed=3)
  ids = np.random.RandomState(0).randint(0, 256, (8, 12)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[0, :4] = 0
  mask[5, :1] = 0
  return model, ids, mask


def _forward(model, ids, mask, mesh=None, rules=shd.TRAIN_RULES):
  graphdef, state = nnx.split(model)

  def fwd(state, ids, mask):
    with shd.activation_sharding(mesh, rules):
      return nnx.merge(graphdef, state)(ids, attention_mask_BxT=mask)

  if mesh is None:
    return np.asarray(jax.jit(fwd)(state, ids, mask))
  data = shd.batch_sharding(mesh, rules, 2, ids.shape[0])
  ids, mask = jax.device_put(ids, data), jax.device_put(mask, data)
  return np.asarray(jax.jit(fwd)(state, ids, mask))


@pytest.mark.parametrize("axes", [
    [("data", 1), ("fsdp", 8), ("tensor", 1)],
    [("data", 1), ("fsdp", 4), ("tensor", 2)],
    [("data", 2), ("fsdp", 2), ("tensor", 2)],
], ids=["fsdp8", "fsdp4xtp2", "dp2xfsdp2xtp2"])
def test_sharded_forward_equals_single_device(model_and_ids, axes):
  model, ids, mask = model_and_ids
  ref = _forward(model, ids, mask)
  mesh = shd.make_mesh(axes)
  sharded = shard_model(model, mesh, shd.TRAIN_RULES)
  out = _forward(sharded, ids, mask, mesh)
  assert np.abs(out - ref).max() < 1e-5

  # Large parameters really are split: each device holds a fraction of the MLP kernel.
  kernel = sharded.layers[0].mlp.up_proj.kernel.value
  shard_shape = kernel.addressable_shards[0].data.shape
  fsdp, tp = mesh.shape["fsdp"], mesh.shape["tensor"]
  assert shard_shape == (kernel.shape[0] // fsdp, kernel.shape[1] // tp)
  emb = sharded.embed_tokens.value
  assert emb.addressable_shards[0].data.size == emb.size // (fsdp * tp)


def test_sample_rules_replicate_over_data_axes(model_and_ids):
  model, _, _ = model_and_ids
  mesh = shd.make_mesh([("data", 1), ("fsdp", 4), ("tensor", 2)])
  sampled = shard_model(model, mesh, shd.SAMPLE_RULES)
  kernel = sampled.layers[0].mlp.up_proj.kernel.value
  assert kernel.addressable_shards[0].data.shape == (kernel.shape[0], kernel.shape[1] // 2)


def test_indivisible_dims_stay_replicated():
  mesh = shd.make_mesh([("data", 1), ("fsdp", 2), ("tensor", 4)])
  # 2 kv heads cannot split 4 ways: that dim is replicated instead of failing to compile.
  spec = shd.logical_to_spec(("embed", "kv_heads", "head_dim"), shd.TRAIN_RULES, (64, 2, 16),
                             mesh)
  assert spec == jax.sharding.PartitionSpec("fsdp", None, None)
  spec = shd.logical_to_spec(("embed", "heads", "head_dim"), shd.TRAIN_RULES, (64, 8, 16), mesh)
  assert spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)


def test_mesh_errors_are_clear():
  with pytest.raises(ValueError, match="Unknown mesh axis"):
    shd.make_mesh([("pipeline", 8)])
  with pytest.raises(ValueError, match="does not divide"):
    shd.make_mesh([("data", 3), ("fsdp", -1)])
  with pytest.raises(ValueError, match="At most one"):
    shd.make_mesh([("data", -1), ("fsdp", -1)])
  assert shd.make_mesh([("data", 2), ("fsdp", -1), ("tensor", 2)]).shape == {
      "data": 2, "fsdp": 2, "tensor": 2}


def test_remat_gives_same_loss_and_grads(model_and_ids):
  model, ids, mask = model_and_ids
  graphdef, state = nnx.split(model)
  remat_model = create_model(model.config.replace(remat="full"), seed=3)
  graphdef_r, _ = nnx.split(remat_model)

  def loss(state, gd):
    return jnp.mean(nnx.merge(gd, state)(ids, attention_mask_BxT=mask) ** 2)

  l0, g0 = jax.value_and_grad(loss)(state, graphdef)
  l1, g1 = jax.value_and_grad(loss)(state, graphdef_r)
  assert abs(float(l0) - float(l1)) < 1e-6
  diffs = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), g0, g1)
  assert max(jax.tree.leaves(diffs)) < 1e-6
