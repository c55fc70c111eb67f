"""Cells every notebook shares: the Open-in-Colab badge, the install cell, config loading."""

import inspect

REPO = "dapo-jax/dapo_jax"
BADGE_IMG = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_url(name: str) -> str:
  return f"https://colab.research.google.com/github/{REPO}/blob/main/colabs/{name}.ipynb"


def badge(name: str) -> str:
  return f"[![Open In Colab]({BADGE_IMG})]({colab_url(name)})"


def accelerator_extra(environ=None, exists=None) -> str:
  """The dapo_jax extra for this Colab runtime: "[tpu]", "[cuda]" or "" (CPU).

  Without the extra, pip's jax is CPU-only: on a TPU or GPU runtime JAX would silently run on
  the CPU (or fail next to the runtime's preinstalled jax). TPU runtimes: the legacy TPU Node
  sets COLAB_TPU_ADDR; TPU VM runtimes have the chips as /dev/accel* (v2-v4) or /dev/vfio/N
  (v5e, v6e) and set TPU_ACCELERATOR_TYPE or TPU_NAME. GPU runtimes set COLAB_GPU=1 and have
  /dev/nvidia0 (CPU runtimes may ship the nvidia-smi binary too, so its presence says nothing).
  The probes are arguments so each runtime can be simulated in a test.
  """
  import glob  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  environ = os.environ if environ is None else environ
  exists = (lambda pattern: bool(glob.glob(pattern))) if exists is None else exists
  if (any(environ.get(k) for k in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE"))
      or exists("/dev/accel*") or exists("/dev/vfio/[0-9]*")):
    return "[tpu]"
  if environ.get("COLAB_GPU", "0") not in ("", "0") or exists("/dev/nvidia[0-9]*"):
    return "[cuda]"
  return ""


# The install cell carries accelerator_extra's own source: it runs before dapo_jax exists.
INSTALL = "import sys\n\n\n" + inspect.getsource(accelerator_extra) + r'''

if "google.colab" in sys.modules:  # Colab only; locally: `pip install -e .` in the repo
  EXTRA = accelerator_extra()  # "[tpu]" / "[cuda]": JAX for this runtime's accelerator
  print(f"Installing dapo_jax{EXTRA} ({EXTRA.strip('[]') or 'cpu'} runtime)")
  !pip install -q "dapo_jax{EXTRA} @ git+https://github.com/dapo-jax/dapo_jax"
  if EXTRA:
    print("Restart the runtime (Runtime > Restart session) if jax was imported before this cell.")
'''


# Shared by the two notebooks that train: configs/ is not part of the pip package, so outside a
# checkout the config file is fetched from the repository.
LOAD_CONFIG = r'''
import importlib.util
import os
import urllib.request

from ml_collections.config_flags import config_path  # what dapo-train's --config.x=y uses

CONFIG_FILE = "configs/tiny_cpu.py"
if not os.path.exists(CONFIG_FILE):  # e.g. Colab: pip installs dapo_jax/, not configs/
  os.makedirs("configs", exist_ok=True)
  urllib.request.urlretrieve(
      "https://raw.githubusercontent.com/dapo-jax/dapo_jax/main/" + CONFIG_FILE, CONFIG_FILE)


def load_config(overrides, path=CONFIG_FILE):
  """`dapo-train --config PATH --config.KEY=VALUE ...`: get_config(), then locked overrides."""
  spec = importlib.util.spec_from_file_location("run_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.lock()  # a misspelt key raises instead of adding a field nobody reads
  for key, value in overrides.items():
    config_path.set_value(key, config, value)
  return config
'''

# Shared by the two notebooks that train: INFO progress from dapo_jax, not the libraries' chatter.
QUIET_LOGGING = r'''
import logging

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
for noisy in ("jax._src", "orbax"):
  logging.getLogger(noisy).setLevel(logging.WARNING)
for chatty in ("absl", "tensorboardX"):  # Orbax's read-only notices, TensorBoard's "@" renames
  logging.getLogger(chatty).setLevel(logging.ERROR)
'''
