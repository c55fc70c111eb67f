"""dapo_jax: DAPO reinforcement learning for LLMs in JAX / Flax NNX."""

import os
import sys

__version__ = "0.1.0"

# gs:// goes through gcsfs, the backend the emulator tests check (tests/test_storage_backend.py).
# etils.epath would pick TensorFlow's gfile instead whenever TensorFlow is importable (a user's
# environment may have it for other reasons), unless EPATH_USE_TF says no; gfile retries,
# errors and emulator support differ. Set before any path is opened; children inherit it.
os.environ["EPATH_USE_TF"] = "false"
if "etils.epath.gpath" in sys.modules:  # epath caches its "TF installed?" answer at first use
  sys.modules["etils.epath.gpath"]._is_tf_installed.cache_clear()  # pylint: disable=protected-access


def load_pretrained(*args, **kwargs):
  """Loads a HF Qwen2 / Qwen2.5 checkpoint; see ``dapo_jax.checkpoints.hf.load_pretrained``."""
  from dapo_jax.checkpoints.hf import load_pretrained as _load  # pylint: disable=g-import-not-at-top
  return _load(*args, **kwargs)
