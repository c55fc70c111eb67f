"""bench/accelerator.py: its CPU dry run end to end (so it cannot rot) and its arithmetic."""

import os
import re
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import accelerator  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position

from dapo_jax.models import get_preset  # noqa: E402  # pylint: disable=wrong-import-position


def test_dry_run_prints_one_full_table(capsys):
  """`python bench/accelerator.py --dry_run`, in this process (the CLI is main(argv))."""
  accelerator.main(["--dry_run"])
  out = capsys.readouterr()
  rows = [line for line in out.out.splitlines() if line.startswith(("| train", "| decode"))]
  assert [r.split("|")[1].strip() for r in rows] == ["train test", "decode test"]
  for row in rows:  # every cell measured: time, tokens/s, utilisation and a PyTorch ratio
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[2]) > 0 and float(cells[3].replace(",", "")) > 0, row
    assert re.fullmatch(r"\d+\.\d%", cells[5]) and re.fullmatch(r"\d+\.\d\dx", cells[8]), row


def test_model_flops_and_decode_bytes_by_hand():
  cfg = get_preset("qwen2.5-0.5b")
  layer, head = accelerator.matmul_weights(cfg)
  # Non-embedding matmul weights of Qwen2.5-0.5B (biases and norms aside): 357.9M.
  assert layer * cfg.num_hidden_layers == 357_826_560
  assert head == 896 * 151_936
  # 6N per token, the lm_head on response tokens only, causal attention 6 T^2 H E per layer.
  assert accelerator.train_flops(cfg, 1, 4096, 3584) == pytest.approx(
      6 * 357_826_560 * 4096 + 6 * head * 3584 + 6 * 4096**2 * 896 * 24)
  # One row, prompt 1, two new tokens: the one decode step reads the weights and 2 tokens of KV.
  kv_token = 2 * 24 * 2 * 64 * 2
  assert accelerator.decode_bytes(cfg, 1, 1, 2) == pytest.approx(
      2 * (357_826_560 + head) + kv_token * 2)


def test_peak_table_by_device_kind():
  args = types.SimpleNamespace(peak_tflops=0.0, peak_tbps=0.0, dry_run=False)
  assert accelerator.peaks("NVIDIA H200", args)[1:] == (989e12, 4.8e12)
  assert accelerator.peaks("NVIDIA H100 80GB HBM3", args)[1:] == (989e12, 3.35e12)
  assert accelerator.peaks("TPU v5 lite", args)[0] == "TPU v5e"
  assert accelerator.peaks("TPU v5p", args)[0] == "TPU v5p"
  assert accelerator.peaks("TPU v4", args)[1:] == (275e12, 1.2e12)
  args.peak_tflops, args.peak_tbps = 100.0, 2.0
  assert accelerator.peaks("Some GPU", args)[1:] == (100e12, 2e12)


class _Compiled:
  """A compiled step as XLA's memory analysis sees it: 10 GiB fixed, 3 GiB a row."""

  def __init__(self, rows):
    self.rows = rows

  def memory_analysis(self):
    gib = 2**30
    return types.SimpleNamespace(argument_size_in_bytes=6 * gib, output_size_in_bytes=6 * gib,
                                 alias_size_in_bytes=6 * gib,
                                 temp_size_in_bytes=(4 + 3 * self.rows) * gib)


def test_largest_micro_batch_search():
  compiled = []
  compile_at = lambda mb: compiled.append(mb) or _Compiled(mb)
  gib = 2**30
  # 100 GiB: 10 + 3 x 30 fits, so 16 (the largest power of two <= 30) after one probe.
  mb, step = accelerator.largest_micro_batch(compile_at, 100 * gib, 64, grad_bytes=4 * gib)
  assert (mb, step.rows, compiled) == (16, 16, [1, 16])
  # Gradients overstated (6 GiB): 1 GiB a row is assumed, 16 does not fit and is halved.
  compiled.clear()
  mb, _ = accelerator.largest_micro_batch(compile_at, 40 * gib, 64, grad_bytes=6 * gib)
  assert mb == 8 and compiled == [1, 16, 8]
  with pytest.raises(MemoryError, match="one row needs"):
    accelerator.largest_micro_batch(compile_at, 12 * gib, 64, grad_bytes=0)
  assert accelerator.largest_micro_batch(compile_at, None, 4, grad_bytes=0)[0] == 4
