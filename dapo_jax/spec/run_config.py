"""The workdir's config is a contract: a relaunch may change only what leaves the run the same run.

`check` compares a launch's config with the run's ``config.json`` before anything is written
(so a refused launch costs a file read and leaves the workdir untouched):

  * keys in `SAFE_KEYS` may change on a resume: they set how long the run goes, what is logged,
    when checkpoints and evaluations happen, where the same data lives, how the same state is
    laid out and compiled; the change is logged in one line;
  * any other change (the model, the optimizer, the algorithm, the rollout, seeds, the data
    itself) refuses the launch with one line naming each key (old -> new), unless the run has no
    checkpoint yet or ``--allow_config_change=key,...`` names it. An allow-list rather than a
    deny-list: a field added to the schema later is protected until someone decides otherwise.

`record` then runs once the restore has succeeded: it adds the launch to ``config_history/``
(``NNNN.json``: time, command, resumed step, the changes, the full config) and only then
replaces ``config.json``, which dapo-eval, dapo-export and dapo-serve read.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import sys
from typing import Any, Iterable

import ml_collections
from etils import epath

from dapo_jax.infra import run_files

_log = logging.getLogger(__name__)

HISTORY_DIR = "config_history"
# Config leaves that name a local or gs:// path: "~" is expanded in each (data.train/eval may
# also be a dataset name, which expanduser leaves alone), by dapo-train's flags and here.
PATH_FIELDS = ("model.checkpoint", "tokenizer.path", "data.train", "data.eval", "data.data_dir",
               "data.manual_dir")
CHECKPOINT_DIR = "checkpoints"  # run_setup's TrainCheckpointer directory under the workdir

# Keys (or sections, ending in ".") a resume may change, and why each leaves the run the same.
SAFE_KEYS = {
    "num_steps": "the run's length (no schedule depends on it)",
    "log_every": "console cadence",
    "num_sample_texts": "logged samples",
    "logging.": "console, samples and wandb logging",
    "eval.every": "evaluation cadence (not what an evaluation measures)",
    "checkpoint.": "when and how checkpoints are written",
    "compilation_cache_dir": "where compiled programs are cached",
    "tpu_windowed_einsum": "how XLA schedules collectives",
    # The restore reshards the saved state to any mesh, and a rollout's keys depend only on
    # (seed, step, prompt): a relaunch on another slice size is the same run.
    "mesh": "device layout", "rollout_mesh": "device layout", "dcn_mesh": "device layout",
    "rollout_devices": "device layout",
    "model.remat": "recompute or store activations (memory only)",
    # The same loss on the same tokens, computed in packed rows (float rounding apart).
    "optim.packing": "how the trainer lays out the same tokens",
    "optim.max_tokens_per_row": "how the trainer lays out the same tokens",
    "reward.num_workers": "verifier processes",
    # The engine's KV memory and kernel: a sample draws the same tokens with the same keys
    # either way (log-probs equal to ~1e-6, tests/test_paged_engine.py).
    **{f"rollout.{k}": "rollout KV-cache layout" for k in (
        "kv_cache", "page_size", "kv_pages", "kv_hbm_fraction", "attention_impl")},
    # Where the datasets named by data.train / data.eval are stored (not which data).
    "data.data_dir": "dataset location", "data.manual_dir": "dataset location",
    # Stopping rules: train.py's "sampling stopped" and "dataset ran out" errors ask for a
    # relaunch on the same workdir with a higher value.
    "data.num_epochs": "when the data runs out",
    "algorithm.max_num_gen_batches": "when dynamic sampling gives up",
}


class ConfigChangeError(ValueError):
  """A relaunch would resume a run under a config that changes its state or its algorithm."""


class BucketNotFoundError(FileNotFoundError):
  """The ``gs://`` workdir's bucket does not exist (a definite answer, not an outage)."""


@dataclasses.dataclass
class Launch:
  """What `check` found, for `record`."""
  workdir: epath.Path
  config: dict[str, Any]
  changes: dict[str, tuple[Any, Any]]  # key -> (old, new); {} for a first launch
  allowed: list[str]  # unsafe changed keys let through by --allow_config_change
  first: bool  # no config.json before this launch
  index: int = 0  # this launch's number in config_history/ (read before any process writes)


_ABSENT = "<absent>"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Dotted key -> leaf value (lists such as the mesh are leaves)."""
  if not isinstance(tree, dict):
    return {prefix[:-1]: tree}
  out = {}
  for k, v in tree.items():
    out.update(flatten(v, f"{prefix}{k}."))
  return out


def _as_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  # The same serialisation config.json holds, so both sides compare alike (tuples -> lists).
  return json.loads(config.to_json_best_effort())


def _normalised(flat: dict[str, Any]) -> dict[str, Any]:
  """Path leaves with "~" expanded, as dapo-train expands them (an API call may not)."""
  return {k: os.path.expanduser(v) if k in PATH_FIELDS and isinstance(v, str) else v
          for k, v in flat.items()}


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """Changed leaves, key -> (old, new). A key the old file lacks compares with the schema's
  default (a field added to the code since); a key only the old file has is a field since
  removed, ignored, except under a free-form section (a dropped model override)."""
  from dapo_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  defaults = flatten(_as_dict(config_lib.default_config()))
  old, new = _normalised(flatten(old)), _normalised(flatten(new))
  out = {}
  for key in sorted(set(old) | set(new)):
    free = key.startswith(tuple(s + "." for s in config_lib._FREE_FORM))  # pylint: disable=protected-access
    if key not in new and not free:
      continue
    before = old.get(key, _ABSENT if free else defaults.get(key, _ABSENT))
    after = new.get(key, _ABSENT)
    if before != after:
      out[key] = (before, after)
  return out


# Safe keys that change the run in some configs: key -> (whether it does, given the new
# config's flat dict; why).
UNSAFE_WHEN = {
    "checkpoint.save_every": (
        lambda flat: (flat.get("algorithm.max_staleness") or 0) > 0,
        "an overlapped step samples with the newest checkpoint's weights when they are newer "
        "than t - k (docs/overlap.md), so the cadence sets which policy samples each step"),
}


def is_safe(key: str, flat: dict[str, Any] | None = None) -> bool:
  """Whether a resume may change ``key``; ``flat``: the new config (`flatten`), for the keys
  of `UNSAFE_WHEN`."""
  if flat is not None and key in UNSAFE_WHEN and UNSAFE_WHEN[key][0](flat):
    return False
  return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_KEYS)


def _matches(key: str, names: Iterable[str]) -> bool:
  """Whether ``--allow_config_change`` names ``key`` or a section holding it."""
  return any(key == n or key.startswith(n.rstrip(".") + ".") for n in names)


def _show(changes: dict[str, tuple[Any, Any]], limit: int = 12) -> str:
  items = [f"{k} {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in changes.items()]
  more = f" and {len(items) - limit} more" if len(items) > limit else ""
  return ", ".join(items[:limit]) + more


def read_previous(workdir: epath.Path) -> dict[str, Any] | None:
  """The run's ``config.json``, None when there is none; a ``gs://`` workdir whose bucket does
  not exist raises `BucketNotFoundError` (only once storage has answered "not found": an
  unreachable server raises its own error, for the caller's retries)."""
  path = workdir / run_files.CONFIG_FILE
  try:
    text = path.read_text(encoding="utf-8")
  except Exception as e:  # pylint: disable=broad-except
    # FileNotFoundError from gcsfs and local files; TensorFlow's gfile raises its NotFoundError.
    if not isinstance(e, FileNotFoundError) and type(e).__name__ != "NotFoundError":
      raise
    if run_files.is_remote(workdir):
      check_bucket(workdir)
    return None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigChangeError(f"{path} is not valid JSON ({e}): restore it (e.g. from "
                            f"{workdir / HISTORY_DIR}/) or use a new --workdir.") from e


def check_bucket(workdir: epath.Path) -> None:
  """Raises `BucketNotFoundError` when ``workdir``'s bucket does not exist."""
  url = os.fspath(workdir)
  scheme, _, rest = url.partition("://")
  bucket = rest.split("/", 1)[0]
  if scheme != "gs" or not bucket:
    return
  import gcsfs  # pylint: disable=g-import-not-at-top  (epath's backend for gs://)
  try:
    gcsfs.GCSFileSystem().info(bucket)
  except FileNotFoundError as e:  # a 404 on the bucket itself: no outage
    raise BucketNotFoundError(
        f"bucket gs://{bucket} (of --workdir {url}) does not exist or is not reachable with "
        "these credentials: create it (gcloud storage buckets create gs://"
        f"{bucket}) or fix the --workdir.") from e


def _checkpoint_steps(workdir: epath.Path) -> list[int]:
  try:
    return sorted(int(p.name) for p in (workdir / CHECKPOINT_DIR).iterdir() if p.name.isdigit())
  except (FileNotFoundError, NotADirectoryError):
    return []


def check(workdir: epath.PathLike, config: ml_collections.ConfigDict,
          allow_config_change: Iterable[str] = ()) -> Launch:
  """Compares ``config`` with the run's ``config.json``; raises `ConfigChangeError` (one line)
  for a change the run cannot take. Writes nothing."""
  workdir = run_files.resolve(workdir)
  allow = [n.strip() for n in allow_config_change if n.strip()]
  new = _as_dict(config)
  old = read_previous(workdir)
  index = _history_index(workdir / HISTORY_DIR)
  keys = set(flatten(new)) | set(flatten(old or {}))
  unknown = [n for n in allow if not any(_matches(k, [n]) for k in keys)]
  if unknown:
    raise ConfigChangeError(f"--allow_config_change: {', '.join(unknown)} is not a config key "
                            "(write dotted keys, e.g. optim.lr,rollout.n).")
  if old is None:
    return Launch(workdir, new, {}, [], first=True, index=index)
  changes = diff(old, new)
  flat = flatten(new)
  unsafe = {k: v for k, v in changes.items() if not is_safe(k, flat)}
  refused = {k: v for k, v in unsafe.items() if not _matches(k, allow)}
  if refused:
    steps = _checkpoint_steps(workdir)
    if steps:
      names = ",".join(refused)
      raise ConfigChangeError(
          f"--workdir {workdir} holds a run (checkpoint step {steps[-1]}) made with another "
          f"config: {_show(refused)}. These keys change the saved state or the algorithm. "
          f"Relaunch with the run's own config ({workdir / run_files.CONFIG_FILE}), use a new "
          f"--workdir, or pass --allow_config_change={names} to change them on purpose "
          f"(recorded in {workdir / HISTORY_DIR}/).")
    _log.warning("Config changed since the last launch, which left no checkpoint (starting "
                 "afresh): %s.", _show(refused))
  safe = {k: v for k, v in changes.items() if k not in unsafe}
  if safe:
    _log.info("Config changes since the last launch (safe on resume): %s.", _show(safe))
  allowed = [k for k in unsafe if k not in refused]
  if allowed:
    _log.warning("Config changes allowed by --allow_config_change: %s.",
                 _show({k: unsafe[k] for k in allowed}))
  return Launch(workdir, new, changes, allowed, first=False, index=index)


def _history_index(history: epath.Path) -> int:
  try:
    names = [p.name for p in history.iterdir()]
  except (FileNotFoundError, NotADirectoryError):
    return 0
  taken = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
  return max(taken, default=-1) + 1


def record(launch: Launch, resumed_from_step: int | None) -> None:
  """Adds this launch to ``config_history/`` and then writes ``config.json``. Call once the
  restore has succeeded.

  Several processes: the history is process 0's (one writer, even where the hosts share a
  local disk); ``config.json`` follows `run_files` (process 0 on gs://, every process on local
  paths, each of which may be a host's own disk that the next launch's check reads).
  """
  import jax  # pylint: disable=g-import-not-at-top
  workdir = launch.workdir
  if jax.process_index() == 0:
    history_dir = workdir / HISTORY_DIR
    history_dir.mkdir(parents=True, exist_ok=True)
    entry = {"launch": launch.index,
             "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "host": socket.gethostname(), "command": list(sys.argv),
             "resumed_from_step": resumed_from_step,
             "changes": {k: [a, b] for k, (a, b) in launch.changes.items()},
             "allowed": launch.allowed, "config": launch.config}
    run_files.write_text_atomic(history_dir / f"{launch.index:04d}.json",
                                json.dumps(entry, indent=2))
  if run_files._writes_shared_files(workdir):  # pylint: disable=protected-access
    run_files.write_text_atomic(workdir / run_files.CONFIG_FILE,
                                json.dumps(launch.config, indent=2))


def history(workdir: epath.PathLike) -> list[dict[str, Any]]:
  """Every recorded launch, oldest first."""
  d = run_files.resolve(workdir) / HISTORY_DIR
  if not d.exists():
    return []
  paths = sorted(p for p in d.iterdir() if p.name.endswith(".json"))
  return [json.loads(p.read_text(encoding="utf-8")) for p in paths]
