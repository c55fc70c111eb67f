"""Compile once: a relaunch on the same workdir loads every program from the persistent
compilation cache (``dapo_jax/infra/compile_cache.py``) and trains exactly as the first launch
did."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dapo_jax.infra import compile_cache
from tests.tiny_run_flags import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
_COUNTS = re.compile(r"This launch: (\d+) program\(s\) compiled, (\d+) loaded from the persistent "
                     r"compilation cache, (\d+) cache entries written")
_RESUMED = re.compile(r"Resumed from \S+ at step (\d+)\.")
_TIMING = ("time/", "perf/")


def _launch(workdir: str) -> str:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.pop(compile_cache.ENV_DIR, None)  # "auto" must pick the workdir
  env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, "-m", "dapo_jax.main", f"--config={TINY}", f"--workdir={workdir}",
       *TINY_RUN_FLAGS, "--config.num_steps=3", "--config.checkpoint.save_every=1",
       "--config.checkpoint.async_save=False"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout + proc.stderr


def _counts(log: str) -> tuple[int, int, int]:
  found = _COUNTS.findall(log)
  assert len(found) == 1, log[-3000:]
  return tuple(int(x) for x in found[0])


def _rows(workdir: str) -> dict[int, dict]:
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      rows.setdefault(row["step"], {}).update(
          {k: v for k, v in row.items() if not k.startswith(_TIMING)})
  return rows


def _params(workdir: str, step: int) -> list[np.ndarray]:
  path = os.path.join(workdir, "checkpoints", str(step), "params")
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(ocp.StandardCheckpointer().restore(path))]


def test_relaunch_loads_every_program_from_the_cache(tmp_path):
  workdir = str(tmp_path / "run")
  first = _launch(workdir)
  compiled, loaded, written = _counts(first)
  assert compiled > 0 and loaded == 0 and written == compiled, first[-3000:]
  assert os.listdir(os.path.join(workdir, compile_cache.SUBDIR))
  rows, params = _rows(workdir), _params(workdir, 3)
  # The launch "died" after step 2's checkpoint: the relaunch redoes step 3.
  shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))
  second = _launch(workdir)
  assert _RESUMED.findall(second) == ["2"], second[-3000:]
  compiled, loaded, written = _counts(second)
  assert (compiled, written) == (0, 0) and loaded > 0, second[-3000:]
  # The programs loaded from the cache compute what the compiled ones did, bit for bit.
  assert _rows(workdir) == rows
  for a, b in zip(params, _params(workdir, 3), strict=True):
    np.testing.assert_array_equal(a, b)


def test_cache_directory_setting(tmp_path, monkeypatch):
  monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
  run = str(tmp_path / "run")
  assert compile_cache.resolve_dir("auto", run) == os.path.join(run, compile_cache.SUBDIR)
  assert compile_cache.resolve_dir("auto", None) is None  # a command without a workdir
  assert compile_cache.resolve_dir("off", run) is None
  assert compile_cache.resolve_dir("gs://b/cache", run) == "gs://b/cache"
  assert compile_cache.resolve_dir("~/c", run) == os.path.expanduser("~/c")
  monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "shared"))
  assert compile_cache.resolve_dir("auto", run) == str(tmp_path / "shared")
  with pytest.raises(ValueError, match="'auto', 'off' or a directory"):
    compile_cache.resolve_dir(" ", run)
