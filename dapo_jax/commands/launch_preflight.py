r"""Checks a launch on the launching machine, before anything is created (or billed).

  python -m dapo_jax.commands.launch_preflight --type v5p-128 --tree . \
      --config configs/dapo_qwen2_5_32b.py --workdir gs://BUCKET/run [-- --config.x=y ...]

``launch/tpu_vm.sh`` runs it before its first ``gcloud`` call (also with ``--dry-run``); the GPU
launchers run it in their dry runs. In order, cheapest first:

* ``--type``: a known Cloud TPU accelerator type; it gives the slice's hosts and JAX devices;
* ``--config``: the file exists and, with ``--tree``, lies inside the tree copied to the workers;
* ``--workdir``: gs:// on a slice of more than one host (each host has its own disk, and a
  preempted slice loses its disks);
* the config loads with the overrides (``dapo_jax.spec.cli.parse``, as every command) and passes
  ``dapo_jax.config.validate`` for the slice's device count (or ``--num-devices``);
* ``--plan-target gpu:h100:16x8``: the config's compiled plan (``dapo-plan --noestimate``, the
  CUDA plugin's compile-only devices: no GPU needed) fits that many GPUs' memory. The GPU
  launchers run it for the job's node count before any node trains.

Each failure is one line on stderr naming the fix.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple, Sequence

PROG = "launch preflight"


class TpuGeneration(NamedTuple):
  counts: str  # what the N of "gen-N" counts
  n_per_device: int  # N per JAX device: 2 TensorCores per chip are one device from v4 on
  n_per_host: int  # N per host of a multi-host slice
  single_host_max: int  # the largest N that is one host


# cloud.google.com/tpu/docs/system-architecture-tpu-vm and the per-generation pages.
TPU_GENERATIONS = {
    "v2": TpuGeneration("TensorCores", 1, 8, 8),
    "v3": TpuGeneration("TensorCores", 1, 8, 8),
    "v4": TpuGeneration("TensorCores", 2, 8, 8),
    "v5p": TpuGeneration("TensorCores", 2, 8, 8),
    "v5litepod": TpuGeneration("chips", 1, 4, 8),
    "v5e": TpuGeneration("chips", 1, 4, 8),
    "v6e": TpuGeneration("chips", 1, 4, 8),
}
EXAMPLES = "v4-8, v5p-128, v5litepod-16, v6e-8"


class TpuSlice(NamedTuple):
  hosts: int
  devices: int


class PreflightError(ValueError):
  """A launch mistake (one line, as ``cli.exit_on_error`` prints a ValueError)."""


def tpu_slice(accelerator_type: str) -> TpuSlice:
  """Hosts and JAX devices of ``v5p-128``-style accelerator types."""
  gen_name, _, n_text = accelerator_type.rpartition("-")
  gen = TPU_GENERATIONS.get(gen_name)
  if gen is None or not n_text.isdigit() or int(n_text) < 1:
    raise PreflightError(
        f"--type {accelerator_type}: unknown accelerator type; known generations: "
        f"{', '.join(TPU_GENERATIONS)} (e.g. {EXAMPLES}). For another one pass --version and "
        "--skip-preflight.")
  n = int(n_text)
  if n > gen.single_host_max and n % gen.n_per_host or n % gen.n_per_device:
    raise PreflightError(f"--type {accelerator_type}: {gen_name}-N counts {gen.counts}; N is "
                         f"a multiple of {gen.n_per_host} (e.g. {EXAMPLES}).")
  hosts = 1 if n <= gen.single_host_max else n // gen.n_per_host
  return TpuSlice(hosts=hosts, devices=n // gen.n_per_device)


# launch/tpu_vm.sh leaves these out of the tarball it copies to the workers.
_NOT_COPIED = (".git", ".venv", "workdirs", "__pycache__")


def check_config_file(config_arg: str, tree: str | None) -> None:
  """``path[:variant]`` names a file, inside ``tree`` (and copied with it) when given."""
  path = config_arg.partition(":")[0]
  if not os.path.isfile(path):
    raise PreflightError(f"--config {path}: no such file (relative paths start at "
                         f"{os.getcwd()}).")
  if tree is None:
    return
  tree, real = os.path.realpath(tree), os.path.realpath(path)
  rel = os.path.relpath(real, tree)
  parts = rel.split(os.sep)
  if rel.startswith(os.pardir + os.sep):
    raise PreflightError(f"--config {path}: outside {tree}, the tree copied to the workers; "
                         "put the config file inside it (e.g. in configs/).")
  if any(p in _NOT_COPIED or p.endswith(".egg-info") for p in parts[:-1]):
    raise PreflightError(f"--config {path}: inside {os.sep.join(parts[:-1])}, which is not "
                         "copied to the workers; put the config file in configs/.")


def check_workdir(workdir: str, accelerator_type: str, hosts: int) -> None:
  if hosts > 1 and not workdir.startswith("gs://"):
    raise PreflightError(
        f"--workdir {workdir}: a {accelerator_type} slice has {hosts} hosts, each with its own "
        "disk (lost with a preempted slice); use a bucket, e.g. --workdir gs://BUCKET/run.")


def check_config(config_arg: str, overrides: Sequence[str], num_devices: int | None) -> None:
  """The config loads with the overrides as dapo-train would load it, and validates."""
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  from dapo_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  fv = cli.parse("dapo-train", __doc__, ["--config", config_arg, *overrides])
  config_lib.validate(fv.config, num_devices=num_devices)


def check_plan(config_arg: str, overrides: Sequence[str], target: str) -> str:
  """The compiled plan of the config on ``target`` fits its memory; returns its one-line
  verdict."""
  # pylint: disable=g-import-not-at-top,protected-access
  from dapo_jax.planner import plan as plan_lib
  from dapo_jax.planner import targets
  fv = plan_lib._parse(["--config", config_arg, "--target", target, *overrides])
  plan = plan_lib.make_plan(plan_lib.configure(fv), targets.parse_target(target),
                            estimate=False)
  gib = 2**30
  phase = max(plan["phase_peaks"], key=plan["phase_peaks"].get)
  peak = f"{phase} phase {plan['peak_bytes'] / gib:.1f} GiB"
  if plan["fits"] is False:
    cap = f" of {plan['hbm_bytes'] / gib:.1f}" if plan["hbm_bytes"] else ""
    raise PreflightError(
        f"--config {config_arg}: does not fit {target}: the {peak} per device{cap} "
        f"({plan['method']}); see dapo-plan --config {config_arg} --target {target} --noestimate "
        "(docs/planning.md), or pass --skip-plan.")
  return f"fits {target} ({peak} per device, {plan['method']})"


def preflight(argv: Sequence[str]) -> None:
  argv = list(argv)
  overrides = argv[argv.index("--") + 1:] if "--" in argv else []
  argv = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="config file, path[:variant]")
  parser.add_argument("--workdir", help="the run directory")
  parser.add_argument("--type", help="Cloud TPU accelerator type, e.g. v5p-128")
  parser.add_argument("--tree", help="the directory copied to the workers")
  parser.add_argument("--num-devices", type=int, help="device count (default: from --type)")
  parser.add_argument("--plan-target", help="gpu:<h100|h200|a100>:<nodes>x<gpus>: refuse a "
                      "config whose compiled plan does not fit these GPUs")
  args = parser.parse_args(argv)
  if args.plan_target:  # before JAX starts its backends (and the CUDA plugin)
    from dapo_jax.planner import gpu_targets  # pylint: disable=g-import-not-at-top
    gpu_targets.prepare_cuda_env(args.plan_target)
  if any(a in ("-h", "--help", "--helpfull") for a in overrides):
    raise PreflightError("--help after --: dapo-train would print its usage and train nothing; "
                         "see dapo-train --help locally.")
  tpu = tpu_slice(args.type) if args.type else None
  devices = args.num_devices or (tpu.devices if tpu else None)
  check_config_file(args.config, args.tree)
  if tpu and args.workdir:
    check_workdir(args.workdir, args.type, tpu.hosts)
  check_config(args.config, overrides, devices)
  if args.plan_target:
    print(f"{PROG}: {check_plan(args.config, overrides, args.plan_target)}", file=sys.stderr)
  where = (f"{args.type} ({tpu.hosts} host{'s' * (tpu.hosts > 1)}, {devices} devices)" if tpu
           else f"{devices} devices" if devices else "any device count")
  print(f"{PROG}: {args.config} with {len(overrides)} override(s) passes the config checks "
        f"for {where}.", file=sys.stderr)  # stdout: only a dry run's commands


def main() -> None:
  try:
    from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:  # a Python without dapo_jax's dependencies
    sys.exit(f"{PROG}: error: {sys.executable} cannot load dapo_jax ({e}); set "
             "DAPO_PYTHON=/path/to/python of an environment with dapo_jax installed, or pass "
             "--skip-preflight.")
  # Config mistakes (a typo, a batch that does not split) print as every command prints them.
  cli.exit_on_error(PROG, preflight)


if __name__ == "__main__":
  main()
