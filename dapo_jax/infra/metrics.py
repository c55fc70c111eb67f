"""What a researcher reads during and after a run: scalars, samples, a progress bar, curves.

    writer = MetricsWriter(workdir, resume_step=restored_step)  # 0 for a fresh run
    bar = ProgressBar(total_steps, initial=restored_step)
    timer = Timer()
    with timer("rollout"):
      ...
    scalars = {**train_metrics, **timer.pop()}
    writer.write_scalars(step, scalars); bar.update(step, scalars); writer.flush()

Files under ``workdir``: ``metrics.jsonl`` (one JSON object per step: ``{"step": k, name: float
or null}``), ``samples.jsonl`` (``{"step", "tag", "text"}`` per text) and ``tb/`` (TensorBoard).
The curves (`dapo_jax.infra.curves`) match names by glob, so any prefix works (``train/grad_norm``):
``reward_mean``, ``acc_mean``, ``avg@k``/``pass@k``/``maj@k`` (held-out, from
`dapo_jax.trainer.eval_metrics.summarize`), ``response_length_mean``/``_max``, ``entropy``,
``pg_clipfrac``/``_lower``, ``ppo_kl``, ``grad_norm``, ``kept_ratio``, ``all_correct_ratio``,
``all_wrong_ratio``, ``num_gen_batches``/``gen_batches_admitted`` (generation batches drawn from
the data / prompts sent to the rollout over the generation batch size: fractional when streaming
dynamic sampling stops admitting mid-batch), ``decoded_tokens_per_kept_group``,
``slot_utilization``, and the ``diag/*`` panels of `dapo_jax.trainer.diagnostics`.

One piece: the metrics writer, its outage buffering and the reader share one row format
(metrics.jsonl, samples.jsonl, TensorBoard), which must not drift apart.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import time
from typing import Any, Iterator, Mapping

import numpy as np
from etils import epath

from dapo_jax.infra import run_files

_log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TB_SUBDIR = "tb"


def _to_float(name: str, value: Any) -> float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"Metric {name!r} must be a scalar, got shape {arr.shape}.")
  return float(arr.reshape(()))


def _rewrite_jsonl(path: epath.Path, max_step: int | None) -> list[str]:
  """Drops lines with ``step > max_step`` and unreadable ones (a line cut by a crash).

  Returns the kept lines (each ending in a newline).
  """
  if not path.exists():
    return []
  kept, bad, dropped, unterminated = [], 0, 0, False
  # StringIO with newline="\n" splits at "\n" only, like iterating over a file did.
  for line in io.StringIO(path.read_text(encoding="utf-8"), newline="\n"):
    try:
      step = int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      bad += line.strip() != ""
      continue
    if max_step is not None and step > max_step:
      dropped += 1
      continue
    unterminated = not line.endswith("\n")  # Appending would glue the next row onto it.
    kept.append(line.rstrip("\n") + "\n")
  if bad or dropped or unterminated:
    if bad or dropped:
      _log.warning("%s: dropped %d line(s) after step %s and %d unreadable line(s).", path,
                   dropped, max_step, bad)
    # Atomic: a crash here leaves the old file, never a half one.
    run_files.write_text_atomic(path, "".join(kept))
  return kept


class _LineFile:
  """An append-only text file. Local: a file opened for appending. Remote (``gs://``): objects
  cannot be appended to, so the lines are kept and the whole object is uploaded at each flush
  (each upload replaces it atomically). An upload that fails keeps every line for the next
  flush; `unwritten` counts them."""

  def __init__(self, path: epath.Path, lines: list[str]):
    self.path = path
    self._lines: list[str] | None = None
    self._file = None
    self._dirty = False
    self.unwritten = 0
    if run_files.is_remote(path):
      self._lines = list(lines)
    else:
      self._file = open(path, "a", encoding="utf-8")  # pylint: disable=consider-using-with

  def write(self, text: str) -> None:
    if self._file is not None:
      self._file.write(text)
    else:
      self._lines.append(text)
      self._dirty = True
      self.unwritten += 1

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
    elif self._dirty:
      self.path.write_text("".join(self._lines), encoding="utf-8")
      self._dirty = False
      self.unwritten = 0

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()


class _EpathRecordFile:
  """A TensorBoard event file written through epath: buffered, uploaded whole at each flush.

  A failed upload does not raise: tensorboardX's writer thread flushes too, and an exception
  would end that thread, after which the training thread blocks on its full event queue. The
  error is kept in `error` (the writer reports it) and the buffer goes up at the next flush;
  once `give_up` is set, flushes do nothing (the writer has reported what is lost).
  """

  def __init__(self, path: str):
    self._path = epath.Path(path)
    self._buf = io.BytesIO()
    self._dirty = False
    self.error: Exception | None = None
    self.give_up = False

  def write(self, data: bytes) -> None:
    self._buf.write(data)
    self._dirty = True

  def flush(self) -> None:
    if self._dirty and not self.give_up:
      try:
        self._path.write_bytes(self._buf.getvalue())
      except Exception as e:  # pylint: disable=broad-except
        self.error = e
        return
      self._dirty, self.error = False, None

  def close(self) -> None:
    self.flush()


class _EpathRecordWriterFactory:
  """tensorboardX's hook for URL schemes (its own ``gs://`` writer needs GCS credentials and a
  project and reaches neither an emulator nor the rest of our stack's GCS client)."""

  def __init__(self):
    self.files: list[_EpathRecordFile] = []

  def open(self, path: str) -> _EpathRecordFile:
    self.files.append(_EpathRecordFile(path))
    return self.files[-1]

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _tensorboardx():
  """tensorboardX's ``SummaryWriter`` and ``record_writer``, imported with torch hidden.

  Its writer imports torch when torch is installed (about 2 s of a run's start-up on a 2-core
  host; issue 41) only to accept torch tensors, which nothing here passes. Where torch is
  loaded already it stays as it is; otherwise the import sees none and torch stays importable.
  """
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter, record_writer  # pylint: disable=g-import-not-at-top
    return SummaryWriter, record_writer
  sys.modules["torch"] = None  # `import torch` raises ImportError, as without torch
  try:
    from tensorboardX import SummaryWriter, record_writer  # pylint: disable=g-import-not-at-top
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter, record_writer


class MetricsWriter:
  """Scalars and texts to TensorBoard and JSONL; only process 0 writes (``active``).

  Args:
    workdir: the run directory (created): a local path or a URL (``gs://``), see `run_files`.
    tensorboard / jsonl: which sinks to write.
    resume_step: the step the run restarts from. Lines and events with a larger step, written
      before a crash, are dropped, so the resumed log has no duplicate steps. None: keep all.
    active: default ``jax.process_index() == 0``.
  """

  def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True, jsonl: bool = True,
               resume_step: int | None = None, active: bool | None = None):
    if active is None:
      import jax  # pylint: disable=g-import-not-at-top
      active = jax.process_index() == 0
    self.workdir = run_files.resolve(workdir)
    self.active = active
    self._pending: dict[str, Any] | None = None
    self._jsonl = self._texts = self._tb = None
    self._tb_files: list[_EpathRecordFile] = []
    self._failed_flushes = 0  # in a row
    if not active:
      return
    run_files.quiet_storage_tracebacks()
    self.workdir.mkdir(parents=True, exist_ok=True)
    if jsonl:
      self._jsonl, self._texts = (
          _LineFile(self.workdir / name, _rewrite_jsonl(self.workdir / name, resume_step))
          for name in (METRICS_FILE, SAMPLES_FILE))
    if tensorboard:
      SummaryWriter, record_writer = _tensorboardx()
      tb_dir = os.fspath(self.workdir / TB_SUBDIR)
      factory = _EpathRecordWriterFactory()
      if run_files.is_remote(tb_dir):
        record_writer.register_writer_factory(tb_dir.split("://")[0], factory)
      # purge_step makes TensorBoard hide the old run's events from that step on.
      purge = None if resume_step is None else resume_step + 1
      # tensorboardX names event files by the second and opens them with "wb": a unique suffix
      # keeps a restart within the same second from overwriting the previous run's events.
      self._tb = SummaryWriter(tb_dir, purge_step=purge,
                               filename_suffix=f".{os.getpid()}.{time.time_ns()}")
      self._tb_files = list(factory.files)  # (the event file is opened right away)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Numbers (Python, numpy or 0-d jax arrays); several calls for one step make one row.

    Device values are read back here: call it after the next step has been dispatched.
    """
    if not self.active:
      return
    step = int(step)
    values = {k: _to_float(k, v) for k, v in scalars.items()}
    if self._tb is not None:
      for k, v in values.items():
        # A NaN or inf (a ratio with nothing to count) is no point on a curve, and tensorboardX
        # would log a warning for each; metrics.jsonl keeps it as null.
        if math.isfinite(v):
          # TensorBoard tags allow [A-Za-z0-9_./-]: "eval/avg@4" becomes "eval/avg_at_4".
          self._tb.add_scalar(k.replace("@", "_at_"), v, step)
    if self._jsonl is not None:
      if self._pending is not None and self._pending["step"] != step:
        self._emit()
      if self._pending is None:
        self._pending = {"step": step}
      # JSON has no NaN or inf: null keeps the file valid for every reader.
      self._pending.update({k: v if math.isfinite(v) else None for k, v in values.items()})

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    """Sample completions and the like, written now."""
    if not self.active:
      return
    for tag, text in texts.items():
      if self._tb is not None:
        self._tb.add_text(tag, str(text), int(step))
      if self._texts is not None:
        self._texts.write(json.dumps({"step": int(step), "tag": tag, "text": str(text)}) + "\n")

  def flush(self) -> bool:
    """Writes the pending row and flushes every sink (call at each log step); returns whether
    everything is written.

    A later write for the same step starts a second row; `read_jsonl` merges them. A storage
    outage (`run_files.is_transient`) is one warning: the rows stay in memory and the next
    flush writes them (every line once, in order).
    """
    if not self.active:
      return True
    self._emit()
    try:
      self._flush_sinks()
    except Exception as e:  # pylint: disable=broad-except
      if not run_files.is_transient(e):
        raise
      self._failed_flushes += 1
      _log.warning("Metrics not written to %s (%s): %s kept in memory for the next flush "
                   "(failed flushes in a row: %d).", self.workdir, run_files.describe(e),
                   self._unwritten(), self._failed_flushes)
      return False
    if self._failed_flushes:
      _log.info("Metrics written to %s again after %d failed flushes.", self.workdir,
                self._failed_flushes)
      self._failed_flushes = 0
    return True

  def _flush_sinks(self) -> None:
    """One attempt; stops at the first failure (in an outage each upload waits out gcsfs's own
    retries, ~30 s, before it fails)."""
    for f in (self._jsonl, self._texts):
      if f is not None:
        f.flush()
    if self._tb is not None:
      self._tb.flush()
      for f in self._tb_files:
        if f.error is not None:
          raise f.error

  def _unwritten(self) -> str:
    rows = self._jsonl.unwritten if self._jsonl is not None else 0
    texts = self._texts.unwritten if self._texts is not None else 0
    return f"{rows} metric rows, {texts} sample texts and the TensorBoard events"

  def close(self, retry_s: float | None = None) -> None:
    """Writes everything left; in an outage retries for ``retry_s`` (default
    `run_files.FINAL_RETRY_S`), then raises `run_files.StorageUnavailableError` naming what
    was not written."""
    if any(f is not None for f in (self._jsonl, self._texts, self._tb)):
      retry_s = run_files.FINAL_RETRY_S if retry_s is None else retry_s
      try:
        run_files.retry_transient(lambda: (self._emit(), self._flush_sinks()),
                                  what=f"Metrics of {self.workdir}", timeout_s=retry_s)
      except run_files.StorageUnavailableError as e:
        lost = self._unwritten()
        self._abandon()
        raise run_files.StorageUnavailableError(f"{e} Not written: {lost}.") from None
    for f in (self._jsonl, self._texts, self._tb):
      if f is not None:
        f.close()
    self._jsonl = self._texts = self._tb = None

  def _abandon(self) -> None:
    """Closes the sinks without writing again (each upload would wait out gcsfs's retries)."""
    for f in self._tb_files:
      f.give_up = True
    if self._tb is not None:
      self._tb.close()
    for f in (self._jsonl, self._texts):
      if f is not None and f._file is not None:  # pylint: disable=protected-access
        f.close()
    self._jsonl = self._texts = self._tb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    run_files.close_on_exit(self.close, raising=exc_type is not None)

  def _emit(self) -> None:
    if self._pending is not None and self._jsonl is not None:
      self._jsonl.write(json.dumps(self._pending, allow_nan=False) + "\n")
    self._pending = None


def read_jsonl(path: epath.PathLike) -> list[dict[str, Any]]:
  """Rows of ``metrics.jsonl`` by step (rows of one step merged); null becomes NaN."""
  rows: dict[int, dict[str, Any]] = {}
  text = run_files.resolve(path).read_text(encoding="utf-8")
  for line in io.StringIO(text, newline="\n"):
    try:
      row = json.loads(line)
      step = int(row["step"])
    except (ValueError, KeyError, TypeError):
      continue  # A line cut by a crash.
    merged = rows.setdefault(step, {"step": step})
    merged.update({k: math.nan if v is None else v for k, v in row.items() if k != "step"})
  return [rows[s] for s in sorted(rows)]


class ProgressBar:
  """A tqdm bar over rollout steps with a few live metrics in its postfix.

  ``fields`` maps a short label to a metric name; names are matched exactly or as a suffix after
  ``/`` (``"kept_ratio"`` finds ``"sampling/kept_ratio"``).
  """

  DEFAULT_FIELDS = {"reward": "reward_mean", "acc": "acc_mean", "kept": "kept_ratio"}

  def __init__(self, total: int, *, initial: int = 0, fields: Mapping[str, str] | None = None,
               desc: str = "train", disable: bool | None = None):
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    self.fields = dict(self.DEFAULT_FIELDS if fields is None else fields)
    self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                     disable=disable)

  def update(self, step: int, scalars: Mapping[str, Any] | None = None) -> None:
    """Moves the bar to ``step`` (completed steps) and shows the fields found in ``scalars``."""
    if scalars:
      post = {}
      for label, name in self.fields.items():
        key = next((k for k in scalars if k == name or k.endswith("/" + name)), None)
        if key is not None:
          post[label] = f"{_to_float(key, scalars[key]):.3g}"
      self._bar.set_postfix(post, refresh=False)
    self._bar.update(max(0, int(step) - self._bar.n))

  @property
  def n(self) -> int:
    """Completed steps shown."""
    return self._bar.n

  @property
  def postfix(self) -> str:
    return self._bar.postfix or ""

  def close(self) -> None:
    self._bar.close()


class Timer:
  """Wall-clock seconds per phase, summed until `pop`.

  JAX dispatches asynchronously: block on a phase's outputs (``jax.block_until_ready``) inside
  its ``with`` block, or the time lands in whichever phase first waits for them.
  """

  def __init__(self):
    self.totals: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start

  def pop(self, prefix: str = "time/") -> dict[str, float]:
    """The totals as metrics (``time/rollout``...), then reset."""
    out = {prefix + k: v for k, v in self.totals.items()}
    self.totals = {}
    return out


# (title, glob patterns); a panel with no matching metric is left out.
