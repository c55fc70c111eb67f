"""Do 2-process CPU runs exit cleanly? Counts exit-time aborts (docs/cloud.md, "Exit of a
multi-process run").

  python bench/distributed_exit.py --pairs 240 --parallel 4             # JAX's own shutdown
  python bench/distributed_exit.py --pairs 240 --parallel 4 --through dapo_jax

Each pair is two processes of 2 CPU devices on 127.0.0.1 that start jax.distributed, run one
allgather and one sharded sum (gloo), print their result and exit. ``--through jax`` starts the
runtime with ``jax.distributed.initialize`` alone, so JAX stops the coordinator's service right
after the shutdown barrier; ``--through dapo_jax`` goes through
``dapo_jax.infra.distributed.maybe_initialize``, whose coordinator waits
``SERVICE_SHUTDOWN_GRACE_S`` first. A pair is bad when a process exits non-zero (a CI run once saw
the coordinator abort in ``server.cc``: ``Check failed: queue.Pop() == nullptr``); the first lines
of each bad pair's output are printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.processes import free_port, process_env  # noqa: E402  # pylint: disable=wrong-import-position

_WORKER = textwrap.dedent("""
    import os, sys
    import jax
    if sys.argv[1] == "jax":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], 2,
                                 int(os.environ["JAX_PROCESS_ID"]))
    else:
      from dapo_jax.infra import distributed
      assert distributed.maybe_initialize()
    import numpy as np, jax.numpy as jnp
    from jax.experimental import multihost_utils
    total = multihost_utils.process_allgather(np.asarray([jax.process_index() + 1])).sum()
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    ones = jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")),
        np.ones(jax.local_device_count(), np.float32))
    assert int(total) == 3 and float(jnp.sum(ones)) == 4.0
    print("RESULT ok", flush=True)
""")


def run_pair(through: str, timeout_s: float) -> tuple[list[int], list[str]]:
  """Both processes' return codes and outputs."""
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-c", _WORKER, through], cwd=ROOT, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      env=process_env(ROOT, 2, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}))
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      outs.append(p.communicate()[0] + "\n(timed out)")
  return [p.returncode for p in procs], outs


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pairs", type=int, default=40)
  p.add_argument("--parallel", type=int, default=2, help="pairs running at once")
  p.add_argument("--through", choices=("jax", "dapo_jax"), default="jax")
  p.add_argument("--timeout_s", type=float, default=120.0)
  args = p.parse_args(argv)
  start, bad = time.perf_counter(), []
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    for rcs, outs in pool.map(lambda _: run_pair(args.through, args.timeout_s),
                              range(args.pairs)):
      if any(rcs) or not all("RESULT ok" in o for o in outs):
        bad.append(rcs)
        failing = next(o for o, rc in zip(outs, rcs) if rc) if any(rcs) else outs[0]
        print(f"bad pair {rcs}:", failing[-800:], flush=True)
  print(json.dumps({"through": args.through, "pairs": args.pairs, "parallel": args.parallel,
                    "bad": len(bad), "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
  main()
