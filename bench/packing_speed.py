r"""The trainer's old-log-prob forward and update, packed (optim.packing) vs padded, in one run.

    python bench/packing_speed.py [--rounds 10] [--response 256] [--out FILE]

The batch is the CPU demo's warm start (configs/tiny_cpu.py: its model, 64 arithmetic problems
with their worked solutions) at ``max_response_length=--response``: with 256, a response is
about 10% of its row (the padded layout's P + R = 281 positions a row). Both paths get the same
rows; the packed one lays them into rows of ``--budget`` tokens (default P + R, as a run does)
with `trainer/packing.py`, as the trainer would. Padded and packed calls alternate, one at a
time, and the medians and their ratio are printed (the host may be shared: the ratio of
neighbouring calls is the figure). Compile time is excluded (one warm-up call each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import _host  # noqa: E402
from dapo_jax.data import arithmetic  # noqa: E402
from dapo_jax.spec import cli  # noqa: E402
from dapo_jax.spec.run_spec import RunSpec  # noqa: E402
from dapo_jax.trainer import packing, run_setup, sft  # noqa: E402
from dapo_jax.trainer import train_step as ts  # noqa: E402
from dapo_jax.models import create_model  # noqa: E402


def _batch(spec: RunSpec, rows: int):
  a = spec.data.arithmetic
  config = arithmetic.ArithmeticConfig(min_digits=a.min_digits, max_digits=a.max_digits,
                                       min_operands=a.min_operands, max_operands=a.max_operands,
                                       ops=a.ops)
  records = arithmetic.make_records(rows, seed=0, config=config)
  tokenizer = run_setup.build_tokenizer(spec.tokenizer, "")
  return sft.reference_batch(records, tokenizer, spec.data.max_prompt_length,
                             spec.rollout.max_response_length), tokenizer


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--response", type=int, default=256, help="rollout.max_response_length")
  p.add_argument("--rows", type=int, default=64, help="rows of the batch (the warm start's 64)")
  p.add_argument("--budget", type=int, default=0, help="tokens a packed row (0: P + R)")
  p.add_argument("--out", default="", help="also write the figures to this JSON file")
  args = p.parse_args(argv)

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  fv = cli.parse("bench", "", [f"--config={root}/configs/tiny_cpu.py",
                               f"--config.rollout.max_response_length={args.response}",
                               "--config.optim.packing=True",
                               f"--config.optim.max_tokens_per_row={args.budget}"])
  spec = RunSpec.from_config(fv.config)
  (ids, attn, resp_mask), tokenizer = _batch(spec, args.rows)
  r = resp_mask.shape[1]
  cfg = spec.train_config().replace(num_micro_batches=1, forward_micro_batch_size=0)
  model = create_model(run_setup.model_config(spec.model, spec.tokenizer.kind, tokenizer), seed=0)
  graphdef, state = ts.init_train_state(model, cfg)
  params = jax.tree.map(np.asarray, state.params)
  fwd = ts.LogProbForward(graphdef, cfg)
  budget = args.budget or spec.sizes.max_length
  lay = packing.pack_layout(attn, budget, 1, 1)
  rows = jax.tree.map(jax.numpy.asarray, packing.packed_rows(lay, ids, attn, r))
  adv = np.where(np.arange(args.rows) % 2 == 0, 1.0, -1.0).astype(np.float32)
  old_pad = np.asarray(fwd(state.params, ids, attn, r)[0])
  padded_batch = ts.TrainBatch(input_ids=ids, attention_mask=attn, response_mask=resp_mask,
                               old_log_probs=old_pad, advantages=adv)
  packed_batch = ts.TrainBatch(
      input_ids=None, attention_mask=None, response_mask=lay.to_slots(resp_mask, False),
      old_log_probs=lay.to_slots(old_pad), advantages=lay.to_slots(adv), packed=rows)
  padded_batch, packed_batch = (jax.tree.map(jax.numpy.asarray, b)
                                for b in (padded_batch, packed_batch))
  step = ts.TrainStep(graphdef, cfg)
  states = {"padded": jax.tree.map(jax.numpy.asarray, state),
            "packed": jax.tree.map(lambda x: jax.numpy.array(np.asarray(x)), state)}

  def forward(kind):
    out = fwd(params, ids, attn, r) if kind == "padded" else fwd.packed(params, rows)
    jax.block_until_ready(out)

  def update(kind):
    batch = padded_batch if kind == "padded" else packed_batch
    states[kind], m = step(states[kind], batch, 0)
    jax.block_until_ready(m)

  times = {f"{phase}/{kind}": [] for phase in ("old_logprob", "update")
           for kind in ("padded", "packed")}
  for rnd in range(args.rounds + 1):  # round 0 compiles
    for phase, fn in (("old_logprob", forward), ("update", update)):
      for kind in ("padded", "packed"):
        t = time.perf_counter()
        fn(kind)
        if rnd:
          times[f"{phase}/{kind}"].append(time.perf_counter() - t)
  med = {k: statistics.median(v) for k, v in times.items()}
  real = int(attn.sum())
  result = {
      "cpu": _host.cpu_name(), "cores": os.cpu_count(), "rounds": args.rounds,
      "rows": args.rows, "prompt_len": spec.data.max_prompt_length, "response_len": r,
      "budget": budget, "packed_rows": lay.num_packed_rows, "real_tokens": real,
      "response_share_of_row": float(resp_mask.sum() / resp_mask.size),
      "positions_vs_padded": lay.num_packed_rows * budget / (args.rows * spec.sizes.max_length),
      "median_s": med,
      "ratio": {ph: med[f"{ph}/packed"] / med[f"{ph}/padded"]
                for ph in ("old_logprob", "update")},
  }
  print(f"{result['cpu']}, {result['cores']} cores; {args.rows} rows of "
        f"{spec.sizes.max_length} positions (responses {result['response_share_of_row']:.1%} of "
        f"theirs) -> {lay.num_packed_rows} packed rows of {budget}")
  print("| phase | padded (s) | packed (s) | packed / padded |")
  print("|---|---|---|---|")
  for ph in ("old_logprob", "update"):
    print(f"| {ph} | {med[f'{ph}/padded']:.4f} | {med[f'{ph}/packed']:.4f} | "
          f"{result['ratio'][ph]:.2f}x |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
