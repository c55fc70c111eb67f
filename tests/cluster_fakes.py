"""Stand-ins for the clouds the launch scripts talk to, so their commands run end to end here.

* ``MetadataServer``: a GCE metadata server (stdlib http.server on 127.0.0.1) answering what JAX's
  ``GceTpuCluster`` asks a TPU VM worker: ``agent-worker-number``, ``worker-network-endpoints``
  and ``tpu-env``. One per worker, as each TPU VM has its own.
* ``write_tpu_vm_probe``: a ``sitecustomize`` that tells JAX it runs on a Cloud TPU VM (its
  probe looks for TPU chips), active only where DAPO_TEST_FAKE_TPU_VM=1: test processes, never
  the package.
* ``FakeTpuCloud``: a ``gcloud`` on PATH that records its calls and runs ``tpu-vm ssh
  --worker=all --command CMD`` as one local process per worker (own HOME, own metadata server,
  CPU devices), ``tpu-vm scp`` as a copy, ``create``/``delete``/``describe`` on a state file.
* ``write_fake_srun``: an ``srun`` that starts its tasks as local processes with the SLURM_*
  variables JAX's ``SlurmCluster`` reads, and an ``scontrol show hostnames`` that lists a
  comma-separated node list (no bracket ranges) one name a line.
"""

from __future__ import annotations

import http.server
import json
import os
import stat
import sys
import threading
from typing import Any

from tests.processes import free_port  # noqa: F401  (the fake gcloud/srun scripts use fakes.free_port)

# Variables of the test session that a fresh cloud worker would not have.
_FOREIGN_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                "JAX_LOCAL_DEVICE_IDS", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
                "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID",
                "PYTEST_CURRENT_TEST")



def worker_env(base: dict[str, str], local_devices: int) -> dict[str, str]:
  """A clean process environment: CPU backend with ``local_devices`` devices, no launch hints."""
  env = {k: v for k, v in base.items() if k not in _FOREIGN_ENV and not k.startswith("SLURM_")}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}")
  return env


class MetadataServer:
  """The metadata server of one TPU VM worker of a slice whose workers are all on 127.0.0.1."""

  def __init__(self, worker: int, num_workers: int, accelerator: str = "v5litepod-16"):
    attrs = {
        "agent-worker-number": str(worker),
        # The old name:id:ip format (JAX reads both; the hostnames-only one too).
        "worker-network-endpoints": ",".join(
            f"fake-tpu-w-{i}:{i}:127.0.0.1" for i in range(num_workers)),
        "tpu-env": f"ACCELERATOR_TYPE: '{accelerator}'\nWORKER_ID: '{worker}'\n",
        "accelerator-type": accelerator,
    }
    self.requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(handler):  # pylint: disable=no-self-argument
        prefix = "/computeMetadata/v1/instance/attributes/"
        key = handler.path[len(prefix):] if handler.path.startswith(prefix) else None
        self.requests.append(handler.path)
        if handler.headers.get("Metadata-Flavor") != "Google":
          handler.send_response(403)
          body = b"Missing Metadata-Flavor: Google"
        elif key in attrs:
          handler.send_response(200)
          body = attrs[key].encode()
        else:
          handler.send_response(404)
          body = b"not found"
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

      def log_message(handler, *args):  # pylint: disable=no-self-argument
        del args

    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.address = f"127.0.0.1:{self._server.server_address[1]}"
    threading.Thread(target=self._server.serve_forever, daemon=True).start()

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()


_PROBE = '''\
"""Test-only: JAX believes it runs on a Cloud TPU VM. At import its probe finds no TPU chips,
so it leaves running_in_cloud_tpu_vm False and sets TPU_SKIP_MDS_QUERY; both are undone."""
import os
if os.environ.get("DAPO_TEST_FAKE_TPU_VM") == "1":
  import jax  # runs the probe
  from jax._src import cloud_tpu_init
  os.environ.pop("TPU_SKIP_MDS_QUERY", None)
  from jax._src.clusters import cloud_tpu_cluster, cluster
  cloud_tpu_init.running_in_cloud_tpu_vm = True
  cloud_tpu_cluster.running_in_cloud_tpu_vm = True
  cluster.running_in_cloud_tpu_vm = True
'''


def write_tpu_vm_probe(directory: str) -> str:
  """Writes the probe patch as ``directory/sitecustomize.py``; put ``directory`` on PYTHONPATH."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
    f.write(_PROBE)
  return directory


def tpu_worker_env(base: dict[str, str], metadata: MetadataServer, probe_dir: str,
                   coordinator_port: int, local_devices: int) -> dict[str, str]:
  """What a TPU VM worker's process sees: only the metadata server says it is part of a pod."""
  env = worker_env(base, local_devices)
  env.update(GCE_METADATA_IP=metadata.address, DAPO_TEST_FAKE_TPU_VM="1",
             JAX_COORDINATOR_PORT=str(coordinator_port))  # 8482 on a real pod
  env["PYTHONPATH"] = os.pathsep.join(p for p in (probe_dir, env.get("PYTHONPATH")) if p)
  return env


def _write_exe(path: str, text: str) -> str:
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
  return path


_GCLOUD = '''\
#!{python}
"""Fake gcloud (tests/cluster_fakes.py): Cloud TPU VM verbs on local processes."""
import json, os, shutil, subprocess, sys
sys.path.insert(0, {tests_dir!r})
import cluster_fakes as fakes

cfg = json.load(open({cfg_path!r}))
argv = sys.argv[1:]
with open(cfg["calls"], "a") as f:
  f.write(json.dumps(argv) + "\\n")
if argv[:3] != ["compute", "tpus", "tpu-vm"] or len(argv) < 5:
  sys.exit("fake gcloud: only 'compute tpus tpu-vm VERB NAME ...' is simulated")
verb, rest = argv[3], argv[4:]
# Positional arguments: NAME for most verbs; SRC... NAME:DEST for scp.
values = {{i + 1 for i, a in enumerate(rest) if a in ("--zone", "--worker", "--command",
                                                    "--accelerator-type", "--version",
                                                    "--format")}}
positional = [a for i, a in enumerate(rest) if not a.startswith("--") and i not in values]
name = positional[-1].split(":", 1)[0]


def opt(flag, default=None):
  for i, a in enumerate(rest):
    if a == flag:
      return rest[i + 1]
    if a.startswith(flag + "="):
      return a.split("=", 1)[1]
  return default


state_path = os.path.join(cfg["root"], f"tpu_{{name}}.json")
vm = json.load(open(state_path)) if os.path.exists(state_path) else None
homes = [os.path.join(cfg["root"], f"{{name}}-w{{i}}") for i in range(cfg["num_workers"])]


def workers():
  w = opt("--worker", "0")
  return range(len(homes)) if w == "all" else [int(w)]


def remote(path, i):
  path = path.split(":", 1)[1]
  path = path[2:] if path.startswith("~/") else path
  return os.path.join(homes[i], path)


if verb == "describe":
  if vm is None:
    sys.exit(f"ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: {{name}}")
  print(vm["state"])
elif verb == "create":
  if vm is not None:
    sys.exit(f"ERROR: (gcloud.compute.tpus.tpu-vm.create) ALREADY_EXISTS: {{name}}")
  for h in homes:
    os.makedirs(h)
  json.dump({{"state": "READY", "type": opt("--accelerator-type"),
             "version": opt("--version")}}, open(state_path, "w"))
elif verb == "delete":
  if vm is None:
    sys.exit(f"ERROR: NOT_FOUND: {{name}}")
  for h in homes:  # a new VM comes with new disks
    shutil.rmtree(h, ignore_errors=True)
  os.remove(state_path)
elif verb in ("scp", "ssh"):
  if vm is None or vm["state"] != "READY":
    sys.exit(f"ERROR: {{name}} is not READY ({{vm and vm['state']}})")
  if verb == "scp":
    *sources, dst = positional
    for i in workers():
      for src in sources:
        shutil.copy(src, remote(dst, i))
  else:
    cmd = opt("--command")
    port = fakes.free_port()
    procs = []
    for i in workers():
      env = fakes.tpu_worker_env(dict(os.environ), fakes.MetadataServerRef(cfg["metadata"][i]),
                                 cfg["probe_dir"], port, cfg["local_devices"])
      env.update(HOME=homes[i], TMUX_TMPDIR=homes[i])
      procs.append(subprocess.Popen(["bash", "-c", cmd], env=env, cwd=homes[i]))
    sys.exit(max(p.wait() for p in procs))
else:
  sys.exit(f"fake gcloud: tpu-vm {{verb}} is not simulated")
'''


class MetadataServerRef:
  """The address of a MetadataServer running in another process (the test's)."""

  def __init__(self, address: str):
    self.address = address


class FakeTpuCloud:
  """A TPU slice of ``num_workers`` local workers behind a fake ``gcloud``."""

  def __init__(self, root: str, num_workers: int = 2, local_devices: int = 4):
    self.root = root
    self.bin = os.path.join(root, "bin")
    os.makedirs(self.bin, exist_ok=True)
    self.metadata = [MetadataServer(i, num_workers) for i in range(num_workers)]
    self.calls_path = os.path.join(root, "gcloud_calls.jsonl")
    cfg = {"root": root, "num_workers": num_workers, "local_devices": local_devices,
           "metadata": [m.address for m in self.metadata], "calls": self.calls_path,
           "probe_dir": write_tpu_vm_probe(os.path.join(root, "probe"))}
    cfg_path = os.path.join(root, "fake_cloud.json")
    with open(cfg_path, "w") as f:
      json.dump(cfg, f)
    _write_exe(os.path.join(self.bin, "gcloud"), _GCLOUD.format(
        python=sys.executable, tests_dir=os.path.dirname(os.path.abspath(__file__)),
        cfg_path=cfg_path))

  def env(self, base: dict[str, str]) -> dict[str, str]:
    """The environment to run a launch script in: the fake gcloud first on PATH."""
    return {**base, "PATH": os.pathsep.join([self.bin, base.get("PATH", "")])}

  def calls(self) -> list[list[str]]:
    if not os.path.exists(self.calls_path):
      return []
    with open(self.calls_path) as f:
      return [json.loads(line) for line in f]

  def home(self, name: str, worker: int) -> str:
    return os.path.join(self.root, f"{name}-w{worker}")

  def vm(self, name: str) -> dict[str, Any] | None:
    path = os.path.join(self.root, f"tpu_{name}.json")
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  def preempt(self, name: str) -> None:
    """What a spot preemption leaves: the TPU in state PREEMPTED, unusable until recreated."""
    vm = self.vm(name)
    assert vm is not None, f"no TPU {name}"
    with open(os.path.join(self.root, f"tpu_{name}.json"), "w") as f:
      json.dump({**vm, "state": "PREEMPTED"}, f)

  def close(self) -> None:
    for m in self.metadata:
      m.close()


_SRUN = '''\
#!{python}
"""Fake srun (tests/cluster_fakes.py): SLURM_NNODES tasks as local processes."""
import os, subprocess, sys
sys.path.insert(0, {tests_dir!r})
import cluster_fakes as fakes

args, i = sys.argv[1:], 0
export = "ALL"
while i < len(args) and args[i].startswith("-"):
  if args[i].startswith("--export="):
    export = args[i].split("=", 1)[1]
  i += 1
cmd = args[i:]
with open(os.environ["FAKE_SRUN_CALLS"], "a") as f:
  f.write(" ".join(sys.argv) + "\\n")
# srun's --export: comma-separated NAME or NAME=value items (a value cannot hold a comma).
items = export.split(",")
if items[0] != "ALL":
  sys.exit("fake srun: only --export=ALL[,...] is simulated")
extra = {{}}
for item in items[1:]:
  name, eq, value = item.partition("=")
  if not name.isidentifier():
    sys.exit(f"srun: error: --export: {{item!r}} is not a variable name")
  if eq:
    extra[name] = value
n = int(os.environ["SLURM_NNODES"])
port = fakes.free_port()
procs = []
for rank in range(n):
  env = fakes.worker_env(dict(os.environ), int(os.environ["FAKE_SRUN_LOCAL_DEVICES"]))
  env.update({{k: v for k, v in os.environ.items() if k.startswith("SLURM_")}})
  for k in ("JAX_LOCAL_DEVICE_IDS", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    if k in os.environ:
      env[k] = os.environ[k]
  env.update(extra)
  env.update(SLURM_NTASKS=str(n), SLURM_PROCID=str(rank), SLURM_LOCALID="0",
             SLURM_NODEID=str(rank), SLURM_STEP_NODELIST="localhost",
             SLURM_STEP_NUM_NODES=str(n), JAX_COORDINATOR_PORT=str(port))
  procs.append(subprocess.Popen(cmd, env=env))
sys.exit(max(p.wait() for p in procs))
'''


_SCONTROL = '''\
#!{python}
"""Fake scontrol (tests/cluster_fakes.py): ``show hostnames [LIST]``, comma lists only."""
import os, sys
args = sys.argv[1:]
if args[:2] != ["show", "hostnames"]:
  sys.exit(f"fake scontrol: only 'show hostnames' is simulated, not {{args}}")
names = args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"]
if "[" in names:
  sys.exit("fake scontrol: bracket ranges are not simulated")
print("\\n".join(names.split(",")))
'''


def write_fake_srun(bin_dir: str) -> str:
  """An ``srun`` and an ``scontrol`` in ``bin_dir``; the caller sets SLURM_JOB_ID, SLURM_NNODES,
  SLURM_GPUS_ON_NODE, FAKE_SRUN_LOCAL_DEVICES and FAKE_SRUN_CALLS (a file the calls are
  appended to), and SLURM_JOB_NODELIST where the script asks scontrol for it."""
  os.makedirs(bin_dir, exist_ok=True)
  _write_exe(os.path.join(bin_dir, "scontrol"), _SCONTROL.format(python=sys.executable))
  return _write_exe(os.path.join(bin_dir, "srun"), _SRUN.format(
      python=sys.executable, tests_dir=os.path.dirname(os.path.abspath(__file__))))

