"""Helpers for tests that start several local processes (jax.distributed on localhost)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import threading
import time
from typing import Sequence

import pytest


def _ephemeral_ports() -> tuple[int, int]:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = (int(x) for x in f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now, below the ephemeral range.

  A port the kernel hands out for ``bind(0)`` is ephemeral: between this call and the server's
  bind, any outgoing connection on the host may take it as its source port (a peer's own connect
  retries to this very port included: TCP self-connect), and the server then fails with "address
  in use". Ports below the ephemeral range are only ever taken by an explicit bind.
  """
  low = _ephemeral_ports()[0]
  if low > 12000:
    for _ in range(100):
      port = random.randrange(10000, low)
      if _bindable(port):
        return port
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def free_port_pair() -> int:
  """A port P such that P and P + 1 are both free now (`free_port`'s range)."""
  for _ in range(100):
    port = free_port()
    if _bindable(port + 1):
      return port
  raise RuntimeError("no two consecutive free ports found")


def process_env(root: str, local_devices: int, env_extra: dict[str, str]) -> dict[str, str]:
  """A child's environment: CPU JAX with ``local_devices`` devices, this checkout first on the
  path, and the jax.distributed variables only where ``env_extra`` sets them."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1",
         "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}", **env_extra}
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    if k not in env_extra:
      env.pop(k, None)
  return env


def _tree_state(paths: Sequence[str]) -> tuple:
  """What changes while a run makes progress: every file's path, size and mtime under paths."""
  state = []
  for root in paths:
    for dirpath, _, files in os.walk(root):
      for name in files:
        try:
          st = os.stat(os.path.join(dirpath, name))
        except OSError:  # removed while walking (a temporary file renamed into place)
          continue
        state.append((dirpath, name, st.st_size, st.st_mtime_ns))
  return tuple(sorted(state))


def wait_all(procs: Sequence[subprocess.Popen], stall_s: float, what: str,
             watch: Sequence[str] = ()) -> list[str]:
  """Each process's output once all have exited with 0. Waits for events, not for a time:

  * the first process to exit non-zero fails the test at once, with its output, the others
    killed (its peers would otherwise wait in a collective for it until their own timeouts);
  * a hang is no sign of progress from any of them for ``stall_s``: no line of output and no
    file written under ``watch`` (a run's workdir: its compilation cache grows during the long
    compiles that print nothing). A loaded host makes each step slower, never silent.
  """
  outs: list[list[str]] = [[] for _ in procs]
  last = [time.monotonic()]

  def read(i: int, p: subprocess.Popen) -> None:
    for line in p.stdout:
      outs[i].append(line)
      last[0] = time.monotonic()

  readers = [threading.Thread(target=read, args=(i, p), daemon=True)
             for i, p in enumerate(procs) if p.stdout is not None]
  for t in readers:
    t.start()

  def text(i: int) -> str:
    return "".join(outs[i])

  def stop(reason: str, tracebacks: bool = False) -> None:
    if tracebacks:  # SIGABRT: faulthandler (PYTHONFAULTHANDLER=1) prints every thread's stack
      for q in procs:
        if q.poll() is None:
          q.send_signal(signal.SIGABRT)
      deadline = time.monotonic() + 15
      while time.monotonic() < deadline and any(q.poll() is None for q in procs):
        time.sleep(0.2)
    for q in procs:
      if q.poll() is None:
        q.kill()
    for q in procs:
      q.wait()
    for t in readers:
      t.join(timeout=10)
    pytest.fail(reason + "".join(f"\n--- {what} {i} (rc {q.returncode}):\n{text(i)[-3000:]}"
                                 for i, q in enumerate(procs)))

  state = _tree_state(watch)
  while True:
    codes = [p.poll() for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      stop(f"{what} {failed[0]} exited with {codes[failed[0]]}; the others were stopped.")
    if all(c == 0 for c in codes):
      break
    now_state = _tree_state(watch)
    if now_state != state:
      state, last[0] = now_state, time.monotonic()
    if time.monotonic() - last[0] > stall_s:
      stop(f"{what} hung: no output and no file written for {stall_s:.0f} s (is a collective "
           "waiting for a peer?); where each was is below.", tracebacks=True)
    time.sleep(1.0)
  for t in readers:
    t.join()
  return [text(i) for i in range(len(procs))]
