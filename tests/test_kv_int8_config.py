"""rollout.kv_cache_dtype in the run config: bad values and an 8-bit cache without a behaviour
correction are refused in one line; the configs that enable it enable token-TIS; an int8 run
trains and logs the sampler/trainer gap (rollout/logprob_diff_*), larger than the default's."""

import importlib.util
import os

import pytest

from dapo_jax import config as config_lib
from tests.test_train_e2e import _small_config, _with_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**rollout_and_algorithm):
  c = config_lib.default_config()
  for key, value in rollout_and_algorithm.items():
    section, leaf = key.split("__")
    c[section][leaf] = value
  return c


@pytest.mark.parametrize("value", ["", "bfloat16", "int8", "float8_e4m3fn"])
def test_kv_cache_dtype_values_with_a_correction_are_accepted(value):
  c = _config(rollout__kv_cache_dtype=value, algorithm__rollout_is="token_truncated")
  c.model.dtype = "bfloat16"
  config_lib.validate(c)


@pytest.mark.parametrize("value,match", [
    ("int4", "choose '' .*'int8' or 'float8_e4m3fn'"),
    ("float32", "choose '' "),  # not the model's dtype (bfloat16)
])
def test_bad_kv_cache_dtype_is_a_one_line_error(value, match):
  c = _config(rollout__kv_cache_dtype=value)
  c.model.dtype = "bfloat16"
  with pytest.raises(config_lib.ConfigError, match=rf"^config\.rollout\.kv_cache_dtype=.*{match}"
                     ) as e:
    config_lib.validate(c)
  assert "\n" not in str(e.value)


def test_an_8bit_cache_without_a_correction_is_refused_unless_asked_for():
  c = _config(rollout__kv_cache_dtype="int8")
  assert c.algorithm.rollout_is == "none"
  with pytest.raises(config_lib.ConfigError, match=(
      r"^config\.rollout\.kv_cache_dtype='int8': .*rollout_is='token_truncated'.*"
      r"allow_uncorrected_kv_quantization=True")) as e:
    config_lib.validate(c)
  assert "\n" not in str(e.value)
  c.algorithm.allow_uncorrected_kv_quantization = True
  config_lib.validate(c)
  config_lib.validate(_config(rollout__kv_cache_dtype="int8",
                              algorithm__rollout_is="sequence_mask"))


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", name + ".py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("name,variant", [("tiny_cpu", "kv_int8"),
                                          ("dapo_qwen2_5_32b", "dapo_kv_int8")])
def test_the_int8_configs_enable_token_tis(name, variant):
  c = _load(name).get_config(variant)
  assert c.rollout.kv_cache_dtype == "int8" and c.algorithm.rollout_is == "token_truncated"
  config_lib.validate(c)


def test_an_int8_run_trains_and_logs_a_larger_logprob_gap(tmp_path, monkeypatch):
  """One step of the shrunken tiny run, int8 cache + token-TIS against the default: both log
  rollout/logprob_diff_*; the default's gap is fp32 noise, the int8 cache's is larger."""
  from dapo_jax.trainer.train import train_and_evaluate  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  base = _small_config(**{"algorithm.rollout_is": "token_truncated"})
  int8 = _small_config(**{"algorithm.rollout_is": "token_truncated",
                          "rollout.kv_cache_dtype": "int8"})
  m0 = train_and_evaluate(_with_steps(base, 1), str(tmp_path / "default"))
  m8 = train_and_evaluate(_with_steps(int8, 1), str(tmp_path / "int8"))
  for m in (m0, m8):
    assert {"rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/kl_k3"} <= set(m)
  assert m8["rollout/logprob_diff_max"] > 10 * max(m0["rollout/logprob_diff_max"], 1e-6), (
      m0["rollout/logprob_diff_max"], m8["rollout/logprob_diff_max"])
  assert m8["rollout/logprob_diff_max"] < 0.5
