"""Decode with an int8 KV cache against the default cache on CPU (issue 51), and the scale
granularity the int8 cache uses (per token and KV head) against one per page and head.

  python bench/kv_int8_decode.py                  # throughput table, alternating, best of rounds
  python bench/kv_int8_decode.py --granularity    # accuracy of the two scale layouts
  python bench/kv_int8_decode.py --plan           # dapo-plan's 32B v5p-64 estimate, int8 vs default

Throughput: the tiny preset's whole decode step (`decode_step_paged` with the XLA paged
attention, and the dense `decode_step`), N slots each at a live context of L positions (2,048
and more) filled with random K/V, ``--steps`` steps per compiled call (a `lax.fori_loop`, the
sampled token fed back). Each round times every case once, in turn; the table gives each case's
median over rounds and the int8 / default ratio of tokens per second within each round (median).

Granularity: quantize K and V per token and KV head (kv_quant.encode) or per page of T tokens
and KV head (one absmax over the page), dequantize, and compare one decode query's attention
output with the full-precision one: on random K/V with outlier channels (a few head dims 10x
larger, as real keys have) and on the K/V a trained tiny policy (the committed warm start)
computes for arithmetic prompts, with its own keys as the queries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _host import cpu_name  # noqa: E402  # pylint: disable=wrong-import-position

from dapo_jax.models import attention, create_model, get_preset, kv_quant  # noqa: E402
from dapo_jax.models import paged_kv as pkv  # noqa: E402


def _filled_paged(model, n: int, live: int, page: int, seed: int) -> pkv.PagedKVCache:
  """N slots of `live` tokens each over random pages (every slot's own), stored as the model's
  kv_cache_dtype says."""
  cfg = model.config
  m = pkv.pages_for(live + 64, page)
  cache = model.init_paged_cache(n, num_pages=n * m, page_size=page, max_pages_per_slot=m)
  rng = np.random.default_rng(seed)
  shape = (cfg.num_key_value_heads, n * m, page, cfg.dim_per_head)
  fill = lambda _: kv_quant.encode(jnp.asarray(rng.normal(size=shape), jnp.float32),
                                   cfg.kv_dtype)
  table = np.arange(n * m, dtype=np.int32).reshape(n, m)
  return cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)),
                       refcount=jnp.ones((n * m,), jnp.int32), table=jnp.asarray(table),
                       length=jnp.full((n,), live, jnp.int32))


def _filled_dense(model, n: int, live: int, seed: int):
  """The dense cache: N rows of `live` valid slots (64 more invalid), random K/V."""
  cfg = model.config
  size = live + 64
  cache = model.init_cache(n, size)
  rng = np.random.default_rng(seed)
  kh, e = cfg.num_key_value_heads, cfg.dim_per_head
  rand = lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  k = tuple(kv_quant.encode(rand((n, kh, e, size)), cfg.kv_dtype, -2) for _ in cache.k)
  v = tuple(kv_quant.encode(rand((n, kh, size, e)), cfg.kv_dtype, -1) for _ in cache.v)
  valid = jnp.broadcast_to(jnp.arange(size)[None] < live, (n, size))
  return cache.replace(k=k, v=v, valid=valid, index=jnp.full((n,), live, jnp.int32))


def _program(model, engine: str, steps: int):
  """`steps` decode steps of every slot in one compiled call; returns the last tokens."""
  @jax.jit
  def run(cache, tokens_N):
    n = tokens_N.shape[0]

    def body(i, carry):
      cache, tok = carry
      pos = jnp.full((n,), 4096, jnp.int32) + i
      if engine == "paged":
        logits, cache, _ = model.decode_step_paged(tok, pos, cache, jnp.ones((n,), bool),
                                                   impl="xla")
      else:
        logits, cache = model.decode_step(tok, pos, cache)
      return cache, jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, steps, body, (cache, tokens_N))[1]
  return run


def throughput(args) -> dict:
  cases = []
  for live in args.contexts:
    for engine in args.engines:
      for name in ("", "int8"):
        model = create_model(get_preset("tiny", kv_cache_dtype=name), seed=0)
        cache = (_filled_paged(model, args.slots, live, args.page_size, 0) if engine == "paged"
                 else _filled_dense(model, args.slots, live, 0))
        run = _program(model, engine, args.steps)
        tok = jnp.ones((args.slots,), jnp.int32)
        jax.block_until_ready(run(cache, tok))  # compile
        cases.append(dict(live=live, engine=engine, dtype=name or "default", run=run,
                          cache=cache, tok=tok, times=[]))
  for _ in range(args.rounds):  # alternating: every case once a round
    for c in cases:
      start = time.perf_counter()
      jax.block_until_ready(c["run"](c["cache"], c["tok"]))
      c["times"].append(time.perf_counter() - start)
  rows = []
  for live in args.contexts:
    for engine in args.engines:
      pick = lambda d: next(c for c in cases
                            if (c["live"], c["engine"], c["dtype"]) == (live, engine, d))
      base, q8 = pick("default"), pick("int8")
      ratio = statistics.median(b / q for b, q in zip(base["times"], q8["times"]))
      per_tok = lambda c: statistics.median(c["times"]) / (args.steps * args.slots)
      kv_bytes = lambda c: sum(x.size * x.dtype.itemsize for x in
                               jax.tree.leaves((c["cache"].k, c["cache"].v)))
      rows.append(dict(live=live, engine=engine, default_tok_s=1 / per_tok(base),
                       int8_tok_s=1 / per_tok(q8), int8_over_default=ratio,
                       default_kv_bytes=kv_bytes(base), int8_kv_bytes=kv_bytes(q8)))
  print(f"tiny preset (4 layers, 2 KV heads, E=32, fp32), {args.slots} slots, "
        f"{args.steps} steps a call, {args.rounds} rounds; {cpu_name()}")
  print("| live context | engine | default tok/s | int8 tok/s | int8 / default (tok/s) | "
        "KV bytes int8 / default |")
  print("|---:|---|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['live']} | {r['engine']} | {r['default_tok_s']:.0f} | {r['int8_tok_s']:.0f} | "
          f"{r['int8_over_default']:.2f}x | {r['int8_kv_bytes'] / r['default_kv_bytes']:.3f} |")
  return {"cpu": cpu_name(), "slots": args.slots, "steps": args.steps, "rounds": args.rounds,
          "page_size": args.page_size, "rows": rows}


def _per_page(x_NxSxKxE: jax.Array, page: int, qmax: float = 127.0) -> jax.Array:
  """int8 round trip with one absmax scale per page of `page` tokens and KV head."""
  n, s, k, e = x_NxSxKxE.shape
  pages = x_NxSxKxE.reshape(n, s // page, page, k, e)
  amax = jnp.abs(pages).max(axis=(2, 4), keepdims=True)
  scale = jnp.where(amax > 0, amax / qmax, 1.0)
  return (jnp.clip(jnp.rint(pages / scale), -qmax, qmax) * scale).reshape(x_NxSxKxE.shape)


def _per_token(x_NxSxKxE: jax.Array) -> jax.Array:
  return kv_quant.decode(kv_quant.encode(x_NxSxKxE, jnp.int8), jnp.float32)


def _errors(q_NxHxE, k, v, k_hat, v_hat) -> dict[str, float]:
  """RMS and max |attention output with quantized K/V - full precision| (one query per row),
  and the RMS error of K and V relative to their RMS."""
  dense = lambda k, v: attention.decode_attention(
      q_NxHxE, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), jnp.ones(k.shape[:2], bool))
  d = dense(k_hat, v_hat) - dense(k, v)
  rel = lambda x, x_hat: float(jnp.sqrt(((x_hat - x) ** 2).mean() / (x ** 2).mean()))
  return {"attn_rms": float(jnp.sqrt((d ** 2).mean())), "attn_max": float(jnp.abs(d).max()),
          "k_rel_rms": rel(k, k_hat), "v_rel_rms": rel(v, v_hat)}


def _both(q, k, v, page: int) -> dict[str, dict[str, float]]:
  return {"per_token": _errors(q, k, v, _per_token(k), _per_token(v)),
          "per_page": _errors(q, k, v, _per_page(k, page), _per_page(v, page))}


def granularity(args) -> dict:
  out = {}
  rng = np.random.default_rng(0)
  n, s, kh, e, t = 8, 2048, 2, 64, args.page_size
  scale_E = np.ones(e)
  scale_E[rng.choice(e, 4, replace=False)] = 10.0  # outlier channels
  k = jnp.asarray(rng.normal(size=(n, s, kh, e)) * scale_E, jnp.float32)
  v = jnp.asarray(rng.normal(size=(n, s, kh, e)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(n, 4, e)), jnp.float32)
  out["random_outlier_channels"] = _both(q, k, v, t)
  # A trained policy's own K/V (the warm start; arithmetic prompts under the chat template).
  from dapo_jax import load_pretrained  # pylint: disable=import-outside-toplevel
  from dapo_jax.data import arithmetic  # pylint: disable=import-outside-toplevel
  from dapo_jax.tokenizers.char_tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  ws = os.path.join(ROOT, "bench/results/ablation/warm_starts/seed0_sft600")
  model = load_pretrained(ws)
  tok = CharTokenizer.load(ws)
  recs = arithmetic.make_records(64, split="test", seed=0)
  ids = [tok.encode(r.prompt)[:2 * t] for r in recs]
  s_real = 2 * t
  ids = np.asarray([x + [tok.pad_id] * (s_real - len(x)) for x in ids], np.int32)
  mask = ids != tok.pad_id
  _, cache = model.prefill(jnp.asarray(ids), None, jnp.asarray(mask))
  g = model.config.num_attention_heads // model.config.num_key_value_heads
  for layer, (kl, vl) in enumerate(zip(cache.k, cache.v)):  # [N, K, E, S], [N, K, S, E]
    k_l, v_l = kl.transpose(0, 3, 1, 2), vl.transpose(0, 2, 1, 3)  # -> [N, S, K, E]
    q_l = jnp.repeat(k_l[:, -1], g, axis=1)  # the last key of each row as its query
    out[f"warm_start_seed0_layer{layer}"] = _both(q_l, k_l, v_l, t)
  print(f"int8 round trip, pages of {t}: per token and KV head / per page and KV head; "
        f"{cpu_name()}")
  print("| K/V | attention RMS error | attention max error | K rel. RMS error | "
        "V rel. RMS error |")
  print("|---|---:|---:|---:|---:|")
  for name, r in out.items():
    cell = lambda key: f"{r['per_token'][key]:.4f} / {r['per_page'][key]:.4f}"
    print(f"| {name} | {cell('attn_rms')} | {cell('attn_max')} | {cell('k_rel_rms')} | "
          f"{cell('v_rel_rms')} |")
  return {"cpu": cpu_name(), "page_size": t, **out}


PLAN_32B = ["--config", "configs/dapo_qwen2_5_32b.py", "--target", "tpu:v5p:2x4x4",
            "--config.optim.micro_batch_size=4", "--config.rollout.prompts_per_call=16",
            "--config.rollout.max_concurrent_decodes=256", "--config.mesh=data=1,fsdp=-1,tensor=8"]


def plan(args) -> dict:
  """dapo-plan's closed-form paged estimate (plan_paged.estimate) for the 32B paper config on
  v5p-64, default cache vs int8, with the resident bytes (training state + rollout weights) of
  the committed plan (bench/results/paged_plan.json, run "v5p64": HBM - KV budget / 0.9)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from dapo_jax.planner import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from dapo_jax.planner import plan_paged, programs, targets  # pylint: disable=import-outside-toplevel
  spec = plan_lib.configure(plan_lib._parse(PLAN_32B))  # pylint: disable=protected-access
  target = targets.parse_target("tpu:v5p:2x4x4")
  with open(os.path.join(ROOT, "bench/results/paged_plan.json")) as f:
    committed = json.load(f)["runs"]["v5p64"]["paged_estimate"]
  resident = int(target.hbm_bytes - committed["kv_budget_bytes"] / spec.rollout.kv_hbm_fraction)
  mcfg = programs.plan_model_config(spec.model, spec.tokenizer)
  out = {}
  for name in ("", "int8"):
    s = dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, kv_cache_dtype=name))
    out[name or "default"] = plan_paged.estimate(s, mcfg, target.chip, target.num_devices,
                                                 target.hbm_bytes, resident)
  gib = 2**30
  print(f"Qwen2.5-32B paper config, v5p-64 (fsdp 4, tensor 8), closed form; resident "
        f"{resident / gib:.2f} GiB/chip")
  print("| KV cache | KV bytes/token/chip | pool pages/shard | slots that fit | KV read/step | "
        "step | steps | rollout (paged, slots that fit) | dense closed form |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name, e in out.items():
    fit = e["paged_fit"]
    print(f"| {name} | {e['kv_bytes_per_token']:,} | {e['pool_pages']:,} | "
          f"{fit['slots']:,} | {(fit['bytes'] / 1e9):.1f} GB | {fit['step_seconds'] * 1e3:.1f} ms |"
          f" {fit['steps']:,.0f} | {fit['seconds']:,.0f} s | {e['dense']['seconds']:,.0f} s |")
  ratio = out["int8"]["paged_fit"]["seconds"] / out["default"]["paged_fit"]["seconds"]
  print(f"int8 / default rollout: {ratio:.2f}x")
  return {"command": PLAN_32B, "resident_bytes": resident, "ratio": ratio,
          **{k: {kk: vv for kk, vv in v.items() if kk != "mix"} for k, v in out.items()}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                  default=[2048, 8192])
  ap.add_argument("--engines", type=lambda s: s.split(","), default=["paged", "dense"])
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--page_size", type=int, default=16)
  ap.add_argument("--granularity", action="store_true")
  ap.add_argument("--plan", action="store_true", help="the 32B v5p-64 paged estimate, int8 vs "
                  "default (closed form)")
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  result = (granularity(args) if args.granularity else plan(args) if args.plan
            else throughput(args))
  if args.out:
    with open(os.path.join(ROOT, args.out), "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
