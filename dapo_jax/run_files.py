"""Run artefacts on any filesystem: a local path and a ``gs://`` URL go through one `epath.Path`.

Orbax writes checkpoints through `etils.epath`; every other file of a run (config.json, metrics,
TensorBoard events, curves, final metrics, eval tables) goes through it too, so ``--workdir
gs://bucket/run`` puts everything in the bucket and nothing on a worker's local disk.

GCS objects cannot be appended to or renamed atomically, but an upload replaces an object
atomically: a remote file is rewritten whole, a local one goes through a temp file + rename.
With several processes only process 0 writes shared remote files (GCS allows about one update
per second of one object); on local paths every process writes its own copy, since each host
may have its own disk.
"""

from __future__ import annotations

import json
import os
from typing import Any

from etils import epath

CONFIG_FILE = "config.json"
FINAL_METRICS_FILE = "final_metrics.json"
CURVES_FILE = "curves.png"


def resolve(path: epath.PathLike) -> epath.Path:
  """``path`` as an `epath.Path`: a URL (``gs://``) as it is; a local path with ``~`` expanded
  and made absolute (Orbax refuses relative checkpoint paths)."""
  if is_remote(path):
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def is_remote(path: epath.PathLike) -> bool:
  """Whether ``path`` is a URL (``gs://``, ``s3://``...) rather than a local path."""
  return "://" in os.fspath(path)


def write_bytes_atomic(path: epath.PathLike, data: bytes) -> None:
  """Writes ``data``; a reader never sees a half-written file."""
  path = epath.Path(path)
  if is_remote(path):
    path.write_bytes(data)  # One upload: the object is replaced as a whole or not at all.
    return
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)


def write_text_atomic(path: epath.PathLike, text: str) -> None:
  write_bytes_atomic(path, text.encode("utf-8"))


def _writes_shared_files(workdir: epath.Path) -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return not is_remote(workdir) or jax.process_index() == 0


def prepare_workdir(workdir: epath.PathLike, config: Any) -> epath.Path:
  """Creates the run directory and writes ``config.json``; returns the resolved path."""
  workdir = resolve(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if _writes_shared_files(workdir):
    write_text_atomic(workdir / CONFIG_FILE, config.to_json_best_effort(indent=2))
  return workdir


def write_final_metrics(workdir: epath.PathLike, result: dict[str, Any]) -> None:
  """``final_metrics.json``: the run's last metrics and final evaluation."""
  workdir = resolve(workdir)
  if _writes_shared_files(workdir):
    write_text_atomic(workdir / FINAL_METRICS_FILE, json.dumps(result, indent=2))


def write_final_files(workdir: epath.PathLike, result: dict[str, Any]) -> list[dict[str, Any]]:
  """End of a run: ``curves.png`` and ``final_metrics.json``; returns the rows of metrics.jsonl.

  The metrics are written by process 0 only, so only process 0 draws and returns them (other
  processes get []; on a local disk of another host the file does not exist).
  """
  from dapo_jax import metrics  # pylint: disable=g-import-not-at-top  (metrics imports us)
  import jax  # pylint: disable=g-import-not-at-top
  workdir = resolve(workdir)
  rows = []
  if jax.process_index() == 0:
    metrics.plot_curves(workdir / metrics.METRICS_FILE, workdir / CURVES_FILE)
    rows = metrics.read_jsonl(workdir / metrics.METRICS_FILE)
  write_final_metrics(workdir, result)
  return rows


def read_json(path: epath.PathLike) -> Any:
  """A JSON file, local or remote; a missing file raises FileNotFoundError naming it."""
  path = resolve(path)
  if not path.exists():
    raise FileNotFoundError(f"{path} not found.")
  return json.loads(path.read_text(encoding="utf-8"))
