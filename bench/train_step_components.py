r"""Where the CPU train step stands against PyTorch, piece by piece: forward + backward of each.

    python bench/train_step_components.py [--rounds 15]

The tiny shape of `bench/train_step_throughput.py` (batch 64 x 160 tokens, hidden 256, 8 heads,
2 kv heads, head dim 32, MLP 768), fp32, gradients of a sum of squares:

- attention core: `dapo_jax.models.attention.xla_attention` (causal + left-padding mask) against
  `torch.nn.functional.scaled_dot_product_attention` with the same boolean mask and kv heads
  repeated, as transformers' Qwen2 calls it;
- the SwiGLU MLP: `down(silu(gate(x)) * up(x))` on [B * L, D] in both;
- one 256 -> 768 linear layer (the plain matmul, forward and both gradients).

JAX and PyTorch alternate one call at a time (the CPU is shared); the ratio is PyTorch time /
JAX time of the same round (> 1: JAX faster), median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.models import attention

B, L, D, H, K, E, F = 64, 160, 256, 8, 2, 32, 768


def pieces():
  """{name: (jax_call, torch_call)} on the same inputs."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as tf  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  q, k, v = (rng.randn(*s).astype(np.float32) for s in ((B, L, H, E), (B, L, K, E), (B, L, K, E)))
  valid_BxL = np.ones((B, L), bool)
  valid_BxL[:, :10] = False  # left padding
  mask_BxLxL = np.tril(np.ones((L, L), bool))[None] & valid_BxL[:, None, :]
  x = rng.randn(B * L, D).astype(np.float32) * 0.1
  wg, wu, wd = (rng.randn(*s).astype(np.float32) * 0.02 for s in ((D, F), (D, F), (F, D)))

  mask_j = jnp.asarray(mask_BxLxL)
  attn_j = jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(attention.xla_attention(q, k, v, mask_j) ** 2), argnums=(0, 1, 2)))
  mlp_j = jax.jit(jax.grad(
      lambda x, g, u, d: jnp.sum(((jax.nn.silu(x @ g) * (x @ u)) @ d) ** 2), argnums=(0, 1, 2, 3)))
  lin_j = jax.jit(jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1)))
  qj, kj, vj, xj, gj, uj, dj = map(jnp.asarray, (q, k, v, x, wg, wu, wd))

  qt, kt, vt = (torch.tensor(a).transpose(1, 2).requires_grad_() for a in (q, k, v))
  mask_t = torch.tensor(mask_BxLxL)[:, None]
  xt = torch.tensor(x).requires_grad_()
  gt, ut, dt = (torch.tensor(w.T.copy()).requires_grad_() for w in (wg, wu, wd))

  def attn_t():
    kk, vv = kt.repeat_interleave(H // K, 1), vt.repeat_interleave(H // K, 1)
    out = tf.scaled_dot_product_attention(qt, kk, vv, attn_mask=mask_t, scale=E ** -0.5)
    (out ** 2).sum().backward()
    qt.grad = kt.grad = vt.grad = None

  def mlp_t():
    (tf.linear(tf.silu(tf.linear(xt, gt)) * tf.linear(xt, ut), dt) ** 2).sum().backward()
    xt.grad = gt.grad = ut.grad = dt.grad = None

  def lin_t():
    (tf.linear(xt, gt) ** 2).sum().backward()
    xt.grad = gt.grad = None

  return {
      "attention core": (lambda: jax.block_until_ready(attn_j(qj, kj, vj)), attn_t),
      "SwiGLU MLP": (lambda: jax.block_until_ready(mlp_j(xj, gj, uj, dj)), mlp_t),
      f"one linear {D} -> {F}": (lambda: jax.block_until_ready(lin_j(xj, gj)), lin_t),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
  cpu = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if "Model name" in l), "?")
  print(f"CPU: {cpu}; jax {jax.__version__}, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; fp32, forward + backward, {args.rounds} rounds\n")
  print("| piece | JAX ms | PyTorch ms | PyTorch / JAX (median of rounds) |\n|---|---|---|---|")
  for name, (jax_call, torch_call) in pieces().items():
    for _ in range(2):  # warm-up (and compile)
      jax_call()
      torch_call()
    times_j, times_t = [], []
    for _ in range(args.rounds):
      for call, times in ((jax_call, times_j), (torch_call, times_t)):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    ratio = statistics.median(t / j for j, t in zip(times_j, times_t))
    print(f"| {name} | {1e3 * statistics.median(times_j):.1f} | "
          f"{1e3 * statistics.median(times_t):.1f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
  main()
