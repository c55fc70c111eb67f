"""Compile-only CUDA devices for ``gpu:<h100|h200|a100>:<nodes>x<gpus>`` on any host.

With the CUDA plugin installed (``pip install -e '.[cuda]'``) XLA compiles GPU programs with no
GPU present: ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=
<GpuTargetConfig text proto>, topology="1x<nodes>x<gpus>")`` describes the nodes (one process
per node, as `launch/slurm_gpu.sbatch` runs them), and ``jax.jit(...).lower(...).compile()`` on
its devices gives the compiled program, its memory and cost analyses, as libtpu does for TPU
targets. The plugin's driver check (``cuInit``) raises on a host without a GPU unless
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set before the plugin initialises: `prepare_cuda_env`
sets it (and the XLA flags below), as `targets.prepare_libtpu_env` sets libtpu's variables.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os

# The XLA flags the plan compiles with and the launchers set (launch/slurm_gpu.sbatch,
# launch/multinode_gpu.sh): the latency hiding scheduler overlaps collectives with compute
# (NVIDIA's JAX-Toolbox sets it in its images).
XLA_GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
# The memory fraction the plan checks against (`plan_estimates.GPU_MEM_FRACTION`). NCCL: its
# defaults, no NCCL_* variable (the plan counts no communication time).
GPU_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}


@dataclasses.dataclass(frozen=True)
class GpuModel:
  """One GPU's device description (datasheet values; what `cudaGetDeviceProperties` reports)."""
  name: str  # device_description_str
  sm_count: int
  compute_capability: tuple[int, int]
  memory_bytes: int  # total device memory (nvidia-smi's MiB x 2**20)
  bandwidth_bytes_per_s: float
  l2_bytes: int
  clock_ghz: float
  fp32_per_sm: int
  smem_per_sm: int
  smem_per_block_optin: int


# NVIDIA datasheets and the CUDA C++ programming guide's compute-capability tables (SXM parts).
GPUS = {
    "h100": GpuModel("NVIDIA H100 80GB HBM3", 132, (9, 0), 81559 * 2**20, 3350e9, 50 * 2**20,
                     1.98, 128, 228 * 1024, 227 * 1024),
    "h200": GpuModel("NVIDIA H200", 132, (9, 0), 143771 * 2**20, 4800e9, 50 * 2**20, 1.98, 128,
                     228 * 1024, 227 * 1024),
    "a100": GpuModel("NVIDIA A100-SXM4-80GB", 108, (8, 0), 81920 * 2**20, 2039e9, 40 * 2**20,
                     1.41, 64, 164 * 1024, 163 * 1024),
}


def cudnn_version() -> tuple[int, int]:
  """The installed cuDNN wheel's (major, minor): the cuDNN the compiled program would call."""
  try:
    major, minor = importlib.metadata.version("nvidia-cudnn-cu12").split(".")[:2]
    return int(major), int(minor)
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return 9, 8


def target_config(gpu: str) -> str:
  """The ``GpuTargetConfig`` text proto of one ``gpu`` (a key of `GPUS`)."""
  g = GPUS[gpu]
  cudnn = cudnn_version()
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g.smem_per_sm}
  threads_per_core_limit: 2048
  core_count: {g.sm_count}
  fpus_per_core: {g.fp32_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g.bandwidth_bytes_per_s)}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {g.memory_bytes}
  shared_memory_per_block_optin: {g.smem_per_block_optin}
  cuda_compute_capability {{ major: {g.compute_capability[0]} minor: {g.compute_capability[1]} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}
device_description_str: "{g.name}"
"""


def cuda_plugin_missing() -> str | None:
  """Why GPU targets cannot be compiled here (None: the CUDA plugin is installed)."""
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    return ("the CUDA plugin is not installed; for compiled GPU rows: pip install -e '.[cuda]' "
            "(jax[cuda12], about 5.5 GB; no GPU needed), see docs/planning.md")
  return None


def _has_local_gpu() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def prepare_cuda_env(target: str, environ=None) -> dict[str, str]:
  """For a ``gpu:`` target: the variables the compile needs, set before JAX initialises its
  backends and never over a value the user set; returns what it set. On a host without a GPU:
  skip the plugin's driver check. Everywhere: `XLA_GPU_FLAGS` appended to XLA_FLAGS."""
  environ = os.environ if environ is None else environ
  if not target.startswith("gpu:") or cuda_plugin_missing():
    return {}
  added = {}
  if not _has_local_gpu() and "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in environ:
    added["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  flags = environ.get("XLA_FLAGS", "")
  missing = [f for f in XLA_GPU_FLAGS if f.split("=")[0] not in flags]
  if missing:
    added["XLA_FLAGS"] = " ".join(([flags] if flags else []) + missing)
  environ.update(added)
  return added


def cuda_devices(gpu: str, nodes: int, gpus_per_node: int) -> list:
  """Compile-only devices of ``nodes`` x ``gpus_per_node`` GPUs of model ``gpu``."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(gpu),
                                        topology=f"1x{nodes}x{gpus_per_node}")
  except Exception as err:  # pylint: disable=broad-except
    raise RuntimeError(
        f"Cannot describe {nodes}x{gpus_per_node} {gpu} GPUs with the CUDA plugin ({err}). "
        "Set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before JAX starts on a host without a GPU "
        "(dapo-plan does).") from err
  return list(topo.devices)
