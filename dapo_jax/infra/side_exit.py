"""Sides of several processes end together (``dapo-train --role`` with each side a
``jax.distributed`` job of its own, infra/peer_link.py): a bounded exit once a side breaks.

When process i of one side goes (killed, crashed, its host down), process i of the other side
learns it on their link, but the other processes of that side do not: they wait in their next
collective for a process that will never join it, until the job is torn down. So a process
whose link is gone says so to its own side (a key in its ``jax.distributed`` job's key-value
store), and every process that learns it, on its link or from that key (or finds its side's
coordinator gone), exits within `exit_after_s` seconds: by its own path when it can (the one
line of `rollout_process.SideGoneError`), else here, with one line and exit code 2, whatever
it waits in. A link closed on purpose (the run's end) arms nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable

import jax

GONE_KEY = "dapo_side_gone"  # in each side's key-value store: which link broke, and why
EXIT_ENV = "DAPO_SIDE_EXIT_S"
EXIT_S = 60.0  # default bound (seconds from learning it to the exit)
POLL_S = 1.0  # how often a process reads its side's key


def exit_after_s() -> float:
  """The bound: ``DAPO_SIDE_EXIT_S`` when set (a number of seconds > 0), else `EXIT_S`."""
  raw = os.environ.get(EXIT_ENV, "")
  if not raw:
    return EXIT_S
  try:
    value = float(raw)
  except ValueError:
    value = -1.0
  if not value > 0:
    raise ValueError(f"{EXIT_ENV}={raw!r}: give the seconds (> 0) a process of a side of several "
                     "waits, once its side has broken, before it exits")
  return value


class SideWatch:
  """One process's watch (a daemon thread) over its link and its side's key-value store."""

  def __init__(self, side: str, exit_s: float | None = None, client=None,
               exit_fn: Callable[[int], None] = os._exit):  # pylint: disable=protected-access
    self.side, self.exit_s = side, exit_after_s() if exit_s is None else exit_s
    self._client = client if client is not None else _kv_client()
    self._exit = exit_fn
    self.reason: str | None = None  # why this process is to exit
    self._armed = threading.Event()
    self._finished = threading.Event()  # the link closed on purpose: nothing to watch
    self._exiting = False  # the interpreter is exiting: the process's own line came before
    atexit.register(self._at_exit)
    threading.Thread(target=self._run, name="dapo-side-watch", daemon=True).start()

  def link_gone(self, why: str) -> None:
    """This process's link broke (`peer_link.Link`): tell the side, and exit within the bound."""
    if self._finished.is_set() or self._armed.is_set():
      return
    here = f"process {jax.process_index()} of the {self.side} side: {why}"
    try:
      self._client.key_value_set(GONE_KEY, here)
    except Exception:  # pylint: disable=broad-except  (a key already set, or the store gone)
      pass
    self._arm(why)

  def finished(self) -> None:
    """The link was closed on purpose (the run's end): a broken link after it arms nothing."""
    self._finished.set()

  def _arm(self, why: str) -> None:
    if not self._armed.is_set():
      self.reason = why
      self._armed.set()

  def _at_exit(self) -> None:
    self._exiting = True

  def _run(self) -> None:
    while not self._armed.wait(POLL_S):
      if self._finished.is_set():
        return
      try:
        said = self._client.key_value_try_get(GONE_KEY)
      except Exception as e:  # pylint: disable=broad-except  (NOT_FOUND, or the store gone)
        if "not found" in str(e).lower() or "NOT_FOUND" in str(e):
          continue
        said = "the coordinator of this side's jax.distributed job has gone"
      if not self._finished.is_set():
        self._arm(f"{said}" if said.startswith("the coordinator") else
                  f"the link of {said}")
    deadline = time.monotonic() + self.exit_s
    while time.monotonic() < deadline:
      time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
    if not self._exiting:  # (exiting: this process has said its line; its shutdown waits)
      print(f"dapo-train: error: {_one_line(self.reason)}; process {jax.process_index()} of "
            f"the {self.side} side still waited {self.exit_s:.0f} s later (in a collective "
            f"with a process that has gone) and exits ({EXIT_ENV} sets the wait).",
            file=sys.stderr, flush=True)
    sys.stdout.flush()
    self._exit(2)


def _one_line(text: str | None) -> str:
  return " ".join(str(text).split())


def _kv_client():
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  return jax_distributed.global_state.client
