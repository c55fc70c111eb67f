"""train_tiny_dapo.ipynb: configs/tiny_cpu.py through train_and_evaluate, then its curves."""

from cells.common import LOAD_CONFIG, QUIET_LOGGING

TITLE = r'''
# Train a tiny policy with DAPO on a CPU

This runs `configs/tiny_cpu.py` through
`dapo_jax.trainer.train.train_and_evaluate(config, workdir)`, the function behind
`dapo-train --config configs/tiny_cpu.py --workdir ...` (and
`launch/local_cpu.sh`): a ~1M-parameter Qwen2-architecture policy with a character tokenizer
gets a short supervised warm start on worked arithmetic solutions, then DAPO. The run directory
holds what any run writes (`metrics.jsonl`, `samples.jsonl`, TensorBoard events, Orbax
checkpoints); the plots below are read back from it.

The full demo takes about 10 minutes on a CPU; the parameters cell shrinks it.
'''

RUNS_ON = r'''
**Where it runs:** sized for a CPU runtime (about 10 minutes on 2 cores). On a Colab TPU or GPU
runtime the install cell installs `dapo_jax[tpu]` or `dapo_jax[cuda]` so that JAX finds the
accelerator, and the same cells run there (a 1M-parameter model gains little from it).
`lora_rank` (parameters cell) trains low-rank adapters only, with the base frozen: on an
accelerator runtime that is what lets a larger checkpoint fit. "Larger models" below says which
Qwen2.5 sizes fit which runtime, with and without adapters (dapo-plan estimates, docs/lora.md).
'''

CELLS = [
    ("md", r'''
## Parameters

The next cell is tagged `parameters` (papermill injects values after it). `None` keeps the value
of `configs/tiny_cpu.py`; `overrides` sets any other config leaf, exactly like `dapo-train`'s
`--config.KEY=VALUE`. `DAPO_COLAB_SMOKE=1` (set by `tests/test_colabs.py`) swaps in a ~1-minute
smoke run of a 10k-parameter model.
'''),
    ("code", r'''
import os

workdir = "workdirs/colab_tiny_cpu"  # restore_and_sample.ipynb reads this run
num_steps = None  # DAPO rollout steps (tiny_cpu: 160)
sft_steps = None  # supervised warm-start steps before DAPO (tiny_cpu: 600)
overrides = {}  # e.g. {"algorithm.loss_agg_mode": "seq-mean-token-mean", "optim.lr": 3e-4}
lora_rank = 0  # > 0: train LoRA adapters of this rank only, base frozen (docs/lora.md)

if os.environ.get("DAPO_COLAB_SMOKE") == "1":
  num_steps, sft_steps = 2, 20
  overrides = {
      "model.overrides": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1,
                              max_position_embeddings=64),
      # After 20 warm-start steps every answer is wrong: dynamic sampling would keep nothing.
      "algorithm.dynamic_sampling": False, "algorithm.gen_batch_size": 16,
      "data.arithmetic.num_eval": 16, "eval.every": 2, "eval.batch_size": 16,
  }
workdir = os.environ.get("DAPO_COLAB_WORKDIR", workdir)
''', ("parameters",)),
    ("md", r'''
## Larger models: which size fits which runtime

The same trainer runs a Qwen2.5 checkpoint from a cell on an accelerator runtime, e.g. with
`configs/qwen25_1_5b_lora.py` (rank-32 adapters on every projection, base frozen in bf16; 1024
prompt + 3072 response tokens, G = 8, micro-batch 1; `configs/` comes with a clone of the
repository, not with the pip package):

```
!dapo-train --config configs/qwen25_1_5b_lora.py --workdir /content/run \
    --config.model.checkpoint=/content/Qwen2.5-1.5B   # a Hugging Face directory
```

What fits, from `dapo-plan`'s per-device memory: an ESTIMATE (the analytic model; not a run,
not a compile), at 92% of a GPU's memory and 16 GiB for a v5e chip. One cell was also compiled
by libtpu: Qwen2.5-1.5B with LoRA on a v5e chip needs 11.4 GiB at 48 continuous-engine slots
(docs/lora.md, "What fits where", has the commands and every figure). "LoRA" is rank
32, "full" trains every parameter (fp32 master weights and Adam moments); the number is the
largest rollout call, in prompts x 8 samples, that leaves 5% of the memory free; "no" gives
the peak in GiB at one prompt where it is shown. The estimate is optimistic for full
fine-tuning: *the analytic model gave 1.5B full 12 prompts on the A100, but libtpu's compile of
that train step on one chip needs 49.7 GiB; the 0.5B "full" cells are unchecked.

| model | T4 (16 GB) | L4 (24 GB) | A100 (40 GB) | TPU v5e-1 (16 GiB) |
|---|---|---|---|---|
| Qwen2.5-0.5B | LoRA 16, full 12 | LoRA 16, full 16 | LoRA 16, full 16 | LoRA 16, full 16 |
| Qwen2.5-1.5B | LoRA 6; full no (26.6) | LoRA 12; full no | LoRA 16; full no* | LoRA 8; full no |
| Qwen2.5-3B | LoRA 1; full no (53.0) | LoRA 6; full no | LoRA 16; full no | LoRA 2; full no |
| Qwen2.5-7B | no (LoRA 29.2) | no | LoRA 2; full no (129) | no |

Without adapters the fp32 master copy and Adam's two moments cost 12 bytes per parameter, so a
1.5B model's training state alone (17.3 GiB) exceeds a T4; with rank 32 it is 3.3 GiB (the bf16
base, 2 bytes per parameter, plus 37M adapter parameters' 12). Caveats: the T4 has no bf16 tensor
cores (bf16 matmuls run near its fp32 peak: slow); JAX takes 75% of GPU memory unless
`XLA_PYTHON_CLIENT_MEM_FRACTION=0.92` is set before it starts; the free T4 tier's session limits
allow a few steps, not a run.
'''),
    ("md", r'''
## The run configuration

`configs/tiny_cpu.py` is the same `ml_collections` file the CLI reads; the parameters above are
applied to the locked config, so a misspelt key fails here. The DAPO choices (spec section 1):
decoupled clip 0.2 / 0.28, token-mean loss, dynamic sampling, overlong shaping over the last
`overlong_buffer_len` of `max_response_length` tokens, no KL.
'''),
    ("code", LOAD_CONFIG),
    ("code", r'''
run_overrides = dict(overrides)
if num_steps is not None:
  run_overrides["num_steps"] = num_steps
if sft_steps is not None:
  run_overrides["sft.steps"] = sft_steps
if lora_rank:
  run_overrides.update({"model.lora.rank": lora_rank, "model.lora.alpha": 2.0 * lora_rank})
config = load_config(run_overrides)

a = config.algorithm
print(f"model {dict(config.model.overrides)}\n"
      f"steps: {config.sft.steps} warm-start, then {config.num_steps} DAPO; "
      f"{config.optim.train_batch_size} prompts x G={config.rollout.n} per step, "
      f"generation batch {a.gen_batch_size}\n"
      f"clip {a.clip_ratio_low} / {a.clip_ratio_high} (dual {a.clip_ratio_c}), "
      f"loss {a.loss_agg_mode}, dynamic sampling {a.dynamic_sampling}, "
      f"overlong buffer {config.reward.overlong_buffer_len} of "
      f"{config.rollout.max_response_length} tokens")
'''),
    ("md", r'''
## Train

`train_and_evaluate` is the whole loop of spec section 6: dynamic sampling over generation
batches, rewards, GRPO advantages, old log-probs, compiled mini-batch updates, held-out
evaluation every `eval.every` steps and Orbax checkpoints. Like `dapo-train`, a workdir that
already holds a checkpoint is resumed (delete it to start over).
'''),
    ("code", QUIET_LOGGING),
    ("code", r'''
from dapo_jax.trainer.train import train_and_evaluate

result = train_and_evaluate(config, workdir)
print(sorted(os.listdir(workdir)))
'''),
    ("md", r'''
## Learning curves

Read back from `metrics.jsonl` with `dapo_jax.infra.metrics.read_jsonl` (one row per step; step 0
holds the evaluation after the warm start, before any DAPO update).
'''),
    ("code", r'''
%matplotlib inline
import math

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from dapo_jax.infra.metrics import read_jsonl

rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def plot_panels(panels, ncols=3):
  nrows = math.ceil(len(panels) / ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.2 * nrows), squeeze=False)
  for ax, (title, names) in zip(axes.flat, panels):
    for name in names:
      pts = [(r["step"], r[name]) for r in rows if not math.isnan(r.get(name, math.nan))]
      if pts:
        ax.plot(*zip(*pts), marker="o", ms=3, label=name)
    ax.set(title=title, xlabel="step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.tight_layout()
  plt.show()


# The evaluation's avg@K (K = samples per problem), as the trainer's "Held-out" line names it.
headline = next(k for r in rows for k in r if k.startswith("eval/avg@"))
plot_panels([
    ("training rollouts", ["train/acc_mean", "train/reward_mean"]),
    (f"held-out accuracy ({headline}, top-p {config.eval.top_p})",
     [headline, headline.replace("avg@", "pass@")]),
    ("response length", ["response/response_length_mean", "response/response_length_max"]),
    ("clipping", ["actor/pg_clipfrac", "actor/pg_clipfrac_lower"]),
    ("entropy", ["actor/entropy"]),
    ("overlong shaping", ["train/overlong_penalty_mean", "response/in_overlong_buffer"]),
])
'''),
    ("md", r'''
## Dynamic-sampling statistics (spec section 5)

Per step: the share of generated groups kept (mixed right and wrong answers) and dropped
(all-correct or all-wrong), how many generation batches it took to fill the batch, and rollouts
generated versus trained on. The paper never reported these; the trainer logs them every step.
'''),
    ("code", r'''
plot_panels([
    ("group ratios", ["sampling/kept_ratio", "sampling/all_correct_ratio",
                      "sampling/all_wrong_ratio"]),
    ("generation batches per step", ["sampling/num_gen_batches"]),
    ("rollouts per step", ["sampling/rollouts_generated", "sampling/rollouts_trained"]),
])
'''),
    ("md", r'''
## Completions before and after

`samples.jsonl` holds a few training completions per step (`prompt -> response (reward)`). The
first step's were sampled from the warm-started policy before any DAPO update, the last step's
from the trained one.
'''),
    ("code", r'''
import json

with open(os.path.join(workdir, "samples.jsonl")) as f:
  samples = [json.loads(line) for line in f]
first, last = min(s["step"] for s in samples), max(s["step"] for s in samples)
for step, when in ((first, "before DAPO updates"), (last, "after training")):
  print(f"step {step} ({when}):")
  for s in samples:
    if s["step"] == step:
      print("  ", s["text"])
evals = [(r["step"], r[headline]) for r in rows if headline in r]
print(f"\nheld-out {headline} by step: {evals}")
'''),
]
