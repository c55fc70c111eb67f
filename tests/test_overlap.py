"""Overlapped rollout (algorithm.max_staleness, trainer/experience.py): the schedule, the
decoupled objective's old log-probs, the config's refusals, and a tiny run on split devices
that reproduces itself across a kill and resume."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.config import ConfigError, validate
from dapo_jax.trainer import experience
from dapo_jax.trainer import train
from dapo_jax.trainer import trajectories as traj_lib
from dapo_jax.trainer.train import train_and_evaluate
from tests import processes
from tests.test_train_e2e import _params, _small_config

_TIMING = ("time/", "perf/")


def _source(k, *, start=0, end=8, save_every=100, fail_at=None, partial=False, endless_at=None,
            agree=None, poll_after=0.0, wait_newer=False):
  """An overlapped source over a fake rollout: weights are their version number, a batch
  records the weights it was sampled with (and, partial, any newer ones it moved on to). The
  batch of ``endless_at`` polls forever (10 ms a chunk), as a rollout far longer than a
  preemption's notice. ``poll_after``: seconds a batch decodes before it asks for newer
  weights. ``wait_newer``: a batch between the first and the last polls until newer weights come
  (up to 10 s), so each moves on whatever the timing (the last has none to move to: no batch
  to come needs a newer version, so none is handed over)."""
  calls = []

  def sample(weights, step, version, newest, check):
    if step == endless_at:
      calls.append((step, "started"))
      while True:
        check()
        threading.Event().wait(0.01)
    if step == fail_at:
      raise RuntimeError(f"rollout failed at {step}")
    calls.append((step, version, int(weights)))
    if newest is not None:
      threading.Event().wait(poll_after)
      newer = newest()
      deadline = time.monotonic() + 10.0
      while wait_newer and start < step < end - 1 and newer is None and time.monotonic() < deadline:
        threading.Event().wait(0.01)
        newer = newest()
      calls[-1] += (None if newer is None else (int(newer[0]), newer[1]),)
    return int(weights)

  src = experience.OverlappedExperience(
      sample, lambda params: jnp.asarray(params), lambda: {"at": len(calls)},
      max_staleness=k, start_step=start, num_steps=end, save_every=save_every,
      params=jnp.asarray(start), partial=partial, agree=agree)
  return src, calls


@pytest.mark.parametrize("k,save_every,versions", [
    (1, 100, [0, 0, 1, 2, 3, 4]),
    (2, 100, [0, 0, 0, 1, 2, 3]),
    (1, 3, [0, 0, 1, 3, 3, 4]),  # step 3 follows a checkpoint: sampled by its own weights
])
def test_schedule_samples_each_step_with_the_version_it_names(k, save_every, versions):
  src, calls = _source(k, end=len(versions), save_every=save_every)
  try:
    for step in range(len(versions)):
      exp = src.next(step, None)
      assert (exp.step, exp.version, exp.batch) == (step, versions[step], versions[step])
      assert step - exp.version <= k
      src.updated(step + 1, jnp.asarray(step + 1))  # version step + 1 = "weights" step + 1
  finally:
    src.close()
  assert [c[1] for c in calls] == versions
  assert all(v == w for _, v, w in calls)  # each batch saw exactly its version's weights


def test_rollout_runs_ahead_while_the_update_runs():
  """With k = 1 the batch of step 1 is drawn before step 0's update hands its weights over."""
  src, calls = _source(1, end=3)
  try:
    src.next(0, None)
    deadline = threading.Event()
    for _ in range(200):  # the thread draws step 1 with version 0, unprompted
      if len(calls) >= 2:
        break
      deadline.wait(0.05)
    assert calls[:2] == [(0, 0, 0), (1, 0, 0)]
    assert len(calls) == 2  # step 2 waits for version 1
  finally:
    src.close()


def test_partial_rollouts_move_on_to_the_newest_handed_over_version():
  """k = 2, partial: a batch starts with its scheduled version; asked for newer weights, the
  source offers the newest version handed over since, never an older one (which versions are
  out by then depends on timing)."""
  src, calls = _source(2, end=4, partial=True, wait_newer=True)
  try:
    for step in range(4):
      src.next(step, None)
      src.updated(step + 1, jnp.asarray(step + 1))
  finally:
    src.close()
  assert [c[0] for c in calls] == [0, 1, 2, 3]
  for step, version, weights, newer in calls:
    assert weights == version == max(step - 2, 0)
    if step in (0, 3):  # nothing newer is out before step 0 trains, or needed after step 3's
      continue
    assert newer is not None, f"step {step}'s batch never moved on from version {version}"
    assert newer[0] == newer[1] > version and newer[1] <= step


def test_a_rollout_group_moves_to_the_same_version_at_the_same_poll():
  """Two processes of a rollout group (two sources here, agreeing through a 2-party exchange as
  `agree_on_version` broadcasts process 0's version): the second gets each version 0.5 s after
  the first, longer than a batch decodes before it polls, yet both move to the same version at
  every poll, the second waiting for it (without the agreement they part ways: checked)."""
  barrier, said = threading.Barrier(2), {}

  def agree(rank):
    def exchange(version):
      if rank == 0:
        said["v"] = version
      barrier.wait()
      out = said["v"]
      barrier.wait()  # both have read it before the next poll overwrites it
      return out
    return exchange

  (first, calls0), (second, calls1) = (_source(2, end=6, partial=True, agree=agree(r),
                                               poll_after=0.3)
                                       for r in (0, 1))
  late = []
  try:
    for step in range(6):
      first.next(step, None), second.next(step, None)
      first.updated(step + 1, jnp.asarray(step + 1))
      late.append(threading.Timer(0.5, second.updated, (step + 1, jnp.asarray(step + 1))))
      late[-1].start()
  finally:
    for t in late:
      t.join()
    first.close(), second.close()
  assert calls0 == calls1
  assert any(c[3] is not None for c in calls0)  # some batch moved on to a newer version


def test_close_abandons_the_batch_in_flight_at_its_next_chunk():
  """A stopping run (SIGTERM, an error) does not wait for the rollout thread's batch ahead:
  the sampler's check between chunks ends it, and the steps trained so far are untouched."""
  src, calls = _source(1, end=4, endless_at=1)
  exp = src.next(0, None)
  assert exp.batch == 0
  for _ in range(200):
    if (1, "started") in calls:
      break
    threading.Event().wait(0.05)
  assert (1, "started") in calls
  closer = threading.Thread(target=src.close)
  closer.start()
  closer.join(timeout=10.0)
  assert not closer.is_alive(), "close() waited for the endless batch"
  assert not src._thread.is_alive()  # pylint: disable=protected-access


@pytest.mark.parametrize("k,save_every,version,after", [
    (1, 100, 2, 3), (2, 100, 2, 4),
    (1, 3, 2, 2),  # step 3 follows a checkpoint: it waits for version 3
    (1, 100, 8, 7),  # the final evaluation: after the last batch
])
def test_the_last_batch_a_version_samples(k, save_every, version, after):
  assert experience.last_batch_sampled_by(version, k, save_every, 0, 8) == after


def test_tasks_run_on_the_rollout_thread_between_the_batches_they_name():
  """An evaluation placed after the last batch its version samples (what a rollout group of
  several processes agrees on without talking) runs after that batch and before the next;
  one placed after the run's last batch runs once the thread has drawn every batch."""
  src, calls = _source(1, end=6)
  seen = []
  try:
    for step in range(6):
      src.next(step, None)
      src.updated(step + 1, jnp.asarray(step + 1))
      if step + 1 in (1, 6):
        after = experience.last_batch_sampled_by(step + 1, 1, 100, 0, 6)
        src.run_after(after, lambda v=step + 1: seen.append((v, len(calls),
                                                             threading.current_thread().name)))
    for _ in range(200):
      if len(seen) == 2:
        break
      threading.Event().wait(0.05)
  finally:
    src.close()
  assert seen == [(1, 3, "dapo-rollout"), (6, 6, "dapo-rollout")]  # after batch 2, after all


def test_close_gives_up_on_a_rollout_thread_that_never_returns(monkeypatch, caplog):
  """A batch stuck where the stop check never runs (a collective whose peer died): close
  waits experience.CLOSE_TIMEOUT_S, warns and returns, instead of hanging the exit."""
  monkeypatch.setattr(experience, "CLOSE_TIMEOUT_S", 0.5)
  stuck, release = threading.Event(), threading.Event()

  def sample(weights, step, version, newest, check):
    stuck.set()
    release.wait()  # never checks: only the end of the test lets it go

  src = experience.OverlappedExperience(
      sample, lambda p: p, dict, max_staleness=1, start_step=0, num_steps=2, save_every=100,
      params=jnp.asarray(0))
  try:
    assert stuck.wait(20)
    closed = threading.Event()
    threading.Thread(target=lambda: (src.close(), closed.set()), daemon=True).start()
    assert closed.wait(20), "close() waited for the stuck rollout thread"
    assert "The rollout thread did not stop within" in caplog.text, caplog.text
  finally:
    release.set()


def test_a_task_after_a_batch_that_fails_still_runs():
  """An evaluation placed after batch 3 (a rollout group's place for version 2 at k = 1,
  save_every 2) runs although batch 2 fails (a dataset-exhausted stop): the trainer waits for
  its answer before it asks for batch 2, and then meets the error there."""
  src, _ = _source(1, end=4, save_every=2, fail_at=2)
  ran = threading.Event()
  try:
    src.next(0, None)
    src.updated(1, jnp.asarray(1))
    src.next(1, None)
    assert experience.last_batch_sampled_by(2, 1, 2, 0, 4) == 3
    src.run_after(3, ran.set)
    src.updated(2, jnp.asarray(2))
    assert ran.wait(20.0), "the evaluation after batch 3 never ran: batch 2 failed first"
    with pytest.raises(RuntimeError, match="rollout failed at 2"):
      src.next(2, None)
  finally:
    src.close()


def test_a_rollout_error_reaches_the_trainer_at_its_step():
  src, _ = _source(1, end=4, fail_at=1)
  try:
    src.next(0, None)
    with pytest.raises(RuntimeError, match="rollout failed at 1"):
      src.next(1, None)
  finally:
    src.close()


def test_decoupled_old_log_probs_are_the_proximal_policys_on_every_row():
  """At max_staleness >= 1 every row's old log-probs are recomputed (the proximal policy), a
  carried group's too; the synchronous step keeps a carried group's sampler log-probs."""
  n, r = 4, 3
  traj = types.SimpleNamespace(
      input_ids=np.zeros((n, 5), np.int32), attention_mask=np.ones((n, 5), bool),
      response_len=r, sampler_logprobs=np.full((n, r), -2.0, np.float32),
      carried_rows=lambda step: np.array([True, True, False, False]))
  run = types.SimpleNamespace(mesh=None, logp_fn=lambda params, ids, mask, rr: (
      np.full((ids.shape[0], rr), -1.0, np.float32), np.zeros((ids.shape[0], rr))))
  rollout = types.SimpleNamespace(use_sampler_logprobs=False)
  state = types.SimpleNamespace(params=None)
  sync, _, _ = train._old_log_probs(rollout, run, state, traj, 1)  # pylint: disable=protected-access
  np.testing.assert_array_equal(sync[:2], -2.0)
  decoupled, _, _ = train._old_log_probs(rollout, run, state, traj, 1, decoupled=True)  # pylint: disable=protected-access
  np.testing.assert_array_equal(decoupled, -1.0)


def test_staleness_metrics_weigh_tokens_by_their_lag():
  traj = types.SimpleNamespace(policy_version=np.array([5, 5, 4, 4]), token_version=None,
                               response_mask=np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1],
                                                       [1, 1, 1]], bool))
  m = traj_lib.staleness_metrics(traj, 5, 2)
  assert m["staleness/tokens_at_0"] == pytest.approx(3 / 9)
  assert m["staleness/tokens_at_1"] == pytest.approx(6 / 9)
  assert m["staleness/tokens_at_2"] == 0.0
  assert (m["staleness/max"], m["staleness/mean"]) == (1.0, pytest.approx(6 / 9))
  # Partial rollouts: each token's own version (row 2's last two tokens sampled by version 5).
  traj.token_version = np.where(traj.response_mask, traj.policy_version[:, None], -1)
  traj.token_version[2, 1:] = 5
  m = traj_lib.staleness_metrics(traj, 5, 2)
  assert m["staleness/tokens_at_0"] == pytest.approx(5 / 9)


@pytest.mark.parametrize("over,message", [
    ({"algorithm.max_staleness": 1}, "needs the behaviour correction"),
    ({"algorithm.max_staleness": -1}, "must be an integer >= 0"),
    ({"rollout_devices": 8}, "leaves no device to train on"),
    ({"algorithm.partial_rollouts": True}, "needs algorithm.max_staleness >= 1"),
    ({"algorithm.partial_rollouts": True, "algorithm.max_staleness": 1,
      "algorithm.rollout_is": "token_truncated", "rollout.engine": "static"},
     "needs rollout.engine='continuous'"),
])
def test_config_refuses(over, message):
  with pytest.raises(ConfigError, match=message):
    validate(_small_config(**over), num_devices=8)


def test_config_accepts_corrected_or_explicitly_uncorrected_staleness():
  validate(_small_config(**{"algorithm.max_staleness": 2,
                            "algorithm.rollout_is": "token_truncated"}), num_devices=8)
  validate(_small_config(**{"algorithm.max_staleness": 1,
                            "algorithm.allow_uncorrected_staleness": True}), num_devices=8)


def _metrics(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: {k: v for k, v in r.items() if not k.startswith(_TIMING)}
          for r in rows if r["step"] > 0}


def _overlap_config(num_steps, lora_rank=0):
  c = _small_config(**{
      "num_steps": num_steps, "algorithm.max_staleness": 1,
      "algorithm.rollout_is": "token_truncated", "rollout_devices": 4,
      "checkpoint.save_every": 2, "eval.every": 2})
  if lora_rank:
    c.model.lora.rank, c.model.lora.alpha, c.optim.lr = lora_rank, 2.0 * lora_rank, 1e-2
  return c


@pytest.fixture(scope="module")
def whole_split_run(tmp_path_factory):
  """Rollout on 4 devices, training on the other 4, one step off, 4 steps uninterrupted:
  (its metrics by step, its result)."""
  assert jax.device_count() == 8
  whole = str(tmp_path_factory.mktemp("whole"))
  out = train_and_evaluate(_overlap_config(4), whole)
  return _metrics(whole), out


def test_overlapped_run_on_split_devices_resumes_bit_for_bit(tmp_path, whole_split_run):
  """A run stopped after its step-2 checkpoint and relaunched equals the uninterrupted run
  (`whole_split_run`): metrics and weights."""
  a, out = whole_split_run
  split = str(tmp_path / "split")
  train_and_evaluate(_overlap_config(2), split)
  train_and_evaluate(_overlap_config(4), split)
  assert a == _metrics(split)
  assert [a[s]["sync/policy_version"] for s in (1, 2, 3, 4)] == [0, 0, 2, 2]
  assert [a[s]["staleness/max"] for s in (1, 2, 3, 4)] == [0, 1, 0, 1]
  assert all(0 < a[s]["actor/rollout_is_weight"] for s in a)
  assert "eval/avg@4" in a[2] and "eval/avg@4" in out
  assert all(a[s]["sync/weight_bytes"] > 0 for s in a)


def _moves_at_the_second_poll(newest, timeout_s=60.0):
  """``newest`` (a batch's hand-over of newer weights) whose second call waits until a newer
  version is out and gives it: the batch's first chunk is decoded by its scheduled version and
  what follows by a newer one, whatever the timing (a batch polled once moves nowhere)."""
  calls = [0]

  def wrapped():
    calls[0] += 1
    if calls[0] == 1:
      return None
    if calls[0] > 2:
      return newest()
    deadline = time.monotonic() + timeout_s
    while True:
      got = newest()
      if got is not None or time.monotonic() > deadline:
        return got
      time.sleep(0.01)
  return wrapped


def test_partial_rollouts_run_within_the_bound(tmp_path, monkeypatch):
  """k = 2 with partial rollouts on split devices: samples in flight move on to a newer version
  mid-batch (each batch after the first waits at its second poll for one), so a step trains
  tokens of two versions; every trained token within 2 versions, the shares of tokens by
  staleness summing to 1."""
  real = train._sample

  def sample(spec, run, weights, step, version, newest=None, check=None):
    if newest is not None and step in (1, 2):  # scheduled on version 0; 1 is handed over
      newest = _moves_at_the_second_poll(newest)
    return real(spec, run, weights, step, version, newest, check)

  monkeypatch.setattr(train, "_sample", sample)
  c = _small_config(**{
      "num_steps": 4, "algorithm.max_staleness": 2, "algorithm.partial_rollouts": True,
      "algorithm.rollout_is": "token_truncated", "rollout_devices": 4,
      "checkpoint.save_every": 4,
      # 4 slots, one group of 4 samples at a time: a batch is polled once per group
      "rollout.max_concurrent_decodes": 4})
  train_and_evaluate(c, str(tmp_path))
  m = _metrics(str(tmp_path))
  for s, row in m.items():
    assert row["staleness/max"] <= 2
    assert sum(row[f"staleness/tokens_at_{k}"] for k in range(3)) == pytest.approx(1.0)
  # Steps 1 and 2 (rows 2 and 3) are sampled from version 0 (lags 1 and 2); the tokens after
  # the move to version 1 lag one version less. Without the move: every token at its batch's.
  lags = {s: [m[s][f"staleness/tokens_at_{k}"] for k in range(3)] for s in (2, 3)}
  assert lags[2][0] > 0 and lags[2][1] > 0 and lags[2][2] == 0, lags
  assert lags[3][1] > 0 and lags[3][2] > 0, lags


_TWO_PROCESS = """
import sys
from tests.test_overlap import _overlap_config
from dapo_jax.infra import distributed
from dapo_jax.trainer.train import train_and_evaluate
role, peer, workdir, steps, lora_rank = sys.argv[1:6]
distributed.maybe_initialize()  # a side of several processes: its own jax.distributed job
c = _overlap_config(int(steps), int(lora_rank))
c.rollout_devices = 0
train_and_evaluate(c, workdir, role=role, peer=peer)
"""


def _two_process_launch(workdir, steps, lora_rank=0, per_side=1):
  """A ``--role=train`` and a ``--role=rollout`` side of ``per_side`` processes each, 4 CPU
  devices a side (one launch). A side of several processes is a ``jax.distributed`` job of its
  own; process i of one side pairs with process i of the other."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  peer = ",".join(f"127.0.0.1:{processes.free_port()}" for _ in range(per_side))
  procs = []
  for role in ("rollout", "train"):
    coord = f"127.0.0.1:{processes.free_port()}"
    for i in range(per_side):
      dist = {} if per_side == 1 else {"JAX_COORDINATOR_ADDRESS": coord,
                                       "JAX_NUM_PROCESSES": str(per_side),
                                       "JAX_PROCESS_ID": str(i)}
      procs.append(subprocess.Popen(
          [sys.executable, "-c", _TWO_PROCESS, role, peer, workdir, str(steps), str(lora_rank)],
          cwd=root, env=processes.process_env(root, 4 // per_side, dist),
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  processes.wait_all(procs, stall_s=600, what="process", watch=[workdir])


def test_rollout_in_a_process_of_its_own_equals_the_one_process_split(tmp_path,
                                                                     whole_split_run):
  """Measurement 4: the trainer and the rollout in two processes (4 devices each; weights
  pulled by version, batches sent host to host) give the one-process split's metrics, step for
  step, also across a stop after step 2 and a relaunch of both."""
  a, _ = whole_split_run
  workdir = str(tmp_path / "two")
  _two_process_launch(workdir, 2)
  _two_process_launch(workdir, 4)
  b = _metrics(workdir)
  assert all(b[s].pop("sync/batch_bytes") > 0 for s in b)  # the batch host to host
  assert a == b
  assert all(b[s]["sync/weight_bytes"] > 0 for s in b)


def test_a_lora_rollout_process_pulls_the_adapters_alone(tmp_path, whole_split_run):
  """LoRA in two processes: the rollout process holds the frozen base it loaded itself and
  merges the adapters it pulls each step. Its metrics equal the one-process LoRA split's, and
  the bytes handed over per step are the adapters' (fp32), in both layouts."""
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  train_and_evaluate(_overlap_config(2, lora_rank=2), one)
  _two_process_launch(two, 2, lora_rank=2)
  a, b = _metrics(one), _metrics(two)
  assert all(b[s].pop("sync/batch_bytes") > 0 for s in b)
  assert a == b and set(a) == {1, 2} and "eval/avg@4" in a[2]
  adapter_bytes = sum(np.asarray(x).nbytes for x in _params(one, 2))  # the trained params
  assert all(a[s]["sync/weight_bytes"] == adapter_bytes for s in a)
  assert adapter_bytes < whole_split_run[0][1]["sync/weight_bytes"] / 4  # the merged model's


def test_sides_of_two_processes_each_pair_process_by_process(tmp_path, whole_split_run):
  """A training side and a rollout side of 2 processes each (2 devices a process, each side its
  own jax.distributed job): process i pulls its shards of the weights from process i of the
  other side, evaluations fall between the same two batches on both rollout processes, and the
  run takes the one-process split's decisions. (One launch: a stop and relaunch of both sides
  took the same decisions when tried, at twice the test's time; the one-process-a-side test
  above covers the resume.)"""
  a, _ = whole_split_run
  workdir = str(tmp_path / "sides")
  _two_process_launch(workdir, 4, per_side=2)
  b = _metrics(workdir)
  assert sorted(b) == [1, 2, 3, 4] and "eval/avg@4" in b[2] and "eval/avg@4" in b[4]
  assert {f.name for f in tmp_path.joinpath("sides").glob("rollout_peer*")} == {
      "rollout_peer.0.key", "rollout_peer.1.key"}
  for s in a:
    assert b[s].pop("sync/batch_bytes") > 0
    assert set(a[s]) == set(b[s])
    for k in a[s]:
      if k.startswith(_DECISIONS):  # what was sampled, kept, rewarded, handed over: exactly
        assert b[s][k] == a[s][k], (s, k)
      elif k != "rollout/bit_equal":  # floats: gloo's all-reduce sums in another order
        assert b[s][k] == pytest.approx(a[s][k], rel=1e-4, abs=1e-6), (s, k)



_SIDE_CLI = """
import sys
from tests.test_overlap import _overlap_config
from dapo_jax.infra import distributed
from dapo_jax.spec import cli
from dapo_jax.trainer.train import train_and_evaluate


def main(argv):
  role, peer, workdir, steps = argv
  distributed.maybe_initialize()
  c = _overlap_config(int(steps))
  c.rollout_devices, c.eval.every = 0, 0
  train_and_evaluate(c, workdir, role=role, peer=peer)


cli.exit_on_error("dapo-train", main)
"""


def test_a_training_process_killed_ends_every_process_of_both_sides(tmp_path):
  """Issue 50 (8): sides of two processes each; kill -9 of training process 1 after step 1.
  Its rollout process learns it on their link; the others wait in collectives with a process
  that has gone. Each of the three exits within the bound (DAPO_SIDE_EXIT_S, 10 s here, plus
  the link's heartbeat) with exit code 2, one line saying why and no traceback."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workdir = str(tmp_path / "run")
  peer = ",".join(f"127.0.0.1:{processes.free_port()}" for _ in range(2))
  procs = {}
  for role in ("rollout", "train"):
    coord = f"127.0.0.1:{processes.free_port()}"
    for i in range(2):
      env = processes.process_env(root, 2, {"JAX_COORDINATOR_ADDRESS": coord,
                                            "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
                                            "DAPO_SIDE_EXIT_S": "10"})
      procs[role, i] = subprocess.Popen(
          [sys.executable, "-c", _SIDE_CLI, role, peer, workdir, "8"], cwd=root, env=env,
          stdout=open(tmp_path / f"{role}{i}.log", "w"), stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 600
    while not _rows(workdir):
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), (
          "no step logged")
      time.sleep(0.2)
    procs["train", 1].kill()
    killed = time.monotonic()
    codes = {}
    for key, p in procs.items():
      if key != ("train", 1):
        try:
          codes[key] = p.wait(timeout=max(killed + 90 - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
          codes[key] = None
    logs = {k: (tmp_path / f"{k[0]}{k[1]}.log").read_text() for k in codes}
    assert all(c is not None for c in codes.values()), (
        {k: c for k, c in codes.items()}, {k: v[-1500:] for k, v in logs.items()})
    for key, text in logs.items():
      assert codes[key] == 2, (key, codes[key], text[-3000:])
      assert "Traceback" not in text, (key, text[-3000:])
      said = [line for line in text.splitlines() if line.startswith("dapo-train: error:")]
      assert len(said) == 1 and "gone" in said[0], (key, said, text[-3000:])
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()

# Host-side decisions of a step: the same on any process layout (test_multiprocess.py).
_DECISIONS = ("sampling/", "train/", "response/", "reward/", "staleness/", "data/", "eval/",
              "sync/")


_CLI_CONFIG = """
from tests.test_overlap import _overlap_config


def get_config():
  c = _overlap_config({steps})
  c.rollout_devices, c.checkpoint.save_every = 0, 100  # a save only where a run stops
  return c
"""


def _cli_side(role, cfg, workdir, peer, log=subprocess.PIPE):
  """One side as a user starts it: ``dapo-train --role ...`` (`dapo_jax.main`), its output in
  ``log``."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen(
      [sys.executable, "-m", "dapo_jax.main", f"--config={cfg}", f"--workdir={workdir}",
       f"--role={role}", f"--peer={peer}"], cwd=root,
      env=processes.process_env(root, 4, {}), stdout=log, stderr=subprocess.STDOUT, text=True)


def _rows(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  return [json.loads(line)["step"] for line in open(path) if line.strip()]


def _launch_until(tmp_path, cfg, workdir, name, after_row, end):
  """Both sides by the command line, until the training process logs step ``after_row``;
  then ``end(procs)``. Their output: ``<name>.train.log``, ``<name>.rollout.log``."""
  logs = {side: open(tmp_path / f"{name}.{side}.log", "w") for side in ("rollout", "train")}
  peer = f"127.0.0.1:{processes.free_port()}"
  procs = {side: _cli_side(side, cfg, workdir, peer, logs[side]) for side in logs}
  try:
    deadline = time.monotonic() + 600
    while not _rows(workdir) or _rows(workdir)[-1] < after_row:
      assert time.monotonic() < deadline and procs["train"].poll() is None, "no step logged"
      time.sleep(0.2)
    end(procs)
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
  return {side: (tmp_path / f"{name}.{side}.log").read_text() for side in logs}


def test_a_side_stopped_or_killed_loses_no_step_and_the_run_resumes(tmp_path):
  """SIGTERM on the rollout process alone (its host preempted): the training process
  checkpoints the step it reaches and both exit 0. Then kill -9 of the rollout process: the
  training process saves the step it reached (no periodic checkpoint: save_every 100) and ends
  in one line (which side went, the step, the checkpoint, how to relaunch), exit 2, no
  traceback. The relaunch of both logs every step once."""
  cfg = tmp_path / "cfg.py"
  cfg.write_text(_CLI_CONFIG.format(steps=8))
  workdir = str(tmp_path / "run")
  ckpts = lambda: sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")))  # noqa: E731

  def sigterm(procs):
    procs["rollout"].send_signal(signal.SIGTERM)
    assert procs["rollout"].wait(120) == 0 and procs["train"].wait(120) == 0

  out = _launch_until(tmp_path, cfg, workdir, "term", 1, sigterm)
  first = _rows(workdir)[-1]
  assert 0 < first < 8 and ckpts() == [first], (first, ckpts())
  assert f"Stopped at step {first} on request; checkpoint written" in out["train"]

  def kill(procs):
    procs["rollout"].kill()
    assert procs["train"].wait(120) == 2

  out = _launch_until(tmp_path, cfg, workdir, "kill", first + 1, kill)["train"]
  last = out.strip().splitlines()[-1]
  assert "Traceback" not in out, out[-3000:]
  reached = _rows(workdir)[-1]
  assert last.startswith("dapo-train: error: The rollout process has gone (") and (
      f"with the training process at step {reached}. Step {reached} is saved in " in last and
      "relaunch both processes (--role=train and --role=rollout)" in last), last
  assert first < reached < 8 and ckpts() == [first, reached], (reached, ckpts())
  peer = f"127.0.0.1:{processes.free_port()}"
  processes.wait_all([_cli_side(side, cfg, workdir, peer) for side in ("rollout", "train")],
                     stall_s=600, what="process", watch=[workdir])
  rows = _rows(workdir)
  assert [s for s in rows if s > 0] == list(range(1, 9)) and rows.count(0) == 1, rows


def test_the_last_save_retried_on_role_train_keeps_the_last_batchs_data_state(tmp_path,
                                                                             monkeypatch):
  """--role=train (both sides in this process, the rollout on a thread): the last step's save
  lost to a storage outage is saved again with the data state of the last batch the rollout
  drew, the one the lost save held, not this process's iterator (which never moves)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from tests.test_bad_inputs import _saved_meta  # pylint: disable=g-import-not-at-top

  def config():
    c = _overlap_config(2)
    c.rollout_devices, c.eval.every, c.checkpoint.save_every = 0, 0, 100
    return c

  monkeypatch.setattr(train.run_files, "RETRY_WAIT_S", 0.0)
  lost = []
  real_save = ocp.CheckpointManager.save

  def lost_once(self, step, *args, **kwargs):  # the storage drops the first save of step 2
    if step == 2 and not lost:
      lost.append(kwargs["args"].meta.item)
      raise ConnectionRefusedError("storage unreachable (test)")
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", lost_once)
  workdir = str(tmp_path / "run")
  peer = f"127.0.0.1:{processes.free_port()}"
  rollout = threading.Thread(target=train_and_evaluate, args=(config(), workdir),
                             kwargs={"role": "rollout", "peer": peer}, daemon=True)
  rollout.start()
  train_and_evaluate(config(), workdir, role="train", peer=peer)
  rollout.join(60)
  saved = _saved_meta(workdir, 2)
  assert lost and lost[0]["iterator"]["position"] > 0  # two batches drawn by the rollout
  assert (saved["iterator"], saved["sampler"]) == (lost[0]["iterator"], lost[0]["sampler"])
