"""Launch scripts parse (bash -n, shellcheck when installed), explain themselves (--help), refuse
a bad launch with one line before any cloud call (dapo_jax/commands/launch_preflight.py) and
print their dry runs.

The preflight imports JAX (about 3 s of CPU): the tests that reach it are few."""

import os
import shlex
import re
import shutil
import subprocess

import pytest

from tests import cluster_fakes as fakes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.join(ROOT, "launch", f) for f in os.listdir(os.path.join(ROOT, "launch"))
                 if f.endswith((".sh", ".sbatch")))
TPU_VM = os.path.join(ROOT, "launch", "tpu_vm.sh")


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_scripts_parse(path):
  subprocess.run(["bash", "-n", path], check=True)
  if shutil.which("shellcheck"):
    subprocess.run(["shellcheck", "-x", "-S", "error", path], check=True, cwd=ROOT)


def _sh(args, env=None, cwd=ROOT, timeout=120):
  return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, **(env or {})})


def _dry(args, env=None, cwd=ROOT):
  out = _sh(args, env, cwd)
  assert out.returncode == 0, out.stderr
  return out.stdout


def _options(script):
  """The --options a script's argument loop accepts (its case labels)."""
  with open(os.path.join(ROOT, "launch", script)) as f:
    labels = re.findall(r"^ +(-[-a-z|]+)\)", f.read(), re.M)
  return {o for label in labels for o in label.split("|") if o.startswith("--") and o != "--"}


@pytest.mark.parametrize("script", ["tpu_vm.sh", "multinode_gpu.sh", "slurm_gpu.sbatch"])
def test_help_lists_every_option(script):
  for flag in ("--help", "-h"):
    out = _sh(["bash", f"launch/{script}", flag])
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert out.stdout.startswith("Usage: ")
    assert "overrides go last, after --" in out.stdout or "overrides follow WORKDIR" in out.stdout
  missing = {o for o in _options(script) if o not in out.stdout}
  assert not missing, f"{script} --help does not document {missing}"
  if script == "tpu_vm.sh":
    assert {"--name", "--dry-run", "--skip-preflight"} <= _options(script)
    assert "Example:" in out.stdout and "-- --config." in out.stdout


def _tpu_args(**kw):
  args = {"name": "dapo-t", "zone": "us-west4-a", "type": "v5p-16",
          "config": "configs/tiny_cpu.py", "workdir": "gs://b/run", **kw}
  return [a for k, v in args.items() for a in (f"--{k}", v)]


# Each launch is refused with one line (exit 2) before gcloud is ever run: no --dry-run, so a
# missing check would reach the fake gcloud and log a call.
REFUSED = {
    "override before --": (
        [*_tpu_args(), "--config.optim.lr=1e-6"],
        {}, "config overrides go after --: bash launch/tpu_vm.sh ... -- --config.optim.lr=1e-6"),
    "unknown argument": ([*_tpu_args(), "--zonee", "x"], {}, "unknown argument --zonee (see "),
    "missing config": (_tpu_args(config="configs/nope.py:arg"), {},
                       "--config configs/nope.py: no such file"),
    "out-of-tree config": (_tpu_args(config="{tmp}/mine.py"), {}, "outside " + ROOT),
    "local workdir, 2 hosts": (_tpu_args(workdir="/tmp/run"), {},
                               "a v5p-16 slice has 2 hosts, each with its own disk"),
    "unknown type": ([*_tpu_args(type="v9x-8"), "--version", "img"], {},
                     "--type v9x-8: unknown accelerator type; known generations: v2, v3, v4, "),
    "cores not chips": (_tpu_args(type="v4-12"), {}, "v4-N counts TensorCores"),
    "no Python": (_tpu_args(), {"DAPO_PYTHON": "/nonexistent/python"},
                  "no local Python to check the launch with (/nonexistent/python): set "
                  "DAPO_PYTHON"),
    # The one that loads the config: 16 x 8 rows of tiny_cpu on the 64 chips of a v5p-128.
    "batch does not split": (_tpu_args(type="v5p-128"), {},
                             ("launch preflight: error: config.optim.mini_batch_size=4: ",
                              "on 64 devices")),
}


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
  """One fake Cloud TPU for the refused launches: none of them may reach it."""
  c = fakes.FakeTpuCloud(str(tmp_path_factory.mktemp("cloud")), num_workers=1)
  yield c
  c.close()


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_tpu_vm_refuses_a_bad_launch_before_any_gcloud_call(case, cloud, tmp_path):
  args, env, message = REFUSED[case]
  shutil.copy(os.path.join(ROOT, "configs", "tiny_cpu.py"), tmp_path / "mine.py")
  args = [a.format(tmp=tmp_path) for a in args]
  out = _sh(["bash", TPU_VM, *args, "--venv", "/nonexistent", "--skip-install"],
            cloud.env({**os.environ, **env}))
  assert out.returncode == 2, (out.stdout, out.stderr)
  for part in (message,) if isinstance(message, str) else message:
    assert part in out.stderr, out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert not out.stdout
  assert cloud.calls() == [] and not os.path.exists(cloud.calls_path)


def test_tpu_vm_dry_run(tmp_path):
  """From another directory, with the config's absolute path: checked first, then the exact
  commands, the config passed to the workers relative to the copied tree."""
  cloud = fakes.FakeTpuCloud(str(tmp_path / "cloud"), num_workers=1)
  try:
    out = _sh(["bash", TPU_VM, *_tpu_args(name="dapo-32b", zone="us-east5-a", type="v5p-128",
                                          config=f"{ROOT}/configs/dapo_qwen2_5_32b.py"),
               "--dry-run", "--", "--config.seed=1"], cloud.env(dict(os.environ)), cwd=tmp_path)
  finally:
    cloud.close()
  assert out.returncode == 0, out.stderr
  assert cloud.calls() == []  # a dry run calls nothing, describe included
  assert re.fullmatch(r"launch preflight: \S+dapo_qwen2_5_32b.py with 1 override\(s\) passes "
                      r"the config checks for v5p-128 \(16 hosts, 64 devices\)\.\n", out.stderr)
  out = out.stdout.replace("\\", "")
  assert "tpu-vm describe dapo-32b --zone us-east5-a" in out.splitlines()[0]
  assert "tpu-vm create dapo-32b" in out and "--accelerator-type v5p-128 --version v2-alpha-tpuv5" \
      in out
  assert "--worker=all" in out and "launch/worker_env.sh $HOME/dapo_venv tpu 0" in out
  assert ".venv" not in out.replace("--exclude=.venv", "")  # the local env is never copied
  assert "dapo_jax.main --config configs/dapo_qwen2_5_32b.py --workdir gs://b/run --config.seed=1" \
      in out
  assert "tmux new-session" in out


def test_slurm_and_multinode_dry_runs():
  """Each checks the config with its overrides (the count shows they reached the check), then
  prints its command."""
  out = _sh(["bash", "launch/slurm_gpu.sbatch", "configs/dapo_qwen2_5_32b.py", "/runs/x",
             "--config.optim.lr=2e-6"], {"DRY_RUN": "1"})
  assert out.returncode == 0, out.stderr
  assert "dapo_qwen2_5_32b.py with 1 override(s) passes the config checks" in out.stderr
  assert out.stdout.startswith("+ export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7\n+ srun")
  assert "--export=ALL dapo-train --config configs/dapo_qwen2_5_32b.py --workdir /runs/x " \
      "--config.optim.lr=2e-6" in out.stdout
  out = _sh(["bash", "launch/multinode_gpu.sh", "--coordinator=10.0.0.1:1234", "--nodes", "16",
             "--rank", "3", "--config", "configs/dapo_qwen2_5_32b.py", "--workdir", "/runs/x",
             "--dry-run", "--", "--config.seed=1", "--config.num_steps=3"])
  assert out.returncode == 0, out.stderr
  assert "with 2 override(s) passes the config checks" in out.stderr
  assert "JAX_COORDINATOR_ADDRESS=10.0.0.1:1234" in out.stdout and "JAX_PROCESS_ID=3" in out.stdout
  assert out.stdout.endswith("--config.seed=1 --config.num_steps=3\n")


def test_multinode_starts_one_side_of_a_split_run():
  """--role/--peer reach dapo-train on each host of a side (docs/overlap.md); no plan check."""
  out = _sh(["bash", "launch/multinode_gpu.sh", "--coordinator=10.0.0.9:1234", "--nodes", "2",
             "--rank", "1", "--config", "configs/tiny_cpu.py:overlap", "--workdir", "/runs/x",
             "--role", "rollout", "--peer", "t0:29400,t1:29400", "--gpu", "h100", "--dry-run",
             "--", "--config.rollout_devices=0"])
  assert out.returncode == 0, out.stderr
  assert "JAX_PROCESS_ID=1" in out.stdout and "--plan-target" not in out.stderr
  assert shlex.split(out.stdout[2:])[-3:] == ["--role=rollout", "--peer=t0:29400,t1:29400",
                                              "--config.rollout_devices=0"]


_SIDE = ["launch/multinode_gpu.sh", "--coordinator", "h:1", "--nodes", "2", "--rank", "0",
         "--config", "c.py", "--workdir", "/w"]


@pytest.mark.parametrize("args, message", [
    (_SIDE + ["--role", "both", "--peer", "a:1,b:1"], "--role both: choose train or rollout"),
    (_SIDE + ["--role", "train"], "--role train needs --peer HOST:PORT,..."),
    (_SIDE + ["--role", "train", "--peer", "a:1"], "--peer names 1 address(es) for --nodes 2"),
    (_SIDE + ["--peer", "a:1"], "--peer goes with --role train|rollout"),
    (["launch/multinode_gpu.sh", "--nodes", "2"], "multinode_gpu.sh: --coordinator is required"),
    (["launch/multinode_gpu.sh", "--coordinator", "h:1", "--config.seed=1"],
     "config overrides go after --: bash launch/multinode_gpu.sh ... -- --config.seed=1"),
    (["launch/multinode_gpu.sh", "--coordinator", "h:1", "--nodes", "2", "--rank", "0",
      "--config", "configs/nope.py", "--workdir", "/w"], "--config configs/nope.py: no such file"),
    (["launch/slurm_gpu.sbatch", "--config", "configs/tiny_cpu.py"],
     "the first two arguments are CONFIG and WORKDIR"),
    (["launch/slurm_gpu.sbatch", "configs/nope.py", "/w"], "CONFIG configs/nope.py: no such file"),
])
def test_gpu_launchers_refuse_with_one_line(args, message):
  out = _sh(["bash", *args])
  assert out.returncode == 2 and message in out.stderr and not out.stdout, out
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("script", ["multinode_gpu.sh", "slurm_gpu.sbatch"])
def test_gpu_launchers_set_the_flags_the_plan_assumes(script):
  """The XLA flags and memory fraction dapo-plan's GPU rows are compiled with."""
  from dapo_jax.planner import gpu_targets  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, "launch", script)) as f:
    text = f.read()
  for flag in gpu_targets.XLA_GPU_FLAGS:
    assert f'XLA_FLAGS="${{XLA_FLAGS:+$XLA_FLAGS }}{flag}"' in text
  for name, value in gpu_targets.GPU_ENV.items():
    assert f'export {name}="${{{name}:-{value}}}"' in text
  assert "--plan-target" in text


def test_gpu_plan_preflight_refuses_a_config_that_does_not_fit():
  """The launchers' plan check (here multinode_gpu.sh's dry run with --gpu): the 32B on one
  H100 is refused in one line naming dapo-plan; the tiny config on 8 passes. Without the CUDA
  plugin the plan is the analytic one (the compiled one with it)."""
  base = ["bash", "launch/multinode_gpu.sh", "--coordinator=h:1", "--rank", "0", "--workdir",
          "/w", "--dry-run", "--gpu", "h100"]
  out = _sh(base + ["--nodes", "1", "--gpus-per-node", "1", "--config",
                    "configs/dapo_qwen2_5_32b.py", "--", "--config.mesh=data=1,fsdp=1,tensor=1",
                    "--config.optim.micro_batch_size=1"])
  assert out.returncode == 2 and not out.stdout, out
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert "does not fit gpu:h100:1x1" in out.stderr and "dapo-plan --config" in out.stderr
  out = _sh(base + ["--nodes", "1", "--config", "configs/tiny_cpu.py"])
  assert out.returncode == 0, out.stderr
  assert "fits gpu:h100:1x8" in out.stderr


_NVIDIA_SMI = {  # this host's nvidia-smi, as the launchers ask it (-L, then the GPU's name)
    "gpu": 'if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"; '
           'else echo "NVIDIA H100 80GB HBM3"; fi\n',
    "none": 'echo "No devices were found"; exit 6\n'}


@pytest.mark.parametrize("script", ["multinode_gpu.sh", "slurm_gpu.sbatch"])
@pytest.mark.parametrize("platforms,host,gpu_flag", [
    ("cpu", "gpu", False),  # a CPU rehearsal on a GPU host
    ("", "none", False),  # JAX's own choice on a host without a GPU: the CPU (issue 50, 14)
    ("", "gpu", True), ("cuda", "none", True), ("cpu,cuda", "none", True)])
def test_gpu_launchers_add_gpu_flags_only_where_the_platform_is_a_gpu(tmp_path, script,
                                                                      platforms, host, gpu_flag):
  """A CPU run of a GPU launcher gets no GPU-only XLA flag; a GPU run gets the flags dapo-plan's
  GPU rows assume. (The command it starts, dapo-train or srun, is a stand-in printing them.)"""
  for name, text in (("dapo-train", 'echo "XLA_FLAGS=[$XLA_FLAGS]"\n'),
                     ("srun", 'echo "XLA_FLAGS=[$XLA_FLAGS]"\n'),
                     ("nvidia-smi", _NVIDIA_SMI[host])):
    (tmp_path / name).write_text("#!/usr/bin/env bash\n" + text)
    (tmp_path / name).chmod(0o755)
  args = (["--coordinator=h:1", "--nodes", "1", "--rank", "0", "--config", "configs/tiny_cpu.py",
           "--workdir", str(tmp_path / "w"), "--skip-plan"] if script == "multinode_gpu.sh"
          else ["configs/tiny_cpu.py", str(tmp_path / "w")])
  out = _sh(["bash", f"launch/{script}", *args],
            env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "JAX_PLATFORMS": platforms,
                 "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "SKIP_PLAN": "1"})
  assert out.returncode == 0, out.stderr
  expected = "--xla_force_host_platform_device_count=2" + (
      " --xla_gpu_enable_latency_hiding_scheduler=true" if gpu_flag else "")
  assert out.stdout.strip() == f"XLA_FLAGS=[{expected}]", out.stdout


# A stand-in for the venv's python as launch/setup_env.sh runs it: `-m pip install` prints what
# pip 26 prints on a sound install unless told not to (setuptools' "Editable installation" box
# unless PYTHONWARNINGS ignores it; the resolver's conflicts for google-jetstream's left-out
# requirements unless --no-warn-conflicts; neither with --no-deps), and `-m pip check` lists
# those conflicts (plus FAKE_CONFLICT). FAKE_FAIL makes the first install fail as pip does.
_FAKE_VENV_PYTHON = r'''#!/usr/bin/env bash
[ "$1 $2" = "-m pip" ] || { echo "stand-in python: $*" >&2; exit 3; }
shift 2
jetstream="google-jetstream 0.2.2 requires seqio, which is not installed."
if [ "$1" = check ]; then
  printf '%s\n' "$jetstream" ${FAKE_CONFLICT:+"$FAKE_CONFLICT"}; exit 1
fi
case " $* " in *" --no-deps "*) exit 0 ;; esac
if [ -n "${FAKE_FAIL:-}" ]; then echo "ERROR: $FAKE_FAIL" >&2; exit 1; fi
case "${PYTHONWARNINGS:-}" in
  *"ignore:Editable installation"*) ;;
  *) printf '%s\n' "  editable_wheel.py:354: BuildBackendWarning: Editable installation." "  !!" \
       "    Please be careful with folders in your working directory with the same" >&2 ;;
esac
case " $* " in
  *" --no-warn-conflicts "*) ;;
  *) printf '%s\n' "ERROR: pip's dependency resolver does not currently take into account all \
the packages that are installed." "$jetstream" >&2 ;;
esac
'''


@pytest.mark.parametrize("case", ["sound", "other conflict", "failed install"])
def test_setup_env_prints_nothing_alarming_when_the_install_is_sound(case, tmp_path):
  """Issue 50 (15): launch/test.sh and local_cpu.sh (through setup_env.sh) printed pip's
  "ERROR: pip's dependency resolver ..." for google-jetstream's requirements that the no-deps
  install leaves out on purpose, and setuptools' editable-install box, on a sound install. Those
  two are left out; any other conflict still shows, and a failed pip still fails with its
  message. (The real pip in a fresh venv: docs/reliability.md, "A clean install log".)"""
  for f in ("launch/setup_env.sh", "requirements-no-deps.txt"):
    os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
    shutil.copy(os.path.join(ROOT, f), tmp_path / f)
  bin_dir = tmp_path / ".venv" / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "python").write_text(_FAKE_VENV_PYTHON)
  (bin_dir / "python").chmod(0o755)
  (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
  env = {"other conflict": {"FAKE_CONFLICT": "torch 2.13.0 requires sympy, which is not "
                                             "installed."},
         "failed install": {"FAKE_FAIL": "Could not find a version that satisfies torch"}}
  out = _sh(["bash", "-c", "source launch/setup_env.sh test; echo sourced"], env.get(case),
            cwd=tmp_path)
  lines = (out.stdout + out.stderr).splitlines()
  if case == "failed install":
    assert out.returncode != 0 and "sourced" not in out.stdout, out
    assert "ERROR: Could not find a version that satisfies torch" in out.stderr, out.stderr
    return
  assert out.returncode == 0, out.stderr
  want = [f"[setup_env] pip install -e '{tmp_path}[test]'", "sourced"]
  if case == "other conflict":
    want[1:1] = ["[setup_env] pip check: broken requirements (besides google-jetstream's "
                 "expected ones):", "torch 2.13.0 requires sympy, which is not installed."]
  assert sorted(lines) == sorted(want), lines
