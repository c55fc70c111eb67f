"""The rollout in a process of its own (trainer/rollout_process.py): the role checks, the two
channels (infra/peer_link.py), and what crosses them. The two-process run itself:
tests/test_overlap.py."""

import json
import multiprocessing
import os
import signal
import threading
import time
import types
from multiprocessing import connection

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.infra import peer_link
from dapo_jax.infra.peer_link import Link, PeerError
from dapo_jax.trainer import rollout_process as rp
from dapo_jax.trainer.dynamic_sampling import (DatasetExhaustedError, MaxGenBatchesExceededError,
                                               SamplingStats)
from tests import processes


def _spec(rollout_devices=0, max_staleness=1):
  return types.SimpleNamespace(rollout_devices=rollout_devices,
                               algorithm=types.SimpleNamespace(max_staleness=max_staleness))


@pytest.mark.parametrize("role, peer, devices, k, message", [
    ("trainer", "", 0, 1, "choose one of"),
    ("both", "127.0.0.1:1234", 0, 1, "--peer is for --role=train or --role=rollout"),
    ("train", "", 0, 1, "give the training process's HOST:PORT"),
    ("rollout", "localhost", 0, 1, "give the training process's HOST:PORT"),
    ("train", "127.0.0.1:1234", 2, 1, "set config.rollout_devices=0"),
    ("rollout", "127.0.0.1:1234", 0, 0, "set algorithm.max_staleness >= 1"),
    ("train", "127.0.0.1:1234,127.0.0.1:1235", 0, 1, "names 2 address\\(es\\) for 1 process"),
])
def test_role_mistakes_are_one_line(role, peer, devices, k, message):
  with pytest.raises(rp.RoleError, match=message):
    rp.check_role(role, peer, _spec(devices, k))


def test_process_i_of_a_side_pairs_with_process_i_of_the_other(monkeypatch):
  """--peer's item i, and a key file and (--peer=auto) an address file per pair; partial
  rollouts are allowed on sides of several processes (the group agrees on each version)."""
  spec = _spec()
  spec.algorithm.partial_rollouts = True
  monkeypatch.setattr(rp.jax, "process_count", lambda: 2)
  monkeypatch.setattr(peer_link.jax, "process_count", lambda: 2)
  monkeypatch.setattr(peer_link.jax, "process_index", lambda: 1)
  rp.check_role("rollout", "127.0.0.1:1234,127.0.0.1:1235", spec)
  rp.check_role("rollout", "auto", spec)
  assert peer_link.process_peer("127.0.0.1:1234,127.0.0.1:1235") == "127.0.0.1:1235"
  assert peer_link.process_peer("auto") == "auto"
  assert peer_link.key_file() == "rollout_peer.1.key"
  assert peer_link.address_file() == "rollout_peer.1.addr"


def test_auto_peer_finds_the_training_process_through_the_workdir(tmp_path, monkeypatch):
  """--peer=auto: the training process listens on a free port and writes it to the workdir;
  an earlier launch's address there is retried until this launch's answers."""
  monkeypatch.setenv("DAPO_PEER_HOST", "127.0.0.1")
  (tmp_path / peer_link.address_file()).write_text(f"127.0.0.1:{processes.free_port()}")
  ends = {}
  t = threading.Thread(target=lambda: ends.update(rollout=Link.connect("auto", str(tmp_path))))
  t.start()
  time.sleep(1.5)  # the rollout is retrying the stale address meanwhile
  ends["train"] = Link.listen("auto", str(tmp_path), timeout_s=30.0)
  t.join()
  try:
    written = (tmp_path / peer_link.address_file()).read_text()
    assert written.startswith("127.0.0.1:") and written != "127.0.0.1:0"
    ends["rollout"].send(("experience", 1, "one"))
    assert ends["train"].wait("experience", 1) == ("experience", 1, "one")
  finally:
    ends["train"].close(), ends["rollout"].close()
  with pytest.raises(PeerError, match=r"at auto \(rollout_peer.addr in .*\) did not answer"):
    Link.connect("auto", str(tmp_path / "empty"), timeout_s=0.5)


def test_roles_that_fit_pass():
  rp.check_role("both", "", _spec(4, 0))
  rp.check_role("rollout", "10.0.0.2:29500", _spec(0))


def test_a_peer_is_host_and_port():
  assert peer_link.parse_peer("10.0.0.2:29500") == ("10.0.0.2", 29500)
  with pytest.raises(peer_link.PeerAddressError, match="HOST:PORT"):
    peer_link.parse_peer("10.0.0.2:")


def test_no_rollout_process_is_one_line_after_the_wait(tmp_path):
  peer = f"127.0.0.1:{processes.free_port()}"
  with pytest.raises(PeerError, match=f"no rollout process connected to {peer} within 1 s"):
    Link.listen(peer, str(tmp_path), timeout_s=1.0)


def _pair(workdir):
  """Both ends of a link in one process (two threads)."""
  peer = f"127.0.0.1:{processes.free_port()}"
  ends = {}
  t = threading.Thread(target=lambda: ends.update(train=Link.listen(peer, workdir)))
  t.start()
  ends["rollout"] = Link.connect(peer, workdir)
  t.join()
  return ends["train"], ends["rollout"]


def test_weights_are_pulled_by_key_in_any_order(tmp_path):
  """The trainer offers two versions; the rollout pulls the newer first, each by its key, and
  gets the same bits; batches come back host to host, kept until asked for."""
  train, rollout = _pair(str(tmp_path))
  try:
    tree = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    offers = {v: train.offer(v, jax.tree.map(lambda x, v=v: x + v, tree)) for v in (1, 2)}
    for v in (2, 1):
      got, nbytes = rollout.pull(offers[v], None)
      assert nbytes == 6 * 4 + 3 * 2
      for k in tree:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(tree[k] + v))
        assert got[k].dtype == tree[k].dtype
    rollout.send(("experience", 3, "third"))
    rollout.send(("evaluated", 2, {"eval/avg@4": 0.5}))
    assert train.wait("evaluated", 2) == ("evaluated", 2, {"eval/avg@4": 0.5})
    assert train.wait("experience", 3) == ("experience", 3, "third")  # kept meanwhile
    rollout.send(("error", None, "ValueError: bad"))
    with pytest.raises(PeerError, match="the rollout process stopped: ValueError: bad"):
      train.wait("experience", 4)
  finally:
    train.close()
    rollout.close()
  with pytest.raises(PeerError, match="the rollout process has gone"):
    train.recv()


def test_only_a_process_with_this_launchs_key_connects(tmp_path, monkeypatch):
  """The key is random per launch, in the workdir, readable by its owner alone; a process
  holding another key is turned away (the channel carries pickles) and may retry."""
  monkeypatch.delenv("DAPO_PEER_KEY", raising=False)
  key_path = tmp_path / peer_link.KEY_FILE
  train, rollout = _pair(str(tmp_path))
  first = key_path.read_bytes()
  assert len(first) == 64 and oct(key_path.stat().st_mode & 0o777) == "0o600"
  train.close(), rollout.close()
  train, rollout = _pair(str(tmp_path))
  assert key_path.read_bytes() != first  # a new key each launch
  train.close(), rollout.close()
  peer = f"127.0.0.1:{processes.free_port()}"
  listened = []

  def listen():
    try:
      listened.append(Link.listen(peer, str(tmp_path), timeout_s=3.0))
    except PeerError as e:
      listened.append(e)

  t = threading.Thread(target=listen)
  t.start()
  time.sleep(0.5)
  with pytest.raises(multiprocessing.AuthenticationError):
    connection.Client(peer_link.parse_peer(peer), authkey=first)
  t.join()
  assert isinstance(listened[0], PeerError)  # the stale key never became a link


def _scored_groups(n):
  """Scored groups as a partial-rollout batch leaves the rollout: stamped with the policy that
  sampled them, tokens of two versions."""
  from dapo_jax.data import arithmetic  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import trajectories as traj_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  out = []
  for i, rec in enumerate(arithmetic.make_records(n)):
    g = traj_lib.ScoredGroup(
        prompt=rec, acc=np.array([True, False]), reward=np.array([1.0, -1.1]),
        prompt_ids=rng.integers(0, 50, (2, 3)).astype(np.int32),
        prompt_mask=np.ones((2, 3), bool), response_ids=rng.integers(0, 50, (2, 4)).astype(
            np.int32), response_mask=np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool),
        logprobs=rng.normal(size=(2, 4)).astype(np.float32), lengths=np.array([2, 4], np.int32),
        truncated=np.array([False, True]), texts=[f"a{i}", f"b{i}"],
        score=np.array([1.0, -1.0], np.float32), penalty=np.array([0.0, -0.1], np.float32),
        num_errors=i, sampled_at_step=3, policy_version=2,
        token_versions=np.array([[2, 3, -1, -1], [2, 2, 3, 3]], np.int32))
    out.append(g)
  return out


def _same_group(a, b):
  import dataclasses  # pylint: disable=g-import-not-at-top
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if isinstance(x, np.ndarray):
      assert x.dtype == y.dtype, f.name
      np.testing.assert_array_equal(x, y, err_msg=f.name)
    else:
      assert x == y, f.name


def test_a_stopped_batch_crosses_with_what_it_gathered(tmp_path):
  """Dynamic sampling that stops on the rollout process reaches the trainer whole, through the
  link: its message, the scored groups gathered (arrays, stamps, token versions), its stats and
  the rollout's resume state with those groups carried (what the trainer checkpoints, and a
  relaunch trains first)."""
  from dapo_jax.trainer import trajectories as traj_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer.dynamic_sampling import DynamicSampler  # pylint: disable=g-import-not-at-top
  groups = _scored_groups(3)
  stats = SamplingStats(num_gen_batches=4, num_groups_generated=12, num_all_wrong=9)
  err = MaxGenBatchesExceededError("stopped", groups=groups, stats=stats)
  sampler = DynamicSampler(train_batch_size=4, group_type=traj_lib.ScoredGroup)
  sampler.carry(err.groups)  # as `train._serve_rollout` does before it sends the error
  err.resume_state = {"iterator": {"epoch": 1}, "sampler": sampler.state_dict()}
  train, rollout = _pair(str(tmp_path))
  try:
    rollout.send(("experience", 5, err))
    _, _, back = train.wait("experience", 5)
  finally:
    train.close()
    rollout.close()
  assert type(back) is MaxGenBatchesExceededError and str(back) == "stopped"
  assert back.stats.to_dict() == stats.to_dict()
  assert len(back.groups) == 3
  for a, b in zip(groups, back.groups):
    _same_group(a, b)
  relaunched = DynamicSampler(train_batch_size=4, group_type=traj_lib.ScoredGroup)
  relaunched.load_state_dict(back.resume_state["sampler"])
  for a, b in zip(groups, relaunched.carried_groups):
    _same_group(a, b)
  assert back.resume_state["iterator"] == {"epoch": 1}


def test_a_rollout_process_on_another_lora_base_stops_the_run_in_one_line(tmp_path):
  """The rollout process merges pulled adapters into the base it loaded itself: a base whose
  fingerprint is not the training process's is refused at the start, and the trainer learns
  why."""
  train, rollout = _pair(str(tmp_path))
  here = {"source": "preset test (random init, seed 1)", "fingerprint": 1, "signature": "s"}
  theirs = dict(here, source="preset test (random init, seed 0)", fingerprint=2)
  served = []

  def serve():
    try:
      rp.serve(rollout, None, dict, None, None, None, lora_base=here)
    except ValueError as e:
      served.append(e)

  t = threading.Thread(target=serve)
  t.start()
  try:
    train.send(("start", None, {"lora_base": theirs, "resume": None}))
    with pytest.raises(PeerError, match=r"the rollout process stopped: ValueError: the training "
                       r"process holds LoRA adapters of the base preset test \(random init, "
                       r"seed 0\).*start both processes with the same --config"):
      train.wait("experience", 0)
    t.join()
    assert served and "\n" not in str(served[0])
  finally:
    train.close()
    rollout.close()


def _within(fn, timeout_s=30.0):
  """``fn()``'s result, or a failed test after ``timeout_s`` (a hang fails, never stalls)."""
  out = []

  def call():
    try:
      out.append((True, fn()))
    except BaseException as e:  # pylint: disable=broad-except  (re-raised below)
      out.append((False, e))

  t = threading.Thread(target=call, daemon=True)
  t.start()
  t.join(timeout_s)
  assert out, f"no answer within {timeout_s:.0f} s: the two sides wait on each other"
  ok, value = out[0]
  if not ok:
    raise value
  return value


def _rollout_side(link, fail_at=None, fail_with=None, evals=None):
  """`rp.serve` on a thread, over a fake rollout: a batch is (step, version, the weights' sum
  it was sampled with); ``fail_at``'s batch raises ``fail_with()``. Evaluations score the
  pulled weights' sum (appended to ``evals``). Returns (thread, what serve raised)."""
  drawn = []

  def sample(weights, step, version, newest, check):
    del newest, check
    if step == fail_at:
      raise fail_with()
    drawn.append(step)
    return (step, version, float(jnp.sum(weights["w"])))

  def evaluator(weights, step):
    score = float(jnp.sum(weights["w"]))
    if evals is not None:
      evals.append((step, score))
    return {"eval/score": score}

  raised = []

  def run():
    try:
      rp.serve(link, sample, lambda: {"drawn": list(drawn)}, lambda resume: None, evaluator,
               None)
    except BaseException as e:  # pylint: disable=broad-except  (the test reads it)
      raised.append(e)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, raised


def _remote(link, start, end, save_every=2, params=None):
  return rp.RemoteExperience(link, lambda p: p, max_staleness=1, start_step=start,
                             num_steps=end, save_every=save_every,
                             params={"w": jnp.zeros(3)} if params is None else params,
                             partial=False, resume=None)


def test_a_finished_run_relaunched_evaluates_and_stops(tmp_path):
  """start_step == num_steps (a requeued job after the last step): no batch and no weights
  are sent; the final evaluation is answered at once and both sides stop."""
  train, rollout = _pair(str(tmp_path))
  t, raised = _rollout_side(rollout)
  try:
    source = _remote(train, 4, 4)
    params = {"w": jnp.full(3, 2.0)}
    assert _within(lambda: source.evaluate(params, 4)) == {"eval/score": 6.0}
    source.close()
    t.join(10)
    assert not t.is_alive() and not raised
  finally:
    train.close(), rollout.close()


@pytest.mark.parametrize("stop", [MaxGenBatchesExceededError, DatasetExhaustedError])
def test_a_sampling_stop_after_an_evaluation_reaches_the_trainer(tmp_path, stop):
  """A rollout group evaluates version 2 after batch 3 (k = 1, save_every 2): batch 2's
  sampling stop must not leave the trainer waiting for that evaluation. It gets the
  evaluation, then the stop with what was gathered at step 2 (which it checkpoints)."""
  train, rollout = _pair(str(tmp_path))
  make = lambda: stop("stopped at 2", groups=[1], stats=SamplingStats())  # noqa: E731
  evals = []
  t, raised = _rollout_side(rollout, fail_at=2, fail_with=make, evals=evals)
  try:
    source = _remote(train, 0, 4)
    for step in (0, 1):
      assert _within(lambda s=step: source.next(s, None)).batch[0] == step
      source.updated(step + 1, {"w": jnp.full(3, step + 1.0)})
    got = _within(lambda: rp.evaluate(train, lambda p: p, {"w": jnp.full(3, 5.0)}, 2, after=3))
    assert got == {"eval/score": 15.0} and evals == [(2, 15.0)]
    with pytest.raises(stop, match="stopped at 2") as err:
      _within(lambda: source.next(2, None))
    assert err.value.groups == [1]
    source.close()
    t.join(10)
    assert not t.is_alive() and not raised
  finally:
    train.close(), rollout.close()


def test_the_training_process_gone_ends_the_rollout_process_in_one_line(tmp_path):
  """The training process killed mid-run: the rollout process ends with one line naming the
  side that went, the step it had reached, that nothing is saved here, and the relaunch."""
  train, rollout = _pair(str(tmp_path))
  t, raised = _rollout_side(rollout)
  try:
    source = _remote(train, 0, 4)
    _within(lambda: source.next(0, None))
    source.updated(1, {"w": jnp.ones(3)})
    _within(lambda: source.next(1, None))
    train.close()  # what kill -9 leaves: the connection ends
    t.join(20)
    assert not t.is_alive() and len(raised) == 1
    assert isinstance(raised[0], rp.SideGoneError) and raised[0].one_line
    msg = str(raised[0])
    assert "\n" not in msg and msg.startswith("The training process has gone (EOFError) at step 1.")
    assert "at step 1. This process saves nothing" in msg
    assert "relaunch both processes (--role=train and --role=rollout)" in msg
  finally:
    train.close(), rollout.close()


def test_sigterm_on_the_rollout_process_asks_the_trainer_to_stop(tmp_path):
  """SIGTERM on the rollout process (serving on the main thread, as the command runs it): it
  keeps serving and tells the training process, whose stop check sees it; the trainer's
  "stop" then ends it cleanly."""
  train, rollout = _pair(str(tmp_path))
  fallback = []  # the test's own handler, where serve installs none (never Python's default)
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: fallback.append(signum))
  seen = []

  def trainer():
    try:
      source = _remote(train, 0, 4)
      source.next(0, None)
      os.kill(os.getpid(), signal.SIGTERM)
      deadline = time.monotonic() + 10
      while not source.stop_requested() and time.monotonic() < deadline:
        time.sleep(0.05)
      seen.append(source.stop_requested())
      source.updated(1, {"w": jnp.ones(3)})  # the rollout process still answers
      seen.append(source.next(1, None).batch)
      source.close()
    except BaseException as e:  # pylint: disable=broad-except  (the test reads it)
      seen.append(e)
      train.close()

  t = threading.Thread(target=trainer, daemon=True)
  t.start()
  try:
    sample = lambda weights, step, version, newest, check: step  # noqa: E731
    rp.serve(rollout, sample, dict, lambda resume: None, None, None)
    t.join(10)
  finally:
    signal.signal(signal.SIGTERM, previous)
    train.close(), rollout.close()
  assert seen == [True, 1] and not fallback, (seen, fallback)


def test_a_rollout_process_on_another_config_is_refused_on_both_sides(tmp_path):
  """The settings that decide the batches (seed, data, rollout.*, reward.*, the skip filter,
  max_num_gen_batches, ...) cross at the handshake: a difference stops both processes there,
  in one line naming it; the training process's own settings (the optimizer) may differ."""
  from tests.test_train_e2e import _small_config  # pylint: disable=g-import-not-at-top
  base = rp.batch_settings(_small_config())
  assert {"seed", "rollout.n", "rollout.temperature", "reward.overlong_buffer_len",
          "algorithm.skip_filter", "algorithm.max_num_gen_batches", "data.train",
          "optim.train_batch_size"} <= set(base)
  assert rp.batch_settings(_small_config(**{"optim.lr": 0.5})) == base
  theirs = rp.batch_settings(_small_config(**{"rollout.temperature": 0.5, "seed": 3}))
  peer = f"127.0.0.1:{processes.free_port()}"
  ends = {}

  def listen():
    try:
      ends["train"] = Link.listen(peer, str(tmp_path), timeout_s=30.0, agree=base)
    except PeerError as e:
      ends["train"] = e

  t = threading.Thread(target=listen)
  t.start()
  with pytest.raises(PeerError) as err:
    Link.connect(peer, str(tmp_path), agree=theirs)
  t.join()
  assert isinstance(ends["train"], PeerError)
  for e, here, there in ((err.value, "0.5", "1.0"), (ends["train"], "1.0", "0.5")):
    msg = str(e)
    assert "\n" not in msg and msg.startswith("the training and rollout processes run "
                                              "different configs: rollout.temperature=")
    assert f"rollout.temperature={here} here, {there} there" in msg and "seed=" in msg
    assert "Start both with the same --config and overrides" in msg


def test_a_batch_that_cannot_be_sent_stops_the_trainer_with_the_reason(tmp_path):
  """A scored batch that does not pickle (here: a lock inside it) must reach the trainer as an
  error at its step, not end the sender thread with a stderr trace and leave both waiting."""
  train, rollout = _pair(str(tmp_path))

  def sample(weights, step, version, newest, check):
    return {"step": step, "lock": threading.Lock() if step == 1 else None}

  t = threading.Thread(target=rp.serve, args=(rollout, sample, dict, lambda r: None, None, None),
                       daemon=True)
  t.start()
  try:
    source = _remote(train, 0, 4)
    assert _within(lambda: source.next(0, None)).batch["step"] == 0
    source.updated(1, {"w": jnp.ones(3)})
    with pytest.raises(PeerError, match=r"the rollout process stopped: step 1's batch could not "
                       r"be sent: TypeError: cannot pickle '_thread.lock' object"):
      _within(lambda: source.next(1, None))
    source.close()
    t.join(10)
    assert not t.is_alive()
  finally:
    train.close(), rollout.close()


def test_a_silent_peer_is_taken_as_gone_and_a_slow_one_is_not(tmp_path, monkeypatch):
  """Each end says it is alive every HEARTBEAT_S: a wait longer than SILENCE_S for a batch
  still ends with the batch. An other process that stops speaking without closing its
  connection (a host down, a network cut) ends the wait after SILENCE_S, in one line."""
  monkeypatch.setattr(peer_link, "HEARTBEAT_S", 0.1)
  monkeypatch.setattr(peer_link, "SILENCE_S", 1.0)
  train, rollout = _pair(str(tmp_path))
  try:
    threading.Timer(2.5, lambda: rollout.send(("experience", 0, "late"))).start()
    assert _within(lambda: train.wait("experience", 0)) == ("experience", 0, "late")
    rollout._closed.set()  # pylint: disable=protected-access  (its heartbeat stops, the socket stays)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"the rollout process has gone \(no word from it for 1 "
                       r"s, where it says it is alive every 0 s"):
      _within(lambda: train.wait("experience", 1))
    assert time.monotonic() - t0 < 5
  finally:
    train.close(), rollout.close()


def test_a_pull_of_weights_that_never_come_ends(tmp_path, monkeypatch):
  """A pull whose weights never arrive (the offering process stuck or gone mid-transfer) ends
  after PULL_TIMEOUT_S in one line, instead of leaving the rollout process waiting."""
  monkeypatch.setattr(peer_link, "PULL_TIMEOUT_S", 1.0)
  train, rollout = _pair(str(tmp_path))
  try:
    offer = train.offer(1, {"w": jnp.ones(3)})
    never = dict(offer, key=99)  # a key the training process never offered
    with pytest.raises(PeerError, match=r"the weights the training process offered \(key 99\) "
                       r"did not arrive within 1 s"):
      _within(lambda: rollout.pull(never, None))
    got, _ = rollout.pull(offer, None)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.ones(3))
  finally:
    train.close(), rollout.close()


def test_a_rollout_process_reads_no_weights(tmp_path):
  """Issue 50 (11): the rollout process learned the sampler's structure by loading the whole
  model (at 32B, a second full read of the checkpoint per host). Its weights come from the
  training process, so a checkpoint directory holding only config.json is all it reads."""
  from tests.hf_fixtures import TINY_HF  # pylint: disable=g-import-not-at-top
  from tests.test_train_e2e import _small_config  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  ckpt = tmp_path / "ckpt"  # no model.safetensors: a read of any weight fails
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(
      {**TINY_HF, "architectures": ["Qwen2ForCausalLM"]}))
  cfg = _small_config()
  cfg.model.checkpoint = str(ckpt)
  spec = RunSpec.from_config(cfg, num_devices=jax.device_count())
  run, state = run_setup.build_run(spec, str(tmp_path / "work"), role="rollout")
  with run:
    assert state is None and run.checkpointer is None
    assert run.to_rollout.dtype == jnp.float32  # the weights it receives, cast to the model's
  from dapo_jax.checkpoints import hf  # pylint: disable=g-import-not-at-top
  with pytest.raises(hf.CheckpointError, match="No model.safetensors"):  # the trainer reads them
    run_setup.build_run(spec, str(tmp_path / "work"), role="train")


class _Store:
  """A side's key-value store as `side_exit` uses it (jax.distributed's client: a missing key
  raises NOT_FOUND); ``down``: its coordinator gone."""

  def __init__(self):
    self.kv, self.down = {}, False

  def key_value_set(self, key, value):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to the coordinator")
    self.kv.setdefault(key, value)

  def key_value_try_get(self, key):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to the coordinator")
    if key not in self.kv:
      raise RuntimeError(f"NOT_FOUND: {key} not found")
    return self.kv[key]


def _watch(store, exits, exit_s=0.5):
  from dapo_jax.infra import side_exit  # pylint: disable=g-import-not-at-top
  done = threading.Event()

  def leave(code):
    exits.append(code)
    done.set()
  return side_exit.SideWatch("rollout", exit_s=exit_s, client=store, exit_fn=leave), done


def test_a_broken_link_ends_every_process_of_its_side_in_bounded_time(capsys):
  """Issue 50 (8): process 1's link breaks; it tells its side, and both it and process 0 (whose
  link is fine, but which would wait in a collective with process 1) exit with 2 within the
  bound, each in one line naming the link that broke. A link closed at the run's end, or a
  store that stays up with nothing in it, arms nothing; a coordinator gone does."""
  store, exits0, exits1 = _Store(), [], []
  (_, done0), (w1, done1) = _watch(store, exits0), _watch(store, exits1)
  quiet, quiet_exited = _watch(_Store(), [])
  quiet.finished()
  quiet.link_gone("the training process has gone (EOFError)")  # after the run's end: nothing
  t0 = time.monotonic()
  w1.link_gone("the training process has gone (EOFError)")
  assert done0.wait(10) and done1.wait(10)
  assert exits0 == exits1 == [2] and time.monotonic() - t0 < 5
  lines = [line for line in capsys.readouterr().err.splitlines() if line]
  assert len(lines) == 2 and all(line.startswith("dapo-train: error: ") for line in lines)
  assert all("the training process has gone (EOFError)" in line for line in lines), lines
  assert any("the link of process 0 of the rollout side: the training" in line
             for line in lines), lines  # process 0's: the link that broke, and whose
  time.sleep(1.5)
  assert not quiet_exited.is_set()
  down, exits = _Store(), []
  _, gone = _watch(down, exits)
  time.sleep(1.2)
  assert not gone.is_set()  # a store with no key: nothing to do
  down.down = True
  assert gone.wait(10) and exits == [2]
  assert "coordinator of this side's jax.distributed job has gone" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_side_exit_bound_is_one_line(monkeypatch, value):
  from dapo_jax.infra import side_exit  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv(side_exit.EXIT_ENV, value)
  with pytest.raises(ValueError, match=f"DAPO_SIDE_EXIT_S={value!r}: give the seconds"):
    side_exit.exit_after_s()
