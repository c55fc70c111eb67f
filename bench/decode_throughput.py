r"""Decode throughput of the compiled sampler against its matmul floor, Tunix and `generate`.

    python bench/decode_throughput.py              # tiny Qwen2, B=64, P=32, R=128
    python bench/decode_throughput.py --tunix_path DIR   # + Tunix's vanilla sampler (see below)
    python bench/decode_throughput.py --repeats 5 --wide_hidden 1024
    python bench/decode_throughput.py --baseline_path /tmp/dec_base   # old vs this dapo_jax

Prints a table: generated tokens/s of `transformers` `generate` and of
`dapo_jax.rollout.Sampler` on the same random checkpoint (written by transformers, loaded with
`dapo_jax.load_pretrained`), sampling at temperature 1 with no stop token so every row makes all
R tokens. The engines are timed interleaved in one run (the CPU is shared; ratios are what count),
warm-up excluded. The floor is the decode's dense matmuls alone on one device (`matmul_bound_fn`).

With `--tunix_path DIR` (a directory holding `google-tunix`, installed with
`pip install --no-deps --target DIR google-tunix==0.1.7` next to the `[bench]` extra: Tunix's
own requirements pin `safetensors<0.8` and pull its trainers' packages; see bench/README.md) it also
times Tunix's vanilla sampler (`tunix.generate.sampler.Sampler` over `tunix.models.qwen2`, loaded
from the same safetensors) at temperature 1, and first checks that Tunix's model gives the same
logits as ours.

Then decode and prefill utilisation of a wider model against the fp32 matmul peak measured in
the same run. A benchmark, not a test: nothing here asserts a time.

With `--baseline_path DIR` (a directory holding another `dapo_jax` package, e.g. from
`git archive main dapo_jax | tar -x -C DIR`) it instead times that Sampler against this one on the
same checkpoint, in alternating subprocesses (PYTHONPATH=DIR vs this checkout), and checks that
both sample the same tokens and log-probs bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dapo_jax
from dapo_jax.models import Qwen2Config
from dapo_jax.infra import sharding as shd
from dapo_jax.rollout import Sampler, SamplingParams

# What Tunix's sampler and Qwen2 modules import beyond this project's requirements (module ->
# pip package): the `[bench]` extra installs them, tests/test_bench_extras.py checks it.
TUNIX_REQUIRES = {"jaxtyping": "jaxtyping", "sentencepiece": "sentencepiece"}
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2)


def write_hf_checkpoint(out_dir: str, **shape) -> str:
  """A random transformers Qwen2 (no EOS), saved as safetensors."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(**shape, max_position_embeddings=2048, rope_theta=10000.0,
                                 tie_word_embeddings=False, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=0)
  transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(out_dir, safe_serialization=True)
  return out_dir


def hf_generate_fn(ckpt: str, ids: np.ndarray, new_tokens: int, threads: int | None = None):
  """`generate` as a new user would call it (default cache and attention).

  `threads` pins torch's intra-op threads for the call: torch's spinning OpenMP workers slow
  down badly when other processes share the cores, so the 1-thread figure is the steadier one.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
  ids_t = torch.tensor(ids, dtype=torch.long)
  mask_t = torch.ones_like(ids_t)

  def run():
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    with torch.no_grad():
      out = model.generate(ids_t, attention_mask=mask_t, do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)
    torch.set_num_threads(default_threads)
    assert out.shape[1] == ids.shape[1] + new_tokens
  return run


def jax_generate_fn(model, ids: np.ndarray, new_tokens: int, num_devices: int = 1):
  """The compiled sampler; with ``num_devices`` > 1 the prompts split over that many CPU
  devices (a ``data`` mesh), which XLA runs on separate threads."""
  graphdef, state = nnx.split(model)
  mesh = None
  if num_devices > 1:
    mesh = shd.make_mesh([("data", num_devices)], devices=jax.devices()[:num_devices])
    state = jax.device_put(state, shd.state_shardings(state, mesh, shd.SAMPLE_RULES))
  sampler = Sampler(graphdef, mesh=mesh)
  params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, eos_ids=())
  mask = np.ones_like(ids, bool)
  calls = [0]

  def run():
    calls[0] += 1
    out = sampler.generate(state, ids, mask, jax.random.key(calls[0]), params)
    assert int(out.num_steps) == new_tokens  # the only host sync, once per call
  return run


def _import_tunix(tunix_path: str):
  """Tunix's sampler and Qwen2 modules from `tunix_path`, without `tunix/__init__.py`.

  The package's `__init__` imports its trainers (metrax, grain, qwix, ...), which the sampler
  does not use; a bare package object with the same `__path__` loads only the submodules asked
  for.
  """
  import importlib  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  pkg_dir = os.path.join(os.path.abspath(tunix_path), "tunix")
  if not os.path.isdir(pkg_dir):
    raise FileNotFoundError(f"--tunix_path {tunix_path!r} holds no tunix/ package; install it "
                            f"with pip install --no-deps --target DIR google-tunix (see the "
                            f"module docstring).")
  missing = [pkg for mod, pkg in TUNIX_REQUIRES.items() if importlib.util.find_spec(mod) is None]
  if missing:
    raise ModuleNotFoundError(f"Tunix's sampler imports {', '.join(missing)}, not installed: "
                              f"pip install -e '.[bench]' (or pip install {' '.join(missing)}).")
  sys.path.insert(0, os.path.abspath(tunix_path))
  pkg = types.ModuleType("tunix")
  pkg.__path__ = [pkg_dir]
  sys.modules.setdefault("tunix", pkg)
  return (importlib.import_module("tunix.generate.sampler"),
          importlib.import_module("tunix.models.qwen2.model"),
          importlib.import_module("tunix.models.qwen2.params"))


class _IdTokenizer:
  """Tunix's sampler takes strings: these are the prompt ids, space-separated. Pad and EOS are
  ids past the vocabulary, so no prompt or sampled token is either (every row makes R tokens)."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids) -> str:
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self):
    return None

  def pad_id(self) -> int:
    return self.vocab_size

  def eos_id(self) -> int:
    return self.vocab_size + 1


def tunix_generate_fn(tunix_path: str, ckpt: str, ids: np.ndarray, new_tokens: int,
                      ours=None):
  """Tunix's vanilla sampler (one device) on the same checkpoint, temperature 1, top-p 1.

  With `ours` (our model on the same checkpoint), first prints the largest logit difference of
  the two models over the prompts, so the comparison is known to run the same network.
  """
  sampler_lib, model_lib, params_lib = _import_tunix(tunix_path)
  t = TINY
  cfg = model_lib.ModelConfig(
      num_layers=t["num_hidden_layers"], vocab_size=t["vocab_size"],
      embed_dim=t["hidden_size"], hidden_dim=t["intermediate_size"],
      num_heads=t["num_attention_heads"], head_dim=t["hidden_size"] // t["num_attention_heads"],
      num_kv_heads=t["num_key_value_heads"], rope_theta=10000, norm_eps=1e-6)
  model = params_lib.create_model_from_safe_tensors(ckpt, cfg)
  b, p = ids.shape
  if ours is not None:
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((p, p), bool)), (b, p, p))
    theirs_logits, _ = model(jnp.asarray(ids), pos, None, causal)
    diff = float(jnp.max(jnp.abs(theirs_logits - ours(jnp.asarray(ids)))))
    print(f"Tunix Qwen2 vs dapo_jax logits on the prompts: max |diff| {diff:.2e}")
  sampler = sampler_lib.Sampler(model, _IdTokenizer(t["vocab_size"]), sampler_lib.CacheConfig(
      cache_size=p + new_tokens, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim))
  prompts = [" ".join(str(int(x)) for x in row) for row in ids]
  calls = [0]

  def run():
    calls[0] += 1
    out = sampler(prompts, max_generation_steps=new_tokens, max_prompt_length=p,
                  temperature=1.0, top_p=1.0, seed=calls[0])
    assert all(len(tok) == new_tokens for tok in out.tokens)  # host copy: the call is done
  return run


def dense_weights(model):
  """Each layer's (q, k, v, o, gate, up, down) kernels as 2-D matrices, and the LM head."""
  d = model.config.hidden_size
  weights = []
  for layer in model.layers:
    a, m = layer.self_attn, layer.mlp
    weights.append((a.q_proj.kernel[...].reshape(d, -1), a.k_proj.kernel[...].reshape(d, -1),
                    a.v_proj.kernel[...].reshape(d, -1), a.o_proj.kernel[...].reshape(-1, d),
                    m.gate_proj.kernel[...], m.up_proj.kernel[...], m.down_proj.kernel[...]))
  return weights, model.lm_head_kernel()


def matmul_bound_fn(model, batch: int, new_tokens: int, num_devices: int = 1):
  """The decode's dense matmuls ALONE (no attention, norms, RoPE, sampling, cache writes).

  Same weights and [B, D] shapes as each decode step, chained so XLA keeps every product:
  its time is a floor for any decode of this model on this CPU, measured in the same run. With
  ``num_devices`` > 1 the rows split over that many CPU devices, weights replicated: the floor
  of the sampler's data-parallel layout.
  """
  weights, head = dense_weights(model)

  @jax.jit
  def steps(x_BxD):
    def body(_, x):
      for wq, wk, wv, wo, wg, wu, wd in weights:
        q = x @ wq
        x = x + (q @ wo) + jnp.sum(x @ wk, -1, keepdims=True) + jnp.sum(x @ wv, -1, keepdims=True)
        x = x + ((x @ wg) * (x @ wu)) @ wd
      return x + jnp.sum(x @ head, -1, keepdims=True) * 1e-6
    return jax.lax.fori_loop(0, new_tokens - 1, body, x_BxD)
  x = jnp.ones((batch, model.config.hidden_size), jnp.float32) * 1e-3
  if num_devices > 1:
    mesh = shd.make_mesh([("data", num_devices)], devices=jax.devices()[:num_devices])
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  return lambda: steps(x).block_until_ready()


def once(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def flops_per_token(cfg: Qwen2Config, context: float) -> float:
  """Matmul FLOPs of one token: 2 x (weights touched, no embedding lookup) + attention."""
  matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (
      0 if cfg.tie_word_embeddings else 1)
  attn = 4 * context * cfg.num_attention_heads * cfg.dim_per_head * cfg.num_hidden_layers
  return 2 * matmul_params + attn


def _child(ckpt: str, b: int, p: int, r: int, repeats: int):
  """One side of the A/B: best time of `repeats` Sampler calls, and a digest of one output."""
  ids = np.random.RandomState(0).randint(1, TINY["vocab_size"], (b, p)).astype(np.int32)
  model = dapo_jax.load_pretrained(ckpt)
  graphdef, state = nnx.split(model)
  sampler = Sampler(graphdef)
  params = SamplingParams(temperature=1.0, max_new_tokens=r, eos_ids=())
  mask = np.ones_like(ids, bool)
  out = jax.device_get(sampler.generate(state, ids, mask, jax.random.key(1), params))  # compile
  digest = hashlib.sha256(np.asarray(out.response_ids).tobytes()
                          + np.asarray(out.logprobs).tobytes()).hexdigest()[:16]
  times = []
  for i in range(repeats):
    t = time.perf_counter()
    assert int(sampler.generate(state, ids, mask, jax.random.key(2 + i), params).num_steps) == r
    times.append(time.perf_counter() - t)
  print(json.dumps({"best": min(times), "digest": digest, "file": dapo_jax.__file__}))


def baseline_ab(baseline: str, b: int, p: int, r: int, rounds: int, repeats: int):
  """Old (`baseline`) vs this dapo_jax, alternating subprocesses; prints tok/s and the ratio."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
  cpu = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if "Model name" in l), "?")
  best = {"old": float("inf"), "new": float("inf")}
  digests = {}
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = write_hf_checkpoint(tmp, **TINY)
    for _ in range(rounds):
      for name, path in (("old", baseline), ("new", here)):
        env = dict(os.environ, PYTHONPATH=path)
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", ckpt,
                              "--batch", str(b), "--prompt_len", str(p), "--new_tokens", str(r),
                              "--repeats", str(repeats)], env=env, capture_output=True,
                             text=True, check=True)
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got["file"].startswith(os.path.abspath(path)), (got["file"], path)
        best[name] = min(best[name], got["best"])
        digests[name] = got["digest"]
  print(f"CPU: {cpu}; jax {jax.__version__}; B={b} P={p} R={r}, temperature 1, best of "
        f"{rounds} alternating rounds x {repeats} calls\n")
  print("| sampler | best tok/s |\n|---|---|")
  for name in ("old", "new"):
    print(f"| {name} | {b * r / best[name]:,.0f} |")
  print(f"\nnew / old throughput: {best['old'] / best['new']:.3f}x; same tokens and log-probs: "
        f"{digests['old'] == digests['new']} ({digests['old']} vs {digests['new']})")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--wide_hidden", type=int, default=1024, help="0 skips the utilisation table")
  ap.add_argument("--cpu_devices", type=int, default=2,
                  help="also time the sampler with the prompts split over this many CPU "
                       "devices (one per core); 1 skips it")
  ap.add_argument("--baseline_path", default="",
                  help="a directory holding an older dapo_jax: time its Sampler against this "
                       "one instead (alternating subprocesses)")
  ap.add_argument("--rounds", type=int, default=4, help="alternations with --baseline_path")
  ap.add_argument("--tunix_path", default="",
                  help="a directory holding google-tunix (pip install --no-deps --target): "
                       "also time Tunix's vanilla sampler on the same checkpoint")
  ap.add_argument("--_child", dest="child", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return _child(args.child, args.batch, args.prompt_len, args.new_tokens, args.repeats)
  if args.baseline_path:
    return baseline_ab(os.path.abspath(args.baseline_path), args.batch, args.prompt_len,
                       args.new_tokens, args.rounds, args.repeats)
  if args.cpu_devices > 1:  # before any backend starts
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  b, p, r = args.batch, args.prompt_len, args.new_tokens
  ids = np.random.RandomState(0).randint(1, TINY["vocab_size"], (b, p)).astype(np.int32)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; B={b} P={p} R={r}, "
        f"temperature 1, no EOS, best and median of {args.repeats} (warm-up excluded)")

  with tempfile.TemporaryDirectory() as tmp:
    ckpt = write_hf_checkpoint(tmp, **TINY)
    ours_model = dapo_jax.load_pretrained(ckpt)
    engines = {
        "transformers generate (default threads)": hf_generate_fn(ckpt, ids, r),
        "transformers generate (1 torch thread)": hf_generate_fn(ckpt, ids, r, threads=1),
        **({"Tunix vanilla Sampler (one device)": tunix_generate_fn(
            args.tunix_path, ckpt, ids, r, ours=ours_model)} if args.tunix_path else {}),
        "dapo_jax Sampler": jax_generate_fn(ours_model, ids, r),
        "floor: the decode's matmuls alone": matmul_bound_fn(ours_model, b, r),
    }
    if args.cpu_devices > 1:
      n = args.cpu_devices
      engines[f"dapo_jax Sampler, prompts over {n} CPU devices"] = jax_generate_fn(
          dapo_jax.load_pretrained(ckpt), ids, r, n)
      engines[f"floor: the decode's matmuls alone, rows over {n} CPU devices"] = (
          matmul_bound_fn(ours_model, b, r, n))
    for fn in engines.values():
      fn()  # warm-up (and compile)
    times = {name: [] for name in engines}
    for _ in range(args.repeats):  # interleaved, so all see the same background load
      for name, fn in engines.items():
        times[name].append(once(fn))

  # The speed-ups are of the faster dapo_jax layout (one device, or prompts over several).
  ours = min((n for n in times if n.startswith("dapo_jax")), key=lambda n: min(times[n]))
  ours_t = times[ours]
  print(f"\n| engine | best tok/s | median tok/s | speed-up of {ours!r} (median of pairs, "
        "best/best) |\n|---|---|---|---|")
  for name, ts in times.items():
    pairs = statistics.median(h / o for h, o in zip(ts, ours_t))
    print(f"| {name} | {b * r / min(ts):,.0f} | {b * r / statistics.median(ts):,.0f} | "
          f"{pairs:.2f}x, {min(ts) / min(ours_t):.2f}x |")
  # Each sampler layout against the floor of the same layout (same round, then best/best).
  floors = {"dapo_jax Sampler": "floor: the decode's matmuls alone"}
  if args.cpu_devices > 1:
    floors[f"dapo_jax Sampler, prompts over {args.cpu_devices} CPU devices"] = (
        f"floor: the decode's matmuls alone, rows over {args.cpu_devices} CPU devices")
  print()
  for name, floor_name in floors.items():
    ts, fs = times[name], times[floor_name]
    print(f"{name!r}: {statistics.median(f / t for f, t in zip(fs, ts)):.0%} of its matmul "
          f"floor's speed (median of rounds; best/best {min(fs) / min(ts):.0%}).")

  if args.wide_hidden:
    utilisation(args.wide_hidden, b, p, r, args.repeats)


def utilisation(hidden: int, b: int, p: int, r: int, repeats: int):
  """Decode and prefill FLOP/s of a wider model as a fraction of the measured matmul peak."""
  heads = max(hidden // 64, 1)
  cfg = Qwen2Config(TINY["vocab_size"], hidden, hidden * 3, TINY["num_hidden_layers"], heads,
                    max(heads // 4, 1), rope_theta=10000.0, tie_word_embeddings=False,
                    max_position_embeddings=2048, bos_token_id=None, eos_token_id=None)
  model = dapo_jax.models.create_model(cfg)
  ids = np.random.RandomState(1).randint(1, cfg.vocab_size, (b, p)).astype(np.int32)
  a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
  dot = jax.jit(lambda a: jnp.dot(a, a))
  fns = {"peak": lambda: dot(a).block_until_ready(), "full": jax_generate_fn(model, ids, r),
         "prefill": jax_generate_fn(model, ids, 1)}
  for fn in fns.values():
    fn()  # warm-up (and compile)
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):  # interleaved, so all see the same background load
    for name, fn in fns.items():
      # The (short) peak is sampled three times a round so one busy moment does not set it.
      best[name] = min([best[name]] + [once(fn) for _ in range(3 if name == "peak" else 1)])
  peak = 2 * 2048**3 / best["peak"]
  full, prefill = best["full"], best["prefill"]
  decode = max(full - prefill, 1e-9)
  dec_flops = b * (r - 1) * flops_per_token(cfg, p + r / 2)
  pre_flops = b * p * flops_per_token(cfg, p / 2)
  print(f"\nwide model: hidden {hidden}, {cfg.num_hidden_layers} layers, {heads} heads, "
        f"{cfg.num_key_value_heads} kv heads, MLP {3 * hidden}, "
        f"{cfg.num_params() / 1e6:.1f}M params")
  print(f"fp32 matmul peak (jnp.dot 2048^2, best in the same loop): {peak / 1e9:.1f} GFLOP/s\n")
  print("| phase | time s | tok/s | GFLOP/s | fraction of peak |\n|---|---|---|---|---|")
  print(f"| prefill (B x P, + 1 sample) | {prefill:.3f} | {b * p / prefill:,.0f} | "
        f"{pre_flops / prefill / 1e9:.1f} | {pre_flops / prefill / peak:.2f} |")
  print(f"| decode (R - 1 steps) | {decode:.3f} | {b * (r - 1) / decode:,.0f} | "
        f"{dec_flops / decode / 1e9:.1f} | {dec_flops / decode / peak:.2f} |")
  print("\n(Fractions compare best times of a shared CPU; above ~0.9 means the peak samples hit a "
        "busier moment than the run they divide: rerun.)")


if __name__ == "__main__":
  main()
