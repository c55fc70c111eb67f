"""Evaluation: avg@k, unbiased pass@k and maj@k (AIME 2024: avg@32 at temperature 1.0, top-p 0.7).

``Evaluator`` is what the trainer calls every ``eval.every`` steps; ``dapo-eval`` runs it on a
Hugging Face directory or on a training workdir's Orbax checkpoint, sharded over every device by
the config's mesh (``sharding.SAMPLE_RULES``), with the trainer's ``--config.x=y`` overrides::

  dapo-eval --config configs/dapo_qwen2_5_32b.py --config.model.checkpoint=~/ckpt/Qwen2.5-32B \
      --config.mesh=data=-1,tensor=8 --config.eval.num_samples=32
  dapo-eval --workdir /tmp/dapo_tiny --step 40 --output /tmp/aime.json

Without ``--config`` the config is the workdir's saved config.json (or, without ``--workdir``,
the schema defaults in float32: add ``--config.model.param_dtype=bfloat16
--config.model.dtype=bfloat16``). ``--config.data.eval`` picks the dataset (aime_2024,
dapo_math_17k, arithmetic or a parquet/JSONL path). On several processes each one verifies its
share of the answers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Sequence

import jax
from absl import flags
from flax import nnx

from dapo_jax.spec import cli
from dapo_jax.infra import compile_cache
from dapo_jax.infra import libtpu_flags
from dapo_jax.trainer import eval_metrics
from dapo_jax.infra import distributed
from dapo_jax.trainer import generation
from dapo_jax.trainer import policy as policy_lib
from dapo_jax.infra import run_files
from dapo_jax.trainer import run_setup
from dapo_jax.infra import sharding as shd
from dapo_jax.data.records import MathRecord
from dapo_jax.spec.run_spec import RunSpec

_log = logging.getLogger(__name__)


def problem_id(record: MathRecord) -> str:
  """Rows repeating one problem (the AIME file holds each 32x) share an id."""
  return hashlib.sha1(f"{record.prompt}\x00{record.ground_truth}".encode()).hexdigest()[:12]


class Evaluator:
  """Samples ``eval.num_samples`` answers per row and scores them with the training verifier
  (the training rollout's ``generate_and_score``, at the eval sampling settings).

  ``spec``: the run's; it reads ``eval``, the ``rollout`` stop tokens and response length,
  ``data.max_prompt_length`` and ``seed``.
  """

  def __init__(self, spec: RunSpec, rollout, tokenizer, scorer, records: Sequence[MathRecord]):
    self.eval, self.seed = spec.eval, spec.seed
    limit = spec.eval.max_examples
    self.records = list(records[:limit] if limit else records)
    self.params = run_setup.sampling_params(spec.rollout, spec.eval, tokenizer, eval_mode=True)
    self.generator = generation.Generator(
        rollout, tokenizer, scorer, self.params, num_samples=spec.eval.num_samples,
        max_prompt_length=spec.data.max_prompt_length, truncate=spec.data.truncate)
    # The number a run is judged by: summarize's avg@K, K = samples per problem (rows repeating
    # a problem, as the AIME file's 32 copies, each add eval.num_samples).
    k = (eval_metrics.samples_per_problem(map(problem_id, self.records), spec.eval.num_samples)
         if self.records else spec.eval.num_samples)
    self.headline = f"eval/avg@{k}"
    self.last_rows: list[dict[str, Any]] = []
    self.last_texts: list[str] = []

  def __call__(self, params_state, step: int = 0) -> dict[str, float]:
    if not self.records:
      return {}
    bs, n = self.eval.batch_size, self.eval.num_samples
    key = jax.random.fold_in(jax.random.key(self.seed + 7919), step)
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


def _define(fv) -> None:
  flags.DEFINE_string("workdir", None, "A dapo-train workdir: its config.json and Orbax "
                      "checkpoint (default: the HF directory --config.model.checkpoint).",
                      flag_values=fv)
  flags.DEFINE_integer("step", None, "Orbax step (default: the newest readable one).",
                       flag_values=fv)
  flags.DEFINE_string("output", None, "Write the per-problem table as JSON here (local or gs://).",
                      flag_values=fv)
  cli.define_verbose(fv)


def _parse(argv: Sequence[str]) -> flags.FlagValues:
  return cli.parse("dapo-eval", __doc__, argv, _define, cli.workdir_default)


def evaluate_policy(spec: RunSpec, policy: policy_lib.Policy,
                    records: Sequence[MathRecord]) -> tuple[dict[str, float], Evaluator]:
  """``Evaluator`` over ``records`` (``spec``'s eval settings, its verifier without length
  shaping); prompts spread over the mesh's data axes and, on several processes, each process
  verifies its share of the answers (``generation.score_spread``)."""
  from dapo_jax.rewards.batch import RewardScorer  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.sampler import Sampler  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(run_setup.for_rollout(policy.model, spec.rollout))
  sampler = Sampler(graphdef, mesh=policy.mesh, rules=shd.SAMPLE_RULES)
  rollout = distributed.global_rollout(sampler.generate, policy.mesh)
  r = spec.reward
  with RewardScorer(r.verifier, max_response_length=spec.rollout.max_response_length,
                    overlong_buffer_enable=False, timeout_s=r.timeout_s,
                    num_workers=r.num_workers) as scorer:
    evaluator = Evaluator(spec, rollout, policy.tokenizer, scorer, records)
    summary = evaluator(state)
  return summary, evaluator


def provenance(spec: RunSpec, policy: policy_lib.Policy, workdir: str | None
               ) -> dict[str, Any]:
  """What an evaluation used: the weights (workdir, step and the directory read, or the HF
  checkpoint), the dataset, the dtypes and the mesh, as the summary and ``--output`` name them."""
  from dapo_jax.checkpoints import lora_base  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import lora  # pylint: disable=g-import-not-at-top
  mesh = policy.mesh
  # A LoRA run's weights are its adapters merged into this base (checked by fingerprint).
  adapters = ({"lora_base": lora_base.source(spec.model, spec.seed)}
              if workdir and lora.LoRAConfig.from_config(spec.model.lora).rank else {})
  return {
      **adapters,
      "workdir": workdir or None,
      "step": policy.step,
      "checkpoint": (str(policy_lib.checkpoint_dir(workdir) / str(policy.step)) if workdir
                     else spec.model.checkpoint),
      "dataset": spec.data.eval,
      "num_samples": spec.eval.num_samples,
      "dtype": spec.model.dtype,
      "param_dtype": spec.model.param_dtype,
      "mesh": None if mesh is None else ",".join(f"{a}={n}" for a, n in mesh.shape.items()),
      "num_devices": jax.device_count(),
  }


def describe(info: dict[str, Any]) -> str:
  """`provenance` as the one line ``dapo-eval`` prints above its summary."""
  weights = (f"step {info['step']} of {info['workdir']} ({info['checkpoint']})"
             if info["workdir"] else f"HF checkpoint {info['checkpoint']}")
  if info.get("lora_base"):
    weights += f" with its LoRA adapters merged into {info['lora_base']}"
  mesh = f"mesh {info['mesh']}" if info["mesh"] else "no mesh"
  return (f"dapo-eval: {weights}; dataset {info['dataset']} ({info['num_samples']} samples per "
          f"row); dtype {info['dtype']} (params {info['param_dtype']}); {mesh} "
          f"({info['num_devices']} devices)")


def main(argv: Sequence[str]) -> dict[str, float]:
  fv = _parse(argv)
  from dapo_jax.infra import console_log  # pylint: disable=g-import-not-at-top
  console_log.configure_logging(stderr=True, verbose=fv.verbose)  # third-party chatter off
  libtpu_flags.apply(fv.config.get("tpu_windowed_einsum", False))  # before JAX starts
  distributed.maybe_initialize()
  # The workdir's config.json (or --config) as it is: a saved run is not judged again.
  spec = RunSpec.read(fv.config)
  workdir = cli.expand(fv.workdir)
  compile_cache.setup(spec.compilation_cache_dir, workdir)
  mesh = policy_lib.sampling_mesh(spec.mesh, spec.rollout_mesh, spec.dcn_mesh)
  policy = policy_lib.load_policy(spec, workdir=workdir, step=fv.step, mesh=mesh)
  records = run_setup.load_dataset(spec.data.eval, spec.data, spec.seed, "eval")
  summary, evaluator = evaluate_policy(spec, policy, records)
  if jax.process_index() == 0:
    info = provenance(spec, policy, workdir)
    print(eval_metrics.format_table(evaluator.last_rows))
    print(describe(info))
    print(json.dumps(summary, indent=2), flush=True)
    if fv.output:
      run_files.write_text_atomic(run_files.resolve(fv.output), json.dumps(
          {"provenance": info, "summary": summary, "problems": evaluator.last_rows}, indent=2,
          default=str))
  return summary


def run(argv: Sequence[str] | None = None) -> None:
  """Console entry point of ``dapo-eval``."""
  cli.exit_on_error("dapo-eval", lambda a: main(a if argv is None else list(argv)))
