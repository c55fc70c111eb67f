r"""Accelerator benchmark: train-step MFU, decode HBM roofline and PyTorch ratios in one table.

    bash launch/bench_accelerator.sh             # one H100/H200 GPU or TPU chip, < 6 minutes
    python bench/accelerator.py --dry_run        # CPU, tiny shapes, measured "peaks": it runs

Train: one compiled, donated DAPO update (`TrainStep`: forward, chunked fp32 log-probs, clipped
token-mean loss, backward, clip, AdamW) of random-weight Qwen2.5-0.5B and 1.5B shapes, bf16
compute on fp32 master weights, `attention_impl="auto"` (cuDNN on GPU, splash on TPU), rows of
4,096 tokens (512 prompt + 3,584 response), at the largest power-of-two micro-batch whose
compiled step fits in device memory (XLA's memory analysis; an OOM at run time halves it).
MFU = model FLOPs / median step time / peak, model FLOPs = 6 x matmul weights x tokens (lm_head
on response tokens only) + 6 x B x T^2 x H x E x layers (causal attention, forward + backward).

Decode: `dapo_jax.rollout.Sampler.generate` (bf16 weights and KV cache), 128-token prompts, 512
sampled tokens a row with no stop token, batch 64 and 256. HBM utilisation = bytes a step must
read (bf16 weights + the valid KV cache) summed over steps / whole generate time (prefill
included: conservative) / peak bandwidth.

PyTorch: transformers' Qwen2ForCausalLM on the same device and shapes (random weights), run
first so JAX has not reserved the memory yet: the same update (fp32 weights, bf16 autocast,
SDPA attention, gradient checkpointing when remat is on, logits of the response only) at its own
largest micro-batch, and `generate` at the same batches. Ratio = JAX tokens/s over PyTorch's.

Targets on H200: MFU >= 45%, decode >= 60% of the HBM roofline, >= 2x transformers generate.
A benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dapo_jax.trainer import train_step as ts
from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout import Sampler, SamplingParams

# (device_kind substring, name, dense bf16 FLOP/s, HBM bytes/s); the first match wins.
PEAKS = (
    ("h200", "H200", 989e12, 4.8e12),
    ("h100", "H100 SXM", 989e12, 3.35e12),
    ("v5 lite", "TPU v5e", 197e12, 0.82e12),
    ("v5e", "TPU v5e", 197e12, 0.82e12),
    ("v5", "TPU v5p", 459e12, 2.76e12),
    ("v6 lite", "TPU v6e", 918e12, 1.64e12),
    ("v4", "TPU v4", 275e12, 1.2e12),
)
GIB = 2.0 ** 30


def peaks(device_kind: str, args) -> tuple[str, float, float]:
  """(name, peak FLOP/s, peak bytes/s): flags, else the table, else measured now."""
  if args.peak_tflops and args.peak_tbps:
    return device_kind, args.peak_tflops * 1e12, args.peak_tbps * 1e12
  for key, name, flops, bw in PEAKS:
    if key in device_kind.lower() and not args.dry_run:
      return name, flops, bw
  print(f"{device_kind}: not in the peak table (or --dry_run): the 'peaks' are this device's "
        f"best matmul and array-read rates, measured now (set --peak_tflops/--peak_tbps)",
        flush=True)
  dtype, n = (jnp.float32, 1024) if jax.default_backend() == "cpu" else (jnp.bfloat16, 8192)
  a, x = jnp.ones((n, n), dtype), jnp.ones((2**24,), jnp.float32)
  dot, read = jax.jit(jnp.dot), jax.jit(jnp.sum)
  best = lambda fn, *xs: min(_timed(lambda: fn(*xs).block_until_ready()) for _ in range(5))
  return f"{device_kind} (measured peaks)", 2 * n**3 / best(dot, a, a), x.nbytes / best(read, x)


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def matmul_weights(cfg) -> tuple[int, int]:
  """(weights of the matmuls of one layer, of the lm_head)."""
  d, f, h, k, e = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.dim_per_head)
  return d * h * e + 2 * d * k * e + h * e * d + 3 * d * f, d * cfg.vocab_size


def train_flops(cfg, batch: int, length: int, response: int) -> float:
  layer, head = matmul_weights(cfg)
  attention = 6 * batch * length ** 2 * cfg.num_attention_heads * cfg.dim_per_head
  return (6 * layer * batch * length + attention) * cfg.num_hidden_layers + (
      6 * head * batch * response)


def decode_bytes(cfg, batch: int, prompt: int, new_tokens: int, itemsize: int = 2) -> float:
  """Bytes steps 1..R-1 must read: all matmul weights + each row's valid KV (P + i tokens)."""
  layer, head = matmul_weights(cfg)
  weights = (layer * cfg.num_hidden_layers + head) * itemsize
  kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.dim_per_head * itemsize
  steps = new_tokens - 1
  tokens_read = batch * (steps * prompt + new_tokens * steps / 2)
  return steps * weights + kv_per_token * tokens_read


# --- JAX ------------------------------------------------------------------------------------


def train_batch(batch: int, length: int, response: int, vocab: int, seed: int = 0):
  rng = np.random.RandomState(seed)
  return ts.TrainBatch(
      input_ids=jnp.asarray(rng.randint(1, vocab, (batch, length)), jnp.int32),
      attention_mask=jnp.ones((batch, length), jnp.int32),
      response_mask=jnp.ones((batch, response), jnp.float32),
      old_log_probs=jnp.asarray(rng.normal(-np.log(vocab), 0.5, (batch, response)), jnp.float32),
      advantages=jnp.asarray(np.where(np.arange(batch) % 2, -1.0, 1.0), jnp.float32))


def _need_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def largest_micro_batch(compile_at, limit: float | None, max_mb: int, grad_bytes: int):
  """(micro-batch, compiled step): the largest power of two <= max_mb that fits `limit` bytes.

  Compiles at 1 row, extrapolates the per-row bytes (the fp32 gradients do not grow with rows),
  then compiles the guess and halves it until XLA's memory analysis fits.
  """
  if limit is None:
    return max_mb, compile_at(max_mb)
  one = compile_at(1)
  need1 = _need_bytes(one)
  if need1 > limit:
    raise MemoryError(f"one row needs {need1 / GIB:.1f} GiB of {limit / GIB:.1f} GiB")
  per_row = max(one.memory_analysis().temp_size_in_bytes - grad_bytes, 1)
  mb = 2 ** int(np.log2(max(1, min(max_mb, 1 + (limit - need1) // per_row))))
  while mb > 1:
    compiled = compile_at(mb)
    if _need_bytes(compiled) <= limit:
      return mb, compiled
    mb //= 2
  return 1, one


def measure_train(preset: str, args, peak_flops: float) -> dict:
  cfg = _preset(preset, args, param_dtype="bfloat16", dtype="bfloat16", remat=args.remat,
                attention_impl="auto")
  length, response = args.seq_len, args.seq_len - args.prompt_len
  fresh = lambda: ts.init_train_state(create_model(cfg, seed=0), ts.TrainConfig())
  graphdef, state = fresh()

  def tcfg(mb):  # logits of about args.logit_tokens tokens at a time
    return ts.TrainConfig(lr=1e-6, warmup_steps=0,
                          logit_chunk_size=max(64, args.logit_tokens // mb))

  def compile_at(mb):
    batch = train_batch(mb, length, response, cfg.vocab_size)
    t = time.perf_counter()
    compiled = ts.TrainStep(graphdef, tcfg(mb)).compile(state, batch)
    print(f"  {preset}: compiled micro-batch {mb} in {time.perf_counter() - t:.0f} s, needs "
          f"{_need_bytes(compiled) / GIB:.1f} GiB", flush=True)
    return compiled

  limit = _memory_limit(args)
  mb, compiled = largest_micro_batch(compile_at, limit, args.max_micro_batch,
                                     4 * cfg.num_params())
  while True:
    batch = train_batch(mb, length, response, cfg.vocab_size)
    try:
      state, metrics = compiled(state, batch, 0)  # warm-up
      jax.block_until_ready(metrics)
      break
    except jax.errors.JaxRuntimeError as e:  # pragma: no cover - needs an accelerator
      if "RESOURCE_EXHAUSTED" not in str(e) or mb == 1:
        raise
      mb //= 2
      graphdef, state = fresh()  # the failed call may have taken the donated buffers
      compiled = compile_at(mb)
  times = []
  for _ in range(args.steps):
    t = time.perf_counter()
    state, metrics = compiled(state, batch, 0)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t)
  step_s = statistics.median(times)
  flops = train_flops(cfg, mb, length, response)
  return dict(name=f"train {preset}", shape=f"mb {mb} x {length}", seconds=step_s,
              tokens_s=mb * length / step_s, rate=_si(flops / step_s, "FLOP/s"),
              util=flops / step_s / peak_flops, target=0.45, mb=mb)


def measure_decode(preset: str, batch: int, args, peak_bw: float) -> dict:
  cfg = _preset(preset, args, param_dtype="bfloat16", dtype="bfloat16", attention_impl="auto")
  graphdef, state = nnx.split(create_model(cfg, seed=0))
  sampler = Sampler(graphdef, cache_segments=args.cache_segments)
  params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, eos_ids=())
  rng = np.random.RandomState(1)
  ids = jnp.asarray(rng.randint(1, cfg.vocab_size, (batch, args.prompt_tokens)), jnp.int32)
  mask = jnp.ones(ids.shape, bool)
  run = lambda i: int(sampler.generate(state, ids, mask, jax.random.key(i), params).num_steps)
  t = time.perf_counter()
  run(0)  # compile
  print(f"  decode {preset} B={batch}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
  seconds = min(_timed(lambda i=i: run(i)) for i in range(1, 1 + args.repeats))
  nbytes = decode_bytes(cfg, batch, args.prompt_tokens, args.new_tokens)
  return dict(name=f"decode {preset}", shape=f"B {batch}, {args.prompt_tokens}+{args.new_tokens}",
              seconds=seconds, tokens_s=batch * args.new_tokens / seconds,
              rate=_si(nbytes / seconds, "B/s"), util=nbytes / seconds / peak_bw,
              target=0.60)


def _preset(name: str, args, **overrides):
  if args.layers:
    overrides["num_hidden_layers"] = args.layers
  return get_preset(name, **overrides)


def _memory_limit(args) -> float | None:
  if args.memory_limit_gb:
    return args.memory_limit_gb * GIB * args.memory_fraction
  stats = jax.devices()[0].memory_stats() or {}
  return stats["bytes_limit"] * args.memory_fraction if "bytes_limit" in stats else None


# --- PyTorch + transformers (imported only when used) ---------------------------------------


def torch_device() -> str | None:
  """'cuda' on an NVIDIA GPU, 'cpu' for the dry run, None when torch cannot run here."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return None
  if torch.cuda.is_available():
    return "cuda"
  return "cpu" if jax.default_backend() == "cpu" else None


def _torch_model(cfg, device: str):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  transformers.logging.set_verbosity_error()
  hf = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")}
  hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=0)
  with torch.device(device):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf))


def _sync(device: str):
  import torch  # pylint: disable=g-import-not-at-top
  if device == "cuda":
    torch.cuda.synchronize()


def torch_train(preset: str, args, device: str) -> dict:
  """The same update in PyTorch at its own largest micro-batch (<= args.max_micro_batch)."""
  import torch  # pylint: disable=g-import-not-at-top
  cfg = _preset(preset, args)
  model = _torch_model(cfg, device).train()
  if args.remat != "none":
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
  length, resp = args.seq_len, args.seq_len - args.prompt_len

  def step(ids, old, adv):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
      z = model(input_ids=ids, logits_to_keep=resp + 1).logits[:, :-1].float()
    logp = torch.log_softmax(z, -1).gather(-1, ids[:, -resp:, None])[..., 0]
    with torch.no_grad():  # the entropy metric, as the JAX step reports it
      (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)).mean()
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
    per_token = torch.where(adv < 0, torch.minimum(clipped, -adv * 10.0), clipped)
    per_token.mean().backward()  # token-mean: every response token is real here
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    _sync(device)

  mb = args.max_micro_batch
  while True:
    ids = torch.randint(1, cfg.vocab_size, (mb, length), device=device)
    old = torch.full((mb, resp), -float(np.log(cfg.vocab_size)), device=device)
    adv = torch.where(torch.arange(mb, device=device) % 2 == 1, -1.0, 1.0)[:, None]
    try:
      step(ids, old, adv)  # warm-up
      break
    except torch.OutOfMemoryError:  # pragma: no cover - needs a GPU
      opt.zero_grad(set_to_none=True)
      torch.cuda.empty_cache()
      if mb == 1:
        return dict(tokens_s=None, mb="OOM")
      mb //= 2
  seconds = statistics.median(_timed(lambda: step(ids, old, adv)) for _ in range(args.steps))
  return dict(tokens_s=mb * length / seconds, mb=mb)


def torch_generate(preset: str, batch: int, args, device: str) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  cfg = _preset(preset, args)
  model = _torch_model(cfg, device).to(torch.bfloat16 if device == "cuda" else torch.float32)
  ids = torch.randint(1, cfg.vocab_size, (batch, args.prompt_tokens), device=device)

  def run(new):
    with torch.no_grad():
      model.eval().generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                            min_new_tokens=new, pad_token_id=0)
    _sync(device)

  run(4)  # warm-up
  seconds = _timed(lambda: run(args.new_tokens))
  return dict(tokens_s=batch * args.new_tokens / seconds)


# --- the run --------------------------------------------------------------------------------


def _parse(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dry_run", action="store_true",
                  help="CPU: tiny shapes (1 layer), measured 'peaks'")
  ap.add_argument("--train_presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
  ap.add_argument("--decode_preset", default="qwen2.5-0.5b")
  ap.add_argument("--decode_batches", default="64,256")
  ap.add_argument("--seq_len", type=int, default=4096)
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--prompt_tokens", type=int, default=128, help="decode prompt length")
  ap.add_argument("--new_tokens", type=int, default=512, help="decode tokens per row")
  ap.add_argument("--max_micro_batch", type=int, default=64)
  ap.add_argument("--logit_tokens", type=int, default=2048, help="rows x logit chunk length")
  ap.add_argument("--remat", default="dots_no_batch")
  ap.add_argument("--layers", type=int, default=0, help="override the presets' layer count")
  ap.add_argument("--cache_segments", type=int, default=4)
  ap.add_argument("--steps", type=int, default=3, help="timed train steps (median)")
  ap.add_argument("--repeats", type=int, default=2, help="timed generate calls (best)")
  ap.add_argument("--memory_limit_gb", type=float, default=0.0, help="0: the device's own")
  ap.add_argument("--memory_fraction", type=float, default=0.9)
  ap.add_argument("--peak_tflops", type=float, default=0.0, help="override the peak table")
  ap.add_argument("--peak_tbps", type=float, default=0.0)
  ap.add_argument("--no_torch", action="store_true")
  ap.add_argument("--budget_s", type=float, default=330.0,
                  help="measurements not started by then are skipped")
  ap.add_argument("--compile_cache", default="", help="persistent XLA compilation cache dir")
  args = ap.parse_args(argv)
  if args.dry_run:
    args.train_presets, args.decode_preset, args.decode_batches = "test", "test", "4"
    args.seq_len, args.prompt_len, args.prompt_tokens, args.new_tokens = 64, 16, 8, 8
    args.max_micro_batch, args.logit_tokens, args.steps, args.repeats = 8, 64, 2, 1
    args.layers = args.layers or 1
  return args


def _si(x: float, unit: str) -> str:
  scale, prefix = next(((s, p) for s, p in ((1e12, "T"), (1e9, "G"), (1e6, "M")) if x >= s),
                       (1.0, ""))
  return f"{x / scale:.3g} {prefix}{unit}"


def _row(r: dict) -> str:
  util = f"{r['util']:.1%}" if "util" in r else "-"
  torch_tok = r.get("torch_tokens_s")
  ratio = "-" if not torch_tok else f"{r['tokens_s'] / torch_tok:.2f}x"
  return (f"| {r['name']} | {r['shape']} | {r['seconds']:.3f} | {r['tokens_s']:,.0f} | "
          f"{r['rate']} | {util} | >= {r['target']:.0%} | "
          f"{'-' if not torch_tok else f'{torch_tok:,.0f}'} {r.get('torch_note', '')}| {ratio} |")


def main(argv=None):
  args = _parse(argv)
  start = time.perf_counter()
  if args.compile_cache:
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  train_presets = [p for p in args.train_presets.split(",") if p]
  batches = [int(b) for b in args.decode_batches.split(",") if b]
  over = lambda: time.perf_counter() - start > args.budget_s
  # PyTorch first, before JAX reserves the device memory.
  device = None if args.no_torch else torch_device()
  theirs = {}
  if device is None:
    print("PyTorch comparison skipped (--no_torch, or torch/transformers/CUDA absent)")
  for preset in train_presets:
    if device and not over():
      theirs[f"train {preset}"] = torch_train(preset, args, device)
  for b in batches:
    if device and not over():
      theirs[f"decode {b}"] = torch_generate(args.decode_preset, b, args, device)
  if device == "cuda":
    import torch  # pylint: disable=g-import-not-at-top
    torch.cuda.empty_cache()

  kind = jax.devices()[0].device_kind
  name, peak_flops, peak_bw = peaks(kind, args)
  print(f"jax {jax.__version__}, {jax.default_backend()} {kind}: peak {peak_flops / 1e12:.3g} "
        f"TFLOP/s, {peak_bw / 1e12:.3g} TB/s ({name}); remat {args.remat}", flush=True)
  rows = []
  for preset in train_presets:
    if over():
      rows.append(dict(name=f"train {preset}", skipped=True))
      continue
    r = measure_train(preset, args, peak_flops)
    t = theirs.get(r["name"], {})
    r.update(torch_tokens_s=t.get("tokens_s"), torch_note=f"(mb {t['mb']}) " if t else "")
    rows.append(r)
  for b in batches:
    if over():
      rows.append(dict(name=f"decode {args.decode_preset} B={b}", skipped=True))
      continue
    r = measure_decode(args.decode_preset, b, args, peak_bw)
    r.update(torch_tokens_s=theirs.get(f"decode {b}", {}).get("tokens_s"))
    rows.append(r)

  print(f"\n{name}: {'dry run, tiny shapes' if args.dry_run else 'bf16'}; "
        f"{time.perf_counter() - start:.0f} s in all\n")
  print("| measurement | shape | s / step or call | tokens/s | rate | MFU or HBM util | target | "
        "PyTorch tokens/s | JAX / PyTorch |\n|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['name']} | skipped: time budget |||||||" if r.get("skipped") else _row(r))
  print("\nTargets (H200): MFU >= 45%, decode >= 60% of HBM roofline, JAX / PyTorch generate "
        ">= 2x.", flush=True)
  return rows


if __name__ == "__main__":
  main()
