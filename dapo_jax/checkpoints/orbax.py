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

What this adds to ``ocp.CheckpointManager`` so a week-long run does not lose work:
  * A kill mid-write leaves ``<step>.orbax-checkpoint-tmp``; Orbax only lists renamed (finished)
    steps, and this manager deletes such leftovers before its first save.
  * A finished step that no longer reads back (truncated, emptied or bit-flipped files) is moved to
    ``<directory>/corrupt/`` with a warning and the previous step is restored instead. Bit flips
    read back without error from tensorstore, hence the fingerprint.
  * An I/O error (storage unreachable, a reset connection, a tensorstore UNAVAILABLE) is not
    damage: the read is retried with backoff, then `CheckpointIOError` is raised; a good step is
    never skipped or moved because the bucket was briefly unreachable (`is_io_error`).
  * Every process lists the same steps and resumes the same one: the outcome of each read is
    agreed by all processes (a host that sees other checkpoints, e.g. a workdir on local disk of
    a multi-host job, raises instead of mixing shards).
  * Saving at or below an existing step raises, where Orbax would silently skip the save.
  * A save that fails on a storage outage (`run_files.is_transient`, raised by the save or, for
    an async save, found at the next save or wait) is one warning naming the unsaved steps; the
    next save retries. ``max_consecutive_failed_saves`` failures in a row raise
    `run_files.StorageUnavailableError`. TensorStore's retries are bounded
    (`bound_tensorstore_retries`) and directories are created before `save` returns, so a failed
    save leaves no Orbax thread waiting for minutes.
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dapo_jax import run_files

_log = logging.getLogger(__name__)

CORRUPT_SUBDIR = "corrupt"
_INTEGRITY_VERSION = 1


class CheckpointNotFoundError(FileNotFoundError):
  """A requested checkpoint step or directory does not exist; the message lists what does."""


class CorruptCheckpointError(RuntimeError):
  """A checkpoint (or every checkpoint) fails to read back; the message names steps and causes."""


class CheckpointLayoutError(ValueError):
  """The checkpoint holds the other decoder layout (``config.model.scan_layers``)."""


class CheckpointConfigMismatchError(CheckpointLayoutError):
  """The checkpoint's parameters have other names or shapes than the config builds: it was
  saved with another model config (not damage)."""


class Restored(NamedTuple):
  """What `TrainCheckpointer.restore` returns; ``meta["step"]`` is the restored step."""
  params: Any
  opt_state: Any  # None when no abstract_opt_state was given.
  meta: dict[str, Any]

  @property
  def step(self) -> int:
    return int(self.meta["step"])


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


# ----------------------------------------------------------------------------
# Fingerprints: tensorstore reads flipped bits back without any error.
# ----------------------------------------------------------------------------


def _bits_u32(x: jax.Array) -> jax.Array:
  """The raw bits of ``x`` as uint32 words (narrow dtypes zero-extended, 64-bit ones split)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  narrow = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize)
  if narrow is not None:
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


@jax.jit
def _fingerprint(tree: Any) -> jax.Array:
  """A uint32 digest; integer sums wrap exactly, so it does not depend on the sharding."""
  total = jnp.uint32(0)
  for i, x in enumerate(jax.tree.leaves(tree)):
    # An odd factor is invertible mod 2**32: a change confined to one leaf always shows.
    total += jnp.sum(_bits_u32(jnp.asarray(x)), dtype=jnp.uint32) * jnp.uint32(2 * i + 1)
  return total


def _signature(tree: Any) -> str:
  """Paths, shapes and dtypes: a fingerprint is only comparable when these match."""
  desc = [(jax.tree_util.keystr(p), tuple(np.shape(x)), str(getattr(x, "dtype", type(x))))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return hashlib.sha1(repr(desc).encode()).hexdigest()[:16]


def _integrity_record(tree: Any) -> dict[str, Any]:
  return {"fingerprint": int(_fingerprint(tree)), "signature": _signature(tree)}


def fingerprint_record(tree: Any) -> dict[str, Any]:
  """``{"fingerprint", "signature"}`` of ``tree``'s bits and layout (a LoRA run's frozen base)."""
  return _integrity_record(tree)


def _verify(name: str, tree: Any, record: dict[str, Any] | None) -> None:
  # A different signature means the caller restored into other dtypes (a cast): nothing to compare.
  if record is None or record["signature"] != _signature(tree):
    return
  got = int(_fingerprint(tree))
  if got != record["fingerprint"]:
    raise CorruptCheckpointError(
        f"'{name}' read back with fingerprint {got}, saved {record['fingerprint']}: "
        f"the files changed after they were written.")


# ----------------------------------------------------------------------------
# Restore with fall-back.
# ----------------------------------------------------------------------------


def _abstract(tree: Any) -> Any:
  """ShapeDtypeStructs with shardings; live arrays are accepted too (their layout is used)."""
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def one(x):
    s = ocp.utils.to_shape_dtype_struct(x)
    if getattr(s, "sharding", None) is None:
      # Pinned here so a restore never depends on the writer's device layout.
      s = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=default)
    return s
  return jax.tree.map(one, tree)


def _read_step(directory: epath.Path, step: int, abstract_params: Any,
               abstract_opt_state: Any) -> dict[str, Any]:
  """The raw items of ``step``; per process (each reads its own shards), no collective.

  Read with Orbax's item handlers, not ``CheckpointManager.restore``: that one ends with a
  barrier of all processes, which a process whose read failed never reaches (the others would
  wait there until the barrier times out). The processes meet in `_read_agreed` instead.
  """
  handlers = {"params": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  args = {"params": ocp.args.StandardRestore(_abstract(abstract_params)),
          "meta": ocp.args.JsonRestore()}
  if abstract_opt_state is not None:
    handlers["opt_state"] = ocp.StandardCheckpointHandler()
    args["opt_state"] = ocp.args.StandardRestore(_abstract(abstract_opt_state))
  step_dir = epath.Path(directory) / str(step)
  if (step_dir / "integrity").exists():
    handlers["integrity"] = ocp.JsonCheckpointHandler()
    args["integrity"] = ocp.args.JsonRestore()
  handler = ocp.CompositeCheckpointHandler(**handlers)
  try:
    return dict(handler.restore(step_dir, args=ocp.args.Composite(**args)))
  finally:
    handler.close()


def _param_shapes(tree: Any) -> dict[tuple[str, ...], tuple[int, ...] | None]:
  """Each leaf's key path as strings (without the trailing ``value`` of an nnx Variable) ->
  its shape."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    shape = getattr(x, "shape", None)
    out[names[:-1] if names[-1:] == ("value",) else names] = (
        None if shape is None else tuple(shape))
  return out


def _check_shapes(directory: epath.Path, step: int, saved: dict, want: dict) -> None:
  """Raises `CheckpointConfigMismatchError` when the parameters of ``step`` are not the ones
  the config builds (a restore would fail on every step as if all were damaged)."""
  differ = [p for p in sorted(set(saved) | set(want)) if saved.get(p, "absent") != want.get(
      p, "absent")]
  if not differ:
    return
  p = differ[0]
  raise CheckpointConfigMismatchError(
      f"Checkpoint step {step} in {directory} holds other parameters than this config builds "
      f"({len(differ)} differ, e.g. {'/'.join(p)}: saved {saved.get(p, 'absent')}, config "
      f"{want.get(p, 'absent')}): it was saved with another model config; the files are not "
      "damaged. Rerun with the config the run was saved with (the workdir's config.json; "
      "dapo-eval, dapo-export and dapo-serve read it when --config is omitted), or use a new "
      "--workdir.")


def _stacked_layers(paths: set[tuple[str, ...]]) -> bool | None:
  """True for one stacked ``layers`` module (scanned), False for ``layers/<i>``, None: neither."""
  under = [p[1] for p in paths if len(p) > 1 and p[0] == "layers"]
  return None if not under else not under[0].isdigit()


def check_layer_layout(directory: epath.Path, step: int, abstract_params: Any) -> None:
  """Raises `CheckpointLayoutError` when ``step``'s params are the other decoder layout than
  ``abstract_params`` (stacked for ``config.model.scan_layers`` vs one entry per layer), instead
  of the restore failing on every step as if they were all damaged. Unreadable metadata is left
  to the restore's own checks."""
  try:
    handler = ocp.StandardCheckpointHandler()
    saved_shapes = _param_shapes(handler.metadata(epath.Path(directory) / str(step) / "params"))
  except Exception:  # pylint: disable=broad-except
    return
  want_shapes = _param_shapes(abstract_params)
  have, want = _stacked_layers(set(saved_shapes)), _stacked_layers(set(want_shapes))
  if have is None or want is None or have == want:
    _check_shapes(directory, step, saved_shapes, want_shapes)
    return
  flag = "true" if have else "false"
  raise CheckpointLayoutError(
      f"Checkpoint step {step} in {directory} holds the decoder layers "
      f"{'stacked (config.model.scan_layers=true)' if have else 'one by one (scan_layers=false)'}"
      f", but this model is built with scan_layers={str(want).lower()}. Relaunch with "
      f"--config.model.scan_layers={flag} to restore it (the HF export is the same for both, "
      "so `dapo-export` then `--config.model.checkpoint=<export>` also moves weights across).")


def _checked(out: dict[str, Any]) -> Restored:
  """`Restored` from raw items once the fingerprints match (a collective on sharded arrays)."""
  integrity = out.get("integrity") or {}
  _verify("params", out["params"], integrity.get("params"))
  opt_state = out.get("opt_state")
  if opt_state is not None:
    _verify("opt_state", opt_state, integrity.get("opt_state"))
  return Restored(out["params"], opt_state, dict(out["meta"]))


# tensorstore raises ValueError("<STATUS>: ...") with the absl status of the failed operation.
_IO_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL",
                "UNKNOWN", "CANCELLED", "PERMISSION_DENIED", "UNAUTHENTICATED")
# HTTP and GCS client libraries (gcsfs on aiohttp, google-cloud-storage on requests).
_IO_MODULES = ("aiohttp", "google.api_core", "google.auth", "requests", "urllib3", "http.client")


def is_io_error(e: BaseException) -> bool:
  """Whether ``e`` (or an exception it was raised from) is an I/O failure, not damaged files.

  I/O: an `OSError` other than a missing file (connection reset, timeout, permission), an
  HTTP/GCS client error, a tensorstore status such as UNAVAILABLE. Damage: anything else that a
  read of a committed step raises (a missing or truncated file, bad JSON, OUT_OF_RANGE,
  DATA_LOSS, a fingerprint mismatch), and a target of another shape.
  """
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, CorruptCheckpointError):
      return False
    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, IsADirectoryError,
                                                      NotADirectoryError)):
      return True
    if type(e).__module__.startswith(_IO_MODULES):
      return True
    if str(e).lstrip().startswith(tuple(s + ":" for s in _IO_STATUSES)):
      return True
    e = e.__cause__ or e.__context__
  return False


class CheckpointIOError(OSError):
  """Reading a checkpoint kept failing with I/O errors; no step was skipped or moved."""


_OK, _DAMAGED, _IO = 0, 1, 2


def _allgather_ints(values: list[int]) -> np.ndarray:
  """``values`` of every process, shape [processes, len(values)]; no collective on one process."""
  local = np.asarray(values, np.int32)
  if jax.process_count() == 1:
    return local[None]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(local)).reshape(jax.process_count(), -1)


def _agreed_steps(mgr: ocp.CheckpointManager) -> list[int]:
  """The checkpoint steps; raises unless every process lists the same ones."""
  steps = sorted(mgr.all_steps())
  seen = _allgather_ints([len(steps), steps[-1] if steps else -1,
                          zlib.crc32(repr(steps).encode()) & 0x7FFFFFFF])
  if (seen != seen[0]).any():
    raise RuntimeError(
        f"The processes see different checkpoints in {mgr.directory} (per process [count, "
        f"newest step]: {seen[:, :2].tolist()}). Every host must read and write the same "
        f"checkpoint directory: put --workdir on shared storage (gs://bucket/run), not on each "
        f"host's local disk.")
  return steps


def _read_agreed(directory: Any, step: int, read: Callable[[int], dict[str, Any]],
                 retries: int, backoff_s: float) -> Restored | Exception:
  """``step`` read on every process in lockstep: `Restored`, or the damage that stops it.

  Each process reads its own shards, then all agree on the outcome: any I/O error means a
  retry (with backoff) on every process, and past ``retries`` a loud `CheckpointIOError`; any
  damage means every process gives the step up. So no process resumes from another step.
  """
  for attempt in range(retries + 1):
    raw, err = None, None
    try:
      raw = read(step)
      code = _OK
    except Exception as e:  # pylint: disable=broad-except
      # Orbax/tensorstore raise plain ValueError/Exception for unreadable files.
      err, code = e, (_IO if is_io_error(e) else _DAMAGED)
    code = int(_allgather_ints([code]).max())
    if code == _OK:
      try:
        return _checked(raw)
      except CorruptCheckpointError as e:
        return e
    if code == _DAMAGED:
      return err or CorruptCheckpointError("another process could not read its shards")
    if attempt < retries:
      delay = backoff_s * 2 ** attempt
      _log.warning("Checkpoint step %d in %s: I/O error (%s); retry %d/%d in %.1f s.", step,
                   directory, "on another process" if err is None else
                   f"{type(err).__name__}: {_short(err)}", attempt + 1, retries, delay)
      time.sleep(delay)
  what = "on another process" if err is None else f"{type(err).__name__}: {_short(err)}"
  raise CheckpointIOError(
      f"Checkpoint step {step} in {directory} could not be read after {retries + 1} attempts "
      f"(I/O error {what}). Nothing was skipped or moved: check that the storage is reachable "
      f"and readable (credentials, network), then relaunch.") from err


def _restore(mgr: ocp.CheckpointManager, step: int | None,
             read: Callable[[int], dict[str, Any]],
             on_skipped: Callable[[list[int]], None], *, retries: int = 0,
             backoff_s: float = 1.0) -> Restored | None:
  """``step``, or the newest step that reads back; ``on_skipped`` gets the newer damaged ones."""
  steps = _agreed_steps(mgr)
  if step is not None:
    if step not in steps:
      raise CheckpointNotFoundError(
          f"No checkpoint for step {step} in {mgr.directory}; available steps: {steps}.")
    out = _read_agreed(mgr.directory, step, read, retries, backoff_s)
    if isinstance(out, Exception):
      raise out  # The caller asked for this exact step: no fall-back.
    return out
  failures: list[tuple[int, Exception]] = []
  for s in reversed(steps):
    restored = _read_agreed(mgr.directory, s, read, retries, backoff_s)
    if isinstance(restored, Exception):
      _log.warning("Checkpoint step %d in %s cannot be restored (%s: %s); trying the previous "
                   "step.", s, mgr.directory, type(restored).__name__, _short(restored))
      failures.append((s, restored))
      continue
    if failures:
      _log.warning("Restored step %d instead of the newer unreadable step(s) %s.", s,
                   [f for f, _ in failures])
      on_skipped([f for f, _ in failures])
    return restored
  if failures:
    causes = "; ".join(f"step {s}: {type(e).__name__}: {_short(e)}" for s, e in failures)
    raise CorruptCheckpointError(
        f"No checkpoint in {mgr.directory} can be restored ({causes}). If every step fails the "
        f"same way, the abstract target probably does not match the saved state (another "
        f"model config?).") from failures[0][1]
  return None


def _short(e: Exception, limit: int = 300) -> str:
  msg = " ".join(str(e).split())
  return msg if len(msg) <= limit else msg[:limit] + "..."


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


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
    max_consecutive_failed_saves: saves failing on a storage outage in a row before `save`
      raises `run_files.StorageUnavailableError` (earlier ones are warnings; the next save
      retries).
  """

  def __init__(self, directory: str | epath.PathLike, *, max_to_keep: int | None = 3,
               async_save: bool = True, read_retries: int = 4, retry_backoff_s: float = 2.0,
               max_consecutive_failed_saves: int = 3):
    self.directory = run_files.resolve(directory)  # absolute, or a gs:// URL
    self._retries, self._backoff_s = read_retries, retry_backoff_s
    self._max_failed = max(int(max_consecutive_failed_saves), 1)
    self._failed: list[int] = []  # steps of the saves failed in a row, oldest first
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
      return
    clash = [s for s in self._mgr.all_steps() if s >= step]
    if clash and not force:
      raise ValueError(
          f"Cannot save step {step} in {self.directory}: step(s) {sorted(clash)} already exist "
          f"(a run resumed from an older step?). Move them away, or pass force=True to delete "
          f"them.")
    for s in clash:
      _log.warning("Deleting checkpoint step %d in %s to save step %d (force=True).", s,
                   self.directory, step)
      self._mgr.delete(s)
    integrity = {"version": _INTEGRITY_VERSION, "params": _integrity_record(params),
                 "opt_state": _integrity_record(opt_state)}
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
    if step not in self._failed:
      self._failed.append(step)
    newest = self.latest_step()
    unsaved = step - (newest or 0)
    what = run_files.describe(err)
    if len(self._failed) >= self._max_failed:
      raise run_files.StorageUnavailableError(
          f"Checkpoints could not be written to {self.directory}: {len(self._failed)} saves in "
          f"a row failed (steps {', '.join(map(str, self._failed))}; last error {what}). "
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
    return _restore(self._mgr, step,
                    lambda s: _read_step(self.directory, s, abstract_params, abstract_opt_state),
                    self._quarantine, retries=self._retries, backoff_s=self._backoff_s)

  def latest_step(self) -> int | None:
    """The newest complete step (None: none); finished async saves included."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  @property
  def unsaved_failures(self) -> int:
    """Saves failed in a row so far (0 once one lands)."""
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
    if step is not None and int(_allgather_ints([int(err is not None)]).max()) and err is None:
      err = OSError(f"the save of step {step} failed on another process")
    if err is not None:
      self._failure(step, err)
      return False
    if step is not None:
      self._failed.clear()
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
                 "step is %s.", self.directory, run_files.describe(e), self._mgr.latest_step())

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
    restored = _restore(mgr, step, lambda s: _read_step(directory, s, abstract_params, None),
                        lambda _: None, retries=read_retries, backoff_s=retry_backoff_s)
  finally:
    mgr.close()
  if restored is None:
    raise CheckpointNotFoundError(f"No checkpoint in {directory}.")
  return restored
