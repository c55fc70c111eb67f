r"""Tokens/s and FLOP utilisation of one compiled DAPO update vs PyTorch, same weights, same run.

    python bench/train_step_throughput.py [--rounds 10] [--chunks 0,64]

The "tiny" Qwen2 shape (4 layers, hidden 256, 8 heads, 2 kv heads, vocab 512),
fp32, a batch of 64 rows x (32 prompt + 128 response) tokens with unequal
prompt and response lengths. One update = forward with logits / temperature,
token log-probs and entropy, the clipped token-mean loss (spec 4), backward,
global-norm clip 1.0 and AdamW. JAX: `TrainStep` (one compiled, donated call).
PyTorch: transformers' Qwen2ForCausalLM on the same weights, written as a new
user would (full logits, log_softmax + gather, loss.backward, clip_grad_norm_,
torch.optim.AdamW). The CPU is shared with other jobs, so JAX and PyTorch
alternate one update at a time and the ratios of neighbouring updates are
reported.

FLOPs per update (the same nominal count for both): 6 x matmul params x tokens
(the embedding lookup is not a matmul; lm_head is) + 3 x 4 x B x L^2 x H x E per
layer for the two attention einsums (full square, as computed). Peak: a big
fp32 matmul timed in this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.trainer import train_step as ts
from dapo_jax.checkpoints import hf as hf_io
from dapo_jax.models import create_model, default_positions, get_preset

B, P, R = 64, 32, 128


def make_batch(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Left-padded prompts of 16..32 tokens, right-padded responses of 64..128 tokens."""
  rng = np.random.RandomState(seed)
  attn = np.zeros((B, P + R), np.int32)
  for b in range(B):
    attn[b, P - rng.randint(16, P + 1):P + rng.randint(64, R + 1)] = 1
  ids = np.where(attn == 1, rng.randint(1, vocab, (B, P + R)), 0).astype(np.int32)
  adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
  return dict(ids=ids, attn=attn, mask=attn[:, P:].astype(np.float32), adv=adv,
              pos=np.asarray(default_positions(jnp.asarray(attn))))


def matmul_peak_flops(n: int = 2048, reps: int = 5) -> float:
  """Best fp32 matmul rate of this machine, now (FLOP/s)."""
  a = jnp.ones((n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    dot(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def flops_per_update(cfg) -> float:
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  h, k, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
  per_layer = d * h * e + 2 * d * k * e + h * e * d + 3 * d * f
  matmul_params = cfg.num_hidden_layers * per_layer + d * v
  tokens = B * (P + R)
  attention = 3 * 4 * B * (P + R) ** 2 * h * e * cfg.num_hidden_layers
  return 6 * matmul_params * tokens + attention


def torch_update_fn(ckpt_dir: str, data: dict[str, np.ndarray], old_logp: np.ndarray,
                    temperature: float):
  """A PyTorch update on the checkpoint's weights; returns step() -> loss."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  model = transformers.Qwen2ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.1)
  ids, attn, pos = (torch.tensor(data[k], dtype=torch.long) for k in ("ids", "attn", "pos"))
  mask, adv = torch.tensor(data["mask"]), torch.tensor(data["adv"])[:, None]
  old = torch.tensor(old_logp)
  targets = ids[:, P:]

  def step() -> float:
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    z = logits[:, P - 1:-1].float() / temperature
    logp = torch.log_softmax(z, -1).gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():  # entropy as a metric, as the JAX step reports it
      entropy = (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1))
      _ = (entropy * mask).sum() / mask.sum()
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28)
    loss_tok = torch.maximum(pg1, pg2)
    loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -adv * 10.0), loss_tok)
    loss = (loss_tok * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()

  return step


def timed(step) -> float:
  t0 = time.perf_counter()
  step()
  return time.perf_counter() - t0


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=10, help="timed updates of each")
  parser.add_argument("--chunks", default="0,64", help="logit chunk sizes; 0 = unchunked")
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top

  cfg = get_preset("tiny")
  model = create_model(cfg, seed=0)
  data = make_batch(cfg.vocab_size)
  tokens = B * (P + R)
  flops = flops_per_update(cfg)
  peak = matmul_peak_flops()
  print(f"tiny Qwen2 ({cfg.num_params() / 1e6:.2f}M params), fp32, batch {B} x ({P} + {R}) = "
        f"{tokens} tokens ({int(data['mask'].sum())} response tokens), "
        f"{flops / 1e9:.1f} GFLOP per update")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} x{jax.device_count()}, torch "
        f"{torch.__version__} with {torch.get_num_threads()} threads, fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s (jnp.dot 2048^3, best of 5)\n")

  steps = {}
  old_logp = None
  for chunk in (int(c) for c in args.chunks.split(",")):
    tcfg = ts.TrainConfig(lr=1e-6, warmup_steps=0, logit_chunk_size=chunk)
    # A fresh copy per step function: the state takes over (and donates) its arrays.
    graphdef, state = ts.init_train_state(create_model(cfg, seed=0), tcfg)
    if old_logp is None:
      old_logp = np.asarray(ts.LogProbForward(graphdef, tcfg)(
          state.params, jnp.asarray(data["ids"]), jnp.asarray(data["attn"]), R)[0])
    batch = ts.TrainBatch(
        input_ids=jnp.asarray(data["ids"]), attention_mask=jnp.asarray(data["attn"]),
        response_mask=jnp.asarray(data["mask"]), old_log_probs=jnp.asarray(old_logp),
        advantages=jnp.asarray(data["adv"]), positions=jnp.asarray(data["pos"]))
    train_step = ts.TrainStep(graphdef, tcfg)
    box = {"state": state}

    def jax_step(train_step=train_step, batch=batch, box=box):
      box["state"], metrics = train_step(box["state"], batch, 0)
      return metrics

    t0 = time.perf_counter()
    first_loss = float(jax_step()["loss"])
    print(f"JAX chunk {chunk}: compile + first update {time.perf_counter() - t0:.1f} s, "
          f"loss {first_loss:.6f}")

    def blocking(jax_step=jax_step, box=box):
      jax_step()
      jax.block_until_ready(box["state"])

    steps[f"jax chunk={chunk}"] = blocking

  with tempfile.TemporaryDirectory() as tmp:
    hf_io.save_pretrained(model, os.path.join(tmp, "tiny"))
    torch_step = torch_update_fn(os.path.join(tmp, "tiny"), data, old_logp, 1.0)
  print(f"PyTorch first update loss {torch_step():.6f} (same weights, batch and old log-probs)\n")
  steps["pytorch"] = torch_step

  # Interleaved one update at a time: load from other jobs shifts by the
  # second, so each ratio compares updates run back to back.
  per = {name: [] for name in steps}
  for _ in range(args.rounds):
    for name, step in steps.items():
      per[name].append(timed(step))
  print(f"| {'update':>14} | {'s / update':>10} | {'tokens/s':>9} | {'resp tok/s':>10} | "
        f"{'GFLOP/s':>8} | {'FLOP util':>9} | {'vs PyTorch: median [min, max]':>29} |")
  print(f"|{'-' * 16}|{'-' * 12}|{'-' * 11}|{'-' * 12}|{'-' * 10}|{'-' * 11}|{'-' * 31}|")
  n_resp = float(data["mask"].sum())
  for name, times in per.items():
    t = statistics.median(times)
    ratios = [pt / jt for jt, pt in zip(times, per["pytorch"])]
    spread = f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"
    print(f"| {name:>14} | {t:10.3f} | {tokens / t:9.0f} | {n_resp / t:10.0f} | "
          f"{flops / t / 1e9:8.1f} | {flops / t / peak:9.1%} | {spread:>29} |")
  print(f"\nmedians over {args.rounds} rounds; ratio = PyTorch time / this time, same round "
        f"(> 1: faster).")


if __name__ == "__main__":
  main()
