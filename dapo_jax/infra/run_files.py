"""Run artefacts on any filesystem: a local path and a ``gs://`` URL go through one `epath.Path`.

Orbax writes checkpoints through `etils.epath`; every other file of a run (config.json, metrics,
TensorBoard events, curves, final metrics, eval tables) goes through it too, so ``--workdir
gs://bucket/run`` puts everything in the bucket and nothing on a worker's local disk.

GCS objects cannot be appended to or renamed atomically, but an upload replaces an object
atomically: a remote file is rewritten whole, a local one goes through a temp file + rename.
With several processes only process 0 writes shared remote files (GCS allows about one update
per second of one object); on local paths every process writes its own copy, since each host
may have its own disk.

Storage outages: `is_transient` tells an outage (connection refused or reset, timeouts, HTTP 5xx,
a TensorStore UNAVAILABLE) from a definite answer (a missing file or bucket, a 403); callers
retry only the former (`retry_transient`) and end with one `StorageUnavailableError` line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from typing import Any, Callable, TypeVar

from etils import epath

CONFIG_FILE = "config.json"
FINAL_METRICS_FILE = "final_metrics.json"
CURVES_FILE = "curves.png"

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
# Seconds between two attempts of `retry_transient`, and how long the files still unwritten at the
# end of a launch (metrics) are retried. Module constants so that tests can shrink them.
RETRY_WAIT_S = 10.0
FINAL_RETRY_S = 30.0


class StorageUnavailableError(OSError):
  """Storage kept failing with transient errors (an outage) past the retries; the message names
  the path, the last error and what was kept or lost."""


# Answers that retrying cannot change: the object or bucket is not there, or access is refused.
_DEFINITE = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
             PermissionError, StorageUnavailableError)
# TensorStore raises ValueError("<STATUS>: ...") with the absl status of the failed operation;
# these are the statuses of an unreachable or overloaded server (after its own retries).
_TRANSIENT_STATUSES = ("UNAVAILABLE:", "DEADLINE_EXCEEDED:", "RESOURCE_EXHAUSTED:", "ABORTED:",
                       "INTERNAL:", "UNKNOWN:", "CANCELLED:")
# Connection-level errors of the HTTP clients under gcsfs and google-cloud-storage.
_CLIENT_MODULES = ("aiohttp", "requests", "urllib3", "http.client")


def _verdict(e: BaseException) -> bool | None:
  """True: an outage; False: a definite answer; None: says nothing (look at its cause)."""
  if isinstance(e, FileNotFoundError) and "upload_id=" in str(e):
    # gcsfs's 404 on a resumable upload *session* (the object's URL carries the session's id):
    # the server lost it (a restarted or failed-over frontend, an expired session), not the
    # bucket. The write as a whole is redone by the next save or flush.
    return True
  if isinstance(e, _DEFINITE):
    return False
  code = getattr(e, "code", None)
  if type(e).__name__ == "HttpError" and isinstance(code, int):  # gcsfs, after its retries
    return code >= 500 or code in (408, 429)
  if isinstance(e, (ConnectionError, TimeoutError)):
    return True
  if type(e).__module__.startswith(_CLIENT_MODULES) and not isinstance(e, (ValueError,
                                                                          TypeError)):
    return True
  if str(e).lstrip().startswith(_TRANSIENT_STATUSES):
    return True
  return None


def _chain(e: BaseException | None):
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def is_transient(e: BaseException | None) -> bool:
  """Whether ``e`` (or an exception it was raised from) is an outage worth retrying: a refused,
  reset or timed-out connection, an HTTP 408/429/5xx, a TensorStore UNAVAILABLE-like status.
  A missing file or bucket (404), a 403 and every other error are not."""
  for x in _chain(e):
    verdict = _verdict(x)
    if verdict is not None:
      return verdict
  return False


def describe(e: BaseException) -> str:
  """``Type: message`` of the error in ``e``'s chain that made it transient, on one line."""
  inner = next((x for x in _chain(e) if _verdict(x)), e)
  msg = " ".join(str(inner).split())
  return f"{type(inner).__name__}: {msg[:200] + '...' if len(msg) > 200 else msg}"


def retry_transient(fn: Callable[[], _T], *, what: str, timeout_s: float,
                    wait_s: float | None = None) -> _T:
  """``fn()``, retried while it fails with a transient storage error (one warning) for up to
  ``timeout_s``; then `StorageUnavailableError` naming ``what``. Other errors (a missing
  bucket, a 403, a bug) are raised at once. One attempt may itself last longer than
  ``wait_s``: gcsfs retries a request for about 30 s before it raises."""
  quiet_storage_tracebacks()  # our warning below says it; gcsfs would add a traceback per try
  deadline = time.monotonic() + timeout_s
  wait_s = RETRY_WAIT_S if wait_s is None else wait_s
  warned = False
  while True:
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except
      if not is_transient(e):
        raise
      left = deadline - time.monotonic()
      if left <= 0:
        raise StorageUnavailableError(
            f"{what}: storage unreachable for {timeout_s:.0f} s ({describe(e)}). Check the "
            "network, the bucket's endpoint and credentials, then relaunch.") from None
      if not warned:
        _log.warning("%s: storage unreachable (%s); retrying for up to %.0f s.", what,
                     describe(e), timeout_s)
        warned = True
      time.sleep(min(wait_s, left))


class _DropHandledStorageTracebacks(logging.Filter):
  """Drops third-party records whose exception is a transient storage error: the code that
  catches that error retries it and logs one line of its own (gcsfs logs every request out of
  retries, Orbax every failed background thread, each with a traceback)."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return exc is None or not is_transient(exc)


_DROP_HANDLED = _DropHandledStorageTracebacks()


def _is_closed_loop_callback(exc_type, exc, tb) -> bool:
  """TensorStore reports (through `sys.unraisablehook`) an error raised in a future's
  done-callback. After a failed save Orbax has closed the asyncio loop that awaited its array
  writes; each write still retrying then fails to post its result to that loop: a 5-line
  traceback each, about nothing left to handle."""
  return (exc_type is RuntimeError and str(exc) == "Event loop is closed" and tb is not None
          and tb.tb_frame.f_code.co_name == "call_soon_threadsafe")


def quiet_storage_tracebacks() -> None:
  """Installs the filter on the loggers of gcsfs, fsspec's read-ahead (a logger's filter does
  not see its children's records, so each is named) and Orbax (absl), and the unraisable-hook
  wrapper for TensorStore's callbacks, once; idempotent."""
  for name in ("gcsfs", "fsspec", "fsspec.prefetcher", "absl"):
    logger = logging.getLogger(name)
    if _DROP_HANDLED not in logger.filters:
      logger.addFilter(_DROP_HANDLED)
  previous = sys.unraisablehook
  if getattr(previous, "_dapo_quiet", False):
    return

  def hook(unraisable):
    if not _is_closed_loop_callback(unraisable.exc_type, unraisable.exc_value,
                                    unraisable.exc_traceback):
      previous(unraisable)
  hook._dapo_quiet = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


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
  """Writes ``data``; a reader never sees a half-written file.

  Several writers of one file (every process of a run writes ``config.json``, and the hosts may
  share the disk) each write their own temporary file: with one shared name, the first rename
  took the file from under the second (FileNotFoundError, seen in the 2-rank launch test).
  """
  path = epath.Path(path)
  if is_remote(path):
    path.write_bytes(data)  # One upload: the object is replaced as a whole or not at all.
    return
  tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")
  try:
    tmp.write_bytes(data)
    os.replace(tmp, path)
  finally:
    if tmp.exists():  # a failed write leaves nothing behind
      tmp.unlink()


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


def read_json(path: epath.PathLike) -> Any:
  """A JSON file, local or remote; a missing file raises FileNotFoundError naming it."""
  path = resolve(path)
  if not path.exists():
    raise FileNotFoundError(f"{path} not found.")
  return json.loads(path.read_text(encoding="utf-8"))


def close_on_exit(close, *, raising: bool) -> None:
  """A writer's ``__exit__``: ``close()``; if it fails on storage while another error is already
  on its way out, that error stays the one reported and this one is logged."""
  try:
    close()
  except StorageUnavailableError as e:
    if not raising:
      raise
    logging.getLogger(__name__).error("%s", e)
