"""JAX's persistent compilation cache for a run: a relaunch loads its programs instead of
compiling them again (after a preemption, every host of a slice would otherwise spend the
32B train step's minutes of compilation before its first step).

``config.compilation_cache_dir`` picks the directory (local or ``gs://``; JAX reads and writes
it through `etils.epath`, as the run's other files):

* ``"auto"`` (default): ``JAX_COMPILATION_CACHE_DIR`` when the environment sets it (several runs
  then share one cache), else ``<workdir>/compilation_cache``;
* ``"off"``: no persistent cache;
* any other value: that directory.

Every program is cached, however small or quick to compile (JAX's defaults skip programs that
compile in under a second, which is most of a CPU run): the thresholds are set to zero unless
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` / ``JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES``
are set. JAX writes entries from process 0 only: on a slice, put the workdir (or the cache) on
storage every host reads (``gs://``), or hosts other than the first compile on every launch.

The cache is trusted: whoever can write to it can run code in the job (JAX's warning).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from dapo_jax.infra import run_files

_log = logging.getLogger(__name__)

SUBDIR = "compilation_cache"
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
# JAX's own settings, applied here unless the environment sets them.
_THRESHOLDS = {"jax_persistent_cache_min_compile_time_secs": 0.0,
               "jax_persistent_cache_min_entry_size_bytes": -1}
_HITS = "/jax/compilation_cache/cache_hits"
_WRITES = "/jax/compilation_cache/cache_misses"  # JAX records it when it writes an entry
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a program compiled or loaded


def resolve_dir(setting: str, workdir) -> str | None:
  """The cache directory ``setting`` names for a run in ``workdir`` (None: no cache)."""
  setting = (setting or "").strip()
  if setting == "off":
    return None
  if setting == "auto":
    if os.environ.get(ENV_DIR):
      return os.environ[ENV_DIR]
    if workdir is None:
      return None
    return os.fspath(run_files.resolve(workdir) / SUBDIR)
  if not setting:
    raise ValueError("config.compilation_cache_dir is empty: use 'auto', 'off' or a directory.")
  return os.fspath(run_files.resolve(setting))


def enable(path: str | None) -> str | None:
  """Points JAX's persistent cache at ``path`` (None: turns it off) for the compiles to come."""
  current = jax.config.jax_compilation_cache_dir
  if path != current:
    jax_cache.reset_cache()  # JAX opens its cache once per process, on the first compile
    jax.config.update("jax_compilation_cache_dir", path)
  if path is not None:
    for name, value in _THRESHOLDS.items():
      if name.upper() not in os.environ:
        jax.config.update(name, value)
  return path


def setup(cache_dir: str, workdir) -> str | None:
  """Enables the cache ``compilation_cache_dir`` names ("auto", "off" or a directory) for
  ``workdir``; logs where."""
  path = enable(resolve_dir(cache_dir, workdir))
  if path is not None:
    _log.info("Persistent compilation cache: %s", path)
  return path


@dataclasses.dataclass
class CompileCounts:
  """Programs this process obtained since `CompileCounter` started: from the persistent cache
  (``loaded``) or by compiling (``compiled``), and cache entries written."""
  programs: int = 0
  loaded: int = 0
  written: int = 0

  @property
  def compiled(self) -> int:
    return self.programs - self.loaded

  def __str__(self) -> str:
    return (f"{self.compiled} program(s) compiled, {self.loaded} loaded from the persistent "
            f"compilation cache, {self.written} cache entries written")


class CompileCounter:
  """Counts compiles and cache hits through `jax.monitoring` while open (a context manager)."""

  def __init__(self):
    self.counts = CompileCounts()
    self._lock = threading.Lock()

  def _event(self, event: str, **kwargs) -> None:
    del kwargs
    with self._lock:
      if event == _HITS:
        self.counts.loaded += 1
      elif event == _WRITES:
        self.counts.written += 1

  def _duration(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == _BACKEND_COMPILE:
      with self._lock:
        self.counts.programs += 1

  def __enter__(self) -> CompileCounter:
    jax.monitoring.register_event_listener(self._event)
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_listener(self._event)
    jax.monitoring.unregister_event_duration_listener(self._duration)
