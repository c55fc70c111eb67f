r"""The paged decode-attention kernel on this machine's accelerator, checked and timed.

    python bench/paged_kernel_check.py              # GPU: pallas_gpu, TPU: ragged_tpu, CPU: xla
    python bench/paged_kernel_check.py --impl xla   # any backend: the pure-JAX reference

Two checks, one JSON (bench/results/paged_kernel_check_<platform>.json):

1. The kernel against dense `attention.decode_attention` on the long-tail mix
   (`bench/continuous_vs_static.py`'s lengths) at a few shapes, fp32 and bf16: max |diff| and
   the time per call of each (compiled, best of `--iters`).
2. The continuous engine (tiny preset) with the paged cache and that kernel against the dense
   engine: the same tokens (log-probs within `--logprob_atol`), and tokens/s of each.

The kernels only compile on their own hardware (Pallas TPU through libtpu, Pallas GPU through
Triton); on CPU `--interpret` runs them in Pallas interpret mode (slow: small shapes only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.continuous_vs_static import long_tail_lengths  # noqa: E402
from dapo_jax.models import attention, create_model, get_preset  # noqa: E402
from dapo_jax.models import paged_attention as pa  # noqa: E402
from dapo_jax.rollout.continuous import ContinuousSampler  # noqa: E402
from dapo_jax.rollout.sampling import SamplingParams  # noqa: E402


def _best(fn, iters: int) -> float:
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


def kernel_case(n, h, kh, e, t, capacity, mix_max, dtype, impl, iters, seed=0) -> dict:
  """One shape: random pool, pages shuffled, lengths from the long-tail mix."""
  rng = np.random.default_rng(seed)
  length = long_tail_lengths(n, mix_max, 0.05, rng)
  m = -(-capacity // t)
  pages = n * m
  perm = rng.permutation(pages).reshape(n, m).astype(np.int32)
  table = np.where(np.arange(m)[None] < -(-length[:, None] // t), perm, 0).astype(np.int32)
  k = jnp.asarray(rng.standard_normal((kh, pages, t, e)), dtype)
  v = jnp.asarray(rng.standard_normal((kh, pages, t, e)), dtype)
  q = jnp.asarray(rng.standard_normal((n, h, e)), dtype)
  # The dense layout of the same tokens: [N, K, E, S] keys, [N, K, S, E] values.
  kd = jnp.take(k, jnp.asarray(table), axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kh, m * t, e)
  vd = jnp.take(v, jnp.asarray(table), axis=1).transpose(1, 0, 2, 3, 4).reshape(n, kh, m * t, e)
  valid = jnp.arange(m * t)[None] < jnp.asarray(length)[:, None]
  dense = jax.jit(lambda q, k, v, valid: attention.decode_attention(q, k, v, valid))
  paged = jax.jit(lambda q, k, v, tb, ln: pa.paged_decode_attention(q, k, v, tb, ln, impl=impl))
  args_p = (q, k, v, jnp.asarray(table), jnp.asarray(length))
  if pa.uses_combined_pool(impl):  # the ragged kernel's [P, T, 2K, E]: head j's K at 2j, V 2j+1
    kv = jnp.stack([k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)], axis=3)
    args_p = (q, kv.reshape(pages, t, 2 * kh, e), None) + args_p[3:]
  args_d = (q, kd.transpose(0, 1, 3, 2), vd, valid)
  diff = float(jnp.abs(paged(*args_p).astype(jnp.float32)
                       - dense(*args_d).astype(jnp.float32)).max())
  td, tp = _best(lambda: dense(*args_d), iters), _best(lambda: paged(*args_p), iters)
  return {"n": n, "h": h, "kv_heads": kh, "head_dim": e, "page": t, "capacity": capacity,
          "mean_length": float(length.mean()), "dtype": jnp.dtype(dtype).name,
          "max_abs_diff": diff, "dense_ms": 1e3 * td, "paged_ms": 1e3 * tp,
          "dense_over_paged": td / tp}


def engine_case(impl: str, capacity: int, rows: int, iters: int, atol: float) -> dict:
  graphdef, state = nnx.split(create_model(get_preset("tiny"), seed=0))
  rng = np.random.default_rng(1)
  g = 8
  lengths = long_tail_lengths(rows, capacity // 4, 0.05, rng)
  ids = rng.integers(1, 200, (rows // g, 32)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  params = SamplingParams(temperature=1.0, max_new_tokens=capacity, eos_ids=())
  out, times = {}, {}
  for kv in ("dense", "paged"):
    s = ContinuousSampler(graphdef, num_slots=32, max_prefill_length=32, kv_cache=kv,
                          page_size=16, attention_impl=impl)
    run = lambda s=s: s.generate(state, ids, mask, jax.random.key(0), params, g,
                                 max_new_tokens=lengths)
    times[kv] = _best(lambda run=run: run().response_ids, iters)
    out[kv] = jax.device_get(run())
  same = bool(np.array_equal(out["dense"].response_ids, out["paged"].response_ids))
  lp = float(np.abs(np.asarray(out["dense"].logprobs) - np.asarray(out["paged"].logprobs)).max())
  tokens = int(lengths.sum())
  return {"capacity": capacity, "rows": rows, "tokens": tokens, "same_tokens": same,
          "max_logprob_diff": lp, "logprob_ok": lp <= atol,
          **{f"{kv}_tokens_per_s": tokens / t for kv, t in times.items()}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--impl", default="auto", choices=pa.PAGED_IMPLS)
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--small", action="store_true", help="small shapes only (CPU, interpret)")
  ap.add_argument("--logprob_atol", type=float, default=1e-4)
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  platform = jax.devices()[0].platform
  impl = pa.resolve_paged_impl(args.impl)
  with attention.interpret_pallas() if args.interpret else contextlib.nullcontext():
    res = _run(args, platform, impl)
  out = args.out or f"bench/results/paged_kernel_check_{platform}.json"
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(res, f, indent=1)
  ok = res["engine"]["same_tokens"] and res["engine"]["logprob_ok"]
  sys.exit(0 if ok else 1)


def _run(args, platform: str, impl: str) -> dict:
  shapes = [(8, 4, 2, 64, 16, 512, 128)] if args.small else [
      (64, 32, 8, 128, 16, 4096, 1024), (256, 40, 8, 128, 64, 20480, 5120)]
  res = {"command": " ".join(["python bench/paged_kernel_check.py"] + sys.argv[1:]),
         "platform": platform, "device": jax.devices()[0].device_kind, "impl": impl,
         "jax": jax.__version__, "kernel": [], "engine": None}
  for shape in shapes:
    for dtype in (jnp.float32, jnp.bfloat16):
      row = kernel_case(*shape, dtype, impl, args.iters)
      res["kernel"].append(row)
      print("kernel", json.dumps(row), flush=True)
  res["engine"] = engine_case(impl, 512 if args.small else 4096, 64 if args.small else 256,
                              1 if args.small else 2, args.logprob_atol)
  print("engine", json.dumps(res["engine"]), flush=True)
  return res


if __name__ == "__main__":
  main()
