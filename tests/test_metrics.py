"""Metrics sinks: JSONL rows and resume truncation, TensorBoard events, curves, bar, timer."""

import json
import math
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from dapo_jax.infra import metrics as M
from dapo_jax.infra import curves


def _lines(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _events(logdir):
  """(file, Event) from TFRecord files, parsed here rather than by the writer's own code."""
  out = []
  for name in sorted(os.listdir(logdir)):
    with open(os.path.join(logdir, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event()
      ev.ParseFromString(data[pos + 12:pos + 12 + n])  # 8 length + 4 length-crc bytes.
      out.append((name, ev))
      pos += 12 + n + 4
  return out


def _scalars(logdir):
  return {(v.tag, ev.step): v.simple_value for _, ev in _events(logdir)
          for v in ev.summary.value if v.HasField("simple_value")}


def test_jsonl_rows(tmp_path):
  with M.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.write_scalars(1, {"a": 1, "b": np.float32(2.5), "c": jnp.array(3.0), "ok": True,
                        "nan": math.nan, "inf": -math.inf})
    w.write_scalars(1, {"d": 4})  # Same step: the same row.
    w.write_scalars(2, {"a": 5.5})
    with pytest.raises(ValueError, match="'v' must be a scalar"):
      w.write_scalars(2, {"v": np.ones(3)})
  rows = _lines(tmp_path / M.METRICS_FILE)
  assert rows == [{"step": 1, "a": 1.0, "b": 2.5, "c": 3.0, "ok": 1.0, "nan": None, "inf": None,
                   "d": 4.0}, {"step": 2, "a": 5.5}]
  assert all(type(v) is float for k, v in rows[0].items() if k != "step" and v is not None)
  merged = M.read_jsonl(tmp_path / M.METRICS_FILE)
  assert math.isnan(merged[0]["nan"]) and merged[1] == {"step": 2, "a": 5.5}


def test_resume_drops_later_steps_and_cut_lines(tmp_path):
  with M.MetricsWriter(tmp_path, tensorboard=False) as w:
    for step in range(1, 6):
      w.write_scalars(step, {"loss": float(step)})
      w.write_texts(step, {"sample": f"old {step}"})
      w.flush()
  with open(tmp_path / M.METRICS_FILE, "a", encoding="utf-8") as f:
    f.write('{"step": 6, "lo')  # Cut by the crash.
  # The checkpoint was at step 3: steps 4.. are recomputed by the resumed run.
  with M.MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as w:
    for step in (4, 5):
      w.write_scalars(step, {"loss": 10.0 * step})
      w.write_texts(step, {"sample": f"new {step}"})
  rows = _lines(tmp_path / M.METRICS_FILE)
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0),
                                                    (5, 50.0)]
  texts = _lines(tmp_path / M.SAMPLES_FILE)
  assert [t["text"] for t in texts] == ["old 1", "old 2", "old 3", "new 4", "new 5"]


def test_append_without_resume_step_keeps_rows_and_repairs_last_line(tmp_path):
  path = tmp_path / M.METRICS_FILE
  path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}')  # No final newline.
  with M.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.write_scalars(3, {"a": 3.0})
  assert [r["step"] for r in _lines(path)] == [1, 2, 3]


def test_tensorboard_scalars_texts_and_purge(tmp_path):
  with M.MetricsWriter(tmp_path, jsonl=False) as w:
    for step in range(4):
      w.write_scalars(step, {"train/reward_mean": step / 4, "train/grad_norm": 2.0 * step})
    w.write_texts(3, {"samples/completion": "Answer: 42"})
  tb = tmp_path / M.TB_SUBDIR
  scalars = _scalars(tb)
  assert scalars[("train/reward_mean", 2)] == pytest.approx(0.5)
  assert scalars[("train/grad_norm", 3)] == pytest.approx(6.0)
  assert len(scalars) == 8
  texts = [v for _, ev in _events(tb) for v in ev.summary.value if "completion" in v.tag]
  assert texts and b"Answer: 42" in texts[0].tensor.string_val[0]
  assert not (tmp_path / M.METRICS_FILE).exists()
  # A resumed run from step 1 in the same second: its own file, and a purge marker at step 2.
  with M.MetricsWriter(tmp_path, jsonl=False, resume_step=1) as w:
    w.write_scalars(2, {"train/reward_mean": 0.9})
  files = sorted(os.listdir(tb))
  assert len(files) == 2
  starts = [ev.step for name, ev in _events(tb)
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START]
  assert starts == [2]
  assert _scalars(tb)[("train/grad_norm", 3)] == pytest.approx(6.0)  # Old file intact.


def test_tensorboard_writer_does_not_import_torch(tmp_path):
  """tensorboardX's writer imports torch where it is installed (seconds of every run's start);
  the writer is opened without it, and torch still imports afterwards."""
  pytest.importorskip("torch")  # the test extras install it; without it there is nothing to hide
  code = f"""if True:
    import sys
    from dapo_jax.infra import metrics as M
    with M.MetricsWriter({str(tmp_path)!r}, jsonl=False) as w:
      w.write_scalars(1, {{"a": 1.0}})
    print("torch loaded by the writer:", "torch" in sys.modules)
    import torch
    print("torch after:", torch.zeros(2).sum().item())
  """
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
  assert "torch loaded by the writer: False" in out
  assert "torch after: 0.0" in out
  assert _scalars(tmp_path / M.TB_SUBDIR) == {("a", 1): 1.0}


def test_inactive_writer_writes_nothing(tmp_path):
  with M.MetricsWriter(tmp_path / "run", active=False) as w:
    w.write_scalars(1, {"a": 1.0})
    w.write_texts(1, {"t": "x"})
  assert not (tmp_path / "run").exists()


def test_plot_curves_png(tmp_path):
  with M.MetricsWriter(tmp_path, tensorboard=False) as w:
    for step in range(1, 41):
      w.write_scalars(step, {"train/reward_mean": math.tanh(step / 10),
                             "train/acc_mean": step / 40, "actor/grad_norm": 1 / step,
                             "actor/pg_clipfrac": 0.01, "actor/pg_clipfrac_lower": math.nan,
                             "sampling/kept_ratio": 0.5, "sampling/num_gen_batches": 2})
      if step % 10 == 0:
        w.write_scalars(step, {"eval/avg@32": step / 100, "eval/num_problems": 30})
  out = tmp_path / "curves.png"
  titles = curves.plot_curves(tmp_path / M.METRICS_FILE, out)
  assert titles == ["reward / accuracy (train)", "held-out accuracy", "clip fraction",
                    "grad norm", "dynamic sampling: group ratios",
                    "generation batches per step"]
  data = out.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  img = matplotlib.image.imread(out)
  assert img.shape[0] > 300 and img.shape[1] > 1000  # 2 rows x 3 columns of panels.
  assert img.std() > 0.01  # Not a blank canvas.
  assert curves.plot_curves(tmp_path / M.METRICS_FILE, tmp_path / "one.png",
                       ["actor/grad_norm"]) == ["actor/grad_norm"]
  with pytest.raises(ValueError, match="actor/grad_norm"):
    curves.plot_curves(tmp_path / M.METRICS_FILE, tmp_path / "none.png", ["nothing*"])


def test_progress_bar_fields():
  bar = M.ProgressBar(10, initial=2, disable=False)
  bar.update(3, {"train/reward_mean": 0.5, "sampling/kept_ratio": 0.25, "other": 1.0})
  assert bar.n == 3
  assert "reward=0.5" in bar.postfix and "kept=0.25" in bar.postfix
  assert "acc" not in bar.postfix and "other" not in bar.postfix
  bar.update(5)
  assert bar.n == 5
  bar.close()


def test_timer_accumulates_per_phase(monkeypatch):
  clock = iter([0.0, 1.5, 10.0, 10.25, 20.0, 23.0])
  monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
  timer = M.Timer()
  with timer("rollout"):
    pass
  with timer("update"):
    pass
  with pytest.raises(RuntimeError), timer("rollout"):
    raise RuntimeError("a failing phase is still timed")
  assert timer.pop() == {"time/rollout": 4.5, "time/update": 0.25}
  assert timer.pop() == {}
