"""Multi-host: ``jax.distributed.initialize`` at start-up, and host <-> global array moves.

In multi-controller SPMD every process runs this same program. The trainer's host-side state
(prompts, scored groups, the dynamic-sampling decision) must be the same on every process, so
what one process computes for its share is gathered to all of them; the arrays a compiled step
reads are global ``jax.Array``s that each process fills with the rows its own devices hold. On a
single process each helper is the plain single-host operation (``device_put``/``device_get``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from dapo_jax.infra import sharding as shd

_log = logging.getLogger(__name__)

# How long the coordinator waits, after the shutdown barrier, before it stops its service.
SERVICE_SHUTDOWN_GRACE_S = 1.0


def _detected_cluster() -> Any:
  """The cluster environment ``jax.distributed.initialize()`` would pick, or None.

  JAX's own detection (``jax._src.clusters``, in its order, opt-in methods such as mpi4py
  skipped): a GCE TPU VM answers through the metadata server (``agent-worker-number``,
  ``worker-network-endpoints``), GKE TPU pods set TPU_WORKER_HOSTNAMES, SLURM its SLURM_*
  variables, Open MPI its ORTE URI. A plain TPU VM sets no variable at all, so no list of
  environment hints can replace asking JAX.
  """
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  for env in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
    if not env.opt_in_only_method and env.is_env_present():
      return env
  return None


def maybe_initialize() -> bool:
  """Initialises the distributed runtime when the environment names several processes.

  An explicit launch sets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID
  (launch/multinode_gpu.sh); otherwise JAX's cluster detection decides (Cloud TPU VM pod
  slices, GKE, SLURM, Open MPI). One process (a single-host slice, ``srun -n1``, a laptop) stays
  a no-op. JAX_LOCAL_DEVICE_IDS (comma-separated) limits the devices a process owns. CPU
  processes talk through gloo collectives.
  """
  explicit = bool(os.environ.get("JAX_COORDINATOR_ADDRESS") and
                  os.environ.get("JAX_NUM_PROCESSES"))
  if explicit:
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    source = "JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES"
  else:
    env = _detected_cluster()
    if env is None:
      return False
    num_processes = env.get_process_count()
    source = env.__name__
  if num_processes <= 1:
    _log.info("%s names one process: jax.distributed not started.", source)
    return False
  if "cpu" in os.environ.get("JAX_PLATFORMS", ""):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Under SLURM / Open MPI, JAX gives each process the one GPU of its local rank unless told
  # otherwise; one process per node owning all its GPUs sets JAX_LOCAL_DEVICE_IDS=0,...,7.
  ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
  local_device_ids = [int(i) for i in ids.split(",")] if ids else None
  if explicit:
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=num_processes,
        process_id=int(os.environ.get("JAX_PROCESS_ID", "0")),
        local_device_ids=local_device_ids)
  else:
    jax.distributed.initialize(local_device_ids=local_device_ids,
                               cluster_detection_method=env.name)
  _stop_service_after_peers()
  _log.info("jax.distributed (%s): process %d of %d, %d local / %d global devices", source,
            jax.process_index(), jax.process_count(), jax.local_device_count(),
            jax.device_count())
  return True


class _LateStoppingService:
  """The coordinator's service, stopped ``grace_s`` after the shutdown barrier.

  At exit JAX passes the shutdown barrier and stops the coordinator's gRPC service at once,
  while each peer, released by the same barrier, is still tearing its agent down (stopping the
  heartbeat, cancelling the error poll). A peer RPC that reaches the service while it is being
  destroyed aborts the coordinator (``server.cc: Check failed: queue.Pop() == nullptr``, SIGABRT)
  after a run that succeeded, seen once in CI on a 2-process CPU run. Waiting a moment first lets
  those RPCs land; it costs the coordinator ``grace_s`` at exit and nothing else.
  """

  def __init__(self, service: Any, grace_s: float):
    self._service = service
    self.grace_s = grace_s

  def shutdown(self) -> None:
    time.sleep(self.grace_s)
    self._service.shutdown()

  def __getattr__(self, name: str) -> Any:
    return getattr(self._service, name)


def _stop_service_after_peers(grace_s: float = SERVICE_SHUTDOWN_GRACE_S) -> None:
  """On the coordinator, makes JAX's own exit-time shutdown stop the service last."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  state = jax_distributed.global_state
  if state.service is not None and not isinstance(state.service, _LateStoppingService):
    state.service = _LateStoppingService(state.service, grace_s)


def is_multiprocess() -> bool:
  return jax.process_count() > 1


# --- host data -> global arrays ----------------------------------------------------------------


def process_rows(sharding: Sharding, global_shape: Sequence[int]) -> np.ndarray:
  """Indices (along axis 0) of the rows this process's devices hold, in the order
  ``jax.make_array_from_process_local_data`` expects its local data."""
  shards = sharding.addressable_devices_indices_map(tuple(global_shape))
  starts = sorted({(idx[0].start or 0) for idx in shards.values()})
  first = next(iter(shards.values()))[0]
  size = (first.stop if first.stop is not None else global_shape[0]) - (first.start or 0)
  return np.concatenate([np.arange(s, s + size) for s in starts])


def host_to_global(x: np.ndarray, sharding: Sharding | None) -> jax.Array:
  """A batch-major host array, identical on every process, as a global array.

  Each process uploads only the rows its devices hold (``make_array_from_process_local_data``),
  so nothing crosses hosts and, unlike ``jax.device_put`` of a host value onto devices of
  several processes, no all-process equality check runs.
  """
  x = np.asarray(x)
  if sharding is None:
    return jax.device_put(x)
  if not is_multiprocess():
    return jax.device_put(x, sharding)
  rows = process_rows(sharding, x.shape)
  local = x if len(rows) == x.shape[0] else x[rows]
  return jax.make_array_from_process_local_data(sharding, local, x.shape)


def global_to_host(tree: Any) -> Any:
  """Every leaf as a full host array on every process (``jax.device_get`` on one process)."""
  if not is_multiprocess():
    return jax.device_get(tree)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))

  return jax.tree.map(one, tree)


def rows_on_device(x: np.ndarray, mesh: Mesh | None,
                   rules: shd.Rules = shd.TRAIN_RULES) -> jax.Array:
  """A batch-major host array (the same on every process) as the compiled step's input: rows
  over the data axes; on several processes a global array each process fills with its rows."""
  sharding = None if mesh is None else shd.batch_sharding(mesh, rules, x.ndim, x.shape[0])
  return host_to_global(x, sharding)


def global_rollout(rollout: Callable[..., Any], mesh: Mesh | None,
                   rules: shd.Rules = shd.SAMPLE_RULES) -> Callable[..., Any]:
  """A rollout callable ``(state, ids, mask, key, params, n)`` fed with host prompts that are
  the same on every process: returns the same host ``RolloutBatch`` on every process.

  Single process: ``rollout`` itself (the sampler places host prompts, the caller fetches).
  """
  if not is_multiprocess():
    return rollout
  if mesh is None:
    raise ValueError("Several processes need a device mesh (config.mesh).")

  def run(state, prompt_ids, prompt_mask, key, params, num_samples):
    sharding = shd.prompt_sharding(mesh, rules, prompt_ids.shape[0], num_samples)
    out = rollout(state, host_to_global(prompt_ids, sharding),
                  host_to_global(prompt_mask, sharding), key, params, num_samples)
    return global_to_host(out)

  return run


# --- host values gathered from every process -----------------------------------------------------


def allgather_rows(x: np.ndarray) -> np.ndarray:
  """Concatenates each process's rows, in process order; shapes may differ along axis 0."""
  x = np.asarray(x)
  if not is_multiprocess():
    return x
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  counts = multihost_utils.process_allgather(np.asarray([x.shape[0]], np.int64), tiled=True)
  pad = int(counts.max()) - x.shape[0]
  padded = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
  stacked = multihost_utils.process_allgather(padded, tiled=False)
  return np.concatenate([stacked[p, :int(n)] for p, n in enumerate(counts)])


def allgather_json(values: list[Any]) -> list[Any]:
  """Concatenates each process's list of JSON-serialisable values, in process order."""
  if not is_multiprocess():
    return list(values)
  blob = np.frombuffer(json.dumps(values).encode(), np.uint8)
  out: list[Any] = []
  sizes = allgather_rows(np.asarray([blob.size], np.int64))
  data = allgather_rows(blob)
  for start, n in zip(np.cumsum(sizes) - sizes, sizes):
    out.extend(json.loads(data[start:start + n].tobytes().decode()))
  return out


def share(num_rows: int) -> slice:
  """This process's contiguous share of ``num_rows`` host rows (e.g. responses to verify)."""
  bounds = np.linspace(0, num_rows, jax.process_count() + 1).round().astype(int)
  p = jax.process_index()
  return slice(int(bounds[p]), int(bounds[p + 1]))


def assert_same_on_all_processes(values: np.ndarray, what: str) -> None:
  """Raises if a host value differs between processes (the SPMD program would diverge)."""
  if not is_multiprocess():
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  multihost_utils.assert_equal(np.asarray(values),
                               f"{what} differs between processes; every process must "
                               "take the same host-side decision.")


def split_devices(rollout_devices: int) -> tuple[list | None, list | None]:
  """(training devices, rollout devices) for ``rollout_devices`` (``config.rollout_devices``):
  the last N devices roll out and the others train; (None, None) when N is 0 (every device
  does both)."""
  if not rollout_devices:
    return None, None
  devices = jax.devices()
  if rollout_devices >= len(devices):
    raise ValueError(f"rollout_devices={rollout_devices} leaves none of the {len(devices)} "
                     "devices to train on.")
  return devices[:-rollout_devices], devices[-rollout_devices:]
