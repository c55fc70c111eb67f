"""Cluster logs: the per-step line, its cadence, samples every N steps, process 0 only."""

import io
import logging
import re
import sys
import types

import jax
import pytest

from dapo_jax import config as config_lib
from dapo_jax.infra import console_log as C
from dapo_jax.spec.run_spec import RunSpec

STEP = {
    "train/acc_mean": 0.25, "train/reward_mean": -0.5, "sampling/kept_ratio": 0.75,
    "sampling/num_gen_batches": 2.0, "response/response_length_mean": 17.24,
    "response/response_length_max": 32.0, "actor/pg_clipfrac": 0.01234, "actor/entropy": 4.1089,
    "time/rollout": 0.6234, "time/old_logprob": 0.871, "time/update": 4.2849, "time/step": 5.78,
    "actor/grad_norm": 1.5,
}


def _lines(caplog):
  return [r.getMessage() for r in caplog.records if r.name == C.__name__]


def test_line_format():
  assert C.format_line(2, 10, {**STEP, "eval/avg@4": 0.125}, "eval/avg@4") == (
      "step 2/10 | acc 0.250 reward -0.500 kept 0.75 gen 2 | len 17.2/32 clip 0.0123 "
      "entropy 4.109 | rollout 0.62s old_logprob 0.87s update 4.28s | eval/avg@4 0.125")
  # No eval this step, no entropy (sampler log-probs), a NaN: the rest still prints.
  partial = {k: v for k, v in STEP.items() if k != "actor/entropy"}
  partial["train/acc_mean"] = float("nan")
  assert C.format_line(3, 10, partial, "eval/avg@4") == (
      "step 3/10 | acc nan reward -0.500 kept 0.75 gen 2 | len 17.2/32 clip 0.0123 "
      "| rollout 0.62s old_logprob 0.87s update 4.28s")
  assert C.format_line(1, 5, {}) == "step 1/5"


def test_clip_text_keeps_head_and_tail_on_one_line():
  text = "Let me think.\n" + "x" * 500 + "\nAnswer: 42"
  out = C.clip_text(text, 80)
  assert len(out) <= 80 and "\n" not in out
  assert out.startswith("Let me think.\\n") and out.endswith("Answer: 42")
  marker = re.search(r" \.\.\.\[(\d+) chars\]\.\.\. ", out)
  shown = len(out) - len(marker.group(0))
  assert shown + int(marker.group(1)) == len(text) + 2  # two newlines became two characters
  assert C.clip_text("short\ntext", 80) == "short\\ntext"


def test_log_every_cadence_last_step_and_eval_steps(caplog):
  caplog.set_level(logging.INFO)
  log = C.RunLogger(7, mode="lines", log_every=3, headline="eval/avg@4", active=True)
  for step in range(1, 8):
    log.update(step, {**STEP, **({"eval/avg@4": 0.5} if step == 4 else {})})
  log.close()
  steps = [int(m.split()[1].split("/")[0]) for m in _lines(caplog)]
  assert steps == [3, 4, 6, 7]  # every 3rd, the eval step, the last step
  assert log.bar is None


def test_samples_every_n_steps_first_of_each_group(caplog):
  caplog.set_level(logging.INFO)
  g = 3  # rows are prompt-major: rows 0-2 answer prompt 0, rows 3-5 prompt 1
  traj = types.SimpleNamespace(
      prompts=["What is 2+3?", "Compute 7*6."],
      texts=["5", "six", "4", "42 since 7*6=42", "41", "40"],
      reward=[1.0, -1.0, -1.0, 1.0, -1.0, -1.0])
  log = C.RunLogger(4, mode="lines", log_every=100, samples_every=2, active=True,
                    group_size=g, num_samples=2)
  for step in range(1, 5):
    log.update(step, STEP, traj)
  msgs = _lines(caplog)
  heads = [m for m in msgs if m.startswith("sample ")]
  assert heads == ["sample 1/2 at step 2 (reward +1.00)", "sample 2/2 at step 2 (reward +1.00)",
                   "sample 1/2 at step 4 (reward +1.00)", "sample 2/2 at step 4 (reward +1.00)"]
  assert "  prompt:   Compute 7*6." in msgs and "  response: 42 since 7*6=42" in msgs
  assert "  response: six" not in msgs  # only the first response of a group
  assert sum(m.startswith("step ") for m in msgs) == 1  # log_every=100: only the last step


def test_long_prompt_shows_its_tail(caplog):
  caplog.set_level(logging.INFO)
  log = C.RunLogger(1, mode="lines", samples_every=1, active=True, sample_width=40)
  log.update(1, STEP, [("Solve step by step. " * 10 + "What is 2+2?", "4", 1.0)])
  prompt = next(m for m in _lines(caplog) if "prompt:" in m)
  assert prompt.endswith("What is 2+2?") and len(prompt.split("prompt:   ")[1]) == 40


def test_only_process_zero_logs(caplog, monkeypatch):
  caplog.set_level(logging.INFO)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  log = C.RunLogger(3, mode="lines", samples_every=1)  # active from jax.process_index()
  log.update(1, STEP, [("p", "r", 0.0)])
  assert not log.active and not _lines(caplog) and log.bar is None
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  log = C.RunLogger(3, mode="lines", samples_every=1)
  log.update(1, STEP, [("p", "r", 0.0)])
  assert _lines(caplog)[0].startswith("step 1/3 |") and len(_lines(caplog)) == 4


class _Tty(io.StringIO):

  def isatty(self):
    return True


def test_auto_mode_lines_only_without_a_terminal(monkeypatch):
  monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
  for stream in (io.StringIO, _Tty):  # a SLURM file or a pipe into tee; then a terminal
    monkeypatch.setattr("sys.stdout", stream())
    monkeypatch.setattr("sys.stderr", stream())
    log = C.RunLogger(3, active=True)
    log.update(1, STEP)
    log.close()
    assert log.lines == (stream is io.StringIO)
    drawn = sys.stderr.getvalue()  # tqdm draws on stderr
    assert ("acc=0.25" in drawn) == (stream is _Tty), drawn


def test_for_run_reads_the_logging_keys(caplog):
  caplog.set_level(logging.INFO)
  c = config_lib.default_config()
  c.num_steps, c.log_every, c.rollout.n, c.num_sample_texts = 4, 2, 2, 1
  c.logging.update(console="lines", samples_every=4)
  log = C.RunLogger.for_run(RunSpec.from_config(c), headline="eval/avg@1", active=True)
  traj = types.SimpleNamespace(prompts=["a", "b"], texts=["x", "y", "z", "w"],
                               reward=[0.0, 1.0, 1.0, 0.0])
  for step in range(1, 5):
    log.update(step, STEP, traj)
  msgs = _lines(caplog)
  assert [m.split(" |")[0] for m in msgs if m.startswith("step")] == ["step 2/4", "step 4/4"]
  assert [m for m in msgs if m.startswith("sample")] == ["sample 1/1 at step 4 (reward +0.00)"]


@pytest.mark.parametrize("field,value,match", [
    ("log_every", 0, "config.log_every=0"),
    ("logging.console", "tqdm", "config.logging.console='tqdm': choose one of"),
    ("logging.samples_every", -1, "config.logging.samples_every=-1"),
    ("logging.wandb.mode", "cloud", "config.logging.wandb.mode='cloud'"),
    ("num_sample_texts", -2, "config.num_sample_texts=-2"),
])
def test_config_rejects_bad_logging_values(field, value, match):
  c = config_lib.default_config()
  *parents, leaf = field.split(".")
  node = c
  for name in parents:
    node = node[name]
  node[leaf] = value
  with pytest.raises(ValueError, match=match.replace(".", r"\.").replace("(", r"\(")):
    config_lib.validate(c)


def test_orbax_noise_stays_off_the_terminal_unless_verbose(caplog):
  """Orbax's per-save "Waiting for previous save" (12 of 32 lines of a run saving every step)
  and its read-only note (issue 41) are dropped; --verbose (``verbose=True``) shows them."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top

  def lines():
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      for _ in range(3):  # one per step with checkpoint.save_every=1
        absl_logging.warning("Waiting for previous save to complete took %f seconds. If this "
                             "number is high, consider checkpointing less frequently.", 1.5)
      absl_logging.warning("Given directory is read only=%s", "gs://b/run/checkpoints")
      absl_logging.warning("a warning to keep")
    return [r.getMessage() for r in caplog.records]

  try:
    C.configure_logging(stderr=True)
    assert lines() == ["a warning to keep"]
    C.configure_logging(stderr=True, verbose=True)
    assert len(lines()) == 5
  finally:
    C.configure_logging(stderr=True)
