"""Every run artefact on ``gs://``, against a real GCS server (fake-gcs-server on 127.0.0.1).

Metrics JSONL, TensorBoard events, curves, config and final metrics; a HF checkpoint loaded
from the bucket gives the same logits as from disk; tokenizer and datasets read from it; and a
checkpoint restore tells damaged files (quarantined) from I/O errors (retried, then loud).
"""

import gc
import json
import os
import struct
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from dapo_jax.infra import compile_cache
from dapo_jax.infra import curves
from dapo_jax.infra import metrics
from dapo_jax.infra import run_files
from dapo_jax.checkpoints import orbax as ock
from dapo_jax.checkpoints import orbax_read
from tests.gcs_emulator import GcsEmulator
from tests.test_orbax_checkpoint import _restore_small as _restore
from tests.test_orbax_checkpoint import _small_state as _state

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """The server, with this process's clients pointed at it (restored afterwards)."""
  emu = GcsEmulator(str(tmp_path_factory.mktemp("gcs") / "root"))
  emu.start()
  saved = {k: os.environ.get(k) for k in emu.env}
  emu.apply_in_process()
  yield emu
  emu.stop()
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  from etils.epath import gpath  # pylint: disable=g-import-not-at-top
  gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access


@pytest.fixture
def bucket(gcs):
  name = f"b-{uuid.uuid4().hex[:12]}"
  gcs.create_bucket(name)
  return name


def _events(path: epath.Path) -> list:
  """TensorBoard events of one event file (TFRecord framing, tensorboardX's protos)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  data, out, pos = path.read_bytes(), [], 0
  while pos < len(data):
    (n,) = struct.unpack("<Q", data[pos:pos + 8])
    pos += 12  # length + its crc
    event = event_pb2.Event()
    event.ParseFromString(data[pos:pos + n])
    out.append(event)
    pos += n + 4
  return out


def _scalars(tb_dir: epath.Path) -> dict[tuple[str, int], float]:
  return {(v.tag, e.step): v.simple_value for f in sorted(tb_dir.iterdir())
          for e in _events(f) for v in e.summary.value if v.HasField("simple_value")}


def test_metrics_writer_on_gcs_resumes_like_local(gcs, bucket, tmp_path):
  """metrics.jsonl, samples.jsonl, TensorBoard events and curves.png land in the bucket; a
  resumed writer drops rows past the resume step, as on a local disk."""
  for workdir in (f"gs://{bucket}/run", str(tmp_path / "run")):
    with metrics.MetricsWriter(workdir, active=True) as w:
      for step in range(1, 5):
        w.write_scalars(step, {"reward_mean": step / 10, "acc_mean": 1 - step / 10})
        w.write_texts(step, {"sample": f"text {step}"})
        w.flush()
    with metrics.MetricsWriter(workdir, active=True, resume_step=2) as w:
      w.write_scalars(3, {"reward_mean": 0.33})
    root = run_files.resolve(workdir)
    rows = metrics.read_jsonl(root / metrics.METRICS_FILE)
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.33)]
    samples = (root / metrics.SAMPLES_FILE).read_text().splitlines()
    assert [json.loads(s)["step"] for s in samples] == [1, 2]
    curves.plot_curves(root / metrics.METRICS_FILE, root / "curves.png")
    assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scalars = _scalars(root / metrics.TB_SUBDIR)
    assert scalars[("reward_mean", 4)] == pytest.approx(0.4)  # first writer's events
    assert scalars[("reward_mean", 3)] in (pytest.approx(0.3), pytest.approx(0.33))
    assert len(list((root / metrics.TB_SUBDIR).iterdir())) == 2
  names = gcs.object_names(bucket)
  assert "run/metrics.jsonl" in names and "run/curves.png" in names
  assert any(n.startswith("run/tb/events.out.tfevents") for n in names)


def test_run_files_on_gcs(gcs, bucket):
  config = ml_collections.ConfigDict({"a": 1, "b": {"c": "x"}})
  workdir = run_files.prepare_workdir(f"gs://{bucket}/r", config)
  assert run_files.read_json(workdir / run_files.CONFIG_FILE) == {"a": 1, "b": {"c": "x"}}
  run_files.write_final_metrics(workdir, {"acc": 0.5})
  assert run_files.read_json(f"gs://{bucket}/r/final_metrics.json") == {"acc": 0.5}
  assert run_files.resolve("~/x") == epath.Path(os.path.expanduser("~/x"))
  assert str(run_files.resolve("gs://b/~x")) == "gs://b/~x"


def test_compilation_cache_on_gcs(gcs, bucket):
  """JAX's persistent cache reads and writes gs:// through etils.epath: a second "launch" (the
  in-memory caches cleared) loads the program from the bucket instead of compiling it."""
  path = compile_cache.resolve_dir("auto", f"gs://{bucket}/run")
  assert path == f"gs://{bucket}/run/compilation_cache"
  fn = lambda x: jnp.sin(x) * 3.0 + 0.25  # a program no other test compiles
  try:
    compile_cache.enable(path)
    with compile_cache.CompileCounter() as first:
      want = np.asarray(jax.jit(fn)(np.arange(5, dtype=np.float32)))
    assert (first.counts.compiled, first.counts.written) == (1, 1), first.counts
    assert any(n.startswith("run/compilation_cache/") for n in gcs.object_names(bucket))
    jax.clear_caches()
    with compile_cache.CompileCounter() as second:
      got = np.asarray(jax.jit(fn)(np.arange(5, dtype=np.float32)))
    assert (second.counts.compiled, second.counts.loaded) == (0, 1), second.counts
    np.testing.assert_array_equal(got, want)
  finally:
    compile_cache.enable(None)


def _copy_dir(src: str, dst: epath.Path) -> None:
  dst.mkdir(parents=True, exist_ok=True)
  for name in os.listdir(src):
    (dst / name).write_bytes(epath.Path(src, name).read_bytes())


def test_load_pretrained_from_gcs_matches_disk(gcs, bucket, tmp_path):
  """Same params and logits from gs:// as from disk, for a transformers-written checkpoint and
  for our own sharded export written straight to the bucket."""
  from dapo_jax.checkpoints import hf  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tests.hf_fixtures import write_tiny_qwen2  # pylint: disable=g-import-not-at-top
  local = write_tiny_qwen2(str(tmp_path / "tiny"))
  remote = epath.Path(f"gs://{bucket}/models/tiny")
  _copy_dir(local, remote)
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 9)), jnp.int32)

  def logits(model):
    return np.asarray(model(ids))

  from_disk = hf.load_pretrained(local)
  from_gcs = hf.load_pretrained(os.fspath(remote))
  expected = logits(from_disk)
  np.testing.assert_array_equal(logits(from_gcs), expected)
  export = hf.save_pretrained(from_gcs, f"gs://{bucket}/models/export", max_shard_bytes=20_000)
  assert (export / hf.INDEX_FILE).exists()  # several shards, read through the index
  reloaded = hf.load_pretrained(export)
  np.testing.assert_array_equal(logits(reloaded), expected)
  for a, b in zip(jax.tree.leaves(nnx.state(from_disk)), jax.tree.leaves(nnx.state(reloaded))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tokenizer_and_datasets_from_gcs(gcs, bucket, tmp_path):
  from dapo_jax.tokenizers import qwen_vocab  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import CharTokenizer  # pylint: disable=g-import-not-at-top
  from dapo_jax.data import loaders  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import load_tokenizer  # pylint: disable=g-import-not-at-top
  local = qwen_vocab.write_hf_tokenizer_files(tmp_path / "tok")
  remote = epath.Path(f"gs://{bucket}/tok")
  _copy_dir(os.fspath(local), remote)
  text = "Solve 12 + 30 = ? <|im_end|> ünïcode"
  tok_local, tok_remote = load_tokenizer(local, fallback=None), load_tokenizer(remote,
                                                                                fallback=None)
  assert type(tok_remote).__name__ == "HFTokenizer"
  assert tok_remote.encode(text) == tok_local.encode(text)
  assert tok_remote.eos_ids == tok_local.eos_ids
  assert tok_remote.chat_template == tok_local.chat_template
  char_dir = epath.Path(f"gs://{bucket}/char")
  char_dir.mkdir(parents=True)
  (char_dir / CharTokenizer.FILE_NAME).write_text(
      (epath.Path(CharTokenizer().save(tmp_path))).read_text())
  assert load_tokenizer(char_dir, fallback=None).encode("1+2") == CharTokenizer().encode("1+2")

  rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"q{i}"}],
           "ability": "MATH", "reward_model": {"ground_truth": str(i), "style": "rule"},
           "extra_info": {"index": i}} for i in range(50)]
  for suffix in ("parquet", "jsonl"):
    path = f"gs://{bucket}/data/train.{suffix}"
    loaders.write_rows(rows, path)
    records, stats = loaders.load_records(path)
    assert stats.kept == 50 and [r.ground_truth for r in records] == [str(i) for i in range(50)]
  with pytest.raises(FileNotFoundError, match="gs://.*/data/nope.jsonl"):
    loaders.load_records(f"gs://{bucket}/data/nope.jsonl")


# ----------------------------------------------------------------------------
# Restore: damage vs I/O errors.
# ----------------------------------------------------------------------------




def _saved(directory, steps=(1, 2), **kw):
  with ock.TrainCheckpointer(directory, async_save=False) as ck:
    for s in steps:
      ck.save(s, *_state(s), {"s": s})
  return ock.TrainCheckpointer(directory, retry_backoff_s=0.05, **kw)


def _files(directory: epath.Path) -> list[epath.Path]:
  return [f for p in directory.iterdir() for f in (_files(p) if p.is_dir() else [p])]


def _biggest(directory: epath.Path) -> epath.Path:
  return max(_files(directory), key=lambda p: p.stat().length)


@pytest.fixture(autouse=True)
def _reap():
  yield
  gc.collect()


def test_damaged_step_on_gcs_is_quarantined(gcs, bucket):
  """A truncated array file in the bucket: damage, so the step moves to corrupt/ and the
  previous one is restored."""
  root = epath.Path(f"gs://{bucket}/ck")
  ck = _saved(root)
  f = _biggest(root / "2" / "params")
  f.write_bytes(f.read_bytes()[: f.stat().length // 2])
  with ck:
    r = _restore(ck)
    assert r.step == 1 and ck.all_steps() == [1]
  moved = [p.name for p in (root / ock.CORRUPT_SUBDIR).iterdir() if p.name != "README.txt"]
  assert [m.split("-")[0] for m in moved] == ["2"]
  assert (root / ock.CORRUPT_SUBDIR / moved[0] / "params").exists()
  assert not (root / "2").exists()


def _flaky_read(monkeypatch, fails: int, error: Exception) -> list[int]:
  """Orbax's read of a step (`CompositeCheckpointHandler.restore`) raises a real I/O error
  object the first ``fails`` times, then reads for real; returns the call counter."""
  real, calls = ocp.CompositeCheckpointHandler.restore, [0]

  def restore(handler, directory, *args, **kwargs):
    calls[0] += 1
    if calls[0] <= fails:
      raise error
    return real(handler, directory, *args, **kwargs)
  monkeypatch.setattr(ocp.CompositeCheckpointHandler, "restore", restore)
  return calls


@pytest.mark.parametrize("error", [
    ConnectionResetError(104, "Connection reset by peer"),
    ValueError("UNAVAILABLE: Error reading \"params/d/1\": HTTP response code: 503"),
], ids=["connection-reset", "tensorstore-unavailable"])
def test_transient_io_error_is_retried_never_skipped(gcs, bucket, monkeypatch, error):
  root = epath.Path(f"gs://{bucket}/ck")
  ck = _saved(root, read_retries=3)
  calls = _flaky_read(monkeypatch, fails=2, error=error)
  with ck:
    assert _restore(ck).step == 2 and calls == [3]
  # Past the retries: loud, and the newest step is neither skipped nor moved.
  ck = ock.TrainCheckpointer(root, read_retries=2, retry_backoff_s=0.01)
  monkeypatch.undo()
  calls = _flaky_read(monkeypatch, fails=99, error=error)
  with ck, pytest.raises(ock.CheckpointIOError, match=r"step 2 .* 3 attempts.*Nothing was"):
    _restore(ck)
  assert calls == [3]
  assert ck.all_steps() == [1, 2] and not (root / ock.CORRUPT_SUBDIR).exists()


def test_storage_outage_during_restore_is_survived(gcs, bucket):
  """The real server goes away while a restore reads, and is back 3 s later: the newest step
  is restored (the clients' own retries plus ours), nothing is skipped or moved."""
  root = epath.Path(f"gs://{bucket}/ck")
  ck = _saved(root, read_retries=6)
  ck._backoff_s = 0.5  # pylint: disable=protected-access
  gcs.stop()
  back = threading.Timer(3.0, gcs.start)
  back.start()
  try:
    t0 = time.monotonic()
    with ck:
      r = _restore(ck)
  finally:
    back.join()
  assert r.step == 2 and time.monotonic() - t0 >= 2.5
  assert not (root / ock.CORRUPT_SUBDIR).exists()


@pytest.fixture
def fast_gcsfs_backoff(monkeypatch):
  """gcsfs's own retries (6 tries per request, 1+2+4+8+16 s of backoff, not configurable)
  wait 1/50 of their time: the same requests fail against the stopped server, sooner."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from gcsfs import retry  # pylint: disable=g-import-not-at-top
  real_sleep = asyncio.sleep
  monkeypatch.setattr(retry, "asyncio", types.SimpleNamespace(
      sleep=lambda seconds: real_sleep(seconds / 50)))


def test_outage_past_the_retries_fails_loudly(gcs, bucket, fast_gcsfs_backoff):
  del fast_gcsfs_backoff
  root = epath.Path(f"gs://{bucket}/ck")
  ck = _saved(root, read_retries=1)
  gcs.stop()
  try:
    with pytest.raises(ock.CheckpointIOError, match="step 2 .* 2 attempts") as info:
      _restore(ck)
    assert orbax_read.is_io_error(info.value.__cause__)
  finally:
    gcs.start()
  ck.close()
  assert ock.TrainCheckpointer(root).all_steps() == [1, 2]
  assert not (root / ock.CORRUPT_SUBDIR).exists()


def test_is_io_error_classification():
  assert orbax_read.is_io_error(ConnectionRefusedError())
  assert orbax_read.is_io_error(PermissionError())
  assert orbax_read.is_io_error(ValueError("DEADLINE_EXCEEDED: reading gs://b/x"))
  assert not orbax_read.is_io_error(FileNotFoundError("gone"))
  assert not orbax_read.is_io_error(ValueError("OUT_OF_RANGE: Requested byte range [0, 10) is not "
                                               "valid for value of size 5"))
  assert not orbax_read.is_io_error(ock.CorruptCheckpointError("fingerprint"))
  try:
    try:
      raise TimeoutError("read timed out")
    except TimeoutError as inner:
      raise Exception("Encountered error while reading array index") from inner
  except Exception as outer:  # pylint: disable=broad-except
    assert orbax_read.is_io_error(outer)  # the cause decides
  assert not orbax_read.is_io_error(json.JSONDecodeError("x", "doc", 0))
