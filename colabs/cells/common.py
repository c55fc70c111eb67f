"""Cells every notebook shares: the Open-in-Colab badge, the install cell, config loading."""

REPO = "dapo-jax/dapo_jax"
BADGE_IMG = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_url(name: str) -> str:
  return f"https://colab.research.google.com/github/{REPO}/blob/main/colabs/{name}.ipynb"


def badge(name: str) -> str:
  return f"[![Open In Colab]({BADGE_IMG})]({colab_url(name)})"


INSTALL = r'''
import sys
if "google.colab" in sys.modules:  # Colab only; locally: `pip install -e .` in the repo
  !pip install -q "dapo_jax @ git+https://github.com/dapo-jax/dapo_jax"
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
