"""restore_and_sample.ipynb: Orbax and HF restore, one sampled group, avg@k."""

from cells.common import LOAD_CONFIG, QUIET_LOGGING

TITLE = r'''
# Restore a checkpoint, sample a group, evaluate avg@k

Loads a policy two ways, as `dapo-eval` does: the latest **Orbax** checkpoint of a training
workdir (`dapo_jax.checkpoints.orbax.load_params_only`), and a **Hugging Face** directory
(`dapo_jax.load_pretrained`), which this notebook first writes from the restored params with
`save_pretrained`, so everything runs offline. Then it samples G answers to one prompt through
the chat template (`dapo_jax.rollout.Sampler`), scores them (`dapo_jax.rewards.compute_score`)
and measures avg@k on held-out problems (`dapo_jax.trainer.evaluate.Evaluator`).

It reads the run of `train_tiny_dapo.ipynb` when present, and otherwise trains a tiny one here.
'''

RUNS_ON = r'''
**Where it runs:** any runtime; sized for a CPU one (seconds to a few minutes). On a Colab TPU
or GPU runtime the install cell installs `dapo_jax[tpu]` or `dapo_jax[cuda]` and the restore,
sampling and evaluation run on the accelerator.
'''

CELLS = [
    ("md", r'''
## Parameters

Tagged `parameters`. `DAPO_COLAB_SMOKE=1` (set by `tests/test_colabs.py`) shrinks the fallback
run and the evaluation to seconds.
'''),
    ("code", r'''
import os

workdir = "workdirs/colab_tiny_cpu"  # train_tiny_dapo.ipynb's run; trained here when absent
group_size = 8  # G answers sampled for one prompt
eval_examples = 64  # held-out problems for avg@k
eval_k = 4  # samples per problem
# The fallback run when workdir has no checkpoint: configs/tiny_cpu.py with these overrides.
fallback_overrides = {"num_steps": 2, "eval.every": 0}

if os.environ.get("DAPO_COLAB_SMOKE") == "1":
  eval_examples = 16
  fallback_overrides = {
      "num_steps": 1, "sft.steps": 0, "eval.every": 0,
      "model.overrides": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1,
                              max_position_embeddings=64),
      "algorithm.dynamic_sampling": False, "algorithm.gen_batch_size": 16,
  }
workdir = os.environ.get("DAPO_COLAB_WORKDIR", workdir)
''', ("parameters",)),
    ("md", r'''
## A training run to restore

If `workdir` holds no Orbax checkpoint yet, train a short run there with the same
`train_and_evaluate` the CLI calls (`configs/tiny_cpu.py`: a supervised warm start, then a couple
of DAPO steps).
'''),
    ("code", LOAD_CONFIG),
    ("code", QUIET_LOGGING),
    ("code", r'''
from dapo_jax.trainer.train import train_and_evaluate

ckpt_dir = os.path.join(workdir, "checkpoints")


def saved_steps():
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


if not saved_steps():
  print(f"No checkpoint in {ckpt_dir}: training a short run there first.")
  train_and_evaluate(load_config(fallback_overrides), workdir)
print("checkpoint steps:", saved_steps())
'''),
    ("md", r'''
## Restore the Orbax checkpoint

What `dapo-eval --workdir WORKDIR` does: rebuild the run's config from `config.json`, build the
model *abstractly* (shapes only, nothing allocated), and restore the newest readable step's
params into it with `load_params_only` (read-only: safe next to a running trainer).
'''),
    ("code", r'''
import json

import jax
import ml_collections
from flax import nnx

from dapo_jax.trainer import run_setup
from dapo_jax.checkpoints.orbax import load_params_only
from dapo_jax.models import abstract_model
from dapo_jax.spec.run_spec import RunSpec

with open(os.path.join(workdir, "config.json")) as f:
  config = ml_collections.ConfigDict(json.load(f))
spec = RunSpec.read(config)  # as saved (the run validated it), missing keys at their defaults
tokenizer = run_setup.build_tokenizer(spec.tokenizer, spec.model.checkpoint)
graphdef, abstract_params = nnx.split(abstract_model(
    run_setup.model_config(spec.model, spec.tokenizer.kind, tokenizer)))
params = load_params_only(ckpt_dir, abstract_params=abstract_params)
num_params = sum(x.size for x in jax.tree.leaves(params))
print(f"restored step {saved_steps()[-1]}: {num_params:,} parameters")
'''),
    ("md", r'''
## The same weights as a Hugging Face directory

`save_pretrained` writes `config.json` plus safetensors that `transformers` loads;
`dapo_jax.load_pretrained` reads such a directory (a real Qwen2.5 checkpoint the same way). The
character tokenizer is saved next to it (a Qwen checkpoint carries `tokenizer.json` instead), so
`load_tokenizer` finds it. Everything from here on uses the Hugging Face copy.
'''),
    ("code", r'''
import numpy as np

import dapo_jax
from dapo_jax.checkpoints.hf import save_pretrained
from dapo_jax.tokenizers import load_tokenizer

hf_dir = os.path.join(workdir, "hf")
save_pretrained(nnx.merge(graphdef, params), hf_dir)
tokenizer.save(hf_dir)
print(sorted(os.listdir(hf_dir)))

hf_graphdef, hf_params = nnx.split(dapo_jax.load_pretrained(hf_dir))
hf_tokenizer = load_tokenizer(hf_dir)
diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params,
                                     hf_params))
print(f"{len(diffs)} tensors, max |orbax - hf| = {max(diffs)}")
'''),
    ("md", r'''
## One prompt, G answers: a DAPO group

The prompt goes through the checkpoint's chat template with the generation prompt appended and is
left-truncated to `max_prompt_length` (spec section 7). `Sampler` prefills it once and decodes G
answers in one compiled `lax.while_loop` at the training rollout settings (temperature 1, top-p
1). Each answer is scored by the strict verifier, shaped by the overlong penalty, and the group's
GRPO advantages follow (spec sections 2 and 3); dynamic sampling keeps the group only if it mixes
right and wrong answers.
'''),
    ("code", r'''
from dapo_jax.trainer import dynamic_sampling, generation, objective
from dapo_jax import rewards
from dapo_jax.rollout import Sampler

eval_records = run_setup.load_dataset(spec.data.eval, spec.data, spec.seed, "eval")
record = eval_records[0]
print(repr(hf_tokenizer.apply_chat_template([{"role": "user", "content": record.prompt}],
                                            add_generation_prompt=True)))
print("ground truth:", record.ground_truth)

sampler = Sampler(hf_graphdef)
prompt_ids, prompt_mask = generation.render_batch([record], hf_tokenizer,
                                                  config.data.max_prompt_length)
rollout_params = run_setup.sampling_params(spec.rollout, spec.eval, hf_tokenizer)
out = jax.device_get(sampler.generate(hf_params, prompt_ids, prompt_mask, jax.random.key(0),
                                      rollout_params, num_samples=group_size))
texts = generation.decode_responses(hf_tokenizer, out.response_ids, out.lengths,
                                    rollout_params.eos_ids)
scores = [rewards.compute_score(t, record.ground_truth) for t in texts]
r = config.reward
penalty = (rewards.overlong_penalty(out.lengths, config.rollout.max_response_length,
                                    r.overlong_buffer_len, r.overlong_penalty_factor)
           if r.overlong_buffer_enable else np.zeros(group_size))
reward = np.array([s["score"] for s in scores]) + penalty
advantage = objective.compute_grpo_outcome_advantage(reward, np.zeros(group_size, np.int32))
acc = np.array([s["acc"] for s in scores])
for i, text in enumerate(texts):
  print(f"{i}  L={int(out.lengths[i]):2d}  pred={scores[i]['pred']!r:12s} acc={acc[i]!s:5s} "
        f"reward={reward[i]:+.2f}  A={float(advantage[i]):+.2f}  {text!r}")
print("dynamic sampling keeps this group:", dynamic_sampling.is_valid_acc(acc))
'''),
    ("md", r'''
## avg@k on held-out problems

`Evaluator` is what the trainer runs every `eval.every` steps and what `dapo-eval` runs: k samples
per problem at the evaluation settings (DAPO: temperature 1.0, top-p 0.7; AIME 2024 avg@32,
spec section 8), scored by the training verifier without length shaping. It reports avg@k,
unbiased pass@k and maj@k, and keeps a per-problem table. From a shell:
`dapo-eval --workdir WORKDIR`, or `dapo-eval --config.model.checkpoint=WORKDIR/hf
--config.data.eval=arithmetic --config.rollout.max_response_length=32` (any setting as
`--config.x=y`, as with `dapo-train`).
'''),
    ("code", r'''
from dapo_jax.trainer import eval_metrics
from dapo_jax.trainer.evaluate import Evaluator, problem_id

config.eval.num_samples = eval_k
config.eval.max_examples = eval_examples
config.eval.batch_size = min(config.eval.batch_size, eval_examples)
spec = RunSpec.read(config)  # the run's settings with these eval ones
with rewards.RewardScorer(spec.reward.verifier,
                          max_response_length=spec.rollout.max_response_length,
                          overlong_buffer_enable=False, num_workers=1) as scorer:
  evaluator = Evaluator(spec, sampler.generate, hf_tokenizer, scorer, eval_records)
  summary = evaluator(hf_params)
problems = {problem_id(rec): rec for rec in eval_records}
table = [dict(row, problem=problems[row["problem_id"]].prompt,
              answer=problems[row["problem_id"]].ground_truth) for row in evaluator.last_rows]
print(eval_metrics.format_table(table[:10], ["problem", "answer", "n", "correct", "acc",
                                             f"pass@{eval_k}", f"maj@{eval_k}",
                                             "majority_answer"]))
print(json.dumps(summary, indent=2))
'''),
]
