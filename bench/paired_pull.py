"""Whether the rollout-process design extends to sides of several hosts (docs/overlap.md,
"Measurement 4"): two `jax.distributed` groups of 2 processes each (2 CPU devices a process)
on localhost. The "train" group makes one array sharded over its 4 devices and offers it
(`jax.experimental.transfer`); process i of the "rollout" group pulls it from process i of the
train group, into the same layout over its own 4 devices, and checks every shard it holds.

    python bench/paired_pull.py            # prints each process's shards, equality and time

Nothing is written; the exit status is 0 when every rollout process got its shards intact.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ELEMENTS = 1 << 22  # float32: 16 MiB, 4 MiB a device


def _child(group: str, pid: int, coord: str, base: int) -> None:
  os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import transfer
  from jax.sharding import NamedSharding, PartitionSpec
  # pylint: enable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coord, num_processes=2, process_id=pid)
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices())
  sharding = NamedSharding(mesh, PartitionSpec("x"))
  port = base + (0 if group == "train" else 10) + pid
  server = transfer.start_transfer_server(jax.local_devices()[0].client, f"127.0.0.1:{port}",
                                          ["127.0.0.1:0"])
  if group == "train":
    x = jax.jit(lambda: jnp.arange(ELEMENTS, dtype=jnp.float32), out_shardings=sharding)()
    server.await_pull(7, [x])
    print(f"train {pid}: offered {[s.index[0] for s in x.addressable_shards]}", flush=True)
    time.sleep(30)  # until the pull is served
    return
  conn = server.connect(f"127.0.0.1:{base + pid}")  # the paired training process
  t0 = time.perf_counter()
  (y,) = conn.pull(7, [jax.ShapeDtypeStruct((ELEMENTS,), jnp.float32, sharding=sharding)])
  jax.block_until_ready(y)
  seconds = time.perf_counter() - t0
  want = np.arange(ELEMENTS, dtype=np.float32)
  ok = all(np.array_equal(np.asarray(s.data), want[s.index]) for s in y.addressable_shards)
  print(f"rollout {pid}: pulled {[s.index[0] for s in y.addressable_shards]} from train {pid}, "
        f"{'intact' if ok else 'WRONG'}, {seconds:.3f} s", flush=True)
  sys.exit(0 if ok else 1)


def main() -> None:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tests.processes import free_port  # pylint: disable=g-import-not-at-top
  base = free_port()
  coords = {g: f"127.0.0.1:{free_port()}" for g in ("train", "rollout")}
  procs = {(g, i): subprocess.Popen([sys.executable, __file__, g, str(i), coords[g], str(base)])
           for g in ("train", "rollout") for i in (0, 1)}
  codes = {k: p.wait(timeout=180) for k, p in procs.items()}
  sys.exit(0 if all(c == 0 for c in codes.values()) else 1)


if __name__ == "__main__":
  if len(sys.argv) == 5:
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
  else:
    main()
