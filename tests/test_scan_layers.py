"""`config.scan_layers`: one stacked decoder layer under jax.lax.scan computes the unrolled model.

HF parity of both layouts (forward, prefill + cached decode, load into a mesh, export) is in
tests/test_hf_parity.py; the decode's no-copy check in tests/test_attention.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.infra import sharding as shd
from dapo_jax.trainer import train_step as ts
from dapo_jax.checkpoints import orbax as orbax_ckpt
from dapo_jax.models import abstract_model, create_model, get_preset, shard_model
from tests.test_precision_remat import _batch, _saved_elements

LAYERS = 2


def _pair(**overrides):
  """The unrolled and the scanned model from one seed."""
  cfg = get_preset("test", num_hidden_layers=LAYERS, **overrides)
  return (create_model(cfg, seed=1), create_model(cfg.replace(scan_layers=True), seed=1))


def _per_layer(params_loop, params_scan):
  """(unrolled leaf, layer l of the stacked leaf) for every layer parameter."""
  flat_scan = dict(nnx.to_flat_state(params_scan))
  for path, var in nnx.to_flat_state(params_loop):
    if path[0] == "layers":
      yield var[...], flat_scan[("layers",) + path[2:]][...][path[1]]
    else:
      yield var[...], flat_scan[path][...]


def test_same_seed_same_weights_and_stacked_logical_axes():
  loop, scan = _pair()
  pairs = list(_per_layer(nnx.state(loop, nnx.Param), nnx.state(scan, nnx.Param)))
  assert len(pairs) == 3 + 12 * LAYERS  # embed, norm, lm_head + 12 per layer
  for a, b in pairs:
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q = scan.layers.self_attn.q_proj.kernel
  assert q.shape == (LAYERS, 64, 4, 16)
  assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
  assert ("layers", None) in shd.TRAIN_RULES and ("layers", None) in shd.SAMPLE_RULES


@pytest.mark.parametrize("remat", ["full", "dots_attn"])  # "none": the train step test
def test_same_logits_and_gradients_under_each_remat_policy(remat):
  loop, scan = _pair(remat=remat)
  ids = jnp.asarray(np.random.RandomState(0).randint(1, 128, (2, 11)))
  mask = jnp.ones((2, 11), bool).at[0, :3].set(False)
  grads = []
  for model in (loop, scan):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, g=graphdef, r=rest):
      logits = nnx.merge(g, p, r)(ids, attention_mask_BxT=mask)
      return jnp.sum(jnp.tanh(logits) * mask[..., None])
    grads.append(jax.jit(jax.value_and_grad(loss))(params))
  (l0, g0), (l1, g1) = grads
  np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
  for a, b in _per_layer(g0, g1):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_remat_inside_the_scanned_body_keeps_what_the_policy_says():
  """The scan body is rematerialised layer by layer: each policy keeps exactly the unrolled
  model's residuals (a remat around the whole scan would keep less, none at all more)."""
  ids = jnp.asarray(np.random.RandomState(1).randint(1, 128, (2, 16)))
  for remat in ("full", "dots_attn"):
    loop, scan = _pair(remat=remat)
    assert _saved_elements(scan, ids) == _saved_elements(loop, ids)
  loop, scan = _pair(remat="none")
  assert _saved_elements(scan, ids) > _saved_elements(_pair(remat="full")[1], ids)


def test_one_train_step_matches_the_unrolled_one():
  loop, scan = _pair()
  cfg = ts.TrainConfig(lr=1e-3, warmup_steps=0)
  batch = _batch(128)
  out = []
  for model in (loop, scan):
    graphdef, state = ts.init_train_state(model, cfg)
    state, metrics = ts.TrainStep(graphdef, cfg)(state, batch, 0)
    out.append((state.params, jax.tree.map(float, metrics)))
  (p0, m0), (p1, m1) = out
  assert m0["loss"] == pytest.approx(m1["loss"], rel=1e-6)
  assert m0["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
  for a, b in _per_layer(p0, p1):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_sharded_scanned_forward_keeps_the_layer_axis_whole():
  _, scan = _pair(hidden_size=128, intermediate_size=256, num_attention_heads=8,
                  num_key_value_heads=4)
  ids = jnp.asarray(np.random.RandomState(2).randint(0, 128, (8, 10)))
  ref = np.asarray(scan(ids))
  mesh = shd.make_mesh([("data", 1), ("fsdp", 4), ("tensor", 2)])
  sharded = shard_model(scan, mesh, shd.TRAIN_RULES)
  up = sharded.layers.mlp.up_proj.kernel.value  # [L, 128, 256]
  assert up.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert up.addressable_shards[0].data.shape == (LAYERS, 32, 128)
  graphdef, state = nnx.split(sharded)

  @jax.jit
  def fwd(state, ids):
    with shd.activation_sharding(mesh, shd.TRAIN_RULES):
      return nnx.merge(graphdef, state)(ids)
  ids = jax.device_put(ids, shd.batch_sharding(mesh, shd.TRAIN_RULES, 2, 8))
  assert np.abs(np.asarray(fwd(state, ids)) - ref).max() < 1e-5


@pytest.mark.parametrize("saved_scan", [False, True], ids=["unrolled_ckpt", "scanned_ckpt"])
def test_orbax_checkpoint_of_the_other_layout_fails_clearly(tmp_path, saved_scan):
  cfg = get_preset("test", scan_layers=saved_scan)
  params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                        nnx.state(abstract_model(cfg), nnx.Param))
  with orbax_ckpt.TrainCheckpointer(tmp_path) as ckpt:
    ckpt.save(3, params, {"count": np.zeros((), np.int32)})
    ckpt.wait_until_finished()
  other = nnx.state(abstract_model(cfg.replace(scan_layers=not saved_scan)), nnx.Param)
  flag = f"--config.model.scan_layers={str(saved_scan).lower()}"
  with orbax_ckpt.TrainCheckpointer(tmp_path) as ckpt:
    with pytest.raises(orbax_ckpt.CheckpointLayoutError, match=flag):
      ckpt.restore(abstract_params=other)
    # The same layout still restores, and nothing was moved aside.
    assert ckpt.restore(abstract_params=nnx.state(abstract_model(cfg), nnx.Param)).meta[
        "step"] == 3
  with pytest.raises(orbax_ckpt.CheckpointLayoutError, match=flag):
    orbax_ckpt.load_params_only(tmp_path, abstract_params=other)
