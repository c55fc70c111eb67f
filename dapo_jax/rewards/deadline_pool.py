"""A small process pool whose tasks have hard deadlines: a late worker is killed, not awaited.

Why not `concurrent.futures` or `multiprocessing.Pool`: neither can stop one running task.
A SIGALRM timeout is honoured only between bytecodes or by C code that polls for signals; a
long C loop, or a library's bare `except:`, defeats it. So the only hard bound on SymPy
reading adversarial model text is SIGKILL of the process doing it (docs/algorithm.md section 2,
the symbolic verifier).

Each worker gets its own pipe, so a killed worker loses only its own task. Inside a worker a
SIGALRM interval timer gives a cheap soft stop for Python-level loops (the worker survives
and keeps its caches); the parent kills at `timeout_s + kill_grace_s` if that did not work.
"""
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

Status = Literal["ok", "error", "timeout"]

# A worker that cannot even import its modules is a broken environment, not a bad item.
_STARTUP_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Outcome:
  """Result of one task: `value` is set only when `status == "ok"`.

  `seconds` is the wall time from handing the task to a worker to its answer (or its kill), as
  the parent saw it; 0 for tasks that never reached a worker.
  """
  status: Status
  value: Any = None
  error: str = ""
  seconds: float = 0.0


class _SoftTimeout(BaseException):
  """Raised by SIGALRM inside a worker; BaseException so `except Exception` cannot eat it."""


def _raise_soft_timeout(signum, frame):
  del signum, frame
  raise _SoftTimeout()


def _worker_main(conn, preload: Sequence[str], memory_limit_mb: int | None,
                 warmup: tuple[Callable[..., Any], tuple] | None) -> None:
  """Worker loop: receive (task_id, fn, args, timeout_s), reply (task_id, status, value)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business.
  if memory_limit_mb:
    import resource  # pylint: disable=g-import-not-at-top  (POSIX only)
    limit = int(memory_limit_mb) * 1024 * 1024
    try:
      resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # macOS refuses RLIMIT_AS; the deadline still bounds time
      pass
  for module in preload:
    importlib.import_module(module)
  if warmup is not None:
    # First calls into SymPy pay for lazy imports and caches (~0.5 s); pay it before "ready"
    # so it never counts against an item's deadline.
    warmup[0](*warmup[1])
  signal.signal(signal.SIGALRM, _raise_soft_timeout)
  conn.send(("ready", os.getpid(), None))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task_id, fn, args, timeout_s = msg
    try:
      try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        reply = (task_id, "ok", fn(*args))
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
      reply = (task_id, "timeout", None)
    except BaseException as e:  # pylint: disable=broad-except
      # Only the type name: str() of a SymPy object can itself be arbitrarily slow.
      reply = (task_id, "error", type(e).__name__)
    try:
      conn.send(reply)
    except Exception:  # pylint: disable=broad-except
      # e.g. an unpicklable return value: report it rather than leave the parent waiting.
      conn.send((task_id, "error", "unpicklable result"))


@dataclasses.dataclass
class _Worker:
  process: Any
  conn: Any
  ready: bool = False
  task: int | None = None  # index into the current map() call
  started: float = 0.0
  deadline: float = 0.0


def _shutdown(workers: list[_Worker], dying: list[Any]) -> None:
  for w in workers:
    try:
      w.conn.send(None)
    except Exception:  # pylint: disable=broad-except
      pass
  deadline = time.monotonic() + 1.0  # one grace second in total, then SIGKILL
  for w in workers:
    w.process.join(timeout=max(0.0, deadline - time.monotonic()))
    if w.process.is_alive():
      w.process.kill()
      w.process.join(timeout=1.0)
    w.conn.close()
  workers.clear()
  for p in dying:
    p.join(timeout=1.0)
  dying.clear()


def default_start_method() -> str:
  # forkserver: children never inherit the trainer's threads (fork after JAX starts is unsafe),
  # and a replacement for a killed worker is forked from a server that already imported SymPy.
  return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class DeadlinePool:
  """`num_workers` processes running `fn(*args)` with a hard per-task deadline.

  Example:
    with DeadlinePool(2, preload=["sympy"]) as pool:
      outcomes = pool.map(slow_fn, [(1,), (2,)], timeout_s=5.0)
  """

  def __init__(self, num_workers: int, *, preload: Sequence[str] = (),
               memory_limit_mb: int | None = None, kill_grace_s: float = 0.25,
               warmup: tuple[Callable[..., Any], tuple] | None = None,
               start_method: str | None = None):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
    if kill_grace_s < 0:
      raise ValueError(f"kill_grace_s must be >= 0, got {kill_grace_s}.")
    start_method = start_method or default_start_method()
    self._ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver" and preload:
      # Takes effect only if this process has not started its fork server yet; then every
      # worker (and every replacement) is forked with these modules already imported.
      self._ctx.set_forkserver_preload(list(preload))
    self._preload = tuple(preload)
    self._memory_limit_mb = memory_limit_mb
    self._kill_grace_s = kill_grace_s
    self._warmup = warmup
    self.num_workers = num_workers
    self.num_killed = 0  # lifetime count of workers killed at their deadline or found dead
    self._dying: list[Any] = []  # killed, not yet reaped
    self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]
    self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._dying)

  def _spawn(self) -> _Worker:
    parent_conn, child_conn = self._ctx.Pipe(duplex=True)
    args = (child_conn, self._preload, self._memory_limit_mb, self._warmup)
    process = self._ctx.Process(
        target=_worker_main, args=args, daemon=True, name="dapo-reward-worker")
    process.start()
    child_conn.close()
    return _Worker(process=process, conn=parent_conn)

  def _replace(self, i: int) -> None:
    """Kills worker i without waiting for its task, and starts a fresh one in its place.

    The killed process is reaped later (`_reap`): waiting for a big process to exit here would
    delay the answers of the other workers.
    """
    w = self._workers[i]
    w.process.kill()
    w.conn.close()
    self._dying.append(w.process)
    self.num_killed += 1
    self._workers[i] = self._spawn()

  def _reap(self, timeout_s: float = 0.0) -> None:
    """Joins killed workers that have exited (all of them, waiting up to `timeout_s` each)."""
    for p in list(self._dying):
      p.join(timeout=timeout_s)  # SIGKILL cannot be ignored; this only collects the zombie.
      if p.exitcode is not None:
        self._dying.remove(p)

  @property
  def pids(self) -> list[int]:
    """Current worker process ids (they change when a worker is replaced)."""
    return [w.process.pid for w in self._workers]

  def close(self) -> None:
    self._finalizer()

  def __enter__(self) -> "DeadlinePool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def map(self, fn: Callable[..., Any], args_list: Sequence[tuple], timeout_s: float
          ) -> list[Outcome]:
    """Runs fn(*args) for every args tuple; outcomes are returned in input order.

    `fn` must be picklable (a module-level function). The deadline of a task starts when a
    worker picks it up, so queueing never counts against it.
    """
    if not self._finalizer.alive:
      raise RuntimeError("DeadlinePool.map called after close().")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    outcomes: list[Outcome | None] = [None] * len(args_list)
    next_task = 0
    remaining = len(args_list)
    startup_deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    try:
      while remaining:
        now = time.monotonic()
        for i, w in enumerate(self._workers):  # hand out work in input order
          if w.ready and w.task is None and next_task < len(args_list):
            try:
              w.conn.send((next_task, fn, args_list[next_task], timeout_s))
            except OSError:  # died while idle: replace it; the task goes to the next worker
              self._replace(i)
              continue
            except Exception as e:  # pylint: disable=broad-except
              # Unpicklable arguments (pickling fails before any byte is written).
              outcomes[next_task] = Outcome("error", error=f"unpicklable task: {type(e).__name__}")
              next_task += 1
              remaining -= 1
              continue
            w.task, w.started = next_task, now
            w.deadline = now + timeout_s + self._kill_grace_s
            next_task += 1
        busy = [w.deadline for w in self._workers if w.task is not None]
        wait_s = max(0.0, min(busy) - now) if busy else max(0.0, startup_deadline - now)
        ready_conns = multiprocessing.connection.wait(
            [w.conn for w in self._workers], timeout=wait_s)
        for i, w in enumerate(list(self._workers)):
          if w.conn in ready_conns:
            remaining -= self._receive(i, outcomes)
        now = time.monotonic()
        for i, w in enumerate(self._workers):
          if w.task is not None and now >= w.deadline:
            outcomes[w.task] = Outcome("timeout", error="killed at deadline",
                                       seconds=now - w.started)
            remaining -= 1
            self._replace(i)
        if not any(w.ready for w in self._workers) and now >= startup_deadline:
          raise RuntimeError(
              f"No reward worker became ready within {_STARTUP_TIMEOUT_S:.0f} s; check that "
              f"{list(self._preload)} import in a fresh process.")
    except BaseException:
      # Interrupted mid-batch: busy workers hold stale tasks, so they must not be reused.
      for i, w in enumerate(self._workers):
        if w.task is not None:
          self._replace(i)
      raise
    finally:
      self._reap(timeout_s=1.0)  # the batch is done: no killed worker outlives map()
    return outcomes  # type: ignore[return-value]

  def _receive(self, i: int, outcomes: list[Outcome | None]) -> int:
    """Reads one message from worker i; returns how many tasks it completed (0 or 1)."""
    w = self._workers[i]
    try:
      task_id, status, value = w.conn.recv()
    except (EOFError, OSError):
      # The worker died (segfault, out of memory under memory_limit_mb, killed externally).
      if not w.ready:
        w.process.join(timeout=1.0)
        raise RuntimeError(
            f"A reward worker exited during start-up (exit code {w.process.exitcode}). Workers "
            f"re-import the main module: run from a file whose entry point is guarded by "
            f"`if __name__ == '__main__':`, and check that {list(self._preload)} import in a "
            f"fresh process and fit in memory_limit_mb={self._memory_limit_mb}.") from None
      task = w.task
      self._replace(i)
      if task is None:
        return 0
      outcomes[task] = Outcome("error", error="worker process died",
                               seconds=time.monotonic() - w.started)
      return 1
    if task_id == "ready":
      w.ready = True
      return 0
    if task_id != w.task:  # cannot happen with one task in flight per pipe; fail loudly
      raise RuntimeError(f"Reward worker answered task {task_id}, expected {w.task}.")
    w.task = None
    seconds = time.monotonic() - w.started
    if status == "ok":
      outcomes[task_id] = Outcome("ok", value=value, seconds=seconds)
    else:
      outcomes[task_id] = Outcome(status, error=value or "", seconds=seconds)
    return 1
