"""Two processes restore the same step, or fail together (2 processes x 2 CPU devices).

  * per-host checkpoint directories that differ (a workdir on each TPU VM's local disk): both
    raise, naming the fix, instead of mixing shards of different steps;
  * damage seen by process 1 only: both give the step up and resume the previous one;
  * an I/O error on process 1 only: both retry and resume the newest step.

The faults are injected at Orbax's read of a step on one process (a real exception object
raised before the real read). This file is also the worker: ``python
tests/test_restore_agreement.py OUT_DIR`` with the JAX_* variables set.
"""

import json
import os
import shutil
import subprocess
import sys
from tests.processes import free_port, wait_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed):
  import jax  # pylint: disable=g-import-not-at-top
  return {"w": jax.random.normal(jax.random.key(seed), (16, 8))}


def _abstract():
  """Replicated over every device of every process."""
  import jax  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return {"w": jax.ShapeDtypeStruct((16, 8), jax.numpy.float32, sharding=sharding)}


def _prepare(out: str) -> None:
  """Checkpoints written by one process, before the 2-process run."""
  from dapo_jax.checkpoints import orbax as ock  # pylint: disable=g-import-not-at-top
  for name, steps in (("host0", [1, 2]), ("host1", [1]), ("shared", [1, 2])):
    with ock.TrainCheckpointer(os.path.join(out, name), async_save=False) as ck:
      for s in steps:
        ck.save(s, _state(s), _state(s))


def _worker(out: str) -> None:
  sys.path.insert(0, ROOT)
  from dapo_jax.infra import distributed  # pylint: disable=g-import-not-at-top
  distributed.maybe_initialize()
  import jax  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import orbax as ock  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  result = {}

  def restore(ck):
    try:
      return ck.restore(abstract_params=_abstract()).step
    except Exception as e:  # pylint: disable=broad-except
      return f"{type(e).__name__}: {e}"

  with ock.TrainCheckpointer(os.path.join(out, f"host{me}"), async_save=False) as ck:
    result["split"] = restore(ck)

  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  real_read = ocp.CompositeCheckpointHandler.restore

  def inject(error, times):
    """Orbax's read of step 2 raises ``error`` on process 1, the first ``times`` times."""
    calls = [0]

    def flaky(handler, directory, *args, **kwargs):
      if me == 1 and os.path.basename(str(directory)) == "2":
        calls[0] += 1
        if calls[0] <= times:
          raise error
      return real_read(handler, directory, *args, **kwargs)
    ocp.CompositeCheckpointHandler.restore = flaky

  shared = os.path.join(out, "shared")
  with ock.TrainCheckpointer(shared, async_save=False, retry_backoff_s=0.05) as ck:
    inject(ConnectionResetError(104, "Connection reset by peer"), times=2)
    result["io_on_one"] = restore(ck)
  with ock.TrainCheckpointer(shared, async_save=False, retry_backoff_s=0.05) as ck:
    inject(ValueError("OUT_OF_RANGE: Requested byte range [0, 512) is not valid for value "
                          "of size 100"), times=99)
    result["damage_on_one"] = restore(ck)
    result["steps_after"] = ck.all_steps()
  with open(os.path.join(out, f"result{me}.json"), "w") as f:
    json.dump(result, f)



def test_processes_agree_on_the_restored_step(tmp_path):
  out = str(tmp_path)
  _prepare(out)
  coord = f"127.0.0.1:{free_port()}"
  procs = []
  for i in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, JAX_COORDINATOR_ADDRESS=coord,
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), out], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = wait_all(procs, 300, "a restoring process")
  results = [json.load(open(os.path.join(out, f"result{i}.json"))) for i in range(2)]
  for r in results:
    assert r["split"].startswith("RuntimeError: The processes see different checkpoints")
    assert "gs://" in r["split"]
    assert r["io_on_one"] == 2  # retried on both processes, nothing skipped
    assert r["damage_on_one"] == 1 and r["steps_after"] == [1]
  assert "retry 1/4" in logs[0]  # process 0 read fine but waited for process 1's retry
  moved = os.listdir(os.path.join(out, "shared", "corrupt"))
  assert [m.split("-")[0] for m in moved] == ["2"]
  shutil.rmtree(os.path.join(out, "shared"))


if __name__ == "__main__":
  _worker(sys.argv[1])
