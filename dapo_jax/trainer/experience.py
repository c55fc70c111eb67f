"""Where the loop's experience comes from: the synchronous step, or a rollout overlapped with
the update under bounded staleness (``algorithm.max_staleness``, docs/overlap.md).

``train_and_evaluate`` reads both the same way: ``next(step, params)`` gives the step's scored
batch (an `Experience`, stamped with the policy version that sampled it), ``updated(step,
params)`` hands the weights after an update to the rollout, and ``exclusive()`` holds the
rollout engine for an evaluation.

The overlapped source rolls out in a background thread, on ``rollout_devices`` of their own or
on the training devices. Its schedule is fixed in advance, so its results never depend on
timing: step t's batch is sampled by the weights of version

    v(t) = max(t - k, the last checkpoint step <= t, the run's first step)

(version t = the weights step t starts from). At k = 1 step t+1's batch is generated while
step t trains. A periodic checkpoint is a sync point: nothing is in flight when it is written,
so a run killed and resumed from it regenerates exactly what the uninterrupted run generated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

_log = logging.getLogger(__name__)

# How long `OverlappedExperience.close` waits for the rollout thread: a batch in flight stops
# at its next chunk (seconds), but a chunk stuck (a collective whose peer died) never returns.
CLOSE_TIMEOUT_S = 300.0


@dataclasses.dataclass
class Experience:
  """One step's batch. ``batch`` is the sample function's output (trajectories, sampling stats,
  diagnostics); ``resume_state`` the data iterator's and dynamic sampler's states right after
  it was drawn (what a checkpoint of this step saves); ``times`` seconds spent on it."""
  step: int
  version: int
  batch: Any
  resume_state: dict[str, Any]
  times: dict[str, float]


# (rollout weights, step, policy version, newest, check) -> the step's batch. ``newest``: None,
# or (with partial rollouts) a function giving (weights, version) of a newer published policy or
# None. ``check``: None, or a function the sampler calls between chunks; it raises to abandon
# the batch (a run that is stopping).
SampleFn = Callable[[Any, int, int, Any, Any], Any]


class SyncExperience:
  """Today's step: the batch is sampled by the step's own weights when the loop asks for it."""

  max_staleness = 0

  def __init__(self, sample: SampleFn, to_rollout: Callable[[Any], Any],
               resume_state: Callable[[], dict[str, Any]]):
    self._sample, self._to_rollout, self._resume_state = sample, to_rollout, resume_state

  def next(self, step: int, params: Any) -> Experience:
    t0 = time.perf_counter()
    batch = self._sample(self._to_rollout(params), step, step, None, None)
    return Experience(step, step, batch, self._resume_state(),
                      {"rollout": time.perf_counter() - t0})

  def updated(self, step: int, params: Any) -> None:
    del step, params  # the next step's batch is sampled by then

  @contextlib.contextmanager
  def exclusive(self):
    yield

  def close(self) -> None:
    pass


class _Stopped(Exception):
  """The source was closed while the rollout thread waited or sampled."""


class OverlappedExperience:
  """The rollout runs ahead of the update by up to ``max_staleness`` policy versions, in a
  thread of its own (module docstring: the schedule).

  ``partial``: a batch starts with the version the schedule names, and its samples in flight
  move on to each newer version as the trainer hands it over, keeping their KV (partial
  rollouts; every token records its version). Fresher tokens, but which tokens get which
  version depends on timing: such a run does not repeat bit for bit. ``owned``: ``params``
  belongs to a trainer whose update donates it (the rollout process's own source,
  `rollout_process`, gets weights nobody donates: False). ``to_rollout`` makes what crosses to
  the rollout (called in `updated`), ``receive`` (default: as it is) what the rollout samples
  with, from that (called by the rollout thread; a LoRA run merges its adapters there).
  ``weight_bytes`` counts what crossed.

  Several processes rolling out together (a rollout group, `rollout_process`) must move their
  samples to a newer version at the same chunk, or their decode programs would mix the shards
  of two versions. At each poll they ``agree`` on the version (default: process 0's newest
  handed-over version, broadcast to the group, `agree_on_version`); a process that has not yet
  received it waits for its hand-off, which every training process makes after the same update.
  """

  def __init__(self, sample: SampleFn, to_rollout: Callable[[Any], Any],
               resume_state: Callable[[], dict[str, Any]], *, max_staleness: int,
               start_step: int, num_steps: int, save_every: int, params: Any,
               partial: bool = False, owned: bool = True,
               receive: Callable[[Any], Any] | None = None,
               agree: Callable[[int], int] | None = None):
    if max_staleness < 1:
      raise ValueError(f"max_staleness={max_staleness}: the overlapped source needs >= 1.")
    self.max_staleness, self.partial, self._owned = max_staleness, partial, owned
    if agree is None and jax.process_count() > 1:
      agree = agree_on_version
    self._agree = agree
    # Several processes roll out together (a rollout group, `rollout_process`): a close
    # finishes the batches whose weights were handed over instead of abandoning one mid-way,
    # so every process stops after the same batch.
    self._drain = jax.process_count() > 1
    self._sample, self._to_rollout, self._resume_state = sample, to_rollout, resume_state
    self._receive = receive or (lambda moved: moved)
    self._start, self._end, self._save_every = start_step, num_steps, max(save_every, 1)
    self._cond = threading.Condition()
    self._engine = threading.Lock()  # the rollout engine: the thread's batches, or evaluation
    self._weights: dict[int, tuple[Any, float]] = {}  # version -> (weights, seconds to hand off)
    self._results: dict[int, Experience | BaseException] = {}
    self._tasks: list[tuple[int, Callable[[], None]]] = []  # (after batch, task): `run_after`
    self._done = self._started = start_step - 1  # the last batch produced / started
    self._ended = False  # no batch comes any more (the last produced, or one failed)
    self._task_s = 0.0  # seconds the thread spent on tasks (not idle)
    self._stop = False
    self.updated(start_step, params)
    self._thread = threading.Thread(target=self._produce, name="dapo-rollout", daemon=True)
    self._thread.start()

  def version(self, step: int) -> int:
    """The policy version that samples ``step``'s batch (module docstring)."""
    return scheduled_version(step, self.max_staleness, self._save_every, self._start)

  def next(self, step: int, params: Any) -> Experience:
    del params  # sampled by an earlier version, handed over by `updated`
    t0 = time.perf_counter()
    with self._cond:
      while step not in self._results:
        if not self._thread.is_alive():
          raise RuntimeError(f"The rollout thread ended before step {step}'s batch.")
        self._cond.wait(timeout=1.0)
      out = self._results.pop(step)
    if isinstance(out, BaseException):
      raise out
    out.times["trainer_idle"] = time.perf_counter() - t0
    return out

  def updated(self, step: int, params: Any) -> None:
    """Hands version ``step`` (the weights after step ``step - 1``'s update) to the rollout,
    if a batch still to come is sampled by it. The cast and the move are dispatched here and
    run while the update goes on; the rollout thread waits for them only when it starts the
    batch that needs them."""
    if not version_needed(step, self.max_staleness, self._save_every, self._start, self._end):
      return
    t0 = time.perf_counter()
    weights = self._to_rollout(params)
    if self._owned:  # the update would donate the arrays the weights share with ``params``
      weights = unshared(weights, params)
    with self._cond:
      self._weights[step] = (weights, time.perf_counter() - t0)
      self._cond.notify_all()

  @contextlib.contextmanager
  def exclusive(self):
    """The rollout engine for the caller alone (evaluation), between two of the thread's
    batches."""
    with self._engine:
      yield

  def run_after(self, batch: int | None, task: Callable[[], None]) -> None:
    """Runs ``task`` on the rollout thread once it has produced step ``batch``'s batch, before
    it starts the next one (or after its last, or once a batch fails: no later batch comes);
    None: after the batch it is on (at once when it waits). The place in the thread's work is
    then fixed by ``batch`` alone, so the processes of a rollout group run it between the same
    two batches (their collectives stay in the same order). ``batch`` must be a batch whose
    successor cannot start before the task is registered: one whose next version is not yet
    handed over (`rollout_process`'s evaluations)."""
    with self._cond:
      if batch is not None and batch < self._started:
        raise RuntimeError(f"run_after({batch}): the rollout thread has started batch "
                           f"{self._started}")
      self._tasks.append((batch, task))
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    return self._stop

  def close(self) -> None:
    """Stops the thread: a batch in flight is abandoned at the sampler's next chunk (a stopping
    run checkpoints the step it trained, never a batch ahead of it, so nothing is lost; a
    preempted run need not wait for a whole rollout)."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    self._thread.join(CLOSE_TIMEOUT_S)
    if self._thread.is_alive():  # a daemon: it ends with the process, which is stopping
      _log.warning("The rollout thread did not stop within %.0f s of the close (a chunk or an "
                   "evaluation that does not return); leaving it behind.", CLOSE_TIMEOUT_S)

  def _wait_for(self, version: int | None) -> tuple[Any, float]:
    """Version ``version``'s hand-off, once every task due before it has run (None: only the
    tasks, until the source is closed)."""
    while True:
      with self._cond:
        # Once no batch comes (one failed), a task after a batch never produced is due too:
        # every process of a rollout group fails at the same batch, so all still run it.
        due = [t for t in self._tasks if t[0] is None or t[0] <= self._done or self._ended]
        if not due:
          if version in self._weights:
            return self._weights[version]
          if self._stop:
            raise _Stopped()
          self._cond.wait()
          continue
        self._tasks = [t for t in self._tasks if t not in due]
      t0 = time.perf_counter()
      for _, task in due:  # outside the lock: a task may take a while
        task()
      self._task_s += time.perf_counter() - t0

  def _produce(self) -> None:
    for step in range(self._start, self._end):
      try:
        t0, tasks_s = time.perf_counter(), self._task_s
        v = self.version(step)
        moved, handoff_s = self._wait_for(v)
        t1 = time.perf_counter()
        idle = t1 - t0 - (self._task_s - tasks_s)
        with self._cond:
          self._started = step
        weights = jax.block_until_ready(self._receive(moved))  # the move, if still under way
        t2 = time.perf_counter()
        with self._engine:
          batch = self._sample(weights, step, v, self._newer(v) if self.partial else None,
                               self._check_stop)
          resume = self._resume_state()
        t3 = time.perf_counter()
        out: Experience | BaseException = Experience(
            step, v, batch, resume,
            {"rollout": t3 - t2, "rollout_idle": idle,
             "weight_sync": handoff_s + (t2 - t1), "weight_bytes": float(_nbytes(moved))})
      except _Stopped:
        return
      except BaseException as e:  # pylint: disable=broad-except  (raised in the trainer)
        out = e
      with self._cond:
        self._results[step] = out
        self._done = step
        keep = self.version(step + 1)
        for old in [u for u in self._weights if u < keep]:
          del self._weights[old]
        self._cond.notify_all()
      if isinstance(out, BaseException):
        break
    with self._cond:
      self._ended = True
    with contextlib.suppress(_Stopped):  # the tasks still to come (evaluations), until closed
      self._wait_for(None)

  def _check_stop(self) -> None:
    if self._stop and not self._drain:
      raise _Stopped()

  def _newer(self, version: int) -> Callable[[], tuple[Any, int] | None]:
    """For a batch started with ``version``: a function giving the newest handed-over weights
    once, when newer than those it gave last (None otherwise)."""
    current = [version]

    def newest() -> tuple[Any, int] | None:
      with self._cond:
        latest = max(self._weights, default=current[0])
      if self._agree is not None:  # a rollout group: the version every process moves to
        latest = self._agree(latest)
      if latest <= current[0]:
        return None
      with self._cond:
        while latest not in self._weights:  # handed over to another process of the group
          if self._stop:  # closed: no more hand-offs come (a stop's last one came before it)
            raise _Stopped()
          self._cond.wait(timeout=1.0)
        current[0] = latest
        moved = self._weights[latest][0]
      return self._receive(moved), latest
    return newest


def agree_on_version(version: int) -> int:
  """Process 0's ``version``, on every process of the ``jax.distributed`` job (a collective:
  every process calls it at the same point)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(multihost_utils.broadcast_one_to_all(np.int64(version)))


def scheduled_version(step: int, max_staleness: int, save_every: int, start: int) -> int:
  """The policy version that samples ``step``'s batch: max(step - k, the last checkpoint step
  <= step, the run's first step) (module docstring)."""
  synced = step // max(save_every, 1) * max(save_every, 1)
  return max(step - max_staleness, synced, start)


def version_needed(version: int, max_staleness: int, save_every: int, start: int,
                   end: int) -> bool:
  """Whether a batch still to come (steps ``version`` .. ``end`` - 1) is sampled by
  ``version``."""
  return any(scheduled_version(t, max_staleness, save_every, start) == version
             for t in range(version, min(version + max_staleness + 1, end)))


def last_batch_sampled_by(version: int, max_staleness: int, save_every: int, start: int,
                          end: int) -> int:
  """The last step (< ``end``) whose batch is sampled by ``version`` or an older one: the batch
  after it waits for a newer version."""
  t = min(version, end - 1)
  while t + 1 < end and scheduled_version(t + 1, max_staleness, save_every, start) <= version:
    t += 1
  return t


def unshared(weights: Any, params: Any) -> Any:
  """``weights`` with a copy of every array it shares with ``params`` (one device in the
  model's dtype: the rollout's weights are the trained arrays, which the update donates)."""
  own = {id(x) for x in jax.tree.leaves(params)}
  return jax.tree.map(lambda x: jnp.copy(x) if id(x) in own else x, weights)


def _nbytes(tree: Any) -> int:
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def open_source(max_staleness: int, sample: SampleFn, to_rollout: Callable[[Any], Any],
                resume_state: Callable[[], dict[str, Any]], *, start_step: int, num_steps: int,
                save_every: int, params: Any, partial: bool = False):
  """The run's experience source: `SyncExperience` at ``max_staleness`` 0, else
  `OverlappedExperience`. ``to_rollout``: the run's `rollout.weights.RolloutWeights` (or a
  function of the params); an overlapped source calls its ``send`` half when the weights are
  handed over and its ``receive`` half when the rollout takes them."""
  if not max_staleness:
    return SyncExperience(sample, to_rollout, resume_state)
  if jax.process_count() > 1:
    raise NotImplementedError(
        "algorithm.max_staleness >= 1 with the rollout in the training processes runs in one "
        "process: the rollout thread's cross-process gathers would interleave with the "
        "trainer's. On several processes, give the rollout processes of their own "
        "(dapo-train --role, docs/overlap.md).")
  return OverlappedExperience(sample, getattr(to_rollout, "send", to_rollout), resume_state,
                              max_staleness=max_staleness, start_step=start_step,
                              num_steps=num_steps, save_every=save_every, params=params,
                              partial=partial, receive=getattr(to_rollout, "receive", None))
