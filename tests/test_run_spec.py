"""The run spec: frozen typed sections that mirror the config schema key for key."""

import dataclasses
import glob
import logging
import os
import typing

import ml_collections
import pytest

from dapo_jax import config as config_lib
from dapo_jax.spec.run_spec import Mesh, RunSpec, read_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(path, arg=None):
  ns = {"__file__": path}
  with open(path, encoding="utf-8") as f:
    exec(compile(f.read(), path, "exec"), ns)  # pylint: disable=exec-used
  return ns["get_config"](arg)


def _config_paths(c, prefix=""):
  for key in c.keys():
    if isinstance(c[key], ml_collections.ConfigDict) and prefix + key != "model.overrides":
      yield from _config_paths(c[key], prefix + key + ".")
    else:
      yield prefix + key


def _spec_paths(cls, prefix=""):
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    if dataclasses.is_dataclass(hints[f.name]):
      yield from _spec_paths(hints[f.name], prefix + f.name + ".")
    else:
      yield prefix + f.name


def test_spec_mirrors_the_config_schema_key_for_key():
  # A key added to default_config() without a spec field (or the reverse) fails here.
  assert sorted(_spec_paths(RunSpec)) == sorted(_config_paths(config_lib.default_config()))


def test_spec_is_typed_frozen_and_derives_the_sizes():
  config = _load(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  spec = RunSpec.from_config(config, num_devices=8)
  o, n = config.optim, config.rollout.n
  assert spec.sizes.rows_per_update == o.mini_batch_size * n == 32
  assert spec.sizes.micro_batches_per_update == 1  # micro 64 >= 32 rows: one pass
  assert spec.sizes.updates_per_step == o.train_batch_size // o.mini_batch_size == 4
  assert spec.sizes.rows_per_step == o.train_batch_size * n
  assert spec.sizes.prompts_per_call == config.algorithm.gen_batch_size  # 0 = all at once
  assert spec.sizes.max_length == 25 + 32  # a 3-operand prompt (25 tokens) + the response
  assert spec.mesh == (("data", 1), ("fsdp", -1), ("tensor", 1)) and spec.rollout_mesh == ()
  assert isinstance(spec.algorithm.rollout_is_band, tuple) and isinstance(spec.optim.lr, float)
  assert spec.model.overrides["hidden_size"] == 128
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.optim.lr = 1.0  # type: ignore[misc]
  with pytest.raises(TypeError, match="does not support item assignment"):
    spec.model.overrides["hidden_size"] = 1  # type: ignore[index]
  assert typing.get_type_hints(RunSpec)["mesh"] == Mesh


def test_from_config_validates_once_with_the_config_message():
  config = _load(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  config.optim.mini_batch_size = 5
  with pytest.raises(config_lib.ConfigError, match=r"config\.optim\.mini_batch_size=5"):
    RunSpec.from_config(config)
  config = _load(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  with config.unlocked():
    config.rollout.temprature = 0.5
  with pytest.raises(config_lib.ConfigError, match="Did you mean 'rollout.temperature'"):
    RunSpec.from_config(config)


def test_an_older_config_json_reads_with_todays_defaults():
  config = _load(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  old = ml_collections.ConfigDict(config.to_dict())
  for section, key in (("rollout", "kv_cache"), ("rollout", "stop_tokens"),
                       ("algorithm", "rollout_is"), ("algorithm", "rollout_is_band")):
    del old[section][key]
  del old["model"]["lora"]
  spec = RunSpec.from_config(old)
  default = config_lib.default_config()
  assert spec.rollout.kv_cache == default.rollout.kv_cache
  assert spec.algorithm.rollout_is_band == tuple(default.algorithm.rollout_is_band)
  assert spec.model.lora.rank == 0
  assert spec.rollout.n == config.rollout.n  # what the file holds wins


def test_a_config_json_from_before_scan_layers_reads_as_the_unscanned_layout():
  old = config_lib.default_config()
  del old["model"]["scan_layers"]
  assert RunSpec.from_config(old).model.scan_layers is False
  assert read_section(old, "model").scan_layers is False
  assert read_section(config_lib.default_config(), "model").scan_layers is True


def test_read_section_reads_one_section_without_validating():
  config = config_lib.default_config()
  config.reward.overlong_buffer_len = 10 ** 6  # fails validation; not a section read here
  del config["rollout"]["stop_tokens"]  # an older config.json
  assert read_section(config, "rollout") == RunSpec.from_config(
      config_lib.default_config()).rollout
  assert read_section(config, "mesh") == tuple(tuple(a) for a in config.mesh)
  assert read_section(config, "seed") == config.seed


def test_read_gives_the_whole_spec_without_validating():
  config = config_lib.default_config()
  config.reward.overlong_buffer_len = 10 ** 6  # fails validation: a saved run is not re-judged
  del config["rollout"]["stop_tokens"]  # an older config.json
  with pytest.raises(ValueError, match="overlong_buffer_len"):
    RunSpec.from_config(config)
  spec = RunSpec.read(config)
  assert spec.reward.overlong_buffer_len == 10 ** 6
  assert spec.rollout == RunSpec.from_config(config_lib.default_config()).rollout
  assert spec.sizes.max_length == config.data.max_prompt_length + config.rollout.max_response_length


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_every_shipped_config_reads_and_gives_the_trainers_update_settings(path):
  config = _load(path)
  tcfg = RunSpec.from_config(config).train_config()
  o, a = config.optim, config.algorithm
  rows = o.mini_batch_size * config.rollout.n
  assert tcfg.num_micro_batches == max(1, rows // o.micro_batch_size)
  assert (tcfg.lr, tcfg.max_grad_norm, tcfg.forward_micro_batch_size) == (
      o.lr, o.grad_clip, o.micro_batch_size)
  assert (tcfg.clip_ratio_low, tcfg.clip_ratio_high, tcfg.loss_agg_mode) == (
      a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode)
  assert tcfg.rollout_is_band == tuple(a.rollout_is_band)


@pytest.mark.parametrize("changes,want", [
    ({"rollout.use_sampler_logprobs": True, "algorithm.max_staleness": 2,
      "algorithm.allow_uncorrected_staleness": True},
     "config.rollout.use_sampler_logprobs=True with algorithm.max_staleness=2 "
     "(allow_uncorrected_staleness): the ratio is clipped against the sampler's log-probs, a "
     "behaviour policy up to 2 version(s) old, not against the proximal policy"),
    ({"rollout_devices": 1},
     "config.rollout_devices=1 with algorithm.max_staleness=0: the last 1 device(s) only roll "
     "out and the others only train, one phase after the other, so each set idles"),
    ({}, None),  # the defaults
    ({"rollout.use_sampler_logprobs": True}, None),  # synchronous: the sampler's are v(t)'s
    ({"rollout_devices": 1, "algorithm.max_staleness": 1,
      "algorithm.rollout_is": "token_truncated"}, None),  # the overlapped split
])
def test_choices_that_change_the_run_unasked_are_logged(changes, want, caplog):
  """Issue 50 (9): two combinations validate allows ran without a word: the sampler's
  log-probs as old log-probs of an overlapped step (the clip against the stale behaviour
  policy, not the proximal one), and devices split between the phases of a synchronous step
  (each set idle while the other works). `RunSpec.from_config` now logs each in one line."""
  config = _load(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  for key, value in changes.items():
    section, _, leaf = key.rpartition(".")
    (config[section] if section else config)[leaf] = value
  with caplog.at_level(logging.WARNING, logger="dapo_jax.spec.run_spec"):
    RunSpec.from_config(config, num_devices=2)  # one device trains, one rolls out
  notes = [r for r in caplog.records if r.name == "dapo_jax.spec.run_spec"]
  if want is None:
    assert not notes, [r.message for r in notes]
    return
  assert len(notes) == 1 and notes[0].levelno == logging.WARNING, [r.message for r in notes]
  assert "\n" not in notes[0].message and notes[0].message.startswith(want), notes[0].message
