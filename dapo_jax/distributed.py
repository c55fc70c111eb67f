"""Multi-host start-up: ``jax.distributed.initialize`` when launched on several processes."""

from __future__ import annotations

import logging
import os

import jax

_log = logging.getLogger(__name__)
_ENV_HINTS = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES",
              "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE")


def maybe_initialize() -> bool:
  """Initialises the distributed runtime when the environment names several processes.

  Cloud TPU pod slices, SLURM and Open MPI launches are detected by JAX itself; a plain
  multi-node launch sets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
  """
  if not any(os.environ.get(k) for k in _ENV_HINTS):
    return False
  if os.environ.get("JAX_COORDINATOR_ADDRESS") and os.environ.get("JAX_NUM_PROCESSES"):
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ.get("JAX_PROCESS_ID", "0")))
  else:
    jax.distributed.initialize()
  _log.info("jax.distributed: process %d of %d, %d local / %d global devices",
            jax.process_index(), jax.process_count(), jax.local_device_count(),
            jax.device_count())
  return True
