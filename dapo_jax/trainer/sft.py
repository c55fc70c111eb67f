"""Supervised warm start on reference solutions (the CPU demo's first phase).

It reuses the compiled DAPO update: with ``old_log_probs`` equal to the current log-probs and
advantage +1, the clipped surrogate's gradient is exactly the token-mean negative log-likelihood
gradient (ratio = 1, no clipping), so no second training path is needed.
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dapo_jax.data import arithmetic
from dapo_jax.data.pipeline import PromptIterator
from dapo_jax.trainer import packing
from dapo_jax.trainer.generation import render_batch
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer.train_step import LogProbForward, TrainBatch, TrainStep, init_train_state

_log = logging.getLogger(__name__)


def reference_batch(records, tokenizer, max_prompt_length: int, max_response_length: int):
  """Prompt + reference response (+ EOS) as a left/right padded batch."""
  prompt_ids, prompt_mask = render_batch(records, tokenizer, max_prompt_length)
  resp = np.full((len(records), max_response_length), tokenizer.pad_id, np.int32)
  resp_mask = np.zeros_like(resp, dtype=bool)
  for i, rec in enumerate(records):
    ids = tokenizer.encode(arithmetic.reference_response(rec))[:max_response_length - 1]
    ids = ids + [tokenizer.eos_id]
    resp[i, :len(ids)] = ids
    resp_mask[i, :len(ids)] = True
  input_ids = np.concatenate([prompt_ids, resp], axis=1)
  attn = np.concatenate([prompt_mask.astype(bool), resp_mask], axis=1)
  return input_ids, attn, resp_mask


def warm_start(spec: RunSpec, graphdef, state, tokenizer, records, mesh):
  """Runs ``spec.sft.steps`` supervised updates; returns (state with new params, metrics)."""
  s = spec.sft
  tcfg = spec.train_config()
  rows = s.batch_size
  tcfg = dataclasses.replace(tcfg, lr=s.lr, warmup_steps=s.warmup_steps, weight_decay=0.0,
                             loss_agg_mode="token-mean", use_kl_loss=False, entropy_coeff=0.0,
                             overlong_filter=False, temperature=1.0,
                             num_micro_batches=max(1, rows // spec.optim.micro_batch_size),
                             forward_micro_batch_size=0)
  model = nnx.merge(graphdef, state.params, state.rest)
  graphdef, sft_state = init_train_state(model, tcfg, mesh)
  step_fn = TrainStep(graphdef, tcfg, mesh)
  logp_fn = LogProbForward(graphdef, tcfg, mesh, rest=sft_state.rest)
  it = PromptIterator(records, rows, spec.seed + 1)
  first_nll = last_nll = float("nan")
  for i in range(s.steps):
    batch = next(it)
    ids, attn, resp_mask = reference_batch(batch, tokenizer, spec.data.max_prompt_length,
                                           spec.rollout.max_response_length)
    # optim.packing: the warm start packs its batch as the RL update does.
    layouts = packing.spec_layouts(spec, mesh, attn, rows)
    old, _ = packing.forward_rows(logp_fn, sft_state.params, ids, attn, resp_mask.shape[1],
                                  mesh, layouts)
    adv = np.ones((rows,), np.float32)
    if layouts is None:
      train_batch = TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(attn),
                               response_mask=jnp.asarray(resp_mask),
                               old_log_probs=jnp.asarray(old), advantages=jnp.asarray(adv))
    else:
      lay = layouts[0]
      train_batch = TrainBatch(
          input_ids=None, attention_mask=None, response_mask=lay.to_slots(resp_mask, False),
          old_log_probs=lay.to_slots(old), advantages=lay.to_slots(adv),
          packed=packing.packed_rows(lay, ids, attn, resp_mask.shape[1]))
    sft_state, m = step_fn(sft_state, train_batch, i)
    if i == 0 or (i + 1) % 50 == 0 or i + 1 == s.steps:
      last_nll = -float((old * resp_mask).sum() / resp_mask.sum())
      first_nll = last_nll if i == 0 else first_nll
      _log.info("sft step %d/%d: nll %.4f grad_norm %.3f", i + 1, s.steps, last_nll,
                float(m["grad_norm"]))
  return state.replace(params=sft_state.params), {"sft/nll_first": first_nll,
                                                  "sft/nll_last": last_nll}
