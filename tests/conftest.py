"""Test session set-up: 8 simulated CPU devices so sharding tests run anywhere."""
import os

# Must be set before jax is imported anywhere in the session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Where the CUDA plugin is installed (tests/test_plan_gpu.py), its driver check would raise on a
# host without a GPU and leave the plugin unregistered: GPU programs compile without it.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402

import pytest  # noqa: E402  (after the environment above)

_CUDA_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None


@pytest.fixture(autouse=True)
def _analytic_gpu_targets(request, monkeypatch):
  """With the CUDA plugin installed, dapo-plan compiles GPU targets; the tests written for the
  analytic GPU rows keep them, and only tests marked ``gpu_compile`` compile."""
  if _CUDA_PLUGIN and "gpu_compile" not in request.keywords:
    from dapo_jax.planner import gpu_targets  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(gpu_targets, "cuda_plugin_missing", lambda: "analytic in this test")


@pytest.fixture(scope="module")
def split_model():
  """The tiny test preset's (graphdef, state), seed 0: the continuous engines' tests' model."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import create_model, get_preset  # pylint: disable=g-import-not-at-top
  return nnx.split(create_model(get_preset("test"), seed=0))
