"""``train_and_evaluate(config, workdir)``: the DAPO loop (spec 6), resumable from ``workdir``.

One rollout step: dynamic sampling over generation batches (rollout + rewards), GRPO advantages,
old log-probs by the training forward, then ``train_batch_size / mini_batch_size`` compiled
updates per PPO epoch. Validation every ``eval.every`` steps, a checkpoint every
``checkpoint.save_every`` steps; a run restarted on the same ``workdir`` continues where the
last checkpoint left off (same data order, same random keys).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from dapo_jax import config as config_lib
from dapo_jax import distributed
from dapo_jax import evaluate as eval_lib
from dapo_jax import experience as exp
from dapo_jax import run_setup
from dapo_jax import sft
from dapo_jax.checkpoints.orbax import TrainCheckpointer
from dapo_jax.data.pipeline import PromptIterator
from dapo_jax.dynamic_sampling import (DatasetExhaustedError, DynamicSampler,
                                       DynamicSamplingError)
from dapo_jax.metrics import MetricsWriter, ProgressBar, Timer, plot_curves, read_jsonl
from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.rollout.factory import make_rollout
from dapo_jax.train_step import LogProbForward, TrainBatch, TrainStep, init_train_state

_log = logging.getLogger(__name__)


class NonFiniteUpdatesError(RuntimeError):
  """Too many consecutive skipped (non-finite) updates; the last good checkpoint is kept."""


def _mean_metrics(ms: list[dict[str, Any]]) -> dict[str, float]:
  return {f"actor/{k}": float(np.mean([float(m[k]) for m in ms])) for k in ms[0]}


class _StopRequest:
  """SIGTERM (a preempted VM, `scancel`, `kill`) asks the loop to checkpoint and exit cleanly.

  The current update finishes, the state is saved at the step reached, and the next launch on
  the same workdir resumes from it. One process: a Python handler sets a flag. Several: JAX's
  preemption service owns SIGTERM (a Python handler would replace its notifier) and
  `reached_preemption_sync_point` names the same step on every process; with that service
  off, the processes all-gather their flags each step, so all stop at the same step.
  """

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}
    self._jax_service = jax.process_count() > 1 and jax.config.jax_enable_preemption_service

  def install(self) -> None:
    if self._jax_service or threading.current_thread() is not threading.main_thread():
      return  # (signal handlers can only be set from the main thread, e.g. not in a notebook)
    for sig in (signal.SIGTERM,):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.signum = signum
    _log.warning("Received signal %d: finishing this step, then checkpointing and exiting.",
                 signum)

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def requested(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.signum is not None
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    if self._jax_service:
      return bool(multihost_utils.reached_preemption_sync_point(step))
    flags = multihost_utils.process_allgather(np.int32(self.signum is not None))
    return bool(np.any(flags))


def _committed(state, mesh):
  """On one device, arrays restored from a checkpoint are committed to it and fresh ones are
  not, so jit would compile every program twice (a resumed run misses the persistent compile
  cache); committing both makes them the same programs."""
  return state if mesh is not None else jax.device_put(state, jax.devices()[0])


def _mini_batches(traj: exp.Trajectories, adv: np.ndarray, old_logp: np.ndarray,
                  rows_per_update: int, mesh):
  """Host rows -> device mini-batches (global arrays on several processes)."""
  dev = lambda x: exp.rows_on_device(x, mesh)
  for s in range(0, traj.num_rows, rows_per_update):
    sl = slice(s, s + rows_per_update)
    yield TrainBatch(
        input_ids=dev(traj.input_ids[sl]), attention_mask=dev(traj.attention_mask[sl]),
        response_mask=dev(traj.response_mask[sl]), old_log_probs=dev(old_logp[sl]),
        advantages=dev(adv[sl]), truncated=dev(traj.truncated[sl]))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Runs (or resumes) DAPO training; returns the last step's metrics and final evaluation."""
  config_lib.validate(config, num_devices=jax.device_count())
  workdir = os.path.abspath(os.path.expanduser(workdir))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))

  mesh = run_setup.build_mesh(config)
  tokenizer = run_setup.build_tokenizer(config)
  model = run_setup.build_model(config, tokenizer, mesh)
  _log.info(run_setup.describe(config, model))
  fallback = run_setup.attention_fallback(config, model.config, jax.default_backend())
  if fallback:
    _log.warning(fallback)
  train_records = run_setup.load_dataset(config.data.train, config, "train")
  eval_records = (run_setup.load_dataset(config.data.eval, config, "eval")
                  if config.data.eval else [])
  sampler_graphdef, _ = nnx.split(model)
  if jax.process_count() > 1 and config.rollout.engine != "static":
    raise ValueError(f"config.rollout.engine={config.rollout.engine!r} drives its slots from one "
                     "host; on several processes use rollout.engine='static'.")
  # On several processes: host prompts in, the same host RolloutBatch out on every process.
  rollout_mesh = run_setup.build_rollout_mesh(config, mesh)
  rollout = exp.global_rollout(make_rollout(config, sampler_graphdef, rollout_mesh, tokenizer),
                               rollout_mesh)
  # Once per step: the trained params in the model's dtype and the rollout layout.
  to_rollout = run_setup.RolloutWeights(model.config.jnp_param_dtype, rollout_mesh)
  rollout_weights = {"params": None}
  tcfg = run_setup.train_config(config)
  graphdef, state = init_train_state(model, tcfg, mesh)
  state = _committed(state, mesh)
  del model
  step_fn = TrainStep(graphdef, tcfg, mesh)
  logp_fn = LogProbForward(graphdef, tcfg, mesh, rest=state.rest)

  iterator = PromptIterator(train_records, config.algorithm.gen_batch_size, config.seed,
                            num_epochs=config.data.num_epochs or None,
                            process_index=jax.process_index(),
                            process_count=jax.process_count())
  ckpt = TrainCheckpointer(os.path.join(workdir, "checkpoints"),
                           max_to_keep=config.checkpoint.max_to_keep,
                           async_save=config.checkpoint.async_save)
  base_key = jax.random.key(config.seed)
  # Rollout keys depend only on (seed, step, generation batch): a resumed run draws the same.
  counter = {"step": 0, "gen": 0}

  def key_fn():
    counter["gen"] += 1
    return jax.random.fold_in(jax.random.fold_in(base_key, 1 + counter["step"]), counter["gen"])

  r = config.reward
  scorer = RewardScorer(r.verifier, max_response_length=config.rollout.max_response_length,
                        overlong_buffer_len=r.overlong_buffer_len,
                        overlong_penalty_factor=r.overlong_penalty_factor,
                        overlong_buffer_enable=r.overlong_buffer_enable, timeout_s=r.timeout_s,
                        num_workers=r.num_workers)
  params = run_setup.sampling_params(config, tokenizer)
  generate_fn = exp.make_generate_fn(
      lambda ids, mask, key, n: rollout(rollout_weights["params"], ids, mask, key, params, n),
      tokenizer,
      scorer, num_samples=config.rollout.n, max_prompt_length=config.data.max_prompt_length,
      eos_ids=params.eos_ids, key_fn=key_fn,
      prompts_per_call=config.rollout.prompts_per_call)
  sampler = DynamicSampler(
      generate_fn, train_batch_size=config.optim.train_batch_size,
      max_num_gen_batches=config.algorithm.max_num_gen_batches if
      config.algorithm.dynamic_sampling else 0,
      keep_surplus=config.algorithm.keep_surplus, enable=config.algorithm.dynamic_sampling)

  start_step = 0
  evaluator = eval_lib.Evaluator(config, rollout, tokenizer, scorer, eval_records)
  restored = ckpt.restore(abstract_params=state.params, abstract_opt_state=state.opt_state)
  result: dict[str, float] = {}
  if restored is not None:
    params_r, opt_r, meta = restored
    state = state.replace(params=params_r, opt_state=opt_r,
                          step=jnp.asarray(meta["update_step"], jnp.int32),
                          num_skipped=jnp.asarray(meta["num_skipped"], jnp.int32))
    state = _committed(state, mesh)
    iterator.set_state(meta["iterator"])
    sampler.load_state_dict(exp.sampler_state_from_json(meta["sampler"]))
    start_step = int(meta["step"])
    _log.info("Resumed from %s at step %d.", ckpt.directory, start_step)
  # A fresh run drops any log lines left by an attempt that died before its first checkpoint.
  writer = MetricsWriter(workdir, resume_step=start_step if restored is not None else -1)
  if restored is None:
    before: dict[str, float] = {}
    if config.sft.steps:
      state, before = sft.warm_start(config, graphdef, state, tokenizer, train_records, mesh)
      # A fresh optimizer for DAPO on the warm-started weights.
      state = _committed(
          init_train_state(nnx.merge(graphdef, state.params, state.rest), tcfg, mesh)[1], mesh)
    if eval_records and config.eval.every:
      before.update(evaluator(to_rollout(state.params)))
    if before:
      writer.write_scalars(0, before)
      result.update(before)

  consecutive_skips = 0
  stop = _StopRequest()
  stop.install()
  stopped_at = None
  rows_per_update = config.optim.mini_batch_size * config.rollout.n
  progress = ProgressBar(config.num_steps, initial=start_step, fields={
      "reward": "train/reward_mean", "acc": "train/acc_mean", "kept": "sampling/kept_ratio",
      "eval": evaluator.headline})
  try:
    for step in range(start_step, config.num_steps):
      counter.update(step=step, gen=0)
      timer = Timer()
      with timer("rollout"):
        rollout_weights["params"] = to_rollout(state.params)
        try:
          groups, ds_stats = sampler.sample(exp.global_batches(iterator))
        except DynamicSamplingError as err:
          raise _sampling_stopped(err, step, config, ckpt, state, iterator, sampler) from err
        finally:
          rollout_weights["params"] = None  # freed before the update (the plan's train phase)
        traj = exp.groups_to_trajectories(groups)
        # Every process must train on the same batch (the filter saw gathered rewards).
        distributed.assert_same_on_all_processes(np.stack([traj.lengths, traj.group_ids]),
                                                 "The dynamic-sampling batch")
        adv = exp.compute_advantages(traj, config.algorithm.norm_adv_by_std)
      with timer("old_logprob"):
        if config.rollout.use_sampler_logprobs:
          old_logp, entropy = traj.sampler_logprobs, None
        else:
          old_logp, entropy = distributed.global_to_host(logp_fn(
              state.params, exp.rows_on_device(traj.input_ids, mesh),
              exp.rows_on_device(traj.attention_mask, mesh), traj.response_len))
      with timer("update"):
        updates = []
        for _ in range(config.optim.ppo_epochs):
          for batch in _mini_batches(traj, adv, old_logp, rows_per_update, mesh):
            state, m = step_fn(state, batch, step)
            updates.append(m)
        updates = jax.device_get(updates)
        metrics = _mean_metrics(updates)
      for m in updates:  # spec 6.4 skips non-finite updates; too many in a row stop the run
        consecutive_skips = consecutive_skips + 1 if float(m["skipped"]) else 0
      metrics["actor/skipped_total"] = float(state.num_skipped)  # over the run, resumes included
      metrics.update(exp.rollout_metrics(traj, max_response_length=config.rollout.max_response_length,
                                         buffer_len=config.reward.overlong_buffer_len))
      metrics.update({f"sampling/{k}": float(v) for k, v in ds_stats.to_dict().items()})
      if not config.rollout.use_sampler_logprobs:
        # Sampler vs training forward on the same tokens: should be ~0 (fp32); a gap means the
        # update is silently off-policy (verl logs the same as rollout_probs_diff).
        m = traj.response_mask
        metrics["rollout/logprob_diff_max"] = float(
            np.abs(np.where(m, traj.sampler_logprobs - old_logp, 0.0)).max())
      if entropy is not None:
        mask = traj.response_mask
        metrics["actor/entropy"] = float((np.asarray(entropy) * mask).sum() / max(mask.sum(), 1))
      metrics["reward/verifier_errors"] = float(sum(g.payload["num_errors"] for g in groups))
      metrics["reward/verifier_timeouts"] = float(sum(g.payload["num_timeouts"] for g in groups))
      metrics.update({f"time/{k}": v for k, v in timer.totals.items()})
      total = sum(timer.totals.values())
      metrics["time/step"] = total
      metrics["perf/trained_tokens_per_s"] = float(traj.response_mask.sum()) / max(
          timer.totals.get("update", 1e-9), 1e-9)
      metrics["perf/rollout_tokens_per_s"] = float(
          ds_stats.rollouts_generated * traj.lengths.mean()) / max(timer.totals["rollout"], 1e-9)
      if eval_records and config.eval.every and (step + 1) % config.eval.every == 0:
        metrics.update(evaluator(to_rollout(state.params), step=step + 1))
      writer.write_scalars(step + 1, metrics)
      writer.write_texts(step + 1, {f"sample_{i}": f"{traj.prompts[i // config.rollout.n]!r} -> "
                                    f"{traj.texts[i]!r} (reward {traj.reward[i]:+.2f})"
                                    for i in range(0, min(traj.num_rows, config.num_sample_texts
                                                          * config.rollout.n), config.rollout.n)})
      progress.update(step + 1, metrics)
      writer.flush()  # on disk before the step's checkpoint: a kill never loses a saved step's row
      result = metrics
      if consecutive_skips >= config.optim.max_consecutive_skips:
        ckpt.close()
        raise NonFiniteUpdatesError(
            f"{consecutive_skips} consecutive non-finite updates up to step {step + 1}; stopping. "
            f"The last good checkpoint (step {ckpt.latest_step()}) is kept.")
      preempted = stop.requested(step + 1)
      if (preempted or (step + 1) % config.checkpoint.save_every == 0
          or step + 1 == config.num_steps):
        ckpt.save(step + 1, state.params, state.opt_state,
                  _meta(step + 1, state, iterator, sampler))
      if preempted:
        stopped_at = step + 1
        _log.warning("Stopped at step %d on request; checkpoint written to %s. Relaunch with the "
                     "same --workdir to resume.", stopped_at, ckpt.directory)
        break
  except BaseException:
    # Any failed exit (sampling stopped, non-finite updates, an exception from the rollout or
    # the verifier, Ctrl-C) still ends the verifier processes and closes the metric files.
    stop.restore()
    progress.close()
    writer.close()
    scorer.close()
    raise
  stop.restore()
  progress.close()
  ckpt.close()
  if stopped_at is not None:
    writer.close()
    scorer.close()
    return {**result, "stopped_at_step": float(stopped_at)}
  if eval_records and config.eval.every and not any(k.startswith("eval/") for k in result):
    final = evaluator(to_rollout(state.params), step=config.num_steps)
    writer.write_scalars(config.num_steps, final)
    result.update(final)
  writer.close()
  plot_curves(os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "curves.png"))
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(result, f, indent=2)
  scorer.close()
  evals = [r[evaluator.headline] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
           if r.get(evaluator.headline) is not None]
  if evals:
    _log.info("Held-out %s: %.3f at the start of RL -> %.3f after %d steps. Curves: %s",
              evaluator.headline, evals[0], evals[-1], config.num_steps,
              os.path.join(workdir, "curves.png"))
  return result


class SamplingStoppedError(RuntimeError):
  """Dynamic sampling could not fill a batch (`max_num_gen_batches`, or data ran out).

  The state is checkpointed at the step reached, with the groups gathered so far carried: the
  next launch on the same workdir (e.g. with a higher limit) starts from them.
  """


def _sampling_stopped(err: DynamicSamplingError, step: int, config, ckpt: TrainCheckpointer,
                      state, iterator: PromptIterator, sampler: DynamicSampler
                      ) -> SamplingStoppedError:
  sampler.carry(err.groups)  # nothing gathered is thrown away
  # force: a resumed run re-saves its start step (iterator advanced, groups carried).
  ckpt.save(step, state.params, state.opt_state, _meta(step, state, iterator, sampler),
            force=True)
  ckpt.close()
  st, gathered = err.stats, f"{len(err.groups)}/{config.optim.train_batch_size}"
  if isinstance(err, DatasetExhaustedError):
    what = (f"dataset {config.data.train!r} ran out after data.num_epochs="
            f"{config.data.num_epochs} epoch(s) with {gathered} groups gathered. Raise "
            "data.num_epochs (0 = endless) or lower num_steps")
  else:
    what = (f"{gathered} groups after {st.num_gen_batches} generation batches "
            f"(algorithm.max_num_gen_batches={config.algorithm.max_num_gen_batches}; kept ratio "
            f"{st.kept_ratio:.3f}, all-correct {st.all_correct_ratio:.3f}, all-wrong "
            f"{st.all_wrong_ratio:.3f}). Raise algorithm.max_num_gen_batches (0 = unlimited) "
            "or algorithm.gen_batch_size, or check the data and the reward")
  return SamplingStoppedError(
      f"Dynamic sampling stopped at step {step}: {what}. The {len(err.groups)} group(s) "
      f"gathered are saved with a checkpoint of step {step} in {ckpt.directory} and are used "
      "first when the run is relaunched on the same --workdir.")


def _meta(step: int, state, iterator: PromptIterator, sampler: DynamicSampler) -> dict:
  return {"step": step, "update_step": int(state.step), "num_skipped": int(state.num_skipped),
          "iterator": iterator.get_state(),
          "sampler": exp.sampler_state_to_json(sampler.state_dict())}
