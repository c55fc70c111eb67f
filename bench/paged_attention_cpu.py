r"""Decode attention per token: paged reference vs the dense cache, at several capacities.

    python bench/paged_attention_cpu.py                       # N=64 slots, tiny_cpu heads
    python bench/paged_attention_cpu.py --capacities 512,4096,16384 --repeats 5

One decode step's attention (one layer) over N slots whose live lengths follow a long-tail mix
(mean `--mean_length`, the longest capped by the smallest capacity), timed for:

* dense: `attention.decode_attention` over an [N, K, E, S] cache of capacity S (what the
  continuous engine runs today: every slot's whole reservation, the empty part masked);
* paged: `paged_attention.reference_paged_attention` over pages of `--page_size` tokens, the
  same K/V content, page tables sized for capacity S (M = S / page_size).

Same live lengths at every capacity, timed interleaved (the CPU is shared; the ratios in one run
are what count), compile excluded. Prints the CPU and, per capacity, microseconds per slot-token
(time / N) and the dense / paged ratio. A benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.models import attention
from dapo_jax.models import paged_attention as pa


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def long_tail_lengths(rng, n: int, mean: int, cap: int) -> np.ndarray:
  """Lognormal lengths (sigma 1, a long tail) scaled to `mean`, in [1, cap]."""
  x = rng.lognormal(0.0, 1.0, size=n)
  return np.clip(np.round(x / x.mean() * mean), 1, cap).astype(np.int32)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv_heads", type=int, default=2)
  ap.add_argument("--head_dim", type=int, default=32)
  ap.add_argument("--page_size", type=int, default=16)
  ap.add_argument("--mean_length", type=int, default=96)
  ap.add_argument("--capacities", default="512,4096,16384")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--iters", type=int, default=10)
  args = ap.parse_args()
  caps = [int(c) for c in args.capacities.split(",")]
  n, h, kh, e, t = args.slots, args.heads, args.kv_heads, args.head_dim, args.page_size
  rng = np.random.default_rng(0)
  length = long_tail_lengths(rng, n, args.mean_length, min(caps))
  q = jnp.asarray(rng.normal(size=(n, h, e)), jnp.float32)
  dense_fn = jax.jit(attention.decode_attention)
  paged_fn = jax.jit(pa.reference_paged_attention)

  cases = {}
  for s in caps:
    m = s // t
    pages = n * m  # a pool as large as the dense cache: the same memory, only tables differ
    k_pool = jnp.asarray(rng.normal(size=(kh, pages, t, e)), jnp.float32)
    v_pool = jnp.asarray(rng.normal(size=(kh, pages, t, e)), jnp.float32)
    table = jnp.asarray(rng.permutation(pages).reshape(n, m), jnp.int32)
    idx = jnp.maximum(table, 0)
    k_dense = jnp.take(k_pool, idx, axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kh, s, e)
    v_dense = jnp.take(v_pool, idx, axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kh, s, e)
    valid = jnp.arange(s)[None] < jnp.asarray(length)[:, None]
    dense_args = (q, k_dense.transpose(0, 1, 3, 2), v_dense, valid)
    paged_args = (q, k_pool, v_pool, table, jnp.asarray(length))
    diff = jnp.abs(dense_fn(*dense_args) - paged_fn(*paged_args)).max()  # compiles both
    cases[s] = dict(dense=dense_args, paged=paged_args, diff=float(diff),
                    times={"dense": [], "paged": []})

  def timed(fn, a) -> float:
    jax.block_until_ready(fn(*a))
    t0 = time.perf_counter()
    for _ in range(args.iters):
      out = fn(*a)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / args.iters

  for _ in range(args.repeats):  # interleaved: every case sees the same background load
    for s, c in cases.items():
      c["times"]["dense"].append(timed(dense_fn, c["dense"]))
      c["times"]["paged"].append(timed(paged_fn, c["paged"]))

  print(f"CPU: {cpu_name()} ({jax.device_count()} JAX devices, {jax.default_backend()})")
  print(f"N={n} slots, H={h}, K={kh}, E={e}, page={t}; live lengths mean {length.mean():.0f}, "
        f"max {length.max()}, median of {args.repeats} x {args.iters} calls")
  print(f"{'capacity':>9} {'dense us/tok':>13} {'paged us/tok':>13} {'dense/paged':>12} "
        f"{'max |diff|':>11}")
  for s, c in cases.items():
    d, p = (statistics.median(c["times"][k]) * 1e6 / n for k in ("dense", "paged"))
    print(f"{s:>9} {d:>13.3f} {p:>13.3f} {d / p:>12.2f} {c['diff']:>11.1e}")


if __name__ == "__main__":
  main()
