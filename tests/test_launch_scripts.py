"""Launch scripts parse (bash -n, shellcheck when installed) and print their dry runs."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.join(ROOT, "launch", f) for f in os.listdir(os.path.join(ROOT, "launch"))
                 if f.endswith((".sh", ".sbatch")))


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_scripts_parse(path):
  subprocess.run(["bash", "-n", path], check=True)
  if shutil.which("shellcheck"):
    subprocess.run(["shellcheck", "-S", "error", path], check=True)


def _dry(args, env=None):
  out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True,
                       env={**os.environ, **(env or {})})
  return out.stdout


def test_tpu_vm_dry_run():
  out = _dry(["bash", "launch/tpu_vm.sh", "--name", "dapo-32b", "--zone", "us-east5-a",
              "--type", "v5p-128", "--config", "configs/dapo_qwen2_5_32b.py", "--workdir",
              "gs://b/run", "--dry-run", "--", "--config.seed=1"]).replace("\\", "")
  assert "tpu-vm create dapo-32b" in out and "--accelerator-type v5p-128 --version v2-alpha-tpuv5" \
      in out
  assert "--worker=all" in out and "launch/worker_env.sh $HOME/dapo_venv tpu 0" in out
  assert ".venv" not in out.replace("--exclude=.venv", "")  # the local env is never copied
  assert "dapo_jax.main --config configs/dapo_qwen2_5_32b.py --workdir gs://b/run --config.seed=1" \
      in out
  assert "tmux new-session" in out


def test_slurm_and_multinode_dry_runs():
  out = _dry(["bash", "launch/slurm_gpu.sbatch", "configs/dapo_qwen2_5_32b.py", "/runs/x"],
             {"DRY_RUN": "1"})
  assert out.startswith("+ export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7\n+ srun")
  assert "--export=ALL dapo-train --config configs/dapo_qwen2_5_32b.py" in out
  out = _dry(["bash", "launch/multinode_gpu.sh", "--coordinator", "10.0.0.1:1234", "--nodes",
              "16", "--rank", "3", "--config", "configs/dapo_qwen2_5_32b.py", "--workdir",
              "/runs/x", "--dry-run"])
  assert "JAX_COORDINATOR_ADDRESS=10.0.0.1:1234" in out and "JAX_PROCESS_ID=3" in out
  bad = subprocess.run(["bash", "launch/multinode_gpu.sh", "--nodes", "2"], cwd=ROOT,
                       capture_output=True, text=True)
  assert bad.returncode == 2 and "--coord is required" in bad.stderr
