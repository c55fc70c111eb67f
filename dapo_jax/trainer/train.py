"""``train_and_evaluate(config, workdir)``: the DAPO loop (spec 6), resumable from ``workdir``.

One rollout step: dynamic sampling over generation batches (rollout + rewards), GRPO advantages,
old log-probs by the training forward, then ``train_batch_size / mini_batch_size`` compiled
updates per PPO epoch. Validation every ``eval.every`` steps, a checkpoint every
``checkpoint.save_every`` steps; a run restarted on the same ``workdir`` continues where the
last checkpoint left off (same data order, same random keys).

One piece: `train_and_evaluate` and the per-step helpers it calls, in the order a step runs them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from dapo_jax.data import pipeline
from dapo_jax.infra import compile_cache
from dapo_jax.infra import curves
from dapo_jax.trainer import diagnostics
from dapo_jax.infra import distributed
from dapo_jax.trainer import evaluate as eval_lib
from dapo_jax.trainer import experience as exp_lib
from dapo_jax.trainer import logprob_gap
from dapo_jax.trainer import packing
from dapo_jax.spec import run_config
from dapo_jax.infra import run_files
from dapo_jax.trainer import reference
from dapo_jax.trainer import rollout_process
from dapo_jax.trainer import run_setup
from dapo_jax.trainer import sft
from dapo_jax.trainer import trajectories as traj_lib
from dapo_jax.trainer.dynamic_sampling import (DatasetExhaustedError, DynamicSamplingError,
                                       SamplingStats)
from dapo_jax.infra.console_log import RunLogger
from dapo_jax.infra.logging_writers import MultiWriter, open_writers
from dapo_jax.infra.metrics import Timer
from dapo_jax.spec.run_spec import RolloutSpec, RunSpec
from dapo_jax.trainer.train_step import TrainState
from dapo_jax.trainer.trajectories import Trajectories

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
    self.also: Any = None  # () -> bool: a stop asked elsewhere (a rollout process's SIGTERM)
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

  def __enter__(self) -> _StopRequest:
    self.install()
    return self

  def __exit__(self, *exc) -> None:
    self.restore()

  def requested(self, step: int) -> bool:
    asked = self.signum is not None or bool(self.also is not None and self.also())
    if jax.process_count() == 1:
      return asked
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    if self._jax_service:  # (a rollout process's signal is not seen: JAX's service decides)
      return bool(multihost_utils.reached_preemption_sync_point(step))
    flags = multihost_utils.process_allgather(np.int32(asked))
    return bool(np.any(flags))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       allow_config_change: Sequence[str] = (), role: str = "both",
                       peer: str = "") -> dict[str, float]:
  """Runs (or resumes) DAPO training; returns the last step's metrics and final evaluation.

  A resume refuses a config whose changes from the run's ``config.json`` are not safe
  (`run_config`), unless ``allow_config_change`` names them. ``role`` "train" or "rollout"
  (with ``peer``, the training process's HOST:PORT): this process does one side of the run and
  another process the other (`rollout_process`); "both": this process does both.
  """
  spec = RunSpec.from_config(config, num_devices=jax.device_count())  # validated here, once
  rollout_process.check_role(role, peer, spec)
  if role == "rollout":
    return _serve_rollout(spec, workdir, peer, rollout_process.batch_settings(config))
  # Before anything is built or written: a refused relaunch leaves the workdir as it was.
  # Storage down at launch: retried for checkpoint.storage_wait_s, then one line.
  launch = run_files.retry_transient(
      lambda: run_config.check(workdir, config, allow_config_change),
      what=f"--workdir {workdir}", timeout_s=spec.checkpoint.storage_wait_s)
  workdir = launch.workdir  # local path or gs:// URL
  workdir.mkdir(parents=True, exist_ok=True)
  compile_cache.setup(spec.compilation_cache_dir, workdir)  # before the first compile
  with contextlib.ExitStack() as teardown:  # every exit, failed or not, ends its resources here
    compiles = teardown.enter_context(compile_cache.CompileCounter())
    teardown.callback(lambda: _log.info("This launch: %s.", compiles.counts))
    run, state = run_setup.build_run(spec, workdir, role)
    teardown.enter_context(run)
    evaluator = eval_lib.Evaluator(spec, run.rollout, run.tokenizer, run.scorer,
                                   run.eval_records)
    evaluating = bool(run.eval_records and spec.eval.every)
    link = None
    if role == "train":  # the rollout runs in the process that connects to ``peer``
      link = teardown.enter_context(contextlib.closing(rollout_process.Link.listen(
          peer, str(workdir), agree=rollout_process.batch_settings(config))))
    evaluate = _evaluate_fn(run, evaluator, link)
    state, start_step, resumed = _restore(run, state)
    run_config.record(launch, start_step if resumed else None)  # config.json once restored
    # A fresh run drops any log lines left by an attempt that died before its first checkpoint.
    writer = teardown.enter_context(
        open_writers(spec, workdir, resume_step=start_step if resumed else -1))
    result: dict[str, float] = {}
    if not resumed:
      state, result = _before_rl(spec, run, state, evaluate if evaluating else None)
      if result:
        writer.write_scalars(0, result)
    ref_params = reference.reference_policy(spec.algorithm.use_kl_loss, spec.model.param_dtype,
                                            workdir, state, resumed)  # None: no KL
    stop = teardown.enter_context(_StopRequest())
    progress = RunLogger.for_run(spec, initial=start_step, headline=evaluator.headline)
    teardown.callback(progress.close)
    source, evaluate = _experience_source(spec, run, state, link, evaluate, stop, start_step,
                                          resumed)
    teardown.callback(source.close)
    skips = 0  # consecutive non-finite updates (spec 6.4)
    for step in range(start_step, spec.num_steps):
      try:
        state, exp, metrics, skips = _rl_step(spec, run, state, source, step, ref_params, skips)
      except Exception as err:  # pylint: disable=broad-except  (re-raised unless a side broke)
        if (broke := _side_broke(err, step, run, source)) is None:
          raise
        raise broke from None
      if evaluating and (step + 1) % spec.eval.every == 0:
        with source.exclusive():
          metrics.update(evaluate(state.params, step + 1))
      _log_step(spec, writer, progress, step + 1, metrics, exp.batch[0])
      result = metrics
      _check_skips(spec, run, skips, step + 1)
      if _checkpoint(spec, run, stop, step + 1, state, exp.resume_state):  # stopped on request
        return {**result, "stopped_at_step": float(step + 1)}
    # (the last batch's data state: on --role=train this process's iterator never moves)
    _last_save_landed(run, spec.num_steps, state,
                      exp.resume_state if spec.num_steps > start_step else None)
    if evaluating and not any(k.startswith("eval/") for k in result):
      result.update(_final_evaluate(spec, run, state, source, evaluate, writer))
    writer.flush()
    rows = curves.write_final_files(workdir, result)  # curves.png, final_metrics.json
    _log_held_out(spec.num_steps, workdir, evaluator.headline, rows)
    return result


def _evaluate_fn(run: run_setup.Run, evaluator: eval_lib.Evaluator, link):
  """``evaluate(params, step)`` -> eval metrics: here, or by the rollout process at ``link``
  (None: this process rolls out)."""
  if link is not None:
    return functools.partial(rollout_process.evaluate, link, run.to_rollout.send)
  return lambda params, step: evaluator(run.to_rollout(params), step=step)


def _experience_source(spec: RunSpec, run: run_setup.Run, state: TrainState, link, evaluate,
                       stop: _StopRequest, start_step: int, resumed: bool):
  """Where each step's experience comes from, and the evaluate to use from now on: sampled
  when asked (max_staleness 0), by a rollout thread running ahead, or by the rollout process
  at ``link`` (its evaluations placed among its batches; its SIGTERM stops this loop too)."""
  staleness = spec.algorithm.max_staleness
  if link is None:
    return exp_lib.open_source(
        staleness, functools.partial(_sample, spec, run), run.to_rollout,
        lambda: _resume_state(run), start_step=start_step, num_steps=spec.num_steps,
        save_every=spec.checkpoint.save_every, params=state.params,
        partial=spec.algorithm.partial_rollouts), evaluate
  source = rollout_process.RemoteExperience(
      link, run.to_rollout.send, max_staleness=staleness, start_step=start_step,
      num_steps=spec.num_steps, save_every=spec.checkpoint.save_every, params=state.params,
      partial=spec.algorithm.partial_rollouts,
      resume=_resume_state(run) if resumed else None, lora_base=run.lora_base)
  stop.also = source.stop_requested
  return source, source.evaluate


def _rl_step(spec: RunSpec, run: run_setup.Run, state: TrainState, source, step: int,
             ref_params, skips: int):
  """One DAPO step (spec 6): the batch (dynamic sampling, or the rollout running ahead),
  advantages, old log-probs, the updates, the new weights to the rollout; returns the state,
  the experience, the step's metrics and the consecutive skipped updates so far."""
  staleness = spec.algorithm.max_staleness
  timer = Timer()
  with timer("trainer_idle" if staleness else "rollout"):
    try:
      exp = source.next(step, state.params)
    except DynamicSamplingError as err:
      raise _sampling_stopped(err, step, spec, run, state) from err
    except rollout_process.PeerError as err:  # --role=train: the rollout process went
      raise _rollout_gone(err, step, run, state, source) from None
    traj, ds_stats, diag = exp.batch
    adv = traj_lib.compute_advantages(traj, spec.algorithm.norm_adv_by_std)
  with timer("old_logprob"):
    layouts = _pack(spec, run, traj)  # optim.packing: each mini-batch's packed rows
    old_logp, entropy, ref_logp = _old_log_probs(spec.rollout, run, state, traj, step,
                                                 ref_params, decoupled=staleness > 0,
                                                 layouts=layouts)
  with timer("update"):
    state, updates = _update(spec, run, state, traj, adv, old_logp, step, ref_logp, layouts)
  source.updated(step + 1, state.params)  # the new weights to the rollout
  for m in updates:  # spec 6.4 skips non-finite updates; too many in a row stop the run
    skips = skips + 1 if float(m["skipped"]) else 0
  metrics = step_metrics(spec, state, traj, ds_stats, updates, old_logp, entropy, timer, step,
                         rollout_s=exp.times["rollout"])
  metrics.update(diag)
  metrics.update(_grad_weight_metrics(spec, traj, adv))
  metrics.update(_packing_metrics(spec, run, layouts))
  if staleness:
    metrics.update(traj_lib.staleness_metrics(traj, step, staleness))
    metrics.update(_overlap_metrics(exp))
  return state, exp, metrics, skips


def _check_skips(spec: RunSpec, run: run_setup.Run, skips: int, step: int) -> None:
  if skips >= spec.optim.max_consecutive_skips:
    run.checkpointer.wait_until_finished()
    raise NonFiniteUpdatesError(
        f"{skips} consecutive non-finite updates up to step {step}; stopping. "
        f"The last good checkpoint (step {run.checkpointer.latest_step()}) is kept.")


def _checkpoint(spec: RunSpec, run: run_setup.Run, stop: _StopRequest, step: int,
                state: TrainState, resume: dict[str, Any]) -> bool:
  """Saves every checkpoint.save_every steps, at the last and on a stop request; True: stop.

  A save failed on a storage outage is retried at the next one; only
  checkpoint.max_consecutive_failed_saves failures in a row stop the run (one line)."""
  preempted = stop.requested(step)
  if preempted or step % spec.checkpoint.save_every == 0 or step == spec.num_steps:
    _save(run, step, state, resume=resume)
  if preempted:  # one try: a preempted VM has seconds left
    if run.checkpointer.wait_until_finished():
      _log.warning("Stopped at step %d on request; checkpoint written to %s. Relaunch with "
                   "the same --workdir to resume.", step, run.checkpointer.directory)
    else:
      _log.warning("Stopped at step %d on request; its checkpoint could not be written "
                   "(storage), the newest is step %s. Relaunch with the same --workdir to "
                   "resume from it.", step, run.checkpointer.latest_step())
  return preempted


def _final_evaluate(spec: RunSpec, run: run_setup.Run, state: TrainState, source, evaluate,
                    writer: MultiWriter) -> dict[str, float]:
  """The last step's evaluation when no eval step fell on it, written to the logs."""
  try:
    final = evaluate(state.params, spec.num_steps)
  except rollout_process.PeerError as err:  # its step is saved: a relaunch evaluates it
    raise _rollout_gone(err, spec.num_steps, run, state, source) from None
  writer.write_scalars(spec.num_steps, final)
  return final


def _serve_rollout(spec: RunSpec, workdir: str, peer: str, agree: dict[str, str]
                   ) -> dict[str, float]:
  """``--role=rollout``: the rollout side of the run that the training process at ``peer``
  drives (`rollout_process.serve`); writes nothing to ``workdir`` but the compilation cache.
  ``agree``: the config's settings that decide the batches (the training process's must be
  the same: `rollout_process.batch_settings`)."""
  compile_cache.setup(spec.compilation_cache_dir, run_files.resolve(workdir))
  with contextlib.ExitStack() as teardown:
    compiles = teardown.enter_context(compile_cache.CompileCounter())
    teardown.callback(lambda: _log.info("This launch: %s.", compiles.counts))
    run, _ = run_setup.build_run(spec, workdir, role="rollout")
    teardown.enter_context(run)
    evaluator = eval_lib.Evaluator(spec, run.rollout, run.tokenizer, run.scorer,
                                   run.eval_records)
    link = teardown.enter_context(contextlib.closing(
        rollout_process.Link.connect(peer, str(workdir), agree=agree)))
    _log.info("Rolling out for the training process at %s.", peer)

    def sample(weights, step, version, newest=None, check=None):
      try:
        return _sample(spec, run, weights, step, version, newest, check)
      except DynamicSamplingError as err:  # the trainer checkpoints what was gathered
        run.sampler.carry(err.groups)
        err.resume_state = _resume_state(run)
        raise

    def restore(resume: dict[str, Any]) -> None:
      run.iterator.set_state(resume["iterator"])
      run.sampler.load_state_dict(resume["sampler"])

    rollout_process.serve(link, sample, lambda: _resume_state(run), restore, evaluator,
                          run.rollout_mesh, receive=run.to_rollout.receive,
                          lora_base=run.lora_base)
  return {}


def rollout_key(seed: int, step: int) -> jax.Array:
  """A step's rollout key: it depends only on (seed, step), so a resumed run draws the same.

  Prompt i of the step (i counts through its generation batches) draws from it and i alone
  (``rollout.static_stream``, ``rollout.stream``).
  """
  return jax.random.fold_in(jax.random.key(seed), 1 + step)


def _restore(run: run_setup.Run, state: TrainState) -> tuple[TrainState, int, bool]:
  """The state, the first step to run and whether a checkpoint was found in the workdir."""
  restored = run.checkpointer.restore(abstract_params=state.params,
                                      abstract_opt_state=state.opt_state)
  if restored is None:
    return state, 0, False
  params, opt_state, meta = restored
  run_setup.check_lora_base(run, meta)
  state = state.replace(params=params, opt_state=opt_state,
                            step=jnp.asarray(meta["update_step"], jnp.int32),
                            num_skipped=jnp.asarray(meta["num_skipped"], jnp.int32))
  run.iterator.set_state(meta["iterator"])
  run.sampler.load_state_dict(meta["sampler"])
  _log.info("Resumed from %s at step %d.", run.checkpointer.directory, int(meta["step"]))
  return run_setup.commit(state, run.mesh), int(meta["step"]), True


def _before_rl(spec: RunSpec, run: run_setup.Run, state: TrainState, evaluate
               ) -> tuple[TrainState, dict[str, float]]:
  """A fresh run's optional SFT warm start and its step-0 evaluation (``evaluate(params,
  step)``; None: none)."""
  before: dict[str, float] = {}
  if spec.sft.steps:
    state, before = sft.warm_start(spec, run.graphdef, state, run.tokenizer, run.train_records,
                                   run.mesh)
    state = run.fresh_optimizer(state)  # a fresh optimizer for DAPO on the warm-started weights
  if evaluate is not None:
    before.update(evaluate(state.params, 0))
  return state, before


def _sample(spec: RunSpec, run: run_setup.Run, weights, step: int, version: int, newest=None,
            check=None) -> tuple[Trajectories, SamplingStats, dict[str, float]]:
  """Dynamic sampling (spec 5) of step ``step``'s batch with rollout ``weights`` (policy
  ``version``); the step's sampling diagnostics (`diagnostics.sampling_metrics`).

  ``algorithm.sampling_loop``: "batch" rolls out whole generation batches; "stream" admits
  prompts only while they can be needed and keeps the same groups; "stream_eager" takes
  groups as they finish. A kill mid-rollout resumes from the last checkpoint (a step
  boundary, where nothing is in flight) and redraws the step with the same keys. Under
  ``algorithm.max_staleness`` k >= 1, carried groups that would train more than k versions
  after their policy are dropped first (counted). ``newest`` (partial rollouts,
  `experience.OverlappedExperience`): newer weights the samples in flight continue with.
  ``check`` (the overlapped rollout thread): called before each poll of the stream; it raises
  to abandon the batch when the run stops.
  """
  loop = spec.algorithm.sampling_loop
  dropped = _drop_stale_carried(run, step, spec.algorithm.max_staleness)
  stream = run.generator.stream(weights, rollout_key(spec.seed, step))
  if newest is not None:
    stream.follow(newest, version)
  stream.check = check
  batches = pipeline.global_batches(run.iterator)
  prefilter = run.sampler.prefilter
  if prefilter is not None:
    prefilter.begin(step)  # its draws depend on (seed, step, prompt index) only
  try:
    if loop == "batch":
      groups, ds_stats = run.sampler.sample(batches, generate_fn=stream.generate)
    else:
      groups, ds_stats = run.sampler.sample_stream(batches, stream, wait=loop == "stream")
  finally:
    decoded = stream.stats()
    stream.close()
  traj_lib.stamp_sampled_at(list(groups) + run.sampler.carried_groups, step, version)
  ds_stats.decoded_tokens = int(decoded["decoded_tokens"])
  ds_stats.decode_slot_steps = int(decoded["slot_steps"])
  ds_stats.preemptions = int(decoded.get("preemptions", 0))
  traj = Trajectories.from_groups(groups)
  # Every process must train on the same batch (the filter saw gathered rewards); with partial
  # rollouts, every rollout process must have moved its samples to each version together.
  checked = [traj.lengths, traj.group_ids]
  if traj.token_version is not None:
    checked.append(traj.token_version.ravel())
  distributed.assert_same_on_all_processes(np.concatenate(checked),
                                           "The dynamic-sampling batch (or its tokens' versions)")
  r = spec.rollout
  ppc = r.prompts_per_call if r.engine == "static" else 0
  diag = diagnostics.sampling_metrics(stream.log, groups,
                                      max_response_length=r.max_response_length,
                                      rows_per_decode=ppc * r.n)
  diag["data/prompts_truncated"] = float(stream.prompts_truncated)  # data.truncate
  if spec.algorithm.max_staleness:
    diag["sampling/carried_dropped_stale"] = float(dropped)
  if prefilter is not None:
    diag.update(prefilter.metrics(ds_stats.num_groups_generated,
                                  ds_stats.num_all_correct + ds_stats.num_all_wrong,
                                  ds_stats.decoded_per_kept_vs_ideal))
  return traj, ds_stats, diag


def _drop_stale_carried(run: run_setup.Run, step: int, max_staleness: int) -> int:
  """Drops the carried groups whose policy is more than ``max_staleness`` versions older than
  step ``step``; how many (0 when ``max_staleness`` is 0: the synchronous step trains carried
  groups against their own sampler's log-probs, `traj_lib.behaviour_log_probs`)."""
  if not max_staleness:
    return 0
  carried = run.sampler.carried_groups
  keep = [g for g in carried if step - traj_lib.policy_version(g) <= max_staleness]
  if len(keep) < len(carried):
    run.sampler.carry(keep)
  return len(carried) - len(keep)


def _resume_state(run: run_setup.Run) -> dict[str, Any]:
  """What a checkpoint needs to continue the data where the last drawn batch left it."""
  return {"iterator": run.iterator.get_state(), "sampler": run.sampler.state_dict()}


def _overlap_metrics(exp: exp_lib.Experience) -> dict[str, float]:
  """An overlapped step's rollout side: busy, idle and weight hand-off seconds, bytes moved."""
  t = exp.times
  return {"time/rollout": t["rollout"], "time/rollout_idle": t["rollout_idle"],
          "time/weight_sync": t["weight_sync"], "sync/weight_bytes": t["weight_bytes"],
          "sync/policy_version": float(exp.version),
          # a rollout process's batch, pickled host to host (`rollout_process`)
          **({"sync/batch_bytes": t["batch_bytes"]} if "batch_bytes" in t else {})}


def _grad_weight_metrics(spec: RunSpec, traj: Trajectories, adv: np.ndarray
                         ) -> dict[str, float]:
  """`diagnostics.grad_weight_share` under the run's loss aggregation and mini-batches."""
  a = spec.algorithm
  weights = diagnostics.row_loss_weights(
      traj.response_mask, traj.truncated, a.loss_agg_mode, spec.sizes.rows_per_update,
      overlong_filter=a.overlong_filter)
  return diagnostics.grad_weight_share(adv, weights, traj.acc, traj.lengths,
                                       spec.rollout.max_response_length)


def _pack(spec: RunSpec, run: run_setup.Run, traj: Trajectories
          ) -> list[packing.PackLayout] | None:
  """Each mini-batch's packed layout (optim.packing), for the old log-probs, the reference and
  the update alike; None: the padded rows."""
  return packing.spec_layouts(spec, run.mesh, traj.attention_mask)


def _packing_metrics(spec: RunSpec, run: run_setup.Run,
                     layouts: list[packing.PackLayout] | None) -> dict[str, float]:
  """Packed rows' fill and the distinct programs compiled so far (bounded by the buckets)."""
  if layouts is None:
    return {}
  out = packing.metrics(layouts, spec.optim.max_tokens_per_row or spec.sizes.max_length,
                        spec.sizes.max_length)
  out["packing/train_programs"] = float(run.step_fn.num_programs)
  out["packing/logprob_programs"] = float(run.logp_fn.num_programs)
  return out


def _forward(run: run_setup.Run, params, traj: Trajectories, ref_params=None,
             layouts: list[packing.PackLayout] | None = None) -> tuple[np.ndarray, ...]:
  return packing.forward_rows(run.logp_fn, params, traj.input_ids, traj.attention_mask,
                              traj.response_len, run.mesh, layouts, ref_params)


def _old_log_probs(rollout: RolloutSpec, run: run_setup.Run, state: TrainState, traj: Trajectories,
                   step: int, ref_params=None, *, decoupled: bool = False,
                   layouts: list[packing.PackLayout] | None = None):
  """``(old, entropy, ref)`` log-probs (spec 6.2). Old: the behaviour policy's, the sampler's
  or the training forward's (+ entropy) with the sampler's kept for groups carried from an
  earlier step. ``decoupled`` (max_staleness >= 1): the training forward's on every row, the
  proximal policy of the decoupled objective (the sampler's enter as the behaviour weight).
  Ref: the KL reference's, in the same compiled pass (None without one). ``layouts``: packed."""
  if rollout.use_sampler_logprobs:
    ref = None
    if ref_params is not None:
      ref = _forward(run, ref_params, traj, layouts=layouts)[0]
    return traj.sampler_logprobs, None, ref
  if ref_params is None:
    logp, entropy = _forward(run, state.params, traj, layouts=layouts)
    ref = None
  else:
    logp, entropy, ref = _forward(run, state.params, traj, ref_params, layouts)
  if decoupled:
    return np.asarray(logp, np.float32), entropy, ref
  return traj_lib.behaviour_log_probs(traj, np.asarray(logp), step), entropy, ref


def _update(spec: RunSpec, run: run_setup.Run, state: TrainState, traj: Trajectories, adv, old_logp,
            step: int, ref_logp=None, layouts: list[packing.PackLayout] | None = None
            ) -> tuple[TrainState, list[dict[str, Any]]]:
  """``ppo_epochs`` passes of compiled updates over the mini-batches; host metrics per update.
  ``layouts``: each mini-batch packed (optim.packing)."""
  rows_per_update = spec.sizes.rows_per_update
  updates = []
  for _ in range(spec.optim.ppo_epochs):
    for batch in traj_lib.mini_batches(traj, adv, old_logp, rows_per_update, run.mesh,
                                       ref_logp, run.train_config.rollout_is != "none",
                                       layouts):
      state, m = run.step_fn(state, batch, step)
      updates.append(m)
  return state, jax.device_get(updates)


def step_metrics(spec: RunSpec, state: TrainState, traj: Trajectories, ds_stats: SamplingStats,
                 updates: list[dict[str, Any]], old_logp: np.ndarray, entropy, timer: Timer,
                 step: int, rollout_s: float | None = None) -> dict[str, float]:
  """One step's logged scalars: update means, rollout, sampling, verifier, time, throughput.
  ``rollout_s``: the rollout's seconds for the batch (default: the timer's "rollout")."""
  metrics = _mean_metrics(updates)
  metrics["actor/skipped_total"] = float(state.num_skipped)  # over the run, resumes included
  metrics.update(traj_lib.rollout_metrics(
      traj, max_response_length=spec.rollout.max_response_length,
      buffer_len=spec.reward.overlong_buffer_len))
  metrics.update({f"sampling/{k}": float(v) for k, v in ds_stats.to_dict().items()})
  mask = traj.response_mask
  # Response tokens of groups sampled by an earlier step's policy (keep_surplus), trained with
  # that policy's log-probs as old log-probs.
  metrics["sampling/carried_tokens_trained"] = float(mask[traj.carried_rows(step)].sum())
  if not spec.rollout.use_sampler_logprobs:
    # Sampler vs training forward on the same tokens (issue 29): bit-equal share, |delta logp|,
    # k3 KL and importance weights; a gap means the update is silently off-policy (verl logs
    # rollout_probs_diff and rollout_corr/*). Carried groups' old log-probs are the sampler's.
    metrics.update({f"rollout/{k}": v for k, v in logprob_gap.logprob_gap_metrics(
        traj.sampler_logprobs, old_logp, mask).items()})
  if entropy is not None:
    metrics["actor/entropy"] = float((np.asarray(entropy) * mask).sum() / max(mask.sum(), 1))
  metrics["reward/verifier_errors"] = float(traj.verifier_errors)
  metrics["reward/verifier_timeouts"] = float(traj.verifier_timeouts)
  metrics.update({f"time/{k}": v for k, v in timer.totals.items()})
  metrics["time/step"] = sum(timer.totals.values())
  metrics["perf/trained_tokens_per_s"] = float(mask.sum()) / max(
      timer.totals.get("update", 1e-9), 1e-9)
  rollout_s = timer.totals["rollout"] if rollout_s is None else rollout_s
  metrics["perf/rollout_tokens_per_s"] = float(
      ds_stats.rollouts_generated * traj.lengths.mean()) / max(rollout_s, 1e-9)
  return metrics


def _log_step(spec: RunSpec, writer: MultiWriter, progress: RunLogger, step: int,
              metrics: dict[str, float], traj: Trajectories) -> None:
  n = spec.rollout.n
  writer.write_scalars(step, metrics)
  writer.write_texts(step, {f"sample_{i}": f"{traj.prompts[i // n]!r} -> {traj.texts[i]!r} "
                            f"(reward {traj.reward[i]:+.2f})"
                            for i in range(0, min(traj.num_rows, spec.num_sample_texts * n), n)})
  progress.update(step, metrics, traj)
  writer.flush()  # on disk before the step's checkpoint: a kill never loses a saved step's row


def _log_held_out(num_steps: int, workdir, headline: str, rows: list[dict[str, Any]]) -> None:
  evals = [r[headline] for r in rows if r.get(headline) is not None]
  if evals:
    _log.info("Held-out %s: %.3f at the start of RL -> %.3f after %d steps. Curves: %s",
              headline, evals[0], evals[-1], num_steps, workdir / run_files.CURVES_FILE)


class SamplingStoppedError(RuntimeError):
  """Dynamic sampling could not fill a batch (`max_num_gen_batches`, or data ran out).

  The state is checkpointed at the step reached, with the groups gathered so far carried: the
  next launch on the same workdir (e.g. with a higher limit) starts from them.
  """

  one_line = True  # what to change, not a bug: dapo-train prints it in one line


def _sampling_stopped(err: DynamicSamplingError, step: int, spec: RunSpec, run: run_setup.Run,
                      state: TrainState) -> SamplingStoppedError:
  resume = getattr(err, "resume_state", None)  # from a rollout process (`_serve_rollout`)
  if resume is None:
    run.sampler.carry(err.groups)  # nothing gathered is thrown away
  # force: a resumed run re-saves its start step (iterator advanced, groups carried).
  _save(run, step, state, force=True, resume=resume)
  st, gathered = err.stats, f"{len(err.groups)}/{spec.optim.train_batch_size}"
  if isinstance(err, DatasetExhaustedError):
    what = (f"dataset {spec.data.train!r} ran out after data.num_epochs="
            f"{spec.data.num_epochs} epoch(s) with {gathered} groups gathered. Raise "
            "data.num_epochs (0 = endless) or lower num_steps")
  else:
    what = (f"{gathered} groups after {st.num_gen_batches} generation batches "
            f"(algorithm.max_num_gen_batches={spec.algorithm.max_num_gen_batches}; kept ratio "
            f"{st.kept_ratio:.3f}, all-correct {st.all_correct_ratio:.3f}, all-wrong "
            f"{st.all_wrong_ratio:.3f}). Raise algorithm.max_num_gen_batches (0 = unlimited) "
            "or algorithm.gen_batch_size (add --allow_config_change=algorithm.gen_batch_size), "
            "or check the data and the reward")
  return SamplingStoppedError(
      f"Dynamic sampling stopped at step {step}: {what}. The {len(err.groups)} group(s) "
      f"gathered are saved with a checkpoint of step {step} in {run.checkpointer.directory} and "
      "are used first when the run is relaunched on the same --workdir.")


def _rollout_gone(err: rollout_process.PeerError, step: int, run: run_setup.Run,
                  state: TrainState, source) -> rollout_process.SideGoneError:
  """The rollout process has gone or stopped with the trainer at ``step``: what was trained
  this launch is saved at the step reached (as a SIGTERM stop saves it; one process a side:
  on several, the others may not know yet) and one line says what to do."""
  last = getattr(source, "last_resume", None)  # the last trained batch's data state
  if jax.process_count() == 1:  # (on several, a save or a wait is a collective: not here)
    run.checkpointer.wait_until_finished()  # a save under way lands first
    if last is not None and run.checkpointer.latest_step() != step:
      _save(run, step, state, resume=last)
      run.checkpointer.wait_until_finished()
  newest = run.checkpointer.latest_step()
  if newest == step:
    saved = f"Step {step} is saved in {run.checkpointer.directory}"
  elif newest is None:
    saved = "No checkpoint is saved yet"
  else:
    saved = f"The newest checkpoint is step {newest} in {run.checkpointer.directory}"
  text = str(err)
  return rollout_process.SideGoneError(
      f"{text[0].upper()}{text[1:]} with the training process at step {step}. {saved}; "
      f"{rollout_process.RELAUNCH} from it.")


def _side_broke(err: Exception, step: int, run: run_setup.Run, source
                ) -> rollout_process.SideGoneError | None:
  """Where a collective failed because a process of a side has gone (here, or on the rollout
  side: its error came as the batch), one line saying so; the rollout process is told and
  every process of this side exits within the bound (`infra.side_exit`). None: ``err`` is of
  another kind."""
  if not rollout_process.is_side_failure(err):
    return None
  first = " ".join(str(err).splitlines()[0].split()) if str(err) else type(err).__name__
  reason = f"a process of a side has gone ({first[:300]})"
  if isinstance(source, rollout_process.RemoteExperience):
    source.fail(reason)
  newest = run.checkpointer.latest_step()
  saved = ("No checkpoint is saved yet" if newest is None else
           f"The newest checkpoint is step {newest} in {run.checkpointer.directory}")
  return rollout_process.SideGoneError(
      f"{reason[0].upper()}{reason[1:]} with the training process at step {step}. {saved}; "
      f"{rollout_process.RELAUNCH} from it.")


def _last_save_landed(run: run_setup.Run, step: int, state: TrainState,
                      resume: dict[str, Any] | None) -> None:
  """Waits for the run's last checkpoint; one lost to a storage outage is saved again (with
  ``resume``, the last batch's data state, as the lost one; None: none trained this launch)
  until it lands, or until checkpoint.max_consecutive_failed_saves in a row stop the run."""
  while not run.checkpointer.wait_until_finished():
    time.sleep(run_files.RETRY_WAIT_S)
    _save(run, step, state, resume=resume)


def _save(run: run_setup.Run, step: int, state: TrainState, force: bool = False,
          resume: dict[str, Any] | None = None) -> None:
  """Params, optimizer state and the JSON meta a resumed run continues from; ``resume``: the
  data's state after the last trained batch (`_resume_state`; default: as it is now, which an
  overlapped rollout may have moved past it)."""
  meta = {"step": step, "update_step": int(state.step), "num_skipped": int(state.num_skipped),
          **(resume or _resume_state(run))}
  if run.lora_base is not None:  # the base a LoRA run's adapters belong to
    meta["lora_base"] = run.lora_base
  run.checkpointer.save(step, state.params, state.opt_state, meta, force=force)
