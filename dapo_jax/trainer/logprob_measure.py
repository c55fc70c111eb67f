"""The rollout/trainer log-prob gap of a run spec and weights, in one call (a notebook's, a
probe's).

    from dapo_jax.spec.run_spec import RunSpec
    from dapo_jax.trainer import logprob_measure
    spec = RunSpec.from_config(config)
    metrics = logprob_measure.measure(spec, params, records[:8], jax.random.key(0))
    # {"bit_equal": 1.0, "logprob_diff_max": 0.0, "kl_k3": 0.0, ...}  (logprob_gap.KEYS)

It samples the records with the run's own rollout (``rollout.engine``, on ``rollout_mesh``, at the
``rollout.*`` sampling settings) and recomputes the sampled tokens with the training forward
(`LogProbForward` on ``mesh``, the trainer's old log-probs), so it covers any compute dtype
(``model.dtype``), either engine and any mesh: the figures the trainer logs every step as
``rollout/*`` (`logprob_gap.logprob_gap_metrics`), without a workdir, data set or verifier.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from dapo_jax.trainer import generation
from dapo_jax.trainer import logprob_gap
from dapo_jax.trainer import run_setup
from dapo_jax.data.records import MathRecord
from dapo_jax.models import abstract_model
from dapo_jax.rollout.factory import make_rollout
from dapo_jax.rollout.weights import RolloutWeights
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer import packing
from dapo_jax.trainer.train_step import LogProbForward


def sample_and_recompute(spec: RunSpec, params: nnx.State, records: Sequence[MathRecord],
                         key: jax.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(sampler_logp, trainer_logp, response_mask)``, each [len(records) * rollout.n, R].

  ``params``: the model's ``nnx.Param`` state for ``spec`` (the trainer's ``state.params``, fp32
  master weights of a bf16 model included, or a restored checkpoint's); the rollout reads them
  cast to ``model.param_dtype``, as in training. On several processes the records must be the
  same on every process (as ``build_run``'s rollout expects).
  """
  mesh = run_setup.build_mesh(spec.mesh, spec.dcn_mesh)
  rollout_mesh = run_setup.build_rollout_mesh(spec.rollout_mesh, spec.dcn_mesh, mesh)
  tokenizer = run_setup.build_tokenizer(spec.tokenizer, spec.model.checkpoint)
  model = abstract_model(run_setup.model_config(spec.model, spec.tokenizer.kind, tokenizer))
  sampler_graphdef = nnx.split(run_setup.for_rollout(model, spec.rollout))[0]
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  rest = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), rest)  # (none in Qwen2)
  r = spec.rollout
  rollout = make_rollout(r.engine, sampler_graphdef, rollout_mesh, tokenizer,
                         **run_setup.engine_args(r, spec.data.max_prompt_length))
  weights = RolloutWeights(model.config.jnp_param_dtype, rollout_mesh)(params)
  sampling = run_setup.sampling_params(r, spec.eval, tokenizer)
  n = r.n
  prompt_ids, prompt_mask = generation.render_batch(records, tokenizer,
                                                    spec.data.max_prompt_length)
  out = generation.rollout_chunks(
      lambda ids, mask, k, g: rollout(weights, ids, mask, k, sampling, g), prompt_ids,
      prompt_mask, key, n, r.prompts_per_call)
  response_mask = out["response_mask"].astype(bool)
  input_ids = np.concatenate([np.repeat(prompt_ids, n, axis=0), out["response_ids"]], axis=1)
  attention_mask = np.concatenate([np.repeat(prompt_mask, n, axis=0).astype(bool),
                                   response_mask], axis=1)
  forward = LogProbForward(graphdef, spec.train_config(), mesh, rest=rest)
  # The trainer's own forward: packed as its mini-batches are when optim.packing is on.
  trainer_logp, _ = packing.forward_rows(
      forward, params, input_ids.astype(np.int32), attention_mask, response_mask.shape[1], mesh,
      packing.spec_layouts(spec, mesh, attention_mask))
  return (np.asarray(out["logprobs"], np.float32), np.asarray(trainer_logp, np.float32),
          response_mask)


def measure(spec: RunSpec, params: nnx.State, records: Sequence[MathRecord],
            key: jax.Array | None = None, *,
            band: tuple[float, float] = logprob_gap.DEFAULT_BAND) -> dict[str, Any]:
  """`logprob_gap.logprob_gap_metrics` of the run's rollout against its training forward on
  ``records`` (``rollout.n`` samples each; ``key``: default ``spec.seed``'s); see
  `sample_and_recompute`."""
  key = jax.random.key(spec.seed) if key is None else key
  sampler, trainer, mask = sample_and_recompute(spec, params, records, key)
  return logprob_gap.logprob_gap_metrics(sampler, trainer, mask, band=band)
