r"""LoRA vs full fine-tuning on CPU: update step time, compiled memory, checkpoint bytes, and the
rollout's merge once per step vs applying the adapters inside every decode step.

    nice -n 19 python bench/lora_cost.py [--preset tiny] [--ranks 1,8,32] \
        [--out bench/results/lora_cost.json]

One device (no mesh), bf16 params and compute, fp32 master copy of what is trained, one
mini-batch of `--rows` rows x (`--prompt` + `--response`) tokens in 2 micro-batches. Per variant:
XLA's memory analysis of the compiled `TrainStep` (arguments, outputs, aliased, temporaries),
the median wall time of `--steps` updates after a warm-up one, and the bytes an Orbax save of
(params, opt_state) writes (`TrainCheckpointer`, what dapo-train saves each checkpoint). Then the
rollout side for one LoRA rank: the time of `MergedRolloutWeights` (W + s A B and the cast, once
per step) vs `RolloutWeights` (the cast alone, full fine-tuning), and the static sampler's decode
time with merged weights vs with the adapters applied in every decode step (the adapted graph).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dapo_jax import train_step as ts
from dapo_jax.checkpoints.orbax import TrainCheckpointer
from dapo_jax.models import create_model, get_preset, lora
from dapo_jax.rollout.sampler import Sampler
from dapo_jax.rollout.sampling import SamplingParams
from dapo_jax.rollout.weights import MergedRolloutWeights, RolloutWeights

MIB = 2.0 ** 20


def _batch(rows, prompt, response, vocab, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, vocab, (rows, prompt + response)).astype(np.int32)
  attn = np.ones_like(ids)
  return ts.TrainBatch(
      input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
      response_mask=jnp.ones((rows, response), jnp.float32),
      old_log_probs=jnp.full((rows, response), -5.0, jnp.float32),
      advantages=jnp.asarray(np.where(np.arange(rows) % 2, 1.0, -1.0), jnp.float32))


def _model(args, rank):
  mcfg = get_preset(args.preset, param_dtype="bfloat16", dtype="bfloat16", remat="full",
                    scan_layers=True)
  model = create_model(mcfg, seed=0)
  if rank:
    lora.add_adapters(model, lora.LoRAConfig(rank=rank, alpha=2.0 * rank), seed=1)
  return model


def _time(fn, n):
  out = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def train_side(args, rank):
  model = _model(args, rank)
  cfg = ts.TrainConfig(num_micro_batches=2, logit_chunk_size=0, warmup_steps=0)
  graphdef, state = ts.init_train_state(model, cfg)
  batch = _batch(args.rows, args.prompt, args.response, model.config.vocab_size)
  step = ts.TrainStep(graphdef, cfg)
  mem = step.lower(state, batch).compile().memory_analysis()
  state, _ = step(state, batch, 0)  # warm-up (compiles)
  times = []
  for s in range(args.steps):
    t0 = time.perf_counter()
    state, m = step(state, batch, s)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  with tempfile.TemporaryDirectory() as d:
    ck = TrainCheckpointer(d, async_save=False)
    ck.save(1, state.params, state.opt_state, {"step": 1})
    ck.wait_until_finished()
    ck.close()
    ckpt_bytes = int(subprocess.check_output(["du", "-sb", d]).split()[0])
  n_trained = sum(x.size for x in jax.tree.leaves(state.params))
  return {"rank": rank, "trained_params": int(n_trained),
          "base_params": int(sum(x.size for x in jax.tree.leaves(state.rest))),
          "argument_mib": mem.argument_size_in_bytes / MIB,
          "output_mib": mem.output_size_in_bytes / MIB,
          "alias_mib": mem.alias_size_in_bytes / MIB,
          "temp_mib": mem.temp_size_in_bytes / MIB,
          "peak_mib": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                       - mem.alias_size_in_bytes + mem.temp_size_in_bytes) / MIB,
          "step_s_median": statistics.median(times), "checkpoint_bytes": ckpt_bytes}


def rollout_side(args, rank):
  model = _model(args, 0)
  plain_graphdef, plain_state = nnx.split(model)
  dtype = model.config.jnp_param_dtype
  fp32 = jax.tree.map(lambda x: x.astype(jnp.float32), plain_state)
  to_rollout = RolloutWeights(dtype, None)
  to_rollout(fp32)
  cast_s = _time(lambda: to_rollout(fp32), 5)
  lcfg = lora.LoRAConfig(rank=rank, alpha=2.0 * rank)
  lora.add_adapters(model, lcfg, seed=1)
  graphdef, adapters, base = nnx.split(model, lora.Adapter, ...)
  adapters = jax.tree.map(lambda x: (x + 0.01).astype(jnp.float32), adapters)
  merge = MergedRolloutWeights(dtype, None, lcfg.scale, base=base)
  merge(adapters)
  merge_s = _time(lambda: merge(adapters), 5)
  sp = SamplingParams(max_new_tokens=args.decode_tokens, eos_ids=(), pad_id=0)
  prompts = jnp.asarray(np.random.RandomState(1).randint(1, 100, (args.decode_rows, 16)),
                        jnp.int32)
  mask = jnp.ones(prompts.shape, bool)
  merged_state = merge(adapters)
  adapted_graphdef, adapted_state = nnx.split(nnx.merge(graphdef, adapters, base))
  calls = {}
  for name, gd, st in (("merged", plain_graphdef, merged_state),
                       ("applied_in_decode", adapted_graphdef, adapted_state)):
    gen = Sampler(gd).generate
    calls[name] = lambda gen=gen, st=st: gen(st, prompts, mask, jax.random.key(0), sp,
                                             1).logprobs
    calls[name]()  # compile
  # Interleaved (A B A B ...) so that load from other processes hits both alike.
  times = {name: [] for name in calls}
  for _ in range(args.decode_repeats):
    for name, call in calls.items():
      times[name].append(_time(call, 1))
  out = {f"decode_s_{name}": statistics.median(t) for name, t in times.items()}
  out.update({f"decode_s_{name}_all": t for name, t in times.items()})
  return {"rank": rank, "cast_only_s": cast_s, "merge_and_cast_s": merge_s, **out,
          "decode_rows": args.decode_rows, "decode_tokens": args.decode_tokens}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--ranks", default="1,8,32")
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--response", type=int, default=96)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--decode_rows", type=int, default=16)
  p.add_argument("--decode_tokens", type=int, default=64)
  p.add_argument("--rollout_rank", type=int, default=8)
  p.add_argument("--decode_repeats", type=int, default=7)
  p.add_argument("--parts", default="train,rollout")
  p.add_argument("--out", default="")
  args = p.parse_args()
  rows, roll = [], None
  if "train" in args.parts:
    rows = [train_side(args, 0)] + [train_side(args, int(r)) for r in args.ranks.split(",")]
    for r in rows:
      print(json.dumps(r), flush=True)
  if "rollout" in args.parts:
    roll = rollout_side(args, args.rollout_rank)
    print(json.dumps(roll), flush=True)
  result = {"command": "python bench/lora_cost.py " + " ".join(
      f"--{k}={v}" for k, v in vars(args).items() if k != "out"),
            "backend": jax.default_backend(), "devices": jax.device_count(),
            "train": rows, "rollout": roll}
  if args.out:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
