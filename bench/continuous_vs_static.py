r"""Continuous vs static batching on a long-tail length mix (same rows, same lengths, one run).

    python bench/continuous_vs_static.py     # tiny preset, 64 prompts x G=16 on 64 slots, R=128

Workload (shaped like the DAPO paper's rollouts): G = 16 responses per prompt whose lengths are
drawn so that about 5% hit the maximum R and the mean is about R/4 (the rest Beta(1.2, 4.5)
scaled to [1, R)). A deterministic stand-in places the stops: EOS is disabled and each row gets
its length as its own budget, so both engines decode exactly the same lengths.

* static (`rollout.sampler.Sampler`, what a fixed-shape trainer runs): `rows / G` prompts per
  call, each call decoding until its longest row ends (R here: EOS is off; with a real stop token
  the static sampler stops at the longest row, and the script prints how many calls hold a
  row at R).
* continuous (`rollout.continuous.ContinuousSampler`): the same number of slots, refilled inside
  the compiled loop as rows end.

Both are compiled before timing (one warm-up run each) and timed alternately (the machine may be
shared). Useful tokens = the response tokens of all rows; slot utilisation = useful tokens /
decoded slot-steps; ideal speed-up = static slot-steps / useful tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout.continuous import ContinuousSampler
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams


def long_tail_lengths(num: int, max_len: int, at_max: float, rng: np.random.Generator
                      ) -> np.ndarray:
  """`num` lengths in [1, max_len]: a share `at_max` exactly max_len, the rest Beta(1.2, 4.5)
  scaled (mean about 0.21 max_len, so the whole mix averages about max_len / 4)."""
  lengths = np.maximum(1, (rng.beta(1.2, 4.5, num) * (max_len - 1)).astype(np.int64) + 1)
  lengths[rng.random(num) < at_max] = max_len
  return lengths.astype(np.int32)


def _run_static(sampler, state, ids, mask, params, prompts_per_call, g) -> int:
  """Calls of `prompts_per_call` prompts x g rows, each decoded to its end; returns steps."""
  steps = 0
  for start in range(0, ids.shape[0], prompts_per_call):
    sl = slice(start, start + prompts_per_call)
    out = sampler.generate(state, jnp.asarray(ids[sl]), jnp.asarray(mask[sl]),
                           jax.random.key(start), params, num_samples=g)
    steps += int(out.num_steps)  # blocks on the call
  return steps


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--rows", type=int, default=64, help="concurrent rows (slots) of both")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--g", type=int, default=16, help="responses per prompt")
  ap.add_argument("--max_len", type=int, default=128, help="R: the longest response")
  ap.add_argument("--at_max", type=float, default=0.05, help="share of responses at R")
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--chunk_steps", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=2, help="timed runs of each (best is kept)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  if args.rows % args.g:
    raise SystemExit(f"--rows ({args.rows}) must be a multiple of --g ({args.g}).")

  rng = np.random.default_rng(args.seed)
  cfg = get_preset(args.preset)
  graphdef, state = nnx.split(create_model(cfg, seed=args.seed))
  n_rows = args.prompts * args.g
  lengths = long_tail_lengths(n_rows, args.max_len, args.at_max, rng)
  ids = np.zeros((args.prompts, args.prompt_len), np.int32)
  mask = np.zeros_like(ids, bool)
  for i, n in enumerate(rng.integers(args.prompt_len // 2, args.prompt_len + 1, args.prompts)):
    ids[i, -n:], mask[i, -n:] = rng.integers(1, cfg.vocab_size, n), True
  params = SamplingParams(temperature=1.0, max_new_tokens=args.max_len, eos_ids=())
  per_call = args.rows // args.g
  static = Sampler(graphdef)
  cont = ContinuousSampler(graphdef, num_slots=args.rows, chunk_steps=args.chunk_steps,
                           max_prefill_length=args.prompt_len)

  runs = {"static": lambda: _run_static(static, state, ids, mask, params, per_call, args.g),
          "continuous": lambda: cont.generate(state, ids, mask, jax.random.key(0), params,
                                              args.g, max_new_tokens=lengths)}
  best, out = {}, {}
  for name, fn in runs.items():
    out[name] = fn()  # compile
  for _ in range(args.repeats):
    for name, fn in runs.items():
      t0 = time.perf_counter()
      out[name] = fn()
      best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
  batch, stats = out["continuous"], cont.last_stats
  assert np.array_equal(np.asarray(batch.lengths), lengths), "a budget was not respected"
  useful = int(lengths.sum())
  static_steps = out["static"]
  calls_at_max = int((lengths.reshape(-1, args.rows).max(1) == args.max_len).sum())

  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices); "
        f"preset {args.preset}; {args.prompts} prompts x G={args.g} = {n_rows} rows on "
        f"{args.rows} slots; R={args.max_len}; lengths mean {lengths.mean():.1f} "
        f"({lengths.mean() / args.max_len:.2f} R), {np.mean(lengths == args.max_len):.1%} at R; "
        f"static calls holding a row at R: {calls_at_max}/{n_rows // args.rows}")
  print(f"{'engine':<12}{'wall s':>8}{'steps':>7}{'slot util':>10}{'useful tok/s':>14}"
        f"{'step ms':>9}")
  rows = (("static", best["static"], static_steps, useful / (static_steps * args.rows)),
          ("continuous", best["continuous"], stats.decode_steps, stats.utilization))
  for name, t, steps, util in rows:
    print(f"{name:<12}{t:>8.2f}{steps:>7d}{util:>10.1%}{useful / t:>14.0f}"
          f"{1e3 * t / steps:>9.2f}")
  ideal = static_steps * args.rows / useful
  print(f"continuous / static useful-token throughput: {best['static'] / best['continuous']:.2f}x "
        f"(ideal {ideal:.2f}x); continuous: {stats.chunks} chunks (host reads), "
        f"{stats.enqueues} enqueues, {stats.prompts_prefilled} prompts prefilled")


if __name__ == "__main__":
  main()
