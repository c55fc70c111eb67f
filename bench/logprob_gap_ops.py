# nice -n 19 python bench/logprob_gap_ops.py   (~1 min on a 2-core CPU)
"""Which layer operation makes the decode and the training forward differ (issue 29): the same
inputs through one op in the two shapes each path uses, bit-equal share of the outputs.

- a dense projection (q_proj, D -> H x E) and the MLP's gate_proj (D -> I) on a training pass's
  [B, L, D] against a decode step's [B, 1, D] per column, and against one row [1, 1, D];
- the attention core: `attention.xla_attention` (the full pass) against
  `attention.decode_attention` (one query over the cache) at the same query, and the two einsums
  (scores, then probabilities x values) alone.

tiny_cpu model, random init, random inputs; fp32 and bf16. Prints one line per comparison.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import logprob_gap_probes as probes_lib  # noqa: E402  # pylint: disable=wrong-import-position

from dapo_jax.models import attention  # noqa: E402


def same_bits(a, b) -> float:
  a, b = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (a, b))
  return float(np.mean(a.view(np.uint32) == b.view(np.uint32)))


def main() -> None:
  for dtype in ("float32", "bfloat16"):
    config = probes_lib.tiny_config(dtype)
    graphdef, params, rest, _ = probes_lib.build(config)
    layer = nnx.merge(graphdef, params, rest).layers[0]
    dt = jnp.dtype(dtype)
    b, l = 8, 56  # 8 rows, prompt 24 + response 32
    d = layer.self_attn.q_proj.kernel.value.shape[0]
    x = jax.random.normal(jax.random.key(0), (b, l, d)).astype(dt)
    for name, mod in (("q_proj", layer.self_attn.q_proj), ("mlp gate_proj", layer.mlp.gate_proj)):
      f = jax.jit(lambda x, mod=mod: mod(x, dt))
      full = f(x)
      cols = jnp.concatenate([f(x[:, t:t + 1]) for t in range(l)], 1)
      print(f"{dtype} {name}: [{b}, {l}, D] vs [{b}, 1, D] per column {same_bits(full, cols):.4f}, "
            f"vs [1, 1, D] {same_bits(full[:1, 5:6], f(x[:1, 5:6])):.4f}")
    h, k, e = 4, 2, d // 4
    q = jax.random.normal(jax.random.key(1), (b, l, h, e)).astype(dt)
    keys = jax.random.normal(jax.random.key(2), (b, l, k, e)).astype(dt)
    vals = jax.random.normal(jax.random.key(3), (b, l, k, e)).astype(dt)
    causal = jnp.tril(jnp.ones((l, l), bool))[None].repeat(b, 0)
    full = jax.jit(attention.xla_attention)(q, keys, vals, causal)
    k_cache, v_cache = jnp.transpose(keys, (0, 2, 3, 1)), jnp.transpose(vals, (0, 2, 1, 3))
    t = 40
    valid = (jnp.arange(l) <= t)[None].repeat(b, 0)
    dec = jax.jit(attention.decode_attention)(q[:, t], k_cache, v_cache, valid)
    diff = float(jnp.max(jnp.abs(full[:, t].astype(jnp.float32) - dec.astype(jnp.float32))))
    print(f"{dtype} attention core, full pass vs decode at query {t}: "
          f"{same_bits(full[:, t], dec):.4f} (max abs diff {diff:.3g})")
    qg = q.reshape(b, l, k, h // k, e)
    s_full = jnp.einsum("btkge,bske->bkgts", qg, keys,
                        preferred_element_type=jnp.float32)[..., t, :]
    s_dec = jnp.einsum("nkge,nkes->nkgs", qg[:, t], k_cache, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(jnp.where(valid[:, None, None], s_dec, -1e30), -1).astype(dt)
    o_full = jnp.einsum("bkgts,bske->btkge", p[:, :, :, None, :], vals)[:, 0]
    o_dec = jnp.einsum("nkgs,nkse->nkge", p, v_cache)
    print(f"{dtype} attention einsums alone: scores {same_bits(s_full, s_dec):.4f}, "
          f"probabilities x values {same_bits(o_full, o_dec):.4f}")


if __name__ == "__main__":
  main()
