"""Storage outages on a ``gs://`` workdir, against a real GCS server (fake-gcs-server, stopped
and started again; `tests/gcs_emulator.py`).

The runs are `dapo-train` subprocesses (`tests/outage_run.py`) whose waits are all scaled by
``SCALE`` (`tests/outage_target.py`): gcsfs's retries of one request (~33 s real), TensorStore's
of one array write (~47 s), our waits between attempts (10 s) and at exit (30 s). An outage of
T s is replayed as ``T * SCALE`` s, so the run meets the same sequence of failed requests,
flushes and saves as in real time, only the steps (not scaled) are relatively slower. The
real-time outages are measured by bench/storage_outages.py.
"""

import os
import re
import time
import uuid

import pytest

from dapo_jax.infra import metrics
from dapo_jax.infra import run_files
from tests import outage_run
from tests.gcs_emulator import GcsEmulator

SCALE = 0.05  # 60 s of outage -> 3 s
MAX_FAILED_SAVES = 3  # the default of checkpoint.max_consecutive_failed_saves
_STEP_LINE = re.compile(r"console_log: step \d+/\d+")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  emu = GcsEmulator(str(tmp_path_factory.mktemp("gcs") / "root"))
  emu.start()
  yield emu
  emu.stop()


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  """One persistent compilation cache for the module's runs: the later launches load the
  programs the first compiled."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def _noise(result: outage_run.Result) -> list[str]:
  """Output lines other than the step lines."""
  return [t for _, t in result.lines if not _STEP_LINE.search(t)]


def _run(gcs, bucket, tmp_path, jax_cache, **kw) -> outage_run.Result:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = jax_cache
  try:
    return outage_run.run(gcs, bucket, str(tmp_path), scale=SCALE, timeout_s=400, **kw)
  finally:
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


@pytest.mark.slow
def test_outages_of_5_s_and_60_s_are_ridden_out_then_5_min_stops_the_run(gcs, tmp_path,
                                                                         jax_cache):
  """One run, two outages (5 s after checkpoint 1, 60 s after checkpoint 3): it completes, with
  every step's metrics exactly once and its last checkpoint. Then a relaunch on the same
  workdir meets a 5-minute outage: it stops after 3 failed saves in a row, exits within 60 s
  (scaled) with one line naming the storage error, and loses only the unsaved steps. The outage
  starts after step 9's checkpoint, so at most two distinct steps fail (10, and 9 when its save's
  clean-up was caught by the outage) and the third failed save is always the end of the run's
  retry of its last step, which counts as one more (issue 41: counted per distinct step, that
  retry went on for as long as the outage lasted, past this test's timeout). A launch while
  storage is still down waits checkpoint.storage_wait_s, then fails in one line."""
  bucket = f"run-{uuid.uuid4().hex[:8]}"
  gcs.create_bucket(bucket)
  first = _run(gcs, bucket, tmp_path, jax_cache, num_steps=7,
               outages=[outage_run.Outage(1, 5 * SCALE), outage_run.Outage(3, 60 * SCALE)])
  assert first.returncode == 0 and len(first.outages) == 2, first.text
  assert outage_run.logged_steps(gcs, bucket) == list(range(1, 8)), first.text
  assert outage_run.committed_steps(gcs, bucket)[-1] == 7
  assert "Traceback" not in first.text
  # One warning per failed save or flush; no third-party chatter about the outage.
  warned = [t for t in _noise(first) if "not saved" in t or "Metrics not written" in t]
  # Each names the client's error: a refused connection, TensorStore's ABORTED after its
  # retries, or the 404 of an upload session the restarted server no longer has.
  causes = {re.search(r"(?:not saved|not written to \S+) \((\w+): ", t).group(1) for t in warned}
  assert warned and causes <= {"ClientConnectorError", "ValueError", "FileNotFoundError",
                               "ServerDisconnectedError"}, warned
  assert len(_noise(first)) <= len(warned) + 12, "\n".join(_noise(first))

  second = _run(gcs, bucket, tmp_path, jax_cache, num_steps=10,
                outages=[outage_run.Outage(9, None)])
  assert second.returncode == 2 and second.gave_up_at is not None, second.text
  assert second.exited_at - second.gave_up_at < 60 * SCALE + 15, second.text
  last = second.lines[-1][1]
  assert last.startswith("dapo-train: error: Checkpoints could not be written"), second.text
  assert f"{MAX_FAILED_SAVES} saves in a row failed" in last
  assert "Traceback" not in second.text
  newest = outage_run.committed_steps(gcs, bucket)[-1]
  trained = max(int(m) for m in re.findall(r"step (\d+)/10", second.text))
  assert 9 <= newest and trained == 10, second.text
  # The step it names is on storage (9, or 8 when step 9's save finished its clean-up in the
  # outage and so counted as failed), never one whose save failed.
  named = int(re.search(r"the newest checkpoint is step (\d+) ", last).group(1))
  assert 8 <= named <= newest and named in outage_run.committed_steps(gcs, bucket), last
  logged = outage_run.logged_steps(gcs, bucket)
  assert logged == sorted(set(logged)) and logged[:newest] == list(range(1, newest + 1))

  t0 = time.time()
  third = _run(gcs, bucket, tmp_path, jax_cache, num_steps=30,
               outages=[outage_run.Outage(0, None)],
               extra_flags=("--config.checkpoint.storage_wait_s=2",))
  assert third.returncode == 2, third.text
  assert third.lines[-1][1].startswith("dapo-train: error: --workdir gs://"), third.text
  assert "storage unreachable for 2 s" in third.lines[-1][1] and "Traceback" not in third.text
  assert third.exited_at - t0 < 120


def test_metric_flushes_keep_every_row_through_an_outage(gcs, tmp_path, monkeypatch):
  """Flushes during an outage fail with a warning and keep the rows; the first flush after it
  writes them all, each once; at close an outage past the final retry raises one
  StorageUnavailableError naming what is not written."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  for k, v in gcs.env.items():
    monkeypatch.setenv(k, v)
  gcs.apply_in_process()
  from gcsfs import retry  # pylint: disable=g-import-not-at-top
  real_sleep = asyncio.sleep
  monkeypatch.setattr(retry, "asyncio", types.SimpleNamespace(
      sleep=lambda seconds: real_sleep(seconds * SCALE)))
  bucket = f"b-{uuid.uuid4().hex[:8]}"
  gcs.create_bucket(bucket)
  workdir = f"gs://{bucket}/run"
  w = metrics.MetricsWriter(workdir, active=True)
  try:
    w.write_scalars(1, {"x": 1.0})
    assert w.flush()
    gcs.stop()
    for step in (2, 3):
      w.write_scalars(step, {"x": float(step)})
      w.write_texts(step, {"sample": f"text {step}"})
      assert not w.flush()
  finally:
    gcs.start()
  w.write_scalars(4, {"x": 4.0})
  assert w.flush()
  # The TensorBoard file went up too (its writer thread, which also flushes, is alive).
  assert [f.error for f in w._tb_files] == [None]  # pylint: disable=protected-access
  rows = metrics.read_jsonl(run_files.resolve(workdir) / metrics.METRICS_FILE)
  assert [(r["step"], r["x"]) for r in rows] == [(s, float(s)) for s in range(1, 5)]
  samples = (run_files.resolve(workdir) / metrics.SAMPLES_FILE).read_text().splitlines()
  assert len(samples) == 2
  w.write_scalars(5, {"x": 5.0})
  gcs.stop()
  try:
    t0 = time.monotonic()
    with pytest.raises(run_files.StorageUnavailableError, match="Not written: 1 metric rows"):
      w.close(retry_s=0.5)
    assert time.monotonic() - t0 < 10
  finally:
    gcs.start()


def test_only_outages_are_retried():
  """A missing bucket or object (404) and a 403 are answers, not outages: no retry."""
  calls = []

  def missing():
    calls.append(1)
    raise FileNotFoundError("http://127.0.0.1/b/nope/o?name=run%2Fconfig.json")
  with pytest.raises(FileNotFoundError):
    run_files.retry_transient(missing, what="x", timeout_s=30)
  assert calls == [1]
  assert not run_files.is_transient(OSError("Forbidden: b/run/config.json"))
  assert run_files.is_transient(FileNotFoundError(  # a resumable upload session the server lost
      "http://h/upload/storage/v1/b/b/o?uploadType=resumable&name=x&upload_id=d2c64daf"))
  assert run_files.is_transient(ValueError("UNAVAILABLE: CURL error Could not connect"))
  refused = ConnectionRefusedError(111, "Connect call failed")
  try:
    try:
      raise refused
    except ConnectionRefusedError as e:
      raise RuntimeError("save failed") from e
  except RuntimeError as outer:  # the cause decides
    assert run_files.is_transient(outer)
    assert run_files.describe(outer).startswith("ConnectionRefusedError: ")
  with pytest.raises(run_files.StorageUnavailableError, match="x: storage unreachable for 0 s"):
    run_files.retry_transient(lambda: (_ for _ in ()).throw(refused), what="x", timeout_s=0)


def _in_process_scaled(gcs, monkeypatch) -> None:
  """This process talks to the emulator, with gcsfs's and TensorStore's retry waits scaled by
  SCALE (undone by ``ock.bound_tensorstore_retries()`` at the test's end)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import orbax as ock  # pylint: disable=g-import-not-at-top
  for k, v in gcs.env.items():
    monkeypatch.setenv(k, v)
  gcs.apply_in_process()
  from gcsfs import retry  # pylint: disable=g-import-not-at-top
  real_sleep = asyncio.sleep
  monkeypatch.setattr(retry, "asyncio", types.SimpleNamespace(
      sleep=lambda seconds: real_sleep(seconds * SCALE)))
  ock.bound_tensorstore_retries(6, 1.0 * SCALE, 16.0 * SCALE)


def test_failed_saves_are_warnings_then_a_resave_of_the_same_step_lands(gcs, monkeypatch,
                                                                        caplog):
  """In-process, against the stopped server: two failed saves are one warning each (the async
  one found at the next save), with no third-party traceback logged; storage back, the same
  step is saved again over its partial files (the end of a run retries its last save) and the
  failure count starts over."""
  import logging  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import orbax as ock  # pylint: disable=g-import-not-at-top
  from tests.test_orbax_checkpoint import _small_state  # pylint: disable=g-import-not-at-top
  _in_process_scaled(gcs, monkeypatch)
  bucket = f"b-{uuid.uuid4().hex[:8]}"
  gcs.create_bucket(bucket)
  try:
    with ock.TrainCheckpointer(f"gs://{bucket}/ck", max_consecutive_failed_saves=3) as ck:
      ck.save(1, *_small_state(1))
      assert ck.wait_until_finished()
      caplog.clear()
      with caplog.at_level(logging.WARNING):
        gcs.stop()
        try:
          ck.save(2, *_small_state(2))
          ck.save(3, *_small_state(3))  # finds step 2 failed, then fails itself
          assert not ck.wait_until_finished() and ck.unsaved_failures == 2
        finally:
          gcs.start()
      warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
      assert [w.split(" not saved")[0] for w in warnings] == ["Checkpoint of step 2",
                                                              "Checkpoint of step 3"], warnings
      assert "2 steps unsaved since step 1" in warnings[1]
      assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
      ck.save(3, *_small_state(3))
      assert ck.wait_until_finished() and ck.unsaved_failures == 0
      assert ck.all_steps() == [1, 3]
  finally:
    ock.bound_tensorstore_retries()


def test_a_step_saved_again_counts_each_attempt(gcs, monkeypatch):
  """The end of a run saves its last step again until it lands (`train._last_save_landed`):
  each attempt counts towards max_consecutive_failed_saves, so a long outage at the last step
  stops the run naming the newest checkpoint instead of retrying forever (issue 41)."""
  from dapo_jax.checkpoints import orbax as ock  # pylint: disable=g-import-not-at-top
  from tests.test_orbax_checkpoint import _small_state  # pylint: disable=g-import-not-at-top
  _in_process_scaled(gcs, monkeypatch)
  bucket = f"b-{uuid.uuid4().hex[:8]}"
  gcs.create_bucket(bucket)
  attempts = 0
  try:
    ck = ock.TrainCheckpointer(f"gs://{bucket}/ck", max_consecutive_failed_saves=3)
    ck.save(1, *_small_state(1))
    assert ck.wait_until_finished()
    gcs.stop()
    try:
      ck.save(2, *_small_state(2))
      with pytest.raises(run_files.StorageUnavailableError) as err:
        while not ck.wait_until_finished() and attempts < 6:  # _last_save_landed's loop
          attempts += 1
          ck.save(2, *_small_state(2))
    finally:
      gcs.start()
    ck.close()
  finally:
    ock.bound_tensorstore_retries()
  assert attempts < 3, attempts
  assert "3 saves in a row failed (step 2; " in str(err.value)
  assert "the newest checkpoint is step 1 (1 steps unsaved)" in str(err.value)



def test_close_during_an_outage_warns_and_never_raises_the_clients_error(gcs, monkeypatch,
                                                                           caplog):
  """A run stopped while storage is down closes its checkpointer in teardown. Whether the last
  save is pending (its failure found in `close`) or already failed (nothing pending, Orbax's
  own wait and close meet the outage), `close` warns and returns, so the error that stopped the
  run (e.g. the metrics' `StorageUnavailableError`, exit code 2) is the one the user sees."""
  import logging  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import orbax as ock  # pylint: disable=g-import-not-at-top
  from tests.test_orbax_checkpoint import _small_state  # pylint: disable=g-import-not-at-top
  _in_process_scaled(gcs, monkeypatch)
  bucket = f"b-{uuid.uuid4().hex[:8]}"
  gcs.create_bucket(bucket)
  try:
    for saves_in_outage in (1, 2, 3):  # pending at close; failed in save; over the limit
      ck = ock.TrainCheckpointer(f"gs://{bucket}/ck{saves_in_outage}",
                                 max_consecutive_failed_saves=3)
      ck.save(1, *_small_state(1))
      assert ck.wait_until_finished()
      caplog.clear()
      gcs.stop()
      try:
        with caplog.at_level(logging.WARNING):
          for step in range(2, 2 + saves_in_outage):
            ck.save(step, *_small_state(step))
          ck.close()
      except run_files.StorageUnavailableError:
        assert saves_in_outage == 3  # the third failure in a row stops the run, in `save`
        ck.close()
      finally:
        gcs.start()
      warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
      last = min(saves_in_outage, 2) + 1  # the third failure is the error, not a warning
      assert any(f"step {last} not saved" in w for w in warnings), warnings
  finally:
    ock.bound_tensorstore_retries()
