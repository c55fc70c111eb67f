"""The launch scripts' commands, run end to end against stand-ins of the clouds (cluster_fakes).

* A TPU pod slice: 2 workers whose only hint of each other is their metadata server; the
  trainer's ``maybe_initialize`` must find the pod through JAX's own cluster detection.
* ``launch/tpu_vm.sh`` with a fake ``gcloud``: create, copy, environment, start on every worker; a
  run killed mid-way and preempted is resumed by running the same command again.
* ``launch/slurm_gpu.sbatch`` with a fake ``srun`` and ``launch/multinode_gpu.sh`` on 2 ranks.

The workdir is a parameter of every helper (``_workdir``): the runs write checkpoints through
Orbax, so pointing it at gs:// (a GCS emulator) is a one-line change.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from etils import epath

from tests import cluster_fakes as fakes
from tests.gcs_emulator import GcsEmulator
from tests.processes import free_port_pair, wait_all
from tests.tiny_run_flags import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 5
LAUNCH_TIMEOUT_S = 600
# Every step saved; async saves need the distributed client on several processes.
RUN_FLAGS = [*TINY_RUN_FLAGS, f"--config.num_steps={NUM_STEPS}",
             "--config.checkpoint.save_every=1", "--config.checkpoint.async_save=True"]
# The GPU launchers only need to show that the processes find each other and finish a run.
GPU_STEPS = 2
GPU_RUN_FLAGS = [*RUN_FLAGS, f"--config.num_steps={GPU_STEPS}"]


def _workdir(tmp_path) -> str:
  """A local workdir (the SLURM and multinode runs: a shared file system)."""
  return str(tmp_path / "workdir")


@contextlib.contextmanager
def _bucket(tmp_path):
  """A gs:// workdir on a GCS emulator (fake-gcs-server on 127.0.0.1), as a TPU pod keeps it:
  yields the URL and the variables that point every client of the workers at the emulator."""
  gcs = GcsEmulator(str(tmp_path / "gcs"))
  gcs.start()
  try:
    gcs.create_bucket("dapo-test")
    gcs.apply_in_process()  # this process reads the bucket through epath too
    yield "gs://dapo-test/run", gcs.env
  finally:
    gcs.stop()


def _base_env() -> dict[str, str]:
  """This checkout first on PYTHONPATH (the workers run its code) and this venv's scripts."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
  return env


def _uncached(workdir: str) -> epath.Path:
  """The workdir as epath sees it now: gcsfs caches listings and sizes, and the workers keep
  writing the bucket behind this process's back."""
  if workdir.startswith("gs://"):
    import fsspec  # pylint: disable=g-import-not-at-top
    for fs in list(fsspec.get_filesystem_class("gs")._cache.values()):  # pylint: disable=protected-access
      fs.invalidate_cache()
  return epath.Path(workdir)


def _steps_done(workdir: str) -> list[int]:
  path = _uncached(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _checkpoints(workdir: str) -> list[int]:
  """Committed checkpoint steps (local or gs://)."""
  path = _uncached(workdir) / "checkpoints"
  if not path.exists():
    return []
  return sorted(int(d.name) for d in path.iterdir()
                if d.name.isdigit() and (d / "commit_success.txt").exists())


def _run(cmd, env, timeout=LAUNCH_TIMEOUT_S, cwd=ROOT) -> subprocess.CompletedProcess:
  """Runs a launch script in its own process group, killed whole if it runs past ``timeout``."""
  p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, start_new_session=True)
  try:
    out, err = p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    out, err = p.communicate()
    pytest.fail(f"{cmd[:3]} ran past {timeout}s (a worker waiting for a peer?):\n"
                f"{out[-3000:]}\n{err[-3000:]}")
  return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# --- maybe_initialize on a pod that only the metadata server describes -------------------------


_PROBE_WORKER = textwrap.dedent("""
    import json, sys
    from dapo_jax.infra import distributed
    started = distributed.maybe_initialize()
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    # A collective across the processes: every process contributes its index + 1.
    total = multihost_utils.process_allgather(np.asarray([jax.process_index() + 1])).sum()
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    ones = jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")),
        np.ones(jax.local_device_count(), np.float32))
    from jax._src.distributed import global_state
    service = type(global_state.service).__name__ if global_state.service else None
    print("RESULT", json.dumps({"started": started, "count": jax.process_count(),
                                "service": service, "index": jax.process_index(),
                                "devices": jax.device_count(),
                                "gathered": int(total), "psum": float(jnp.sum(ones))}))
""")


def _probe_workers(envs, timeout=240):
  procs = [subprocess.Popen([sys.executable, "-c", _PROBE_WORKER], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for env in envs]
  results = []
  for p in procs:
    try:
      out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("a process hung in jax.distributed.initialize")
    assert p.returncode == 0, out[-4000:]
    results.append(json.loads(out.split("RESULT ", 1)[1]))
  return results


def test_maybe_initialize_finds_a_tpu_pod_through_the_metadata_server(tmp_path):
  probe = fakes.write_tpu_vm_probe(str(tmp_path / "probe"))
  servers = [fakes.MetadataServer(i, 2) for i in range(2)]
  port = fakes.free_port()
  try:
    envs = [fakes.tpu_worker_env(_base_env(), m, probe, port, local_devices=2) for m in servers]
    results = _probe_workers(envs)
  finally:
    for m in servers:
      m.close()
  assert sorted(r["index"] for r in results) == [0, 1]
  for r in results:
    assert r["started"] and r["count"] == 2 and r["devices"] == 4
    assert r["gathered"] == 3 and r["psum"] == 4.0
  # Only the coordinator runs the service, and it stops it after the peers' last RPCs.
  assert [r["service"] for r in sorted(results, key=lambda r: r["index"])] == [
      "_LateStoppingService", None]
  for m in servers:
    asked = {path.rsplit("/", 1)[1] for path in m.requests}
    assert {"agent-worker-number", "worker-network-endpoints"} <= asked


def test_the_coordinator_stops_its_service_after_a_grace():
  """The wrapper JAX's exit-time shutdown calls: it waits, then stops the real service once."""
  from dapo_jax.infra import distributed  # pylint: disable=g-import-not-at-top

  class Service:
    stopped_at = None
    port = 1234

    def shutdown(self):
      assert self.stopped_at is None
      self.stopped_at = time.monotonic()

  real = Service()
  late = distributed._LateStoppingService(real, grace_s=0.3)  # pylint: disable=protected-access
  assert late.port == 1234  # everything else reaches the service
  start = time.monotonic()
  late.shutdown()
  assert real.stopped_at - start >= 0.3


def test_maybe_initialize_is_a_no_op_on_one_host(tmp_path):
  """A single-host TPU VM (its metadata lists one worker) and a plain machine: no distributed
  runtime, one process."""
  probe = fakes.write_tpu_vm_probe(str(tmp_path / "probe"))
  server = fakes.MetadataServer(0, 1)
  try:
    envs = [fakes.tpu_worker_env(_base_env(), server, probe, fakes.free_port(), 2),
            fakes.worker_env(_base_env(), 2)]
    results = _probe_workers(envs)
  finally:
    server.close()
  for r in results:
    assert not r["started"] and r["count"] == 1 and r["devices"] == 2
  assert any(p.endswith("worker-network-endpoints") for p in server.requests)


# --- launch/tpu_vm.sh on a fake Cloud TPU ---------------------------------------------------------


def _tpu_launch_cmd(workdir: str) -> list[str]:
  """The command docs/cloud.md's TPU walkthrough gives, plus what makes it run here: the test's
  own Python environment (nothing installed) and a foreground run to wait for."""
  return ["bash", "launch/tpu_vm.sh", "--name", "dapo-test", "--zone", "us-west4-a",
          "--type", "v5litepod-16", "--config", "configs/tiny_cpu.py", "--workdir", workdir,
          "--venv", sys.prefix, "--skip-install", "--foreground", "--", *RUN_FLAGS,
          # The launch is checked for a real v5litepod-16's 16 chips (the fake has 8 CPU
          # devices): 4 x 4 rows split over both.
          "--config.optim.mini_batch_size=4"]


def _worker_logs(cloud, name="dapo-test"):
  logs = []
  for i in range(2):
    path = os.path.join(cloud.home(name, i), "dapo_train.log")
    logs.append(open(path).read() if os.path.exists(path) else "")
  return logs


@pytest.mark.slow
def test_tpu_vm_script_trains_on_two_workers_and_resumes_after_preemption(tmp_path):
  cloud = fakes.FakeTpuCloud(str(tmp_path / "cloud"), num_workers=2, local_devices=4)
  bucket = _bucket(tmp_path)
  workdir, gcs_env = bucket.__enter__()
  env = cloud.env({**_base_env(), **gcs_env})
  try:
    # 1. First launch: killed (with its workers) once a checkpoint is on disk, then preempted.
    first = subprocess.Popen(_tpu_launch_cmd(workdir), env=env, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.time() + LAUNCH_TIMEOUT_S
    while not _checkpoints(workdir) and first.poll() is None and time.time() < deadline:
      time.sleep(0.5)
    if first.poll() is not None:
      pytest.fail(f"the first launch ended (rc {first.returncode}) before any checkpoint:\n"
                  f"{first.communicate()[0][-4000:]}\n{_worker_logs(cloud)[0][-3000:]}")
    assert _checkpoints(workdir), "no checkpoint within the time limit"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert not _steps_done(workdir) or _steps_done(workdir)[-1] < NUM_STEPS
    logs = _worker_logs(cloud)
    for i, log in enumerate(logs):
      # Found through JAX's GCE TPU detection, with nothing but the metadata server.
      assert f"jax.distributed (GceTpuCluster): process {i} of 2" in log, log[-3000:]
    cloud.preempt("dapo-test")

    # 2. The same command again: recreate the slice, resume from the workdir, finish.
    out = _run(_tpu_launch_cmd(workdir), env)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:],
                                 _worker_logs(cloud)[0][-4000:])
    assert "is PREEMPTED: deleting and recreating it" in out.stdout
    resumed = _worker_logs(cloud)  # fresh disks: only the second run's logs
    for log in resumed:
      assert re.search(r"Resumed from .* at step \d", log), log[-3000:]
    assert _steps_done(workdir)[-1] == NUM_STEPS
    assert set(_steps_done(workdir)) == set(range(1, NUM_STEPS + 1))
    assert NUM_STEPS in _checkpoints(workdir)
    # Every artefact in the bucket; nothing of the run on the workers' disks.
    names = {p.name for p in _uncached(workdir).iterdir()}
    assert {"config.json", "metrics.jsonl", "checkpoints", "curves.png",
            "final_metrics.json"} <= names, names
    assert not any("workdir" in d or d.startswith("gs:") for i in range(2)
                   for d in os.listdir(cloud.home("dapo-test", i))), "run files on a worker disk"
  finally:
    cloud.close()
    bucket.__exit__(None, None, None)

  calls = cloud.calls()
  verbs = [c[3] for c in calls]
  creates = [c for c in calls if c[3] == "create"]
  assert len(creates) == 2 and verbs.count("delete") == 1
  assert creates[0][creates[0].index("--version") + 1] == "v2-alpha-tpuv5-lite"
  assert creates[0][creates[0].index("--accelerator-type") + 1] == "v5litepod-16"
  # Every ssh went to all workers; the code went over as a tarball, never a virtualenv.
  assert all("--worker=all" in c for c in calls if c[3] in ("ssh", "scp"))
  scps = [c for c in calls if c[3] == "scp"]
  assert scps and all(c[4].endswith("dapo_jax.tar.gz") and c[5] == "dapo-test:dapo_jax.tar.gz"
                      for c in scps)


@pytest.mark.parametrize("tpu_type, version", [
    ("v4-32", "tpu-ubuntu2204-base"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p-128", "v2-alpha-tpuv5"), ("v6e-64", "v2-alpha-tpuv6e")])
def test_tpu_vm_script_picks_the_runtime_image_per_generation(tpu_type, version):
  out = subprocess.run(
      ["bash", "launch/tpu_vm.sh", "--name", "n", "--zone", "z", "--type", tpu_type, "--config",
       "configs/tiny_cpu.py", "--workdir", "gs://b/r", "--dry-run", "--skip-preflight"],
      cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert f"--accelerator-type {tpu_type} --version {version}" in out
  bad = subprocess.run(["bash", "launch/tpu_vm.sh", "--name", "n", "--zone", "z", "--type",
                        "v9x-8", "--config", "c", "--workdir", "w", "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True)
  assert bad.returncode == 2 and "pass --version" in bad.stderr


def test_worker_env_refuses_a_python_older_than_3_11(tmp_path):
  """An existing --venv whose python is too old (the TPU images' 3.10) is not used silently."""
  venv = tmp_path / "old_venv" / "bin"
  venv.mkdir(parents=True)
  (venv / "python").write_text("#!/bin/sh\n"
                               "case \"$1\" in -V) echo 'Python 3.10.12';; *) exit 1;; esac\n")
  (venv / "python").chmod(0o755)
  out = subprocess.run(["bash", "launch/worker_env.sh", str(tmp_path / "old_venv"), "", "1"],
                       cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 1 and "Python 3.10.12; dapo_jax needs 3.11+" in out.stderr


# --- GPU clusters -------------------------------------------------------------------------------


def _slurm_env(tmp_path, *, nodes: int, gpus: int, **extra: str) -> dict[str, str]:
  """A batch job's environment with the stand-in srun/scontrol first on PATH: ``nodes`` nodes
  named localhost, each task ``gpus`` CPU devices."""
  bin_dir = str(tmp_path / "bin")
  fakes.write_fake_srun(bin_dir)
  env = _base_env()
  env.update(PATH=os.pathsep.join([bin_dir, env["PATH"]]), SLURM_JOB_ID="4242",
             SLURM_NNODES=str(nodes), SLURM_GPUS_ON_NODE=str(gpus),
             FAKE_SRUN_LOCAL_DEVICES=str(gpus), SLURM_JOB_NODELIST=",".join(["localhost"] * nodes),
             FAKE_SRUN_CALLS=str(tmp_path / "srun_calls"), **extra)
  return env


@pytest.mark.slow
def test_slurm_script_trains_on_two_tasks(tmp_path):
  workdir = _workdir(tmp_path)
  env = _slurm_env(tmp_path, nodes=2, gpus=4)
  out = _run(["bash", "launch/slurm_gpu.sbatch", "configs/tiny_cpu.py", workdir,
              *GPU_RUN_FLAGS], env)
  assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
  for i in range(2):
    assert f"jax.distributed (SlurmCluster): process {i} of 2" in out.stdout, out.stdout[-3000:]
  assert _steps_done(workdir) == list(range(1, GPU_STEPS + 1))
  assert GPU_STEPS in _checkpoints(workdir)


@pytest.mark.slow
def test_slurm_script_puts_the_rollout_on_nodes_of_its_own(tmp_path):
  """SIDES=1 on 4 nodes: the first two train, the last two roll out, each pair joined through
  the workdir (--peer=auto), with partial rollouts: the rollout processes agree on the version
  at every poll (a collective; a disagreement would stop the run, `train._sample`'s check).
  Whether a batch here outlasts an update, so that a newer version arrives mid-batch, depends on
  timing: the move itself is tested in tests/test_overlap.py."""
  workdir = _workdir(tmp_path)
  env = _slurm_env(tmp_path, nodes=4, gpus=1, SIDES="1", SIDES_PORT=str(free_port_pair()))
  steps = 4
  out = _run(["bash", "launch/slurm_gpu.sbatch", "configs/tiny_cpu.py:overlap", workdir,
              *RUN_FLAGS, f"--config.num_steps={steps}", "--config.checkpoint.save_every=4",
              "--config.rollout_devices=0", "--config.algorithm.max_staleness=2",
              "--config.algorithm.partial_rollouts=True"], env)
  assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
  for i in range(2):  # on each side
    assert out.stdout.count(f"process {i} of 2") == 2, out.stdout[-3000:]
  assert _steps_done(workdir) == list(range(1, steps + 1))
  rows = [json.loads(line) for line in (epath.Path(workdir) / "metrics.jsonl").read_text()
          .splitlines()]
  assert all(r["sync/batch_bytes"] > 0 and r["staleness/max"] <= 2 for r in rows)
  assert rows[-1]["staleness/max"] > 0  # overlapped
  for i in range(2):
    host, _, port = (epath.Path(workdir) / f"rollout_peer.{i}.addr").read_text().rpartition(":")
    assert host and port.isdigit()


@pytest.mark.slow
def test_multinode_script_trains_on_two_ranks(tmp_path):
  workdir = _workdir(tmp_path)
  coord = f"127.0.0.1:{fakes.free_port()}"
  procs = []
  for rank in range(2):
    cmd = ["bash", "launch/multinode_gpu.sh", "--coordinator", coord, "--nodes", "2", "--rank",
           str(rank), "--config", "configs/tiny_cpu.py", "--workdir", workdir, "--",
           *GPU_RUN_FLAGS]
    env = {**fakes.worker_env(_base_env(), 4), "PYTHONFAULTHANDLER": "1"}  # stacks on a hang
    procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  # Done when both exit; failed when one exits non-zero or neither writes a line or a file
  # (the workdir holds the compilation cache, filled as each program compiles) for the limit.
  outs = wait_all(procs, LAUNCH_TIMEOUT_S, "a rank", watch=[workdir])
  for rank, out in enumerate(outs):
    assert f"process {rank} of 2" in out
  assert _steps_done(workdir) == list(range(1, GPU_STEPS + 1))
  assert GPU_STEPS in _checkpoints(workdir)
