"""The read side of the train-state checkpoints (`orbax.TrainCheckpointer`): reading a step back
and deciding whether it is good.

  * The errors a restore raises and `Restored`, what it returns (re-exported by `orbax`).
  * Integrity fingerprints (`fingerprint_record`): tensorstore reads flipped bits back without any
    error, so each array item's bits are summed at save time and checked after a read.
  * `check_layer_layout`: a checkpoint of the other decoder layout or another model config fails
    with an error naming the fix, not as damage on every step.
  * `restore_with_fallback`: the newest step that reads back (`read_step`), every process
    agreeing on each read's outcome (`allgather_ints`); I/O errors (`is_io_error`) are retried,
    then raise `CheckpointIOError`; damaged steps are skipped and handed to the caller.
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

_log = logging.getLogger(__name__)


class CheckpointNotFoundError(FileNotFoundError):
  """A requested checkpoint step or directory does not exist; the message lists what does."""


class CorruptCheckpointError(RuntimeError):
  """A checkpoint (or every checkpoint) fails to read back; the message names steps and causes."""


class CheckpointLayoutError(ValueError):
  """The checkpoint holds the other decoder layout (``config.model.scan_layers``)."""


class CheckpointConfigMismatchError(CheckpointLayoutError):
  """The checkpoint's parameters have other names or shapes than the config builds: it was
  saved with another model config (not damage)."""


class CheckpointIOError(OSError):
  """Reading a checkpoint kept failing with I/O errors; no step was skipped or moved."""


class Restored(NamedTuple):
  """What `TrainCheckpointer.restore` returns; ``meta["step"]`` is the restored step."""
  params: Any
  opt_state: Any  # None when no abstract_opt_state was given.
  meta: dict[str, Any]

  @property
  def step(self) -> int:
    return int(self.meta["step"])


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


def fingerprint_record(tree: Any) -> dict[str, Any]:
  """``{"fingerprint", "signature"}`` of ``tree``'s bits and layout (each array item of a saved
  step, a LoRA run's frozen base)."""
  return {"fingerprint": int(_fingerprint(tree)), "signature": _signature(tree)}


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


def read_step(directory: epath.Path, step: int, abstract_params: Any,
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


_OK, _DAMAGED, _IO = 0, 1, 2


def allgather_ints(values: list[int]) -> np.ndarray:
  """``values`` of every process, shape [processes, len(values)]; no collective on one process."""
  local = np.asarray(values, np.int32)
  if jax.process_count() == 1:
    return local[None]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(local)).reshape(jax.process_count(), -1)


def _agreed_steps(mgr: ocp.CheckpointManager) -> list[int]:
  """The checkpoint steps; raises unless every process lists the same ones."""
  steps = sorted(mgr.all_steps())
  seen = allgather_ints([len(steps), steps[-1] if steps else -1,
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
    code = int(allgather_ints([code]).max())
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


def restore_with_fallback(mgr: ocp.CheckpointManager, step: int | None,
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
