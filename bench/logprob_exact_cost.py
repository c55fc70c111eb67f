# nice -n 19 python bench/logprob_exact_cost.py   (~5 min on a 2-core CPU)
"""What the routes to a bit-equal sampler/trainer log-prob buy and cost, in one run (issue 29).

Variants, each on the tiny_cpu model (random init, fp32 and bf16 compute):

- ``two formulas``: the code before issue 29 part 4: the sampler took log_softmax and gathered
  the token, the trainer took target minus logsumexp (patched back in here);
- ``one formula`` (today's default): both call `logprobs.token_log_probs`, whose sum over the
  vocabulary has a fixed order (`logprobs.fixed_order_sum`);
- ``+ fixed-order layer reductions`` (a route tried, not kept): RMSNorm's mean and the attention
  softmax's sum also through `fixed_order_sum` (patched into the model here).

For each: the share of response tokens whose teacher-forced decode log-prob (the sampler's
programs: prefill, then one `decode_step` per token) is bit-equal to the training forward's
(`LogProbForward`), its max |delta|, and the time of the decode (response tokens/s) and of one
forward+backward of the update's log-probs (`jax.grad`, as `train_step`), on the same rows. The
variants are compiled ahead of time (their patches act when a program is traced), then timed
interleaved, `repeats` (the argument, default 5) times each; the fastest call is reported as a
ratio to ``two formulas`` (the CPU is shared: the minimum is the call least disturbed). The tiny
model's vocabulary is 64, so the formula's own cost is also timed alone at Qwen2.5's 151,936:
a decode step's [64, V] logits and a [1, 256, V] training chunk under jax.grad.

Writes bench/results/logprob_exact_cost.json and prints a markdown table.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import logprob_gap_probes as probes_lib  # noqa: E402  # pylint: disable=wrong-import-position

from dapo_jax.trainer import logprob_gap  # noqa: E402
from dapo_jax.models import logprobs  # noqa: E402
from dapo_jax.models import attention, qwen2  # noqa: E402
from dapo_jax.rollout import sampling  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "logprob_exact_cost.json")
ROWS = 32  # prompts decoded at once (one static-engine call's worth on this model)


def _sampler_two_formulas(logits_xV, targets_x, *, temperature=1.0):
  """Before part 4: the sampler's log_softmax, then the token."""
  z = logits_xV.astype(jnp.float32)
  z = z / temperature if temperature != 1.0 else z
  lp = jax.nn.log_softmax(z, axis=-1)
  return jnp.take_along_axis(lp, targets_x[..., None], axis=-1)[..., 0]


def _trainer_two_formulas(logits_xV, targets_x, *, temperature=1.0):
  """Before part 4: the trainer's target minus logsumexp."""
  z = logits_xV.astype(jnp.float32) / temperature
  vocab = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
  target = jnp.sum(jnp.where(vocab == targets_x[..., None], z, 0.0), axis=-1)
  return target - jax.nn.logsumexp(z, axis=-1)


def _rms_fixed(self, x):
  x32 = x.astype(jnp.float32)
  mean_sq = logprobs.fixed_order_sum(x32 * x32)[..., None] / x32.shape[-1]
  y = x32 * jax.lax.rsqrt(mean_sq + self.eps)
  return self.scale.value.astype(x.dtype) * y.astype(x.dtype)


def _softmax_fixed(x, axis=-1):
  if axis != -1:
    raise ValueError("fixed-order softmax: last axis only")
  e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
  return e / logprobs.fixed_order_sum(e)[..., None]


@contextlib.contextmanager
def variant(name: str):
  """Patches the variant in (module attributes), with JAX's caches cleared around it."""
  saved = [(logprobs, "token_log_probs"), (sampling, "token_log_probs"),
           (probes_lib, "token_log_probs"), (qwen2.RMSNorm, "__call__"),
           (attention.jax.nn, "softmax")]
  old = [getattr(m, a) for m, a in saved]
  if name == "two formulas":
    logprobs.token_log_probs = _trainer_two_formulas
    sampling.token_log_probs = probes_lib.token_log_probs = _sampler_two_formulas
  elif name == "+ fixed-order layer reductions":
    qwen2.RMSNorm.__call__ = _rms_fixed
    attention.jax.nn.softmax = _softmax_fixed
  jax.clear_caches()
  try:
    yield
  finally:
    for (m, a), v in zip(saved, old):
      setattr(m, a, v)
    jax.clear_caches()


VARIANTS = ("two formulas", "one formula", "+ fixed-order layer reductions")


def _timed(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def measure(dtype: str, repeats: int) -> dict:
  config = probes_lib.tiny_config(dtype)
  graphdef, params, rest, tokenizer = probes_lib.build(config)
  _, pids, pmask, resp, rmask = probes_lib.fixed_rows(config, tokenizer, num=ROWS)
  ids, mask = probes_lib._full_rows(pids, pmask, resp, rmask)  # pylint: disable=protected-access
  r = resp.shape[1]
  tokens = int(rmask.sum())
  out, programs = {}, {}
  for v in VARIANTS:  # the patches act at trace time: compile each variant ahead of time
    with variant(v):
      dec = jax.jit(probes_lib.decode_logp.__wrapped__, static_argnums=0).lower(
          graphdef, params, rest, pids, pmask, resp).compile()
      upd = jax.jit(probes_lib.update_logp.__wrapped__, static_argnums=(0, 5)).lower(
          graphdef, params, rest, ids, mask, r).compile()
      trainer = np.asarray(probes_lib.train_logp(config, graphdef, params, rest, ids, mask, r))
    m = logprob_gap.logprob_gap_metrics(np.asarray(dec(params, rest, pids, pmask, resp)),
                                        trainer, rmask)
    out[v] = {"bit_equal": m["bit_equal"], "logprob_diff_max": m["logprob_diff_max"],
              "decode_s": [], "update_s": []}
    programs[v] = (lambda dec=dec: dec(params, rest, pids, pmask, resp),
                   lambda upd=upd: upd(params, rest, ids, mask))
  for _ in range(repeats):  # interleaved: load changes hit every variant alike
    for v in VARIANTS:
      out[v]["decode_s"].append(_timed(programs[v][0]))
      out[v]["update_s"].append(_timed(programs[v][1]))
  base = out["two formulas"]
  for v in VARIANTS:
    # The minimum: the call least disturbed by the other jobs on the shared cores.
    d, u = min(out[v]["decode_s"]), min(out[v]["update_s"])
    out[v].update(decode_tokens_per_s=tokens / d, update_min_s=u,
                  decode_time_ratio=d / min(base["decode_s"]),
                  update_time_ratio=u / min(base["update_s"]))
  return out


def formula_cost(repeats: int, vocab: int = 151936) -> dict:
  """The log-prob formulas alone at Qwen2.5's vocabulary: a decode step's [64, V] logits (the
  sampler) and a [1, 256, V] chunk under jax.grad (the trainer), time ratio one / two formulas."""
  key = jax.random.key(0)
  out = {}
  for name, shape, two in (("sampler step [64, V]", (64, vocab), _sampler_two_formulas),
                           ("trainer chunk [1, 256, V] fwd+bwd", (1, 256, vocab),
                            _trainer_two_formulas)):
    z = jax.random.normal(key, shape, jnp.float32) * 3
    t = jax.random.randint(key, shape[:-1], 0, vocab)
    fns = {}
    for label, f in (("two formulas", two), ("one formula", logprobs.token_log_probs)):
      if len(shape) == 3:  # value and gradient, as the update
        fns[label] = jax.jit(jax.value_and_grad(lambda z, t, f=f: jnp.sum(f(z, t))))
      else:
        fns[label] = jax.jit(f)
      jax.block_until_ready(fns[label](z, t))
    times = {label: [] for label in fns}
    for _ in range(repeats):
      for label, fn in fns.items():
        times[label].append(_timed(lambda fn=fn: fn(z, t)))
    med = {label: min(v) for label, v in times.items()}
    out[name] = {"two_formulas_s": med["two formulas"], "one_formula_s": med["one formula"],
                 "time_ratio": med["one formula"] / med["two formulas"]}
  return out


def main() -> dict:
  repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
  start = time.perf_counter()
  results = {dtype: measure(dtype, repeats) for dtype in ("float32", "bfloat16")}
  print("| dtype | variant | decode vs training forward: bit-equal | max abs d | "
        "decode time / two formulas | update time / two formulas |")
  print("|---|---|---|---|---|---|")
  for dtype, rows in results.items():
    for v, m in rows.items():
      print(f"| {dtype} | {v} | {m['bit_equal']:.4f} | {m['logprob_diff_max']:.3g} | "
            f"{m['decode_time_ratio']:.3f} | {m['update_time_ratio']:.3f} |")
  results["formula_at_full_vocab"] = formula_cost(repeats)
  for name, m in results["formula_at_full_vocab"].items():
    print(f"{name}: one formula / two formulas time = {m['time_ratio']:.3f} "
          f"({m['one_formula_s'] * 1e3:.1f} ms vs {m['two_formulas_s'] * 1e3:.1f} ms)")
  results["meta"] = {"rows": ROWS, "repeats": repeats, "backend": jax.default_backend(),
                     "jax": jax.__version__, "seconds": round(time.perf_counter() - start, 1)}
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  with open(RESULTS, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  print(f"wrote {RESULTS}")
  return results


if __name__ == "__main__":
  main()
