"""Meshes for real clouds: multislice (hybrid ICI x DCN) layouts and batches that must split.

CPU devices have no ``slice_index``, so the hybrid layout is checked on stand-in device objects
(``mesh_utils`` reads only ids, kinds and slice indices from them); the config checks and the
errors run on the 8 simulated CPU devices.
"""

import dataclasses
import importlib.util
import logging
import os

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils
from jax.sharding import PartitionSpec

from dapo_jax import config as config_lib
from dapo_jax.infra import sharding as shd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, arg: str | None = None):
  path = os.path.join(ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(name[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


@dataclasses.dataclass(frozen=True)
class SliceDevice:
  """What mesh_utils reads of a device on a non-TPU platform, plus the slice it sits in."""
  id: int
  slice_index: int
  platform: str = "cpu"
  device_kind: str = "cpu"
  process_index: int = 0


@pytest.mark.parametrize("axes", [[("data", 1), ("fsdp", -1), ("tensor", 1)],
                                  [("data", 2), ("fsdp", 2), ("tensor", 2)],
                                  [("data", -1), ("fsdp", 4), ("tensor", 1)]])
def test_single_slice_mesh_is_unchanged(axes):
  """No dcn_mesh (or an all-ones one): the device order mesh_utils gave before."""
  sizes = shd.resolve_mesh_sizes(axes, jax.device_count())
  before = mesh_utils.create_device_mesh(sizes, devices=jax.devices())
  for dcn in (None, "", "data=1", [("data", 1)]):
    mesh = shd.make_mesh(axes, dcn_axes=dcn)
    assert mesh.axis_names == tuple(a for a, _ in axes)
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(mesh.devices),
                                  np.vectorize(lambda d: d.id)(before))


def _slices(grid):
  return np.vectorize(lambda d: d.slice_index)(grid)


def test_hybrid_mesh_keeps_fsdp_and_tensor_inside_a_slice():
  # 2 slices of 8, listed interleaved (as jax.devices() may list several processes' devices).
  devices = [SliceDevice(i, i % 2) for i in range(16)]
  sizes = shd.resolve_mesh_sizes([("data", 4), ("fsdp", 2), ("tensor", 2)], 16)
  dcn = shd.dcn_sizes(["data", "fsdp", "tensor"], sizes, [("data", 2)])
  assert dcn == [2, 1, 1]
  slices = _slices(shd.device_grid(sizes, devices, dcn))
  assert slices.shape == (4, 2, 2)
  for i in range(4):  # every (fsdp, tensor) block sits in one slice
    assert len(set(slices[i].ravel())) == 1
  assert sorted(slices[:, 0, 0]) == [0, 0, 1, 1]
  # Without dcn_mesh the same list puts both slices inside each fsdp x tensor block (the slow
  # network under the fast collectives), and says so.
  flat = _slices(shd.device_grid(sizes, devices))
  assert any(len(set(flat[i].ravel())) == 2 for i in range(4))


def test_hybrid_mesh_fsdp_across_slices_tensor_within():
  devices = [SliceDevice(i, i // 4) for i in range(8)]
  sizes = [1, 4, 2]
  slices = _slices(shd.device_grid(sizes, devices, shd.dcn_sizes(
      ["data", "fsdp", "tensor"], sizes, [("fsdp", 2)])))
  assert (slices[0, :2] == 0).all() and (slices[0, 2:] == 1).all()
  for j in range(4):
    assert len(set(slices[0, j])) == 1  # each tensor pair in one slice


def test_multislice_devices_without_dcn_mesh_warn(caplog):
  devices = [SliceDevice(i, i // 4) for i in range(8)]
  with caplog.at_level(logging.WARNING, logger="dapo_jax.infra.sharding"):
    shd.device_grid([2, 4, 1], devices)
  assert "span 2 slices but config.dcn_mesh is empty" in caplog.text


def test_dcn_mesh_errors_name_the_setting():
  with pytest.raises(ValueError, match=r"config.dcn_mesh: axis 'fsdp' of size 2 cannot span 4"):
    shd.dcn_sizes(["data", "fsdp"], [4, 2], [("fsdp", 4)])
  with pytest.raises(ValueError, match=r"config.dcn_mesh names \['tensor'\]"):
    shd.dcn_sizes(["data", "fsdp"], [4, 2], [("tensor", 2)])
  # One process of CPU devices is one slice: asking for 2 says so instead of guessing.
  with pytest.raises(ValueError, match="config.dcn_mesh asks for 2 slices of 4 devices"):
    shd.make_mesh([("data", 2), ("fsdp", -1), ("tensor", 1)], dcn_axes="data=2")
  c = load_config("dapo_qwen2_5_32b.py")
  c.dcn_mesh = "pipeline=2"
  with pytest.raises(ValueError, match=r"config.dcn_mesh=.*among config.mesh's"):
    config_lib.validate(c)
  c.dcn_mesh = "data:2"
  with pytest.raises(ValueError, match=r"config.dcn_mesh='data:2': expected 'axis=slices"):
    config_lib.validate(c)
  c.dcn_mesh = "data=2"
  config_lib.validate(c, num_devices=128)
  assert shd.parse_dcn("data=2,fsdp=1") == [("data", 2), ("fsdp", 1)]


def test_batch_sharding_refuses_a_batch_the_mesh_does_not_divide():
  mesh = shd.make_mesh([("data", 2), ("fsdp", 4), ("tensor", 1)])
  spec = shd.batch_sharding(mesh, shd.TRAIN_RULES, 2, 16).spec
  assert spec == PartitionSpec(("data", "fsdp"), None)
  with pytest.raises(ValueError, match=r"12 rows .* \{'data': 2, 'fsdp': 4\} \(8 shards\).*"
                                       r"rollout.prompts_per_call.*e.g. 8 or 16"):
    shd.batch_sharding(mesh, shd.TRAIN_RULES, 2, 12)
  with pytest.raises(ValueError, match="Set optim.mini_batch_size to a multiple of 8"):
    shd.batch_sharding(mesh, shd.TRAIN_RULES, 2, 12, setting="optim.mini_batch_size")


def test_prompt_sharding_errors_on_rows_and_warns_on_prefill(caplog):
  mesh = shd.make_mesh([("data", 1), ("fsdp", 8), ("tensor", 1)])
  # 12 prompts x 16 samples: the 192 decode rows split, only the prefill is replicated.
  with caplog.at_level(logging.WARNING, logger="dapo_jax.infra.sharding"):
    sh = shd.prompt_sharding(mesh, shd.SAMPLE_RULES, 12, 16)
  assert sh.is_fully_replicated
  assert "12 prompts per rollout call do not split" in caplog.text and "8 or 16" in caplog.text
  assert not shd.prompt_sharding(mesh, shd.SAMPLE_RULES, 16, 2).is_fully_replicated
  with pytest.raises(ValueError, match=r"12 prompts x 1 samples = 12 rows.*every device would "
                                       r"decode every row.*e.g. 8 or 16 prompts"):
    shd.prompt_sharding(mesh, shd.SAMPLE_RULES, 12, 1)


def _tiny(**over):
  c = load_config("tiny_cpu.py")
  for k, v in over.items():
    section, field = k.split(".")
    c[section][field] = v
  return c


@pytest.mark.parametrize("over, field, near", [
    # No value both divides the generation batch and splits over 8 shards: say so, not 8 or 16.
    ({"algorithm.gen_batch_size": 36, "rollout.prompts_per_call": 12, "rollout.n": 1,
      "optim.mini_batch_size": 8, "rollout.engine": "static"}, "rollout.prompts_per_call=12",
     None),
    ({"algorithm.gen_batch_size": 10, "rollout.n": 2, "rollout.engine": "static"},
     "algorithm.gen_batch_size=10", "8 or 12"),
    # The continuous engine splits its slots, not the calls' rows.
    ({"rollout.max_concurrent_decodes": 20}, "rollout.max_concurrent_decodes=20", "16 or 24"),
    ({"eval.batch_size": 6, "eval.num_samples": 1}, "eval.batch_size=6", "8"),
    ({"optim.mini_batch_size": 2, "rollout.n": 3, "optim.micro_batch_size": 6},
     "optim.mini_batch_size=2", "8"),
    ({"sft.steps": 1, "sft.batch_size": 20}, "sft.batch_size=20", "16 or 24"),
])
def test_validate_names_the_batch_setting_and_nearest_values(over, field, near):
  """The message names every rule the value must meet, and its suggestions meet them all."""
  c = _tiny(**over)
  config_lib.validate(c)  # without a device count only the shapes are checked
  tail = f"use e.g. {near}$" if near else "no divisor of .* does: change it, or set "
  rules = r"8 batch shards \(batch axes \{'fsdp': 8\} on 8 devices\)"
  message = rf"config.{field}: must \(1\) .*{rules}.*; .* fails .*{tail}"
  with pytest.raises(ValueError, match=message):
    config_lib.validate(c, num_devices=8)
  config_lib.validate(c, num_devices=1)  # one device: nothing to split
  if near:  # following the suggestion passes every rule
    name, _ = field.split("=")
    section, key = name.split(".")
    for value in near.split(" or "):
      c[section][key] = int(value)
      config_lib.validate(c, num_devices=8)


def test_paper_config_checks_its_batches_per_slice_size():
  c = load_config("dapo_qwen2_5_32b.py")
  config_lib.validate(c, num_devices=64)  # v5p-128: data 2 x fsdp 4
  with pytest.raises(ValueError,
                     match=r"config.optim.mini_batch_size=32: must \(1\) divide "
                     r"optim.train_batch_size=512, \(2\) .*48 batch shards.*no divisor of "
                     r"optim.train_batch_size=512 does"):
    config_lib.validate(c, num_devices=96 * 4)  # data 12 x fsdp 4 = 48 shards: 512 rows
  with pytest.raises(ValueError, match=r"config.mesh=.*does not divide the 20 available"):
    config_lib.validate(c, num_devices=20)
