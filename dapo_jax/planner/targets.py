"""Where a plan is for: ``tpu:v5p:4x4x4``, ``gpu:h100:16x8`` or ``cpu:8``, with the compile-only
TPU devices libtpu describes on any host and the environment it needs there (GPU devices:
`gpu_targets`, the CUDA plugin's)."""

from __future__ import annotations

import dataclasses
import glob
import math
import os

import jax

from dapo_jax.planner import gpu_targets
from dapo_jax.planner import plan_estimates as est

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Target:
  """Where the config would run: ``tpu:v5p:4x4x4``, ``gpu:h100:16x8`` or ``cpu:8``."""
  kind: str
  name: str
  num_devices: int
  hbm_bytes: int | None  # None: unknown (CPU)
  devices: tuple | None  # compile-capable devices; None: analytic only
  why_analytic: str | None = None  # what the compiled plan needs here (analytic targets)

  @property
  def analytic(self) -> bool:
    return self.devices is None

  @property
  def chip(self) -> est.Chip | None:
    """The chip's datasheet peaks (None: unknown, e.g. a CPU)."""
    return est.CHIPS.get(self.name.split(":")[0].lower()) if self.kind != "cpu" else None


def parse_target(spec: str) -> Target:
  kind, _, rest = spec.partition(":")
  if kind == "tpu":
    gen = rest.split(":")[0].lower()
    if gen not in est.TPU_HBM_GIB:
      raise ValueError(f"Unknown TPU generation {gen!r} in {spec!r}; known: "
                       f"{sorted(est.TPU_HBM_GIB)} (e.g. tpu:v5p:4x4x4).")
    devices = tpu_devices(rest)
    return Target("tpu", rest, len(devices), int(est.TPU_HBM_GIB[gen] * GiB), tuple(devices))
  if kind == "gpu":
    gen, _, shape = rest.partition(":")
    gen = gen.lower()
    if gen not in est.GPU_HBM_GB or not shape:
      raise ValueError(f"Use gpu:<{'|'.join(est.GPU_HBM_GB)}>:<nodes>x<gpus per node>, got "
                       f"{spec!r}.")
    dims = [int(s) for s in shape.split("x")]
    n = math.prod(dims)
    why = gpu_targets.cuda_plugin_missing()
    if why is None and gen not in gpu_targets.GPUS:
      why = (f"no device description for {gen!r} (compiled GPU targets: "
             f"{', '.join(gpu_targets.GPUS)})")
    if why is None and len(dims) != 2:
      why = f"write the shape as <nodes>x<gpus per node>, got {shape!r}"
    if why is not None:
      usable = est.GPU_HBM_GB[gen] * 1e9 * est.GPU_MEM_FRACTION
      return Target("gpu", rest, n, int(usable), None, why)
    # The share of each GPU's memory XLA's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION).
    usable = gpu_targets.GPUS[gen].memory_bytes * est.GPU_MEM_FRACTION
    return Target("gpu", rest, n, int(usable), tuple(gpu_targets.cuda_devices(gen, *dims)))
  if kind == "cpu":
    n = int(rest or jax.device_count("cpu"))
    cpus = jax.devices("cpu")
    if len(cpus) < n:
      raise ValueError(f"Target {spec!r} needs {n} CPU devices, this process has {len(cpus)}: "
                       f"set XLA_FLAGS=--xla_force_host_platform_device_count={n}.")
    return Target("cpu", str(n), n, None, tuple(cpus[:n]))
  raise ValueError(f"Target {spec!r}: use tpu:<gen>:<topology>, gpu:<gpu>:<NxM> or cpu:<n>.")


def tpu_devices(topology: str) -> list:
  """Compile-only devices of a TPU topology (``v5p:4x4x4``), from libtpu on any host."""
  # Compile-only use opens no chip: let it run next to another libtpu user (a training job,
  # a second plan) instead of failing on libtpu's one-process lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    dims = [int(x) for x in topology.partition(":")[2].split("x") if x.isdigit()]
    # A slice smaller than libtpu's default 2x2x1 host (v5e-1, a notebook's chip) is one host.
    host = ({"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}
            if dims and math.prod(dims) < 4 else {})
    return list(topologies.get_topology_desc(topology, "tpu", **host).devices)
  except Exception as err:  # pylint: disable=broad-except
    raise RuntimeError(
        f"Cannot describe TPU topology {topology!r} ({err}). TPU planning compiles with libtpu: "
        "pip install 'jax[tpu]' (any host, no TPU needed) or use a gpu:/cpu: target.") from err


# What libtpu reads at start-up on a TPU VM; on a host without TPU chips it logs errors for each
# one it misses (and queries the GCE metadata server). AOT compiles only need them present.
_TPU_NAMES = {"v4": "v4-{cores}", "v5p": "v5p-{cores}", "v5e": "v5litepod-{chips}",
              "v5litepod": "v5litepod-{chips}", "v6e": "v6e-{chips}"}


def libtpu_compile_env(target: str) -> dict[str, str]:
  """The libtpu environment of a compile-only client for ``target`` (``tpu:v5p:2x2x1``)."""
  kind, _, rest = target.partition(":")
  if kind != "tpu":
    return {}
  gen, _, topo = rest.partition(":")
  try:
    chips = math.prod(int(s) for s in topo.split("x"))
  except ValueError:
    chips = 1
  name = _TPU_NAMES.get(gen.lower(), gen.lower() + "-{cores}").format(chips=chips,
                                                                      cores=2 * chips)
  return {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": name,
          "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}


def _has_local_tpu() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def prepare_libtpu_env(target: str, environ=None) -> dict[str, str]:
  """Sets ``libtpu_compile_env`` before libtpu loads, on hosts without TPU chips only and never
  over a value the user set; returns what it set."""
  environ = os.environ if environ is None else environ
  if _has_local_tpu():
    return {}
  added = {k: v for k, v in libtpu_compile_env(target).items() if k not in environ}
  environ.update(added)
  return added
