r"""Compile time and update time of the CPU train step, decoder layers unrolled vs scanned.

    python bench/scan_layers.py [--config configs/tiny_cpu.py] [--layers 4,16] [--rounds 10]

For each layer count, both layouts (`config.model.scan_layers` false / true) of the config's
model and one update's batch (mini_batch_size x rollout.n rows of max_prompt_length +
max_response_length tokens): the trace + lowering time, the XLA compile time, and the median
of `--rounds` updates, layouts alternating one update at a time (the CPU is shared, so
neighbouring updates are compared). Same seed, so both layouts start from the same weights and
the first losses must agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer import run_setup
from dapo_jax.trainer import train_step as ts
from dapo_jax.models import create_model, default_positions


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def make_batch(rows: int, prompt: int, response: int, vocab: int) -> ts.TrainBatch:
  """Left-padded prompts and right-padded responses of random lengths (fixed seed)."""
  rng = np.random.RandomState(0)
  attn = np.zeros((rows, prompt + response), np.int32)
  for b in range(rows):
    attn[b, prompt - rng.randint(1, prompt + 1):prompt + rng.randint(1, response + 1)] = 1
  ids = np.where(attn == 1, rng.randint(1, vocab, attn.shape), 0).astype(np.int32)
  return ts.TrainBatch(
      input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
      response_mask=jnp.asarray(attn[:, prompt:], jnp.float32),
      old_log_probs=jnp.asarray(-rng.rand(rows, response), jnp.float32),
      advantages=jnp.asarray(np.where(np.arange(rows) % 2, 1.0, -1.0), jnp.float32),
      positions=default_positions(jnp.asarray(attn)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/tiny_cpu.py")
  parser.add_argument("--layers", default="", help="comma-separated layer counts; default: "
                      "the config's")
  parser.add_argument("--rounds", type=int, default=10, help="timed updates of each layout")
  args = parser.parse_args()

  config = load_config(args.config)
  spec = RunSpec.from_config(config)
  base = run_setup.model_config(spec.model, spec.tokenizer.kind,
                                run_setup.build_tokenizer(spec.tokenizer, spec.model.checkpoint))
  o = config.optim
  rows = o.mini_batch_size * config.rollout.n
  batch = make_batch(rows, config.data.max_prompt_length, config.rollout.max_response_length,
                     base.vocab_size)
  tcfg = ts.TrainConfig(lr=1e-6, warmup_steps=0)
  print(f"{args.config}: hidden {base.hidden_size}, remat {base.remat}, batch {rows} x "
        f"{batch.input_ids.shape[1]} tokens; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind} x{jax.device_count()}")
  layer_counts = [int(n) for n in args.layers.split(",")] if args.layers else [
      base.num_hidden_layers]
  for n in layer_counts:
    steps, losses = {}, {}
    for scan in (False, True):
      cfg = base.replace(num_hidden_layers=n, scan_layers=scan)
      graphdef, state = ts.init_train_state(create_model(cfg, seed=0), tcfg)
      train_step = ts.TrainStep(graphdef, tcfg)
      t0 = time.perf_counter()
      lowered = train_step.lower(state, batch)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      box = {"state": state}

      def step(compiled=compiled, box=box):
        box["state"], metrics = compiled(box["state"], batch, jnp.int32(0))
        jax.block_until_ready(box["state"])
        return metrics

      losses[scan] = float(step()["loss"])
      steps[scan] = step
      name = "scanned " if scan else "unrolled"
      print(f"  {n:3d} layers {name}: trace+lower {t1 - t0:6.2f} s, compile {t2 - t1:6.2f} s, "
            f"first loss {losses[scan]:.6f}")
    times = {False: [], True: []}
    for _ in range(args.rounds):
      for scan in (False, True):
        t0 = time.perf_counter()
        steps[scan]()
        times[scan].append(time.perf_counter() - t0)
    unrolled, scanned = (statistics.median(times[s]) for s in (False, True))
    ratios = [b / a for a, b in zip(times[False], times[True])]
    print(f"  {n:3d} layers update: unrolled {unrolled * 1e3:.1f} ms, scanned "
          f"{scanned * 1e3:.1f} ms (median of {args.rounds}); scanned/unrolled per round "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
  main()
