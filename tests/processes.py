"""Helpers for tests that start several local processes (jax.distributed on localhost)."""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Sequence

import pytest


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(root: str, local_devices: int, env_extra: dict[str, str]) -> dict[str, str]:
  """A child's environment: CPU JAX with ``local_devices`` devices, this checkout first on the
  path, and the jax.distributed variables only where ``env_extra`` sets them."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}", **env_extra}
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    if k not in env_extra:
      env.pop(k, None)
  return env


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float, what: str) -> list[str]:
  """Each process's output once all have exited with 0; a hang kills them all and fails the test
  (a collective waiting for a peer that died never returns on its own)."""
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail(f"{what} hung (is a collective waiting for a peer?)")
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"{what} {i} exited with {p.returncode}:\n{(out or '')[-4000:]}"
  return outs
