r"""Compiled memory of one DAPO update at the Qwen2.5-0.5B shape, chunked vs full logits.

    python bench/train_step_memory.py [--response 4096] [--prompt 256] [--chunks 0,512,2048]

Compiles (never runs) `TrainStep` on abstract bf16 params (ShapeDtypeStructs:
nothing is allocated) with remat on, one micro-batch of one sequence, and
prints XLA's memory analysis of the compiled step: arguments (params, AdamW
moments, batch), outputs (aliased to the donated arguments) and temporaries
(activations, logits, gradients). Chunk 0 is the unchunked path, which holds
full fp32 [R, V] logits and their softmax for the backward pass.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dapo_jax.models import logprobs
from dapo_jax.trainer import objective as obj
from dapo_jax.trainer import train_step as ts
from dapo_jax.models import abstract_model, get_preset

GIB = 2.0 ** 30

_CPU_NOTE = """\
Note (XLA:CPU): the compiled CPU program has no optimization barriers left, and
CSE merges remat's recomputation back into the forward pass (with CSE disabled
the scheduler still runs it early): 8 checkpointed toy blocks compile to the
same temp bytes with and without jax.checkpoint. So the whole-step temp on CPU
holds every layer's fp32 [H, L, L] attention scores (about 1 GiB per layer at
L = 4352) and overstates what a GPU/TPU compile needs. The difference between
its rows, and the loss-head table, are the logits' share. The chunk scan is a
loop, so its recompute survives on every backend."""


def abstract_inputs(model_cfg, train_cfg, batch: int, prompt: int, response: int):
  """ShapeDtypeStruct state and batch: no parameter or optimizer memory is touched."""
  graphdef, params, rest = nnx.split(abstract_model(model_cfg), nnx.Param, ...)
  opt_state = jax.eval_shape(ts.make_optimizer(train_cfg).init, params)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  state = ts.TrainState(params, rest, opt_state, scalar, scalar)
  sds = jax.ShapeDtypeStruct
  length = prompt + response
  batch = ts.TrainBatch(
      input_ids=sds((batch, length), jnp.int32), attention_mask=sds((batch, length), jnp.int32),
      response_mask=sds((batch, response), jnp.float32),
      old_log_probs=sds((batch, response), jnp.float32), advantages=sds((batch,), jnp.float32))
  return graphdef, state, batch


def head_memory(model_cfg, batch: int, response: int, chunk: int):
  """Compiled memory of the loss head alone: hidden states -> log-probs -> loss -> grads.

  This is the part the chunking changes; it has no per-layer remat, so XLA:CPU
  measures it faithfully (see the note printed by main).
  """
  d, v = model_cfg.hidden_size, model_cfg.vocab_size
  dt = model_cfg.jnp_dtype
  sds = jax.ShapeDtypeStruct

  def loss(h_BxRxD, w_DxV, targets_BxR, old_BxR, adv_B, mask_BxR):
    logp, _ = logprobs.chunked_token_stats(h_BxRxD, w_DxV, targets_BxR, chunk_size=chunk)
    return obj.compute_policy_loss(old_BxR, logp, adv_B, mask_BxR)[0]

  args = (sds((batch, response, d), dt), sds((d, v), dt), sds((batch, response), jnp.int32),
          sds((batch, response), jnp.float32), sds((batch,), jnp.float32),
          sds((batch, response), jnp.float32))
  t0 = time.perf_counter()
  compiled = jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile()
  return compiled.memory_analysis(), time.perf_counter() - t0


def _row(label, mem, seconds):
  arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
  alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
  peak = arg + out - alias + temp
  print(f"| {label:>11} | {arg / GIB:13.2f} | {out / GIB:11.2f} | {alias / GIB:11.2f} | "
        f"{temp / GIB:8.2f} | {peak / GIB:8.2f} | {seconds:9.1f} |", flush=True)


def _header(title):
  print(f"\n{title}\n")
  print(f"| {'logit chunk':>11} | {'arguments GiB':>13} | {'outputs GiB':>11} | "
        f"{'aliased GiB':>11} | {'temp GiB':>8} | {'peak GiB':>8} | {'compile s':>9} |")
  print(f"|{'-' * 13}|{'-' * 15}|{'-' * 13}|{'-' * 13}|{'-' * 10}|{'-' * 10}|{'-' * 11}|")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="qwen2.5-0.5b")
  parser.add_argument("--prompt", type=int, default=256)
  parser.add_argument("--response", type=int, default=4096)
  parser.add_argument("--micro_batch", type=int, default=1)
  parser.add_argument("--chunks", default="0,512,2048", help="0 = unchunked logits")
  parser.add_argument("--remat", default="full")
  args = parser.parse_args()

  model_cfg = get_preset(args.preset, param_dtype="bfloat16", dtype="bfloat16",
                         remat=args.remat)
  print(f"{args.preset}: {model_cfg.num_params() / 1e6:.0f}M params, vocab "
        f"{model_cfg.vocab_size}, bf16 params and compute, remat={args.remat}, micro-batch "
        f"{args.micro_batch} x ({args.prompt} prompt + {args.response} response) tokens, "
        f"backend {jax.default_backend()}")
  full_logits = args.micro_batch * args.response * model_cfg.vocab_size * 4 / GIB
  print(f"one fp32 [B, R, V] logits tensor is {full_logits:.2f} GiB")
  chunks = [int(c) for c in args.chunks.split(",")]
  _header("Loss head alone (hidden states in; grads of hidden states and lm_head out):")
  for chunk in chunks:
    mem, seconds = head_memory(model_cfg, args.micro_batch, args.response, chunk)
    _row("none" if chunk == 0 else str(chunk), mem, seconds)
  _header("Whole compiled TrainStep (params, AdamW state and batch in; state donated):")
  for chunk in chunks:
    train_cfg = ts.TrainConfig(logit_chunk_size=chunk)
    graphdef, state, batch = abstract_inputs(model_cfg, train_cfg, args.micro_batch, args.prompt,
                                             args.response)
    t0 = time.perf_counter()
    compiled = ts.TrainStep(graphdef, train_cfg).lower(state, batch).compile()
    _row("none" if chunk == 0 else str(chunk), compiled.memory_analysis(),
         time.perf_counter() - t0)
  print("\npeak = arguments + outputs - aliased (donated) + temporaries.")
  if jax.default_backend() == "cpu":
    print(_CPU_NOTE)


if __name__ == "__main__":
  main()
