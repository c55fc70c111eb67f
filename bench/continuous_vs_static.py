r"""Continuous vs static batching on a skewed workload (wall time, same requests, same rows).

    python bench/continuous_vs_static.py            # tiny preset, 16 rows, 160 requests

Workload: 10% of the requests have an 8x longer response budget than the rest; EOS is disabled,
so budgets alone set the lengths. Static batching (`rollout.sampler.Sampler`, what a fixed-R
trainer runs) takes the requests 16 at a time and decodes every batch to the longest budget;
continuous batching (`rollout.continuous.ContinuousSampler`) refills a slot as soon as its request
ends. Both are compiled before timing (a warm-up run of each). Ideal ratio = static decode steps /
(all response tokens / rows).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout.continuous import ContinuousSampler, Request
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams


def _workload(args) -> tuple[list[list[int]], list[int]]:
  rng = np.random.default_rng(args.seed)
  n_long = round(args.requests * args.long_frac)
  budgets = [args.short * args.long_factor] * n_long + [args.short] * (args.requests - n_long)
  budgets = rng.permutation(budgets).tolist()
  vocab = get_preset(args.preset).vocab_size
  prompts = [rng.integers(1, vocab, size=rng.integers(args.prompt_len // 2, args.prompt_len + 1))
             .tolist() for _ in budgets]
  return prompts, budgets


def _run_static(sampler, state, prompts, params, rows) -> int:
  """Left-padded batches of `rows` prompts, each decoded to params.max_new_tokens."""
  steps = 0
  for start in range(0, len(prompts), rows):
    chunk = prompts[start:start + rows]
    p = max(map(len, chunk))
    ids = np.zeros((rows, p), np.int32)
    mask = np.zeros((rows, p), bool)
    for i, q in enumerate(chunk):
      ids[i, p - len(q):], mask[i, p - len(q):] = q, True
    if len(chunk) < rows:
      mask[len(chunk):, -1] = True  # filler rows keep the shape static
    out = sampler.generate(state, jnp.asarray(ids), jnp.asarray(mask),
                           jax.random.key(start), params)
    steps += int(out.num_steps)  # blocks on the batch
  return steps


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--rows", type=int, default=16, help="concurrent rows (slots) of both")
  ap.add_argument("--requests", type=int, default=160)
  ap.add_argument("--short", type=int, default=16, help="budget of a short response")
  ap.add_argument("--long_factor", type=int, default=8)
  ap.add_argument("--long_frac", type=float, default=0.1)
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--chunk_steps", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3, help="timed runs of each (best is kept)")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  model = create_model(get_preset(args.preset), seed=args.seed)
  graphdef, state = nnx.split(model)
  prompts, budgets = _workload(args)
  r = max(budgets)
  params = SamplingParams(temperature=args.temperature, max_new_tokens=r, eos_ids=())
  requests = [Request(q, prompt_index=i, max_new_tokens=b)
              for i, (q, b) in enumerate(zip(prompts, budgets))]
  static = Sampler(graphdef)
  cont = ContinuousSampler(graphdef, num_slots=args.rows, chunk_steps=args.chunk_steps)

  runs = {"static": lambda: _run_static(static, state, prompts, params, args.rows),
          "continuous": lambda: cont.run(state, requests, jax.random.key(0), params)}
  best, out = {}, {}
  for name, fn in runs.items():
    out[name] = fn()  # compile
  for _ in range(args.repeats):  # alternate, so load drift on a shared machine hits both alike
    for name, fn in runs.items():
      t0 = time.perf_counter()
      out[name] = fn()
      best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
  t_static, static_steps = best["static"], out["static"]
  t_cont, batch = best["continuous"], out["continuous"]
  stats = cont.last_stats
  assert np.array_equal(np.asarray(batch.lengths), budgets), "a budget was not respected"
  tokens = sum(budgets)
  ideal = static_steps / (tokens / args.rows)

  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; preset {args.preset}; "
        f"{args.requests} requests on {args.rows} rows; budgets {args.short} "
        f"(x{args.long_factor} for {args.long_frac:.0%}); prompts <= {args.prompt_len} tokens; "
        f"T={args.temperature}")
  print(f"{'engine':<12}{'wall s':>9}{'decode steps':>14}{'tokens/s':>11}{'step ms':>9}")
  for name, t, steps in (("static", t_static, static_steps),
                         ("continuous", t_cont, stats.decode_steps)):
    print(f"{name:<12}{t:>9.3f}{steps:>14d}{tokens / t:>11.0f}{1e3 * t / steps:>9.2f}")
  print(f"speed-up {t_static / t_cont:.2f}x (ideal {ideal:.2f}x); continuous: {stats.refills} "
        f"refills, {stats.chunks} chunks, slot utilization {stats.utilization:.1%}")


if __name__ == "__main__":
  main()
