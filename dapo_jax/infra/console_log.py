"""What a run prints: a tqdm bar on a terminal, one plain line per step in a cluster log.

A SLURM output file or a ``| tee`` on a TPU worker is not a terminal, and tqdm switches itself
off there, so such a log would show nothing between start-up and the end. `RunLogger` writes
instead, every ``log_every`` steps, one line of the scalars a DAPO run is watched by, and every
``samples_every`` steps a few decoded samples (prompt, response, reward):

    step 2/4 | acc 0.000 reward -1.101 kept 0.00 gen 1 | len 16.1/32 clip 0.0244 entropy 2.461
    | rollout 0.72s old_logprob 0.75s update 5.47s | eval/avg@4 0.000

(one line in the log: acc and reward means, the dynamic-sampling kept ratio and generation
batches, response length mean/max, the clip fraction, entropy, seconds per phase, the eval
headline when the step evaluated). Only process 0 prints. The lines go to the
``dapo_jax.infra.console_log`` logger (``dapo-train`` sends logging to stdout).
"""

from __future__ import annotations

import logging
import math
import sys
from typing import TYPE_CHECKING, Any, Mapping, Sequence


from dapo_jax.infra.metrics import ProgressBar

if TYPE_CHECKING:  # run_spec imports config, which imports this module
  from dapo_jax.spec.run_spec import RunSpec

_log = logging.getLogger(__name__)

CONSOLE_MODES = ("auto", "bar", "lines")

# (label, metric name as the trainer writes it, format); missing metrics are left out.
LINE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("acc", "train/acc_mean", "{:.3f}"),
    ("reward", "train/reward_mean", "{:+.3f}"),
    ("kept", "sampling/kept_ratio", "{:.2f}"),
    ("gen", "sampling/num_gen_batches", "{:.0f}"),
    ("answers", "diag/distinct_answers_generated", "{:.2f}"),  # distinct per group
)
UPDATE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("clip", "actor/pg_clipfrac", "{:.4f}"),
    ("entropy", "actor/entropy", "{:.3f}"),
)
LENGTH_MEAN, LENGTH_MAX = "response/response_length_mean", "response/response_length_max"
TIME_PHASES = ("rollout", "old_logprob", "update")  # `time/<phase>` seconds from the trainer

# A sample: (prompt, response, reward).
Sample = tuple[str, str, float]

# Libraries whose INFO lines are per-call chatter, not run events: fsspec logs every gs:// file
# it reads ("AdaptiveReadaheadCache enabled": 282 lines in a 40-step gs:// run of issue 27),
# gcsfs and aiohttp their retries, matplotlib its font cache. Their warnings and errors show.
QUIET_LOGGERS = ("absl", "jax._src", "orbax", "tensorflow", "fsspec", "gcsfs", "aiohttp",
                 "google", "urllib3", "matplotlib", "tensorboardX")
LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"

# Third-party warnings about nothing a user can act on: (logger, message start). Orbax warns that
# a checkpoint opened read-only (dapo-eval, dapo-export, dapo-serve) is read-only, and, with a
# checkpoint every step, how long each save waited for the previous one (issue 41: 12 of 32 lines).
NOISE = (("absl", "Given directory is read only"),
         ("absl", "Waiting for previous save to complete took"))


class _DropNoise(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    return not any(record.name == name and str(record.msg).startswith(start)
                   for name, start in NOISE)


_DROP_NOISE = _DropNoise()


def configure_logging(stderr: bool = False, verbose: bool = False) -> None:
  """The commands' logging: INFO lines of ours to stdout (``dapo-train``: where a cluster log
  looks) or stderr (commands whose stdout is their result), third-party chatter
  (`QUIET_LOGGERS`) from WARNING up only, minus `NOISE`; ``verbose`` (``--verbose``) shows both.
  Every command drops the tracebacks of storage errors its own code retries and reports in one
  line (`run_files.quiet_storage_tracebacks`)."""
  from dapo_jax.infra import run_files  # pylint: disable=g-import-not-at-top
  # stdout replaces any handler already there (absl's); stderr keeps one (a test's capture).
  logging.basicConfig(level=logging.INFO, format=LOG_FORMAT,
                      stream=sys.stderr if stderr else sys.stdout, force=not stderr)
  for name in QUIET_LOGGERS:
    logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
  for name in {name for name, _ in NOISE}:
    if verbose:
      logging.getLogger(name).removeFilter(_DROP_NOISE)
    elif _DROP_NOISE not in logging.getLogger(name).filters:
      logging.getLogger(name).addFilter(_DROP_NOISE)
  run_files.quiet_storage_tracebacks()


def _number(scalars: Mapping[str, Any], name: str) -> float | None:
  if name not in scalars:
    return None
  try:
    return float(scalars[name])
  except (TypeError, ValueError):
    return None


def _fmt(fmt: str, value: float) -> str:
  return fmt.format(value) if math.isfinite(value) else str(value)


def format_line(step: int, total: int, scalars: Mapping[str, Any],
                headline: str | None = None) -> str:
  """The one-line summary of a step; groups whose metrics are all missing are left out."""
  parts = [f"step {step}/{total}"]

  def group(fields):
    out = []
    for label, name, fmt in fields:
      v = _number(scalars, name)
      if v is not None:
        out.append(f"{label} {_fmt(fmt, v)}")
    return out

  sampling = group(LINE_FIELDS)
  if sampling:
    parts.append(" ".join(sampling))
  update = []
  mean, longest = _number(scalars, LENGTH_MEAN), _number(scalars, LENGTH_MAX)
  if mean is not None:
    update.append(f"len {_fmt('{:.1f}', mean)}"
                  + (f"/{_fmt('{:.0f}', longest)}" if longest is not None else ""))
  update += group(UPDATE_FIELDS)
  if update:
    parts.append(" ".join(update))
  times = [f"{p} {_fmt('{:.2f}', t)}s" for p in TIME_PHASES
           if (t := _number(scalars, f"time/{p}")) is not None]
  if times:
    parts.append(" ".join(times))
  if headline is not None and (h := _number(scalars, headline)) is not None:
    parts.append(f"{headline} {_fmt('{:.3f}', h)}")
  return " | ".join(parts)


def clip_text(text: str, width: int) -> str:
  """One line of at most ``width`` characters: newlines shown as ``\\n``; a long text keeps its
  head and its tail (a math response ends with its answer), with the cut count in between."""
  flat = str(text).replace("\r", "").replace("\n", "\\n")
  if len(flat) <= width:
    return flat
  keep = max(width - len(f" ...[{len(flat)} chars]... "), 2)  # the widest count
  head = keep // 2
  marker = f" ...[{len(flat) - keep} chars]... "
  return flat[:head] + marker + flat[len(flat) - (keep - head):]


def format_samples(step: int, samples: Sequence[Sample], width: int = 160) -> list[str]:
  """Log lines for a few decoded samples: the prompt's tail (where the question is), the
  response's head and tail, the shaped reward."""
  lines = []
  for i, (prompt, response, reward) in enumerate(samples):
    flat = str(prompt).replace("\r", "").replace("\n", "\\n")
    shown = flat if len(flat) <= width else "..." + flat[len(flat) - width + 3:]
    lines.append(f"sample {i + 1}/{len(samples)} at step {step} (reward {float(reward):+.2f})")
    lines.append(f"  prompt:   {shown}")
    lines.append(f"  response: {clip_text(response, width) if response else '(empty)'}")
  return lines


def group_samples(prompts: Sequence[str], texts: Sequence[str], rewards: Sequence[float],
                  group_size: int, num: int) -> list[Sample]:
  """The first response of each of the first ``num`` groups (rows are prompt-major)."""
  rows = range(0, min(len(texts), num * group_size), group_size)
  return [(prompts[i // group_size], texts[i], float(rewards[i])) for i in rows]


def stdout_is_terminal() -> bool:
  """A terminal or a notebook (tqdm draws a widget there); not a file or a pipe."""
  if "ipykernel" in sys.modules:
    return True
  streams = (sys.stdout, sys.stderr)
  return all(getattr(s, "isatty", lambda: False)() for s in streams)


class RunLogger:
  """The trainer's console: a tqdm bar, plain log lines, or both (``mode``).

  Args:
    total: the run's rollout steps.
    initial: the step the run starts from (a resumed run).
    mode: ``"bar"``, ``"lines"``, or ``"auto"``: lines when stdout or stderr is not a
      terminal (a cluster log), and the bar wherever tqdm finds a terminal on stderr.
    log_every: a line every this many steps (and always at the last step and eval steps).
    samples_every: decoded samples every this many steps; 0 never.
    headline: the eval metric shown when present (``eval/avg@32``).
    fields: the bar's postfix, `metrics.ProgressBar` fields.
    active: default ``jax.process_index() == 0``; other processes print nothing.
    group_size, num_samples: trajectories passed to `update` come in groups of ``group_size``
      rows; the first row of ``num_samples`` groups is printed.
  """

  def __init__(self, total: int, *, initial: int = 0, mode: str = "auto", log_every: int = 1,
               samples_every: int = 0, headline: str | None = None,
               fields: Mapping[str, str] | None = None, active: bool | None = None,
               group_size: int = 1, num_samples: int = 2, sample_width: int = 160):
    if mode not in CONSOLE_MODES:
      raise ValueError(f"config.logging.console={mode!r}: choose one of {CONSOLE_MODES}.")
    if log_every < 1 or samples_every < 0:
      raise ValueError(f"log_every={log_every} must be >= 1 and samples_every={samples_every} "
                       ">= 0 (0 = never).")
    if active is None:
      import jax  # pylint: disable=g-import-not-at-top
      active = jax.process_index() == 0
    self.total, self.log_every, self.samples_every = int(total), log_every, samples_every
    self.headline, self.active, self.sample_width = headline, active, sample_width
    self.group_size, self.num_samples = group_size, num_samples
    self.lines = active and (mode == "lines" or (mode == "auto" and not stdout_is_terminal()))
    self.bar = None
    if active and mode != "lines":
      # "auto": tqdm decides (off when stderr is not a terminal), as before this logger.
      self.bar = ProgressBar(total, initial=initial, fields=fields,
                             disable=None if mode == "auto" else False)

  @classmethod
  def for_run(cls, spec: RunSpec, *, initial: int = 0, headline: str | None = None,
              active: bool | None = None) -> RunLogger:
    """The trainer's logger: ``log_every``, ``logging.console``/``samples_every``,
    ``num_sample_texts`` samples per printout, the bar showing reward, acc, kept, eval."""
    fields = {"reward": "train/reward_mean", "acc": "train/acc_mean",
              "kept": "sampling/kept_ratio"}
    if headline:
      fields["eval"] = headline
    return cls(spec.num_steps, initial=initial, mode=spec.logging.console,
               log_every=spec.log_every, samples_every=spec.logging.samples_every,
               headline=headline, fields=fields, active=active, group_size=spec.rollout.n,
               num_samples=spec.num_sample_texts)

  def due(self, step: int, scalars: Mapping[str, Any] | None = None) -> bool:
    """Whether ``step`` gets a line: the cadence, the last step, or an eval result."""
    return (step % self.log_every == 0 or step == self.total
            or bool(self.headline and scalars and self.headline in scalars))

  def update(self, step: int, scalars: Mapping[str, Any], rollouts: Any = None) -> None:
    """After step ``step`` (completed steps): the bar, the line, the samples when due.

    ``rollouts``: a list of `Sample`, or the step's trajectories (anything with ``prompts``,
    ``texts``, ``reward``, rows prompt-major in groups of ``group_size``), of which the first
    response of ``num_samples`` groups is shown.
    """
    if not self.active:
      return
    if self.bar is not None:
      self.bar.update(step, scalars)
    if not self.lines:
      return
    if self.due(step, scalars):
      _log.info(format_line(step, self.total, scalars, self.headline))
    if rollouts is not None and self.samples_every and step % self.samples_every == 0:
      samples = rollouts
      if hasattr(rollouts, "texts"):
        samples = group_samples(rollouts.prompts, rollouts.texts, rollouts.reward,
                                self.group_size, self.num_samples)
      for line in format_samples(step, samples, self.sample_width):
        _log.info(line)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
