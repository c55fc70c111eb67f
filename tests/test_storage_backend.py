"""The install users get: ``gs://`` through gcsfs whatever else is installed, and JetStream's
engine without seqio/TensorFlow.

Both run in a plain child process (no ``EPATH_USE_TF`` in its environment, nothing imported
before), as ``dapo-train`` starts.
"""

import importlib.metadata
import os
import subprocess
import sys
import uuid

import pytest

from tests.gcs_emulator import GcsEmulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BACKEND = """
import sys
import dapo_jax
from etils import epath
from etils.epath import backend
path = epath.Path(sys.argv[1]) / "probe.txt"
assert path._backend is backend.fsspec_backend, path._backend  # pylint: disable=protected-access
path.write_text("through gcsfs")
assert path.read_text() == "through gcsfs"
from etils.epath import gpath
assert gpath._is_tf_installed() is False  # pylint: disable=protected-access
print("ok")
"""

# Hides seqio (and so TensorFlow) as in an install from requirements-no-deps.txt: what dapo_jax
# imports from JetStream must load, and `import seqio` must still fail afterwards.
_NO_SEQIO = """
import sys
sys.modules["seqio"] = None  # `import seqio` raises ImportError, find_spec says not installed
sys.modules["tensorflow"] = None
from dapo_jax.rollout import jetstream_api, jetstream_engine
from dapo_jax.commands import serve
orchestrator, _ = serve._jetstream()  # pylint: disable=protected-access
assert issubclass(jetstream_engine.QwenEngine, jetstream_api.engine_api.Engine)
assert jetstream_api.token_utils.pad_tokens is not None
assert "seqio.vocabularies" not in sys.modules, "the stand-in outlived the import"
try:
  jetstream_api.token_utils.load_vocab("tokenizer.model")
except ImportError as e:
  assert "seqio" in str(e), e
else:
  raise AssertionError("load_vocab ran without seqio")
print(jetstream_api.JETSTREAM_REQUIREMENT)
"""


def _run(code, *args, env_extra=None):
  env = {k: v for k, v in os.environ.items() if k != "EPATH_USE_TF"}
  env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **(env_extra or {})})
  return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(sys.platform != "linux", reason="fake-gcs-server binary")
def test_gs_paths_go_through_gcsfs_even_with_tensorflow_installed(tmp_path):
  """epath picks TensorFlow's gfile whenever a ``tensorflow`` package can be found (a user's
  install may have one for other reasons) unless told otherwise: ``import dapo_jax`` tells it.
  The child finds a stand-in ``tensorflow`` first on its path, which fails if imported."""
  fake_tf = tmp_path / "site" / "tensorflow"
  fake_tf.mkdir(parents=True)
  (fake_tf / "__init__.py").write_text("raise ImportError('the test stand-in was imported')\n")
  emu = GcsEmulator(str(tmp_path / "gcs"))
  emu.start()
  try:
    emu.create_bucket("bkt-backend")
    out = _run(_BACKEND, f"gs://bkt-backend/{uuid.uuid4().hex}",
               env_extra={**emu.env, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"})
  finally:
    emu.stop()
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_jetstream_engine_and_orchestrator_import_without_seqio():
  """And the pin the code names is the one requirements-no-deps.txt installs, and installed."""
  out = _run(_NO_SEQIO)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(ROOT, "requirements-no-deps.txt")) as f:
    pins = [l.strip() for l in f if l.strip() and not l.startswith("#")]
  assert pins == [out.stdout.strip()]
  name, version = pins[0].split("==")
  assert importlib.metadata.version(name) == version
