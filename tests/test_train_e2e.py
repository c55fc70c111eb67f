"""End to end: a 2-step ``dapo-train`` smoke run of configs/tiny_cpu.py and exact resume."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dapo_jax.trainer import run_setup
from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.rollout.static_stream import StaticStream
from dapo_jax.trainer.train import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")


def _small_config(**over):
  spec = importlib.util.spec_from_file_location("tiny_cpu", TINY)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.model.overrides = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=64)
  c.sft.steps = 0
  # 24, as the golden files were recorded (tests/golden): one token under a 3-operand prompt,
  # so the runs also take the truncation path (data/prompts_truncated).
  c.data.max_prompt_length = 24
  c.rollout.n = 4
  c.rollout.max_response_length = 12
  c.reward.overlong_buffer_len = 4
  c.algorithm.dynamic_sampling = False  # an untrained policy is all wrong: nothing to keep
  c.algorithm.gen_batch_size = 4
  c.optim.update(train_batch_size=4, mini_batch_size=2, micro_batch_size=4)
  c.eval.update(every=0, batch_size=8)
  c.data.arithmetic.update(num_train=64, num_eval=8)
  c.checkpoint.update(save_every=1, async_save=False)
  for k, v in over.items():  # "section.field" (any depth) -> value
    *parents, leaf = k.split(".")
    node = c
    for name in parents:
      node = node[name]
    node[leaf] = v
  return c


def _params(workdir, step):
  path = os.path.join(workdir, "checkpoints", str(step), "params")
  return jax.tree.leaves(jax.device_get(ocp.StandardCheckpointer().restore(path)))


class _FirstOfEachGroupCorrect(RewardScorer):
  """Response 0 of every group of 4 is correct: every group is mixed, so dynamic sampling keeps
  it (the untrained policy's own answers are all wrong)."""

  def __call__(self, responses, ground_truths, response_lengths, timeout_s=None):
    out = super().__call__(responses, ground_truths, response_lengths, timeout_s)
    acc, score = np.zeros_like(out.acc), np.full_like(out.score, -1.0)
    acc[::4], score[::4] = True, 1.0
    return dataclasses.replace(out, acc=acc, score=score, reward=score + out.overlong_penalty)


class _Killed(Exception):
  pass


def _metric_rows(workdir):
  rows = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    assert row["step"] not in rows, "a step logged twice after the resume"
    # NaN (an empty diag/accepted bucket) compares equal to NaN here.
    rows[row["step"]] = {k: "nan" if v != v else v for k, v in row.items()
                         if not k.startswith(("time/", "perf/"))}
  return rows


def test_resume_is_exact(tmp_path, monkeypatch):
  """A run that dies in the middle of step 2's streaming rollout (one of its two rollout calls
  done, step 1's surplus carried in) resumes from the step-1 checkpoint, redraws step 2 with the
  same keys and ends bit-identical to an uninterrupted run."""
  monkeypatch.setattr(run_setup, "RewardScorer", _FirstOfEachGroupCorrect)
  # 4 prompts per generation batch in 2 calls of 2: step 1 takes 2 batches (4 calls) and carries
  # 2 surplus groups, step 2 takes 1 batch (calls 5 and 6).
  cfg = lambda: _small_config(**{
      "algorithm.dynamic_sampling": True, "algorithm.keep_surplus": True,
      "rollout.engine": "static", "algorithm.gen_batch_size": 4, "rollout.prompts_per_call": 2,
      "optim.train_batch_size": 6, "num_steps": 3})
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  m_full = train_and_evaluate(cfg(), full)
  real_poll, polls = StaticStream.poll, []

  def dying_poll(self):
    polls.append(1)
    if len(polls) == 6:
      raise _Killed()
    return real_poll(self)
  monkeypatch.setattr(StaticStream, "poll", dying_poll)
  with pytest.raises(_Killed):
    train_and_evaluate(cfg(), part)
  meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
      os.path.join(part, "checkpoints", "1", "meta"))
  assert len(meta["sampler"]["carried"]) == 2  # step 1's surplus rides in the checkpoint
  monkeypatch.setattr(StaticStream, "poll", real_poll)
  m_resumed = train_and_evaluate(cfg(), part)
  a, b = _params(full, 3), _params(part, 3)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for k in ("actor/pg_loss", "train/reward_mean", "actor/grad_norm"):
    assert m_full[k] == m_resumed[k], k
  rows = _metric_rows(part)
  assert rows == _metric_rows(full) and sorted(rows) == [1, 2, 3]
  assert rows[1]["sampling/surplus_groups"] == 2 and rows[2]["sampling/carried_in_groups"] == 2
  shares = [v for k, v in rows[3].items() if k.startswith("diag/grad_weight/")]
  assert len(shares) == 8 and sum(shares) == pytest.approx(1.0 if any(shares) else 0.0)
  for key in ("diag/distinct_answers_generated", "diag/pass_rate_generated/p0"):
    assert key in rows[3], key
  # Only buckets that generated groups have an acceptance share (no NaN in metrics.jsonl).
  accepted = {k: v for k, v in rows[3].items() if k.startswith("diag/accepted/")}
  assert accepted and all(0 <= v <= 1 for v in accepted.values()), accepted
  last = json.loads(open(os.path.join(part, "metrics.jsonl")).readlines()[-1])
  assert sum(last[f"time/decode_by_length/q{i}"] for i in range(1, 5)) > 0


def _with_steps(c, n):
  c.num_steps = n
  return c


@pytest.mark.slow
def test_dapo_train_cli_two_steps(tmp_path):
  workdir = str(tmp_path / "cli")
  cmd = [sys.executable, "-m", "dapo_jax.main", f"--config={TINY}", f"--workdir={workdir}",
         "--config.num_steps=2", "--config.sft.steps=2", "--config.sft.batch_size=16",
         "--config.algorithm.dynamic_sampling=False", "--config.algorithm.gen_batch_size=16",
         "--config.eval.every=2", "--config.eval.batch_size=32",
         "--config.data.arithmetic.num_eval=32", "--config.checkpoint.async_save=False"]
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [0, 1, 2]
  last = rows[-1]
  for key in ("train/reward_mean", "train/acc_mean", "actor/pg_clipfrac", "actor/grad_norm",
              "sampling/num_gen_batches", "response/response_length_mean", "time/rollout",
              "eval/avg@4"):
    assert key in last, key
  assert os.path.getsize(os.path.join(workdir, "curves.png")) > 1000
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))


def test_carried_surplus_groups_round_trip_through_json():
  from dapo_jax.data import arithmetic  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.dynamic_sampling import DynamicSampler  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.trajectories import ScoredGroup, Trajectories  # pylint: disable=g-import-not-at-top
  rec = arithmetic.make_records(1)[0]
  arrays = dict(prompt_ids=np.arange(6, dtype=np.int32).reshape(2, 3),
                prompt_mask=np.ones((2, 3), bool), response_ids=np.ones((2, 4), np.int32),
                response_mask=np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool),
                logprobs=np.full((2, 4), -0.5, np.float32), lengths=np.array([2, 4], np.int32),
                truncated=np.array([False, True]), score=np.array([1, -1], np.float32),
                penalty=np.zeros(2, np.float32))
  group = ScoredGroup(prompt=rec, acc=np.array([True, False]), reward=np.array([1.0, -1.0]),
                      texts=["a", "b"], num_errors=2, **arrays)
  sampler = DynamicSampler(train_batch_size=1, keep_surplus=True, group_type=ScoredGroup)
  sampler.carry([group])
  js = json.loads(json.dumps(sampler.state_dict()))
  # The checkpoints' meta layout (older runs resume from it): arrays under "payload".
  assert sorted(js["carried"][0]) == ["acc", "payload", "prompt", "reward"]
  assert js["carried"][0]["payload"]["num_errors"] == 2
  sampler.load_state_dict(js)
  back = sampler.carried_groups[0]
  assert isinstance(back, ScoredGroup) and back.prompt == rec and back.texts == ["a", "b"]
  for k, v in arrays.items():
    assert getattr(back, k).dtype == v.dtype and (getattr(back, k) == v).all(), k
  traj = Trajectories.from_groups([back])
  assert traj.num_rows == 2 and traj.verifier_errors == 2


def test_rollout_reads_one_model_dtype_copy_per_step(tmp_path, monkeypatch):
  """A bf16 model trains fp32 master weights; every rollout call of a step (two per generation
  batch here) reads the same bf16 copy in the rollout layout, made once per step."""
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import weights  # pylint: disable=g-import-not-at-top
  seen, copies = [], []
  real_make, real_call = run_setup.make_rollout, weights.RolloutWeights.__call__

  def make_rollout(*args, **kwargs):
    rollout = real_make(*args, **kwargs)
    def spy(params, *rest):
      seen.append(params)
      return rollout(params, *rest)
    return spy

  def to_rollout(self, params):
    copies.append(real_call(self, params))
    return copies[-1]

  monkeypatch.setattr(run_setup, "make_rollout", make_rollout)
  monkeypatch.setattr(weights.RolloutWeights, "__call__", to_rollout)
  c = _small_config(**{"model.param_dtype": "bfloat16", "model.dtype": "bfloat16",
                       "rollout.engine": "static",  # the continuous engine: one stream a step
                       "rollout.prompts_per_call": 2})  # 4 prompts per generation batch
  c.num_steps = 2
  train_and_evaluate(c, str(tmp_path / "run"))
  assert len(copies) == 2 and len(seen) == 4  # one copy per step, two rollout calls per step
  assert [id(p) for p in seen] == [id(copies[0])] * 2 + [id(copies[1])] * 2
  assert {x.dtype for p in seen for x in jax.tree.leaves(p)} == {np.dtype("bfloat16")}


def test_verl_warmup_and_micro_batch_loss_run_through_the_trainer(tmp_path, monkeypatch):
  """Issue 17 D3: set in the run config, verl's warmup (rate 0 at step 0) and micro-batch loss
  reach the trainer's compiled update."""
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  seen = []
  real = run_setup.TrainStep.__init__

  def spy(self, graphdef, cfg, *args, **kwargs):
    seen.append(cfg)
    real(self, graphdef, cfg, *args, **kwargs)

  monkeypatch.setattr(run_setup.TrainStep, "__init__", spy)
  c = _small_config(**{"optim.warmup_style": "verl", "optim.micro_batch_loss": "verl",
                       "optim.micro_batch_size": 2, "optim.warmup_steps": 5})
  m = train_and_evaluate(_with_steps(c, 1), str(tmp_path / "run"))
  assert [(s.warmup_style, s.micro_batch_loss, s.num_micro_batches) for s in seen] == [
      ("verl", "verl", 4)]
  assert m["actor/lr"] == 0.0 and m["actor/loss"] != 0.0  # "paper" trains step 0 at lr / 5
  # use_kl_loss is off: no reference policy is built (issue 17 D2).
  assert "actor/kl" not in m and not os.path.exists(tmp_path / "run" / "reference")


def test_kl_loss_runs_end_to_end_and_resumes_with_its_reference(tmp_path, monkeypatch):
  """Issue 17 D2: use_kl_loss builds the reference once (the RL start's weights), trains with
  the KL term, and a resumed run reads the same reference back."""
  from dapo_jax.trainer import reference  # pylint: disable=g-import-not-at-top
  refs = []
  real = reference.reference_policy

  def spy(*args):
    refs.append(real(*args))
    return refs[-1]

  monkeypatch.setattr(reference, "reference_policy", spy)
  workdir = str(tmp_path / "run")
  c = _small_config(**{"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.5})
  m1 = train_and_evaluate(_with_steps(c, 1), workdir)
  assert os.path.isdir(os.path.join(workdir, reference.REFERENCE_DIR))
  # The first update starts at the reference (KL 0), the second has moved: the mean is > 0.
  assert 0.0 < m1["actor/kl"] < 1.0 and np.isfinite(m1["actor/loss"])
  m2 = train_and_evaluate(_with_steps(c, 2), workdir)
  assert np.isfinite(m2["actor/kl"]) and m2["actor/kl"] > 0.0
  assert len(refs) == 2
  for a, b in zip(jax.tree.leaves(refs[0]), jax.tree.leaves(refs[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The reference is the step-0 weights, not the trained ones.
  trained = _params(workdir, 1)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(refs[0]), trained))


def test_a_packed_run_trains_as_the_padded_one(tmp_path, monkeypatch):
  """Issue 49: the same two steps, with the KL reference on, packed (several sequences a row,
  token-budget micro-batches) and padded: the same logged values to float tolerance, and the
  packed run says how it packed."""
  monkeypatch.setattr(run_setup, "RewardScorer", _FirstOfEachGroupCorrect)
  runs = {}
  for packing in (False, True):
    c = _small_config(**{"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.5,
                         "algorithm.dynamic_sampling": True, "optim.packing": packing,
                         "optim.max_tokens_per_row": 72, "checkpoint.save_every": 10,
                         # 16 rows a mini-batch over the 8 simulated devices' shards: two a
                         # shard, one row of 72 holds both.
                         "optim.mini_batch_size": 4})
    workdir = str(tmp_path / f"packing_{packing}")
    train_and_evaluate(_with_steps(c, 2), workdir)
    runs[packing] = _metric_rows(workdir)
  padded, packed = runs[False], runs[True]
  assert sorted(padded) == sorted(packed) == [1, 2]
  for step in padded:
    assert packed[step]["packing/seqs_per_row"] == 2.0  # a row of 72 holds two sequences
    assert packed[step]["packing/train_programs"] <= 2
    for k in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/kl", "actor/entropy",
              "actor/pg_clipfrac", "rollout/logprob_diff_max", "train/reward_mean"):
      np.testing.assert_allclose(packed[step][k], padded[step][k], rtol=1e-4, atol=1e-5,
                                 err_msg=f"{k} at step {step}")
