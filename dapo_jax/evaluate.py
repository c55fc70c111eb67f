"""Evaluation: avg@k, unbiased pass@k and maj@k (AIME 2024: avg@32 at temperature 1.0, top-p 0.7).

``Evaluator`` is what the trainer calls every ``eval.every`` steps; ``dapo-eval`` runs it on a
Hugging Face directory or on a training workdir's latest Orbax checkpoint::

  dapo-eval --checkpoint ~/ckpt/Qwen2.5-32B --dataset aime_2024 --num_samples 1
  dapo-eval --workdir /tmp/dapo_tiny --config configs/tiny_cpu.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from typing import Any, Sequence

import jax
import ml_collections
from flax import nnx

from dapo_jax import eval_metrics
from dapo_jax import generation
from dapo_jax import run_files
from dapo_jax import run_setup
from dapo_jax.data.records import MathRecord

_log = logging.getLogger(__name__)


def problem_id(record: MathRecord) -> str:
  """Rows repeating one problem (the AIME file holds each 32x) share an id."""
  return hashlib.sha1(f"{record.prompt}\x00{record.ground_truth}".encode()).hexdigest()[:12]


class Evaluator:
  """Samples ``eval.num_samples`` answers per row and scores them with the training verifier
  (the training rollout's ``generate_and_score``, at the eval sampling settings)."""

  def __init__(self, config: ml_collections.ConfigDict, rollout, tokenizer, scorer,
               records: Sequence[MathRecord]):
    self.config = config
    limit = config.eval.max_examples
    self.records = list(records[:limit] if limit else records)
    self.params = run_setup.sampling_params(config, tokenizer, eval_mode=True)
    self.generator = generation.Generator(
        rollout, tokenizer, scorer, self.params, num_samples=config.eval.num_samples,
        max_prompt_length=config.data.max_prompt_length)
    self.headline = f"eval/avg@{config.eval.num_samples}"  # the number a run is judged by
    self.last_rows: list[dict[str, Any]] = []
    self.last_texts: list[str] = []

  def __call__(self, params_state, step: int = 0) -> dict[str, float]:
    if not self.records:
      return {}
    bs, n = self.config.eval.batch_size, self.config.eval.num_samples
    key = jax.random.fold_in(jax.random.key(self.config.seed + 7919), step)
    results, texts = [], []
    for start in range(0, len(self.records), bs):
      # Padded to a fixed shape: one compiled program.
      out = self.generator(params_state, self.records[start:start + bs],
                           jax.random.fold_in(key, start), pad_to=bs)
      ids = [problem_id(rec) for rec in out.records for _ in range(n)]
      results.extend(zip(ids, out.rewards.pred, (bool(a) for a in out.rewards.acc)))
      texts.extend(out.texts)
    summary, rows = eval_metrics.summarize(results)
    self.last_rows, self.last_texts = rows, texts
    return {f"eval/{k}": float(v) for k, v in summary.items()}


def _parse(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="dapo-eval", description=__doc__.split("\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--checkpoint", help="Hugging Face directory (config.json + safetensors).")
  src.add_argument("--workdir", help="A dapo-train workdir: its config and Orbax checkpoint.")
  p.add_argument("--step", type=int, default=None, help="Orbax step (default: latest).")
  p.add_argument("--dataset", default=None,
                 help="aime_2024, dapo_math_17k, arithmetic or a parquet/JSONL path.")
  p.add_argument("--data_dir", default=None)
  p.add_argument("--manual_dir", default=None)
  p.add_argument("--num_samples", type=int, default=None, help="samples per row (k).")
  p.add_argument("--temperature", type=float, default=None)
  p.add_argument("--top_p", type=float, default=None)
  p.add_argument("--max_response_length", type=int, default=None)
  p.add_argument("--max_examples", type=int, default=None)
  p.add_argument("--batch_size", type=int, default=None)
  p.add_argument("--output", default=None, help="Write the per-problem table as JSON here.")
  return p.parse_args(argv)


def _config_and_params(args):
  """The run config and sampling-ready params, from a HF directory or a training workdir."""
  from dapo_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints.orbax import load_params_only  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import abstract_model  # pylint: disable=g-import-not-at-top
  if args.workdir:
    path = run_files.resolve(args.workdir) / run_files.CONFIG_FILE  # local or gs://
    if not path.exists():
      raise FileNotFoundError(f"{path} not found: is {args.workdir} a dapo-train workdir?")
    config = ml_collections.ConfigDict(run_files.read_json(path))
  else:
    config = config_lib.default_config()
    config.model.checkpoint = args.checkpoint
    config.model.param_dtype = config.model.dtype = "float32"
    config.model.remat = "none"
  e = config.eval
  for field, value in (("num_samples", args.num_samples), ("temperature", args.temperature),
                       ("top_p", args.top_p), ("max_examples", args.max_examples),
                       ("batch_size", args.batch_size)):
    if value is not None:
      e[field] = value
  if args.max_response_length:
    config.rollout.max_response_length = args.max_response_length
  for field in ("data_dir", "manual_dir"):
    if getattr(args, field):
      config.data[field] = getattr(args, field)
  tokenizer = run_setup.build_tokenizer(config)
  if args.workdir:
    graphdef, abstract = nnx.split(abstract_model(
        run_setup.model_config(config, tokenizer)))
    params = load_params_only(run_files.resolve(args.workdir) / "checkpoints",
                              args.step, abstract_params=abstract)
  else:
    graphdef, params = nnx.split(run_setup.build_model(config, tokenizer, None))
  return config, tokenizer, graphdef, params


def main(argv: Sequence[str]) -> dict[str, float]:
  args = _parse(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  from dapo_jax.rewards.batch import RewardScorer  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampler import Sampler  # pylint: disable=g-import-not-at-top
  config, tokenizer, graphdef, params = _config_and_params(args)
  dataset = args.dataset or config.data.eval
  records = run_setup.load_dataset(dataset, config, "eval")
  r = config.reward
  with RewardScorer(r.verifier, max_response_length=config.rollout.max_response_length,
                    overlong_buffer_enable=False, timeout_s=r.timeout_s,
                    num_workers=r.num_workers) as scorer:
    evaluator = Evaluator(config, Sampler(graphdef).generate, tokenizer, scorer, records)
    summary = evaluator(params)
  print(eval_metrics.format_table(evaluator.last_rows))
  print(json.dumps(summary, indent=2))
  if args.output:
    run_files.write_text_atomic(run_files.resolve(args.output), json.dumps(
        {"summary": summary, "problems": evaluator.last_rows}, indent=2, default=str))
  return summary


def run(argv: Sequence[str] | None = None) -> None:
  """Console entry point of ``dapo-eval``."""
  main(sys.argv[1:] if argv is None else list(argv))
