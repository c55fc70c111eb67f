"""Train-state checkpoints on Orbax: params, optimizer state and JSON run state, one dir per step.

    ckpt = TrainCheckpointer(workdir / "checkpoints", max_to_keep=3)
    restored = ckpt.restore(abstract_params=abs_params, abstract_opt_state=abs_opt)  # None: fresh
    ...
    ckpt.save(step, params, opt_state, {"data": it.state(), "sampler": ds.state_dict(),
                                        "rng": rng_to_json(key), "config": config.to_dict()})
    ckpt.close()

A step directory holds four Orbax items: ``params`` and ``opt_state`` (any pytrees of arrays, e.g.
an ``nnx.State`` and an optax state; sharded arrays are written by every shard's owner), ``meta``
(the caller's JSON dict plus ``step``) and ``integrity`` (a fingerprint of each array item).

One piece: `TrainCheckpointer`'s save, its failure accounting across attempts and its restore
share one state (pending save, failed attempts, the newest save that landed); reading and
verifying a step lives in `orbax_read`.

What this adds to ``ocp.CheckpointManager`` so a week-long run does not lose work:
  * A kill mid-write leaves ``<step>.orbax-checkpoint-tmp``; Orbax only lists renamed (finished)
    steps, and this manager deletes such leftovers before its first save.
  * A finished step that no longer reads back (truncated, emptied or bit-flipped files) is moved to
    ``<directory>/corrupt/`` with a warning and the previous step is restored instead. Bit flips
    read back without error from tensorstore, hence the fingerprint.
  * An I/O error (storage unreachable, a reset connection, a tensorstore UNAVAILABLE) is not
    damage: the read is retried with backoff, then `CheckpointIOError` is raised; a good step is
    never skipped or moved because the bucket was briefly unreachable
    (`orbax_read.is_io_error`).
  * Every process lists the same steps and resumes the same one: the outcome of each read is
    agreed by all processes (a host that sees other checkpoints, e.g. a workdir on local disk of
    a multi-host job, raises instead of mixing shards).
  * Saving at or below an existing step raises, where Orbax would silently skip the save.
  * A save that fails on a storage outage (`run_files.is_transient`, raised by the save or, for
    an async save, found at the next save or wait) is one warning naming the unsaved steps; the
    next save retries. ``max_consecutive_failed_saves`` failed attempts in a row (of new steps,
    or of one step saved again) raise
    `run_files.StorageUnavailableError`. TensorStore's retries are bounded
    (`bound_tensorstore_retries`) and directories are created before `save` returns, so a failed
    save leaves no Orbax thread waiting for minutes.

The read side (fingerprints, layout checks, the agreed restore with fall-back) is `orbax_read`;
what `restore` and `load_params_only` return and raise is re-exported from it: `Restored`,
`CheckpointNotFoundError`, `CorruptCheckpointError`, `CheckpointLayoutError`,
`CheckpointConfigMismatchError`, `CheckpointIOError`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dapo_jax.checkpoints.orbax_read import (CheckpointConfigMismatchError, CheckpointIOError,
                                             CheckpointLayoutError, CheckpointNotFoundError,
                                             CorruptCheckpointError, Restored, allgather_ints,
                                             check_layer_layout, fingerprint_record, read_step,
                                             restore_with_fallback)
from dapo_jax.infra import run_files

__all__ = ["CORRUPT_SUBDIR", "CheckpointConfigMismatchError", "CheckpointIOError",
           "CheckpointLayoutError", "CheckpointNotFoundError", "CorruptCheckpointError",
           "Restored", "TrainCheckpointer", "bound_tensorstore_retries", "load_params_only",
           "restore_params_only", "rng_from_json", "rng_to_json", "to_json"]

_log = logging.getLogger(__name__)

CORRUPT_SUBDIR = "corrupt"
_INTEGRITY_VERSION = 1




# ----------------------------------------------------------------------------
# JSON items and RNG keys.
# ----------------------------------------------------------------------------


def to_json(obj: Any, path: str = "meta") -> Any:
  """Plain JSON containers from ``obj`` (numpy values become Python ones, tuples lists).

  Checked when `save` is called, so a bad value fails there and not later in the async writer.
  """
  if isinstance(obj, dict):
    out = {}
    for k, v in obj.items():
      if not isinstance(k, str):
        raise TypeError(f"{path}: JSON keys must be strings, got {k!r}.")
      out[k] = to_json(v, f"{path}.{k}")
    return out
  if isinstance(obj, (list, tuple)):
    return [to_json(v, f"{path}[{i}]") for i, v in enumerate(obj)]
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  if isinstance(obj, (np.ndarray, np.generic, jax.Array)):
    if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
      raise TypeError(f"{path} is a typed PRNG key; store rng_to_json(key) instead.")
    return np.asarray(obj).tolist()
  raise TypeError(
      f"{path} is a {type(obj).__name__}, which JSON cannot hold; convert it first "
      f"(ConfigDict: .to_dict(), RNG key: rng_to_json(key), dataclass: dataclasses.asdict).")


def rng_to_json(key: jax.Array) -> dict[str, Any]:
  """A typed (``jax.random.key``) or raw uint32 (``PRNGKey``) key as JSON."""
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(key) if typed else key
  return {"typed": bool(typed), "impl": str(jax.random.key_impl(key)) if typed else None,
          "data": np.asarray(data).tolist()}


def rng_from_json(obj: dict[str, Any]) -> jax.Array:
  """Inverse of `rng_to_json`."""
  data = jnp.asarray(obj["data"], dtype=jnp.uint32)
  return jax.random.wrap_key_data(data, impl=obj["impl"]) if obj["typed"] else data


def bound_tensorstore_retries(max_retries: int = 6, initial_delay_s: float = 1.0,
                              max_delay_s: float = 16.0) -> None:
  """Caps TensorStore's retries of a GCS request (its default, 32 retries up to 32 s apart, is
  about 15 minutes) at ~47 s, about gcsfs's own 6 tries: in an outage an array write then fails
  about when the rest of the save does, instead of holding Orbax's commit threads (and the
  process's exit) for minutes. Orbax takes its TensorStore context from these module dicts."""
  from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  retries = {"gcs_request_retries": {"max_retries": int(max_retries),
                                     "initial_delay": f"{initial_delay_s}s",
                                     "max_delay": f"{max_delay_s}s"}}
  for context in (tensorstore_utils._BASE_TS_CONTEXT,  # pylint: disable=protected-access
                  tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):  # pylint: disable=protected-access
    context.update(retries)


bound_tensorstore_retries()


class TrainCheckpointer:
  """Saves and restores the train state under ``directory/<step>/``; one writer per directory.

  Args:
    directory: local path or any ``etils.epath`` URL (``gs://...``).
    max_to_keep: newest complete steps kept on disk (None: all).
    async_save: `save` returns once arrays are copied to host; files are written in the
      background (so the caller may donate or overwrite the device buffers right after).
    read_retries / retry_backoff_s: a restore that hits I/O errors retries this many times,
      waiting ``retry_backoff_s * 2**attempt`` before each retry, then raises.
    max_consecutive_failed_saves: save attempts failing on a storage outage in a row (a step
      saved again counts each time) before `save` or `wait_until_finished` raises
      `run_files.StorageUnavailableError` (earlier ones are warnings; the next save retries).
  """

  def __init__(self, directory: str | epath.PathLike, *, max_to_keep: int | None = 3,
               async_save: bool = True, read_retries: int = 4, retry_backoff_s: float = 2.0,
               max_consecutive_failed_saves: int = 3):
    self.directory = run_files.resolve(directory)  # absolute, or a gs:// URL
    self._retries, self._backoff_s = read_retries, retry_backoff_s
    self._max_failed = max(int(max_consecutive_failed_saves), 1)
    # The step of each save attempt failed in a row, oldest first: a step retried (the end of a
    # run saves its last step again until it lands) counts once per attempt.
    self._failed: list[int] = []
    self._pending: int | None = None  # the async save not yet waited for
    self._stale = False  # Orbax's step list may be wrong after a failed save: reload it
    self._async = async_save
    run_files.quiet_storage_tracebacks()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        # Leftovers of killed writes are never listed; this deletes them (in the background,
        # done before the first save) so they do not pile up over a long run.
        cleanup_tmp_directories=True,
        create=True,
        # Directories made in `save` itself: made in the background, a failure leaves Orbax's
        # item threads waiting for a "directory created" signal for 5 minutes (and the process
        # unable to exit); made here, it is one error of this save.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self._mgr = ocp.CheckpointManager(self.directory, options=options)
    # The newest step known to be on storage. Orbax lists a step from the moment its save
    # starts, so after a failed save its list names a step that is not there.
    self._landed: int | None = self._mgr.latest_step()

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any] | None = None,
           *, force: bool = False) -> None:
    """Saves one step; the caller decides when (e.g. ``step % save_every == 0``).

    ``meta`` must be JSON-able (checked now); ``step`` is added to it. A step at or below an
    existing one raises, unless ``force`` (which deletes those steps first: for a run restarted
    from an older step on purpose).
    """
    step = int(step)
    meta = to_json(dict(meta or {}))
    if meta.setdefault("step", step) != step:
      raise ValueError(f"meta['step']={meta['step']} differs from step={step}.")
    # Orbax would wait for the previous async save at the start of its save anyway.
    self.wait_until_finished()
    try:
      self._prepare(step)
    except Exception as e:  # pylint: disable=broad-except
      if not run_files.is_transient(e):
        raise
      self._failure(step, e)
      return
    if step in self._failed and step in self._mgr.all_steps():
      self._failed.clear()  # the "failed" save had committed; only its clean-up failed
      self._landed = step
      return
    clash = [s for s in self._mgr.all_steps() if s >= step]
    if clash and not force:
      raise ValueError(
          f"Cannot save step {step} in {self.directory}: step(s) {sorted(clash)} already exist "
          f"(a run resumed from an older step?). Move them away, or pass force=True to delete "
          f"them.")
    if clash:
      self._landed = max((s for s in self._mgr.all_steps() if s < step), default=None)
    for s in clash:
      _log.warning("Deleting checkpoint step %d in %s to save step %d (force=True).", s,
                   self.directory, step)
      self._mgr.delete(s)
    integrity = {"version": _INTEGRITY_VERSION, "params": fingerprint_record(params),
                 "opt_state": fingerprint_record(opt_state)}
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta), integrity=ocp.args.JsonSave(integrity))
    try:
      # force=True: the interval policy is the caller's; clashes were handled above.
      self._mgr.save(step, args=args, force=True)
    except Exception as e:  # pylint: disable=broad-except
      if not run_files.is_transient(e):
        raise
      self._failure(step, e)
      return
    self._pending = step
    if not self._async:
      self.wait_until_finished()  # a synchronous save is done: record its success now

  def _prepare(self, step: int) -> None:
    """After a failed save: the step list read again, and the remains of a failed attempt at
    ``step`` itself removed (on GCS Orbax writes a step in place, and refuses an existing one)."""
    if self._stale:
      self._mgr.reload()
      self._stale = False
    if step in self._failed and step not in self._mgr.all_steps() and jax.process_index() == 0:
      partial = self.directory / str(step)
      if partial.exists():
        partial.rmtree()
    if jax.process_count() > 1 and step in self._failed:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("dapo_jax_checkpoint_retry")

  def _failure(self, step: int, err: BaseException) -> None:
    """One failed save: a warning, or past the limit `StorageUnavailableError`."""
    self._stale = True
    self._failed.append(step)
    newest = self.latest_step()
    unsaved = step - (newest or 0)
    what = run_files.describe(err)
    if len(self._failed) >= self._max_failed:
      distinct = sorted(set(self._failed))
      steps = f"step{'s' if len(distinct) > 1 else ''} {', '.join(map(str, distinct))}"
      raise run_files.StorageUnavailableError(
          f"Checkpoints could not be written to {self.directory}: {len(self._failed)} saves in "
          f"a row failed ({steps}; last error {what}). "
          f"Training stopped at step {step}; the newest checkpoint is "
          f"{'step %d' % newest if newest is not None else 'none'} ({unsaved} steps unsaved). "
          "Relaunch with the same --workdir once the storage is reachable "
          "(checkpoint.max_consecutive_failed_saves sets the limit).") from None
    _log.warning("Checkpoint of step %d not saved (%s): %d steps unsaved since %s; retrying at "
                 "the next save (failed saves in a row: %d; training stops at %d).", step, what,
                 unsaved, f"step {newest}" if newest is not None else "the start",
                 len(self._failed), self._max_failed)

  def restore(self, step: int | None = None, *, abstract_params: Any,
              abstract_opt_state: Any = None) -> Restored | None:
    """Restores ``step`` (default: the newest readable one) into the targets' shardings.

    Targets are pytrees of ``jax.ShapeDtypeStruct`` with ``.sharding`` (e.g. ``jax.eval_shape``
    output plus the shardings) or of live arrays (their layout is used); a leaf without a sharding
    goes to the first device. ``abstract_opt_state=None`` skips the optimizer state.

    Returns None when the directory holds no checkpoint. With ``step=None`` a damaged newest
    step is moved to ``<directory>/corrupt/`` and the previous one restored (with a warning).
    Raises `CheckpointNotFoundError` for a missing ``step``, `CorruptCheckpointError` when nothing
    reads back, `CheckpointIOError` when I/O errors outlast the retries.
    """
    self._mgr.wait_until_finished()
    steps = self.all_steps()
    if steps:
      check_layer_layout(self.directory, steps[-1] if step is None else step, abstract_params)
    return restore_with_fallback(
        self._mgr, step,
        lambda s: read_step(self.directory, s, abstract_params, abstract_opt_state),
        self._quarantine, retries=self._retries, backoff_s=self._backoff_s)

  def latest_step(self) -> int | None:
    """The newest step known to be complete on storage (None: none): an async save counts once
    `wait_until_finished` (or the next save) found it landed; a failed one never does."""
    return self._landed

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  @property
  def unsaved_failures(self) -> int:
    """Save attempts failed in a row so far (0 once one lands)."""
    return len(self._failed)

  def wait_until_finished(self) -> bool:
    """Blocks until the pending async save is on disk; returns whether it (and so the newest
    requested save) landed. A storage failure is a warning (`save`); past the limit raises
    `run_files.StorageUnavailableError`; any other failure raises."""
    step, self._pending = self._pending, None
    err = None
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if step is None or not run_files.is_transient(e):
        raise
      err = e
    # Every process counts the same failures (and so gives up at the same save).
    if step is not None and int(allgather_ints([int(err is not None)]).max()) and err is None:
      err = OSError(f"the save of step {step} failed on another process")
    if err is not None:
      self._failure(step, err)
      return False
    if step is not None:
      self._failed.clear()
      self._landed = step
    return not self._failed

  def close(self) -> None:
    """Waits for the pending save and releases Orbax's threads; a failed last save is a
    warning here (the caller that needs it on disk waits with `wait_until_finished`).

    A storage outage met here (by the pending save, or by Orbax's own background work and
    close) is a warning too: `close` runs in the teardown of a run that may be stopping for
    another reason, whose error must be the one the user sees."""
    try:
      self.wait_until_finished()
    except run_files.StorageUnavailableError as e:
      _log.warning("%s", e)
    except Exception as e:  # pylint: disable=broad-except
      self._warn_on_close(e)
    try:
      self._mgr.close()
    except Exception as e:  # pylint: disable=broad-except
      self._warn_on_close(e)

  def _warn_on_close(self, e: Exception) -> None:
    if not run_files.is_transient(e):
      raise e
    _log.warning("Closing the checkpoints in %s met a storage outage (%s); the newest saved "
                 "step is %s.", self.directory, run_files.describe(e), self._landed)

  def __enter__(self) -> TrainCheckpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _quarantine(self, steps: list[int]) -> None:
    """Moves unreadable steps aside: kept for inspection, and re-saving those steps works."""
    if jax.process_index() == 0:
      dest_root = self.directory / CORRUPT_SUBDIR
      dest_root.mkdir(parents=True, exist_ok=True)
      if "://" in str(dest_root) and not dest_root.exists():
        # Object stores have no empty directories, and epath renames only into an existing one.
        (dest_root / "README.txt").write_text(
            "Checkpoint steps that failed to read back, moved here by dapo_jax.\n")
      for s in steps:
        dest = dest_root / f"{s}-{int(time.time())}"
        (self.directory / str(s)).rename(dest)
        _log.warning("Moved unreadable checkpoint step %d to %s; delete it once inspected.", s,
                     dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("dapo_jax_checkpoint_quarantine")
    self._mgr.reload()
    self._landed = self._mgr.latest_step()


def load_params_only(directory: str | epath.PathLike, step: int | None = None, *,
                     abstract_params: Any, read_retries: int = 4,
                     retry_backoff_s: float = 2.0) -> Any:
  """Params of ``step`` (default: the newest readable one) for evaluation or serving."""
  return restore_params_only(directory, step, abstract_params=abstract_params,
                             read_retries=read_retries, retry_backoff_s=retry_backoff_s).params


def restore_params_only(directory: str | epath.PathLike, step: int | None = None, *,
                        abstract_params: Any, read_retries: int = 4,
                        retry_backoff_s: float = 2.0) -> Restored:
  """`load_params_only` with the step it read (``.step``: the newest may be unreadable).

  Read-only: never deletes or moves anything, so it is safe next to a running trainer.
  """
  run_files.quiet_storage_tracebacks()  # I/O errors are retried and reported here, as in `save`
  directory = run_files.resolve(directory)
  if not directory.exists():
    raise CheckpointNotFoundError(f"Checkpoint directory {directory} does not exist.")
  # save_interval_steps=0 and no async: what read_only implies anyway, minus Orbax's warnings.
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                         enable_async_checkpointing=False)
  mgr = ocp.CheckpointManager(directory, options=options)
  try:
    steps = list(mgr.all_steps())
    if steps:
      check_layer_layout(directory, max(steps) if step is None else step, abstract_params)
    restored = restore_with_fallback(
        mgr, step, lambda s: read_step(directory, s, abstract_params, None), lambda _: None,
        retries=read_retries, backoff_s=retry_backoff_s)
  finally:
    mgr.close()
  if restored is None:
    raise CheckpointNotFoundError(f"No checkpoint in {directory}.")
  return restored
