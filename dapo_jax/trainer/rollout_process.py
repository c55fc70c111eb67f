"""Rollout and training in processes of their own (``dapo-train --role``, docs/overlap.md).

One process (``--role=train``) holds the training devices and runs `train.train_and_evaluate`;
the other (``--role=rollout``) holds the rollout devices and runs `serve`: the dynamic-sampling
loop, the verifier and evaluation. They are two JAX runtimes, not one ``jax.distributed`` job: no
program, collective or transfer of one needs the other to take part in the same order, so the
rollout's thread and the trainer's loop never wait on each other's collectives.

Two channels join them:

- **weights, device to device** (`jax.experimental.transfer`): after each update the trainer
  casts the weights the schedule needs on its own devices, laid out as the rollout lays them out
  (the rollout mesh's axes over the training devices), and offers them under the policy
  version; the rollout process pulls them onto its devices by that key. A LoRA run offers its
  adapters alone: the rollout process holds the frozen base (loaded from the same source,
  checked by fingerprint at the start) and merges them there (`RolloutWeights.send` and
  ``receive``). A pull names what it
  wants, so the two sides never have to issue transfers in the same order. The two sets must
  have the same device count (equal shard shapes) (`infra.peer_link`);
- **everything else, host to host** (`multiprocessing.connection`, pickled, authenticated):
  the start (first step, the data's resume state), weight offers, evaluation requests and
  results, and each step's `experience.Experience` (the scored batch, its resume state and
  times). A scored batch is host data already: 8 bytes a token (its id and the sampler's
  log-prob), so the paper's 512 x 16 responses at a mean of 5k tokens would be about 330 MB a
  step (not measured at that scale).

The schedule is `experience.scheduled_version`'s: the rollout process runs an
`experience.OverlappedExperience` of its own, fed with pulled weights, so a two-process run
samples what the one-process split samples, step for step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
from typing import Any, Callable

import jax

from dapo_jax.infra.peer_link import Link, PeerAddressError, PeerError, PeerGone, process_peer
from dapo_jax.trainer import experience as exp_lib

_log = logging.getLogger(__name__)

ROLES = ("both", "train", "rollout")
_EVAL_KEY = 1 << 40  # transfer keys of evaluation weights: version + this (sampling: version)


class RoleError(ValueError):
  """``--role`` / ``--peer`` do not fit the run (one line: what to change)."""


class SideGoneError(PeerError):
  """The other side of a split has gone or stopped: this side ends in one line saying which
  side, at which step, what was saved and how to relaunch (a non-zero exit, no traceback)."""


# What a collective says when a process it waits for has gone (gloo's TCP pairs, the
# coordination service): on a side of several processes, one line, not a traceback.
_PEER_FAILURES = ("closed by peer", "reset by peer", "Connection refused", "UNAVAILABLE",
                  "DEADLINE_EXCEEDED", "has been marked as failed", "heartbeat")


def is_side_failure(e: BaseException) -> bool:
  """Whether ``e`` is a collective that failed because a process of this side has gone."""
  import jax.errors  # pylint: disable=g-import-not-at-top
  return (jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError)
          and any(s in str(e) for s in _PEER_FAILURES))


RELAUNCH = ("relaunch both processes (--role=train and --role=rollout) with the same --config "
            "and --workdir to resume")


def check_role(role: str, peer: str, spec) -> None:
  """``dapo-train --role/--peer`` against the run spec."""
  if role not in ROLES:
    raise RoleError(f"--role={role!r}: choose one of {ROLES}")
  if role == "both":
    if peer:
      raise RoleError("--peer is for --role=train or --role=rollout (two processes)")
    return
  try:
    process_peer(peer)
  except PeerAddressError as e:
    raise RoleError(str(e)) from None
  if not spec.algorithm.max_staleness:
    raise RoleError(f"--role={role} with algorithm.max_staleness=0: a rollout process of its "
                    "own runs ahead of the update; set algorithm.max_staleness >= 1 (with "
                    "algorithm.rollout_is), or run one process (no --role) for the serial step")
  if spec.rollout_devices:
    raise RoleError(f"--role={role} with config.rollout_devices={spec.rollout_devices}: the "
                     "rollout has a process of its own; set config.rollout_devices=0")


# What decides the batches: the two processes must agree on it (checked at the handshake).
# The rest (the optimizer, checkpoints, logging, meshes of the update) is the training
# process's alone; save_every and num_steps come with its "start".
BATCH_SETTINGS = ("seed", "data", "model", "tokenizer", "rollout", "reward", "algorithm", "eval",
                  "rollout_mesh", "optim.train_batch_size")


def batch_settings(config) -> dict[str, str]:
  """``config``'s `BATCH_SETTINGS`, one entry per leaf ("rollout.n": "16"), for `Link`'s
  ``agree``."""
  out: dict[str, str] = {}

  def leaves(prefix: str, value: Any) -> None:
    if hasattr(value, "items"):
      for k, v in value.items():
        leaves(f"{prefix}.{k}", v)
    else:
      out[prefix] = repr(value)

  flat = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  for name in BATCH_SETTINGS:
    node: Any = flat
    for part in name.split("."):
      node = node.get(part) if hasattr(node, "get") else None
    leaves(name, node)
  return out


class RemoteExperience:
  """The training process's experience source: batches sampled by the rollout process, weights
  offered to it after each update (`experience.OverlappedExperience`'s interface and schedule,
  ``max_staleness`` >= 1)."""

  def __init__(self, link: Link, to_rollout: Callable[[Any], Any], *, max_staleness: int,
               start_step: int, num_steps: int, save_every: int, params: Any,
               partial: bool, resume: dict[str, Any] | None,
               lora_base: dict[str, Any] | None = None):
    self.link, self._to_rollout, self.max_staleness = link, to_rollout, max_staleness
    self._start, self._end, self._save_every = start_step, num_steps, max(save_every, 1)
    self.last_resume: dict[str, Any] | None = None  # the last batch's (None: none this launch)
    self._gone: PeerError | None = None  # the link ended where the loop could not be told
    link.send(("start", None, {"start_step": start_step, "num_steps": num_steps,
                               "save_every": save_every, "max_staleness": max_staleness,
                               "partial": partial, "resume": resume, "lora_base": lora_base}))
    self.updated(start_step, params)

  def next(self, step: int, params: Any) -> exp_lib.Experience:
    del params
    if self._gone is not None:
      raise self._gone
    t0 = time.perf_counter()
    _, _, out = self.link.wait("experience", step)
    if isinstance(out, BaseException):
      raise out
    _, _, nbytes = self.link.wait("sent", step)  # the batch's size, as the rollout sent it
    out.times["trainer_idle"] = time.perf_counter() - t0
    out.times["batch_bytes"] = float(nbytes)
    self.last_resume = out.resume_state
    return out

  def updated(self, step: int, params: Any) -> None:
    if self._gone is not None:
      return
    try:
      if exp_lib.version_needed(step, self.max_staleness, self._save_every, self._start,
                                self._end):
        self.link.send(("weights", step, _offer(self.link, self._to_rollout, step, params)))
      else:  # the step reached, for the rollout process's last word if this one goes
        self.link.send(("step", step, None))
    except PeerError as e:  # raised by the next `next`, once the step reached is logged
      self._gone = e

  def evaluate(self, params: Any, step: int) -> dict[str, float]:
    """The rollout process's evaluation of ``params`` (version ``step``). On one process it
    runs between the rollout's next two batches. A rollout group of several processes runs it
    after the last batch sampled by version ``step`` or older, a place every process agrees on
    without talking (the next batch needs weights not yet handed over)."""
    after = None
    if jax.process_count() > 1:
      after = exp_lib.last_batch_sampled_by(step, self.max_staleness, self._save_every,
                                            self._start, self._end)
    if self._gone is None or step >= self._end:
      try:
        return evaluate(self.link, self._to_rollout, params, step, after)
      except PeerError as e:
        if step >= self._end:  # the run's last evaluation: the loop has saved the last step
          raise
        self._gone = e  # raised by the next `next`, once this step is logged and saved
    _log.warning("Step %d's evaluation is lost: %s.", step, self._gone)
    return {}

  @contextlib.contextmanager
  def exclusive(self):
    yield  # the rollout process evaluates between its batches (`evaluate`)

  def stop_requested(self) -> bool:
    """Whether the rollout process was sent SIGTERM (`serve`): then this run checkpoints at
    the step reached and stops, as if it had been sent the signal itself."""
    try:
      return self.link.poll_signal() is not None
    except PeerError as e:  # gone: raised by the next `next`, once the step is saved
      self._gone = e
      return False

  def fail(self, reason: str) -> None:
    """Tells the rollout process that this run stops on ``reason`` (it ends in one line, exit
    2, as this process does) and arms this side's bounded exit (`side_exit`)."""
    if self.link.watch is not None:
      self.link.watch.link_gone(reason)
    with contextlib.suppress(PeerError):
      self.link.send(("error", None, reason))

  def close(self) -> None:
    with contextlib.suppress(PeerError):
      self.link.send(("stop", None))


def evaluate(link: Link, to_rollout: Callable[[Any], Any], params: Any, step: int,
             after: int | None = None) -> dict[str, float]:
  """The rollout process's evaluation of ``params`` (the training process's side): before the
  rollout starts, or once it runs, on its thread after its batch ``after`` (None: the next
  batch it finishes; `RemoteExperience.evaluate`)."""
  link.send(("evaluate", step, {"offer": _offer(link, to_rollout, _EVAL_KEY + step, params),
                                "after": after}))
  _, _, metrics = link.wait("evaluated", step)
  if isinstance(metrics, BaseException):
    raise metrics
  return metrics


def _offer(link: Link, to_rollout: Callable[[Any], Any], key: int, params: Any
           ) -> dict[str, Any]:
  """The rollout's copy of ``params`` offered under ``key`` (never arrays the update donates)."""
  return link.offer(key, exp_lib.unshared(to_rollout(params), params))


def serve(link: Link, sample: exp_lib.SampleFn, resume_state: Callable[[], dict[str, Any]],
          restore: Callable[[dict[str, Any]], None], evaluator: Callable[..., dict[str, float]],
          mesh, receive: Callable[[Any], Any] | None = None,
          lora_base: dict[str, Any] | None = None) -> None:
  """The rollout process: answers the training process until it says stop (module docstring).
  ``restore`` sets the data's resume state; ``mesh`` is the rollout mesh (None on one
  device); ``receive`` makes the weights the samplers read from what was pulled (default: as
  pulled); ``lora_base``: this process's frozen base (`checkpoints.lora_base.record`; None: no
  LoRA), which must be the training process's. SIGTERM here is passed on to the training
  process, which stops the run (`_forward_stop_signals`); the training process gone ends it
  with `SideGoneError` (one line)."""
  source: exp_lib.OverlappedExperience | None = None
  stack = contextlib.ExitStack()
  receive = receive or (lambda moved: moved)
  at = None  # the training process's step reached: its newest "weights" or "step" message

  def pulled(offer):  # the source's "to_rollout": the weights arrive by their key
    return link.pull(offer, mesh)[0]

  try:
    stack.enter_context(_forward_stop_signals(link))
    while True:
      msg = link.recv()
      kind = msg[0]
      if kind == "stop":
        return
      if kind == "error":  # the training side failed (a process of it gone): it says why
        raise SideGoneError(f"The training process stopped at step {at}: {msg[2]}. This "
                            f"process saves nothing; {RELAUNCH} from the newest checkpoint.")
      if kind == "evaluate":
        _, step, req = msg
        task = functools.partial(_evaluate, link, evaluator, receive, mesh, step, req["offer"])
        if source is None:
          task()  # before the rollout thread starts: nothing else runs
        else:
          source.run_after(req["after"], task)
      elif kind == "start":
        cfg = msg[2]
        from dapo_jax.checkpoints import lora_base as base_lib  # pylint: disable=g-import-not-at-top
        base_lib.check("the training process", cfg["lora_base"], lora_base,
                       "start both processes with the same --config (model.checkpoint, seed "
                       "and model.lora)")
        at = cfg["start_step"]
        if cfg["resume"]:
          restore(cfg["resume"])
        if cfg["start_step"] >= cfg["num_steps"]:
          continue  # a finished run relaunched: no batch, no weights; evaluations run at once
        first = link.wait("weights", cfg["start_step"])[2]
        source = exp_lib.OverlappedExperience(
            sample, pulled, resume_state, max_staleness=cfg["max_staleness"],
            start_step=cfg["start_step"], num_steps=cfg["num_steps"],
            save_every=cfg["save_every"], params=first, partial=cfg["partial"], owned=False,
            receive=receive)
        threading.Thread(target=_send_batches, name="dapo-rollout-send", daemon=True,
                         args=(link, source, cfg["start_step"], cfg["num_steps"])).start()
      elif kind == "weights":
        at = msg[1]
        source.updated(msg[1], msg[2])
      elif kind == "step":
        at = msg[1]
      else:
        raise PeerError(f"unexpected message {kind!r} from the training process")
  except PeerGone as e:  # nobody left to tell
    raise SideGoneError(
        f"{str(e)[0].upper()}{str(e)[1:]} at step {at}. This process saves nothing: the "
        f"training process writes the checkpoints; {RELAUNCH} from its newest.") from None
  except BaseException as e:
    with contextlib.suppress(PeerError):  # the trainer stops with this process's reason
      link.send(("error", None, f"{type(e).__name__}: {e}"))
    raise
  finally:
    stack.close()
    if source is not None:
      source.close()


@contextlib.contextmanager
def _forward_stop_signals(link: Link):
  """SIGTERM (a preempted host, `scancel`) on the rollout process: it tells the training
  process, which checkpoints at the step reached and says stop, and serves until then (dying
  at once would take the stop checkpoint with it). Main thread only (Python's signals)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def forward(signum, frame):
    del frame
    _log.warning("Received signal %d: the training process checkpoints at the step it reaches "
                 "and stops this process then.", signum)
    link.signal(signum)

  previous = signal.signal(signal.SIGTERM, forward)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def _evaluate(link: Link, evaluator: Callable[..., dict[str, float]],
              receive: Callable[[Any], Any], mesh, step: int, offer: dict[str, Any]) -> None:
  """Pulls the offered weights, evaluates them and answers (an error is raised in the
  trainer)."""
  try:
    metrics = evaluator(receive(link.pull(offer, mesh)[0]), step=step)
  except Exception as e:  # pylint: disable=broad-except  (raised in the trainer)
    metrics = e
  with contextlib.suppress(PeerError):  # the trainer has gone: it stops this process too
    link.send(("evaluated", step, metrics))


def _send_batches(link: Link, source, start: int, end: int) -> None:
  """The rollout process's batches, in step order, as they are ready. One that cannot be sent
  (a batch or an error that does not pickle) stops the training process with the reason."""
  for step in range(start, end):
    try:
      out = source.next(step, None)
    except BaseException as e:  # pylint: disable=broad-except  (raised in the trainer)
      if source.closed:
        return
      out = e
    try:
      link.send(("sent", step, link.send(("experience", step, out))))
    except PeerError:
      return
    except Exception as e:  # pylint: disable=broad-except  (the trainer waits for this step)
      reason = f"step {step}'s batch could not be sent: {type(e).__name__}: {e}"
      _log.error("Rollout process: %s.", reason)
      with contextlib.suppress(PeerError):
        link.send(("error", None, reason))
      return
    if isinstance(out, BaseException):
      return
