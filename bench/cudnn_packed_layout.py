r"""Whether jax's packed ("THD") cuDNN attention, the varlen form packed rows would use on GPU,
compiles for a GPU target on this host (the CUDA plugin, no GPU needed otherwise).

    python bench/cudnn_packed_layout.py --gpu h100     # needs pip install -e '.[cuda]'

It is `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` with per-segment
``q_offsets`` / ``kv_offsets`` and lengths (jax 0.10.2 has no public form), causal, bf16,
rows of 4,096 tokens, forward and gradients. Prints one line: compiled, or the refusal.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dapo_jax.planner import gpu_targets  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gpu", default="h100", help="h100 | h200 | a100")
  args = ap.parse_args()
  gpu_targets.prepare_cuda_env(f"gpu:{args.gpu}:1x1")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  dev = gpu_targets.cuda_devices(args.gpu, 1, 1)[0]
  sharding = jax.sharding.SingleDeviceSharding(dev)
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  b, t, h, e, m = 2, 4096, 8, 128, 8

  def attend(q, k, v, lengths, offsets):
    return fa.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths,
                                    q_offsets=offsets, kv_offsets=offsets,
                                    mask_type=fa.MaskType.CAUSAL, scale=e ** -0.5)

  def loss(*a):
    return attend(*a).astype(jnp.float32).sum()

  args_ = (sds((b, t, h, e), jnp.bfloat16),) * 3 + (sds((b, m), jnp.int32),
                                                    sds((b, m + 1), jnp.int32))
  try:
    jax.jit(attend).lower(*args_).compile()
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args_).compile()
    print(f"{args.gpu}: the packed cuDNN attention compiled, forward and backward")
  except Exception as err:  # pylint: disable=broad-except
    print(f"{args.gpu}: refused: {type(err).__name__}: {str(err).splitlines()[0][:300]}")


if __name__ == "__main__":
  main()
