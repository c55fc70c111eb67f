r"""Decode attention per token: the paged reference vs the dense cache, on long-tail live lengths.

    python bench/paged_attention_cpu.py          # N=64 slots, tiny_cpu heads, both goals
    python bench/paged_attention_cpu.py --repeats 9 --reference_at d8b309d \
        --out bench/results/paged_attention_cpu_before.json     # the reference before the rewrite

One decode step's attention (one layer) over N slots, timed for:

* dense: `attention.decode_attention` over an [N, K, E, S] cache of capacity S (what the
  continuous engine runs today: every slot's whole reservation, the empty part masked);
* paged: `paged_attention.reference_paged_attention` (the "xla" path) over pages of
  `--page_size` tokens holding the same K/V content, page tables sized for capacity S.

Live lengths follow the long-tail bench's mix (`continuous_vs_static.long_tail_lengths`: 5% at
the budget R, the rest Beta(1.2, 4.5) below it, mean about R / 4), drawn once per mix:

* goal 1 (issue 28, measure 1): R = 4 x `--mean_length` (mean about 256) at capacity
  `--goal_capacity` (4096); dense / paged >= 3;
* goal 2: R = the smallest capacity (512), the same lengths at every capacity in
  `--capacities`; paged time per token at the largest / at the smallest capacity <= 1.3.

Cases are timed interleaved, `--repeats` rounds of `--iters` calls each (a round keeps each
case's median call), compile excluded; the CPU is shared, so ratios are taken within a round and
their medians over rounds are reported (and written to `--out`). A benchmark, not a test:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import table1_cpu  # noqa: E402  (host_info)
from continuous_vs_static import long_tail_lengths  # noqa: E402

from dapo_jax.models import attention  # noqa: E402
from dapo_jax.models import paged_attention as pa  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def reference_at(commit: str):
  """`reference_paged_attention` as of `commit` (the before/after table)."""
  src = subprocess.run(["git", "show", f"{commit}:dapo_jax/models/paged_attention.py"], cwd=ROOT,
                       capture_output=True, text=True, check=True).stdout
  module = types.ModuleType(f"paged_attention_{commit}")
  exec(compile(src, f"paged_attention.py@{commit}", "exec"), module.__dict__)  # pylint: disable=exec-used
  return module.reference_paged_attention


def make_case(rng, q, length, s: int, kh: int, e: int, t: int, scatter: bool = False):
  """Dense and paged operands with the same K/V content: a pool as large as the dense cache
  (the same memory, only the tables differ). The live pages are the pool's lowest ids in a
  random order, as `paged_kv` hands out the lowest free pages first (the live set stays at
  the bottom of the pool, its order scattered by churn); `scatter`: anywhere in the pool."""
  n = q.shape[0]
  m = s // t
  pages = n * m
  k_pool = jnp.asarray(rng.normal(size=(kh, pages, t, e)), jnp.float32)
  v_pool = jnp.asarray(rng.normal(size=(kh, pages, t, e)), jnp.float32)
  live_NxM = np.arange(m)[None] < -(-length[:, None] // t)
  ids = rng.permutation(pages)[:live_NxM.sum()] if scatter else rng.permutation(live_NxM.sum())
  table = np.full((n, m), -1, np.int32)
  table[live_NxM] = ids
  idx = jnp.maximum(jnp.asarray(table), 0)
  k_dense = jnp.take(k_pool, idx, axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kh, s, e)
  v_dense = jnp.take(v_pool, idx, axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kh, s, e)
  valid = jnp.arange(s)[None] < jnp.asarray(length)[:, None]
  return dict(dense=(q, k_dense.transpose(0, 1, 3, 2), v_dense, valid),
              paged=(q, k_pool, v_pool, jnp.asarray(table), jnp.asarray(length)))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv_heads", type=int, default=2)
  ap.add_argument("--head_dim", type=int, default=32)
  ap.add_argument("--page_size", type=int, default=16)
  ap.add_argument("--mean_length", type=int, default=256, help="goal 1 mix: R = 4 x this")
  ap.add_argument("--goal_capacity", type=int, default=4096)
  ap.add_argument("--capacities", default="512,4096,16384", help="goal 2 (R = the smallest)")
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--scatter", action="store_true",
                  help="live pages anywhere in the pool (default: its lowest ids, shuffled)")
  ap.add_argument("--reference_at", default="",
                  help="a git commit: time its paged_attention.reference_paged_attention")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/paged_attention_cpu.json"))
  args = ap.parse_args()
  caps = [int(c) for c in args.capacities.split(",")]
  n, h, kh, e, t = args.slots, args.heads, args.kv_heads, args.head_dim, args.page_size
  rng = np.random.default_rng(args.seed)
  q = jnp.asarray(rng.normal(size=(n, h, e)), jnp.float32)
  mixes = {"goal1": long_tail_lengths(n, 4 * args.mean_length, 0.05, rng),
           "goal2": long_tail_lengths(n, min(caps), 0.05, rng)}
  dense_fn = jax.jit(attention.decode_attention)
  paged_fn = jax.jit(reference_at(args.reference_at) if args.reference_at
                     else pa.reference_paged_attention)

  cases = {("goal1", args.goal_capacity): None, **{("goal2", s): None for s in caps}}
  for mix, s in cases:
    c = make_case(rng, q, mixes[mix], s, kh, e, t, args.scatter)
    diff = jnp.abs(dense_fn(*c["dense"]) - paged_fn(*c["paged"])).max()  # compiles both
    cases[mix, s] = dict(c, diff=float(diff), times={(f, clock): [] for f in ("dense", "paged")
                                                      for clock in CLOCKS})

  def timed(fn, a) -> dict[str, float]:
    """Per clock, the median of `--iters` single calls (a call another job's burst hits is
    dropped): wall time, and this process's CPU time (all threads; less sensitive to other
    jobs on the shared cores, but a path that uses both cores pays double)."""
    jax.block_until_ready(fn(*a))
    times = {clock: [] for clock in CLOCKS}
    for _ in range(args.iters):
      t0 = {clock: f() for clock, f in CLOCKS.items()}
      jax.block_until_ready(fn(*a))
      for clock, f in CLOCKS.items():
        times[clock].append(f() - t0[clock])
    return {clock: float(np.median(v)) for clock, v in times.items()}

  load = [os.getloadavg()[0]]
  for _ in range(args.repeats):  # interleaved: every case sees the same background load
    for c in cases.values():
      for f, fn in (("dense", dense_fn), ("paged", paged_fn)):
        for clock, v in timed(fn, c[f]).items():
          c["times"][f, clock].append(v)
  load.append(os.getloadavg()[0])

  host = table1_cpu.host_info()
  print(f"CPU: {host['cpu']} ({host['cpu_count']} cores, load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end, {jax.default_backend()}); N={n} slots, H={h}, K={kh}, E={e}, "
        f"page={t}, live pages {'anywhere in' if args.scatter else 'at the bottom of'} the pool; "
        f"median over {args.repeats} rounds of {args.iters} calls")
  result = dict(host=host, command=" ".join(["python"] + sys.argv), load_average=load, slots=n,
                reference_at=args.reference_at or host["commit"], heads=h, kv_heads=kh,
                head_dim=e, page_size=t, scatter=args.scatter,
                repeats=args.repeats, iters=args.iters, rows=[])
  print(f"{'mix':>6} {'mean':>5} {'max':>5} {'capacity':>8} {'dense us/tok':>13} "
        f"{'paged us/tok':>13} {'dense/paged':>12} {'(CPU time)':>11} {'max |diff|':>11}")
  for (mix, s), c in cases.items():
    row = dict(mix=mix, mean_length=float(mixes[mix].mean()), max_length=int(mixes[mix].max()),
               capacity=s, max_abs_diff=c["diff"])
    for clock in CLOCKS:
      d, p = (np.asarray(c["times"][f, clock]) * 1e6 / n for f in ("dense", "paged"))
      row[clock] = dict(dense_us_per_token=float(np.median(d)),
                        paged_us_per_token=float(np.median(p)),
                        dense_over_paged=float(np.median(d / p)))
    result["rows"].append(row)
    w = row["wall"]
    print(f"{mix:>6} {row['mean_length']:>5.0f} {row['max_length']:>5} {s:>8} "
          f"{w['dense_us_per_token']:>13.3f} {w['paged_us_per_token']:>13.3f} "
          f"{w['dense_over_paged']:>12.2f} {row['cpu']['dense_over_paged']:>11.2f} "
          f"{row['max_abs_diff']:>11.1e}")
  first = result["rows"][0]
  for clock in CLOCKS:
    goal2 = [np.asarray(cases["goal2", s]["times"]["paged", clock]) for s in caps]
    result[clock] = dict(
        goal1_dense_over_paged=first[clock]["dense_over_paged"],
        goal2_paged_largest_over_smallest=float(np.median(goal2[-1] / goal2[0])),
        goal2_paged_max_over_min=float(np.median(np.max(goal2, 0) / np.min(goal2, 0))))
    g = result[clock]
    print(f"{clock + ' time:':>10} goal 1, dense / paged at capacity {args.goal_capacity} (mean "
          f"{first['mean_length']:.0f}): {g['goal1_dense_over_paged']:.2f} (goal >= 3); goal 2, "
          f"paged per token at {caps[-1]} / {caps[0]}: "
          f"{g['goal2_paged_largest_over_smallest']:.2f}, max / min over {caps}: "
          f"{g['goal2_paged_max_over_min']:.2f} (goal <= 1.3)")
  if args.out:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
