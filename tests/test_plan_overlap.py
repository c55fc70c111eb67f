"""``dapo-plan``'s overlap estimate (dapo_jax/planner/plan_overlap.py; issue 37, measurement 5):
the closed form's terms by hand, and the 32B paper config on an analytic v5p-64 (no compiles)."""

import dataclasses
import importlib.util
import os

import pytest

from dapo_jax.planner import plan as plan_lib
from dapo_jax.planner import plan_estimates as plan_est
from dapo_jax.planner import plan_overlap
from dapo_jax.planner import targets as plan_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
V5P_64 = plan_targets.Target("tpu", "v5p:2x4x4", 32, int(95.74 * 2**30), None, "test")


def _spec(name, *extra):
  return plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, name), "--target", "cpu:8", *extra]))


@pytest.fixture(scope="module")
def plan_32b():
  """The padded trainer (optim.packing=False): its closed form against the compiled figures."""
  spec = _spec("dapo_qwen2_5_32b.py", "--config.optim.micro_batch_size=8",
               "--config.rollout.prompts_per_call=48", "--config.optim.packing=False")
  return spec, plan_lib.make_plan(spec, V5P_64)


def test_packing_cuts_the_32b_training_phases(plan_32b):
  """Issue 49's plan goal on the closed form: the paper config packed (its default) trains in
  at most 0.4x the padded phases' time, and the serial step at the published MFU is at most
  1.25 h (2.42 h padded); packed attention stays near the sequences' own causal squares."""
  spec = _spec("dapo_qwen2_5_32b.py", "--config.optim.micro_batch_size=8",
               "--config.rollout.prompts_per_call=48")
  assert spec.optim.packing
  packed = plan_lib.make_plan(spec, V5P_64)
  pk, padded = packed["packing"], plan_32b[1]["overlap_estimate"]["serial"]
  serial = packed["overlap_estimate"]["serial"]
  assert pk["positions_vs_padded"] <= 0.3 and pk["fill"] > 0.9
  assert pk["attention_block"] == 512
  assert 1.0 <= pk["attention_pairs"] / pk["attention_pairs_own_squares"] < 1.3
  assert serial["training"] <= 0.4 * padded["training"]
  assert serial["rollout"] == padded["rollout"]  # packing is the trainer's alone
  assert serial["step_published_mfu"] <= 1.25 * 3600 < padded["step_published_mfu"]


def test_bubble_and_handoff_by_hand():
  # Overlapped: the longer phase, the shorter once per save_every steps (the sync point's
  # serial step), the hand-off; no checkpoints: no bubble.
  assert plan_overlap.avg_step(3.0, 5.0, 0.5, 10) == pytest.approx(5.0 + 0.3 + 0.5)
  assert plan_overlap.avg_step(5.0, 3.0, 0.0, 1) == pytest.approx(8.0)  # every step serial
  assert plan_overlap.avg_step(5.0, 3.0, 0.0, 0) == 5.0
  # Each rollout chip receives its shard; each training chip sends R / T of one.
  assert plan_overlap.handoff_seconds(8e9, 8, 24, 600e9) == pytest.approx(8e9 / 600e9)
  assert plan_overlap.handoff_seconds(8e9, 24, 8, 600e9) == pytest.approx(3 * 8e9 / 600e9)
  assert plan_overlap.handoff_seconds(8e9, 8, 24, None) == 0.0


def test_32b_on_v5p64_serial_vs_overlapped(plan_32b, capsys):
  spec, plan = plan_32b
  oe = plan["overlap_estimate"]
  s = oe["serial"]
  # The serial step: the paged rollout on all 32 chips (slots that fit) + old log-probs +
  # updates; the closed-form old log-probs are the compiled roofline's 989 s within 1%.
  assert s["rollout"] == plan["paged_estimate"]["paged_fit"]["seconds"]
  assert s["step"] == pytest.approx(s["rollout"] + oe["old_logprob_n"] + oe["update_n"])
  assert oe["old_logprob_n"] == pytest.approx(989, rel=0.01)
  assert oe["published_mfu"] == 0.7147 and oe["update_n_published_mfu"] > oe["update_n"]
  # The balance point: a fractional split that ties the serial step, when both phases scale
  # as 1 / chips.
  n, r, t = 32, s["rollout"], s["training"]
  b = oe["balance_rollout_chips"]
  assert b == pytest.approx(n * r / (r + t))
  assert r * n / b == pytest.approx(t * n / (n - b)) == pytest.approx(r + t)
  by_r = {x["rollout_chips"]: x for x in oe["splits"]}
  assert sorted(by_r) == [8, 16, 24]  # multiples of tensor 8 and 4 chips per host
  for x in by_r.values():
    assert x["step"] == pytest.approx(max(x["rollout"], x["training"]) + x["handoff"]
                                      + min(x["rollout"], x["training"]) / 10)
    assert x["training"] == pytest.approx(s["training"] * 32 / x["train_chips"])
  # 8 training chips hold 4x the state of 32: it does not fit and is not recommended.
  assert by_r[24]["train_state_bytes"] == pytest.approx(4 * plan["train"]["state_bytes"])
  assert not by_r[24]["train_fits"] and oe["recommended"] == 16
  # Without the training state the rollout set's pool runs more slots per chip.
  serial_slots = plan["paged_estimate"]["paged_fit"]["slots"] / 32
  assert by_r[16]["slots"] / 16 > serial_slots
  # On this slice no split beats the serial step (the block says so).
  assert by_r[16]["step"] > s["step"]
  print("\n".join(plan_overlap.format_lines(oe)))
  text = capsys.readouterr().out
  assert "overlap ESTIMATE" in text and "overlap does not pay here" in text
  assert "71.47% MFU" in text and "4,800 Gbps" in text


def test_a_split_that_does_not_tile_is_refused(plan_32b):
  spec, plan = plan_32b
  odd = dataclasses.replace(spec, rollout_devices=12)  # 12 chips: not a multiple of tensor 8
  mcfg = plan_lib.plan_model_config(spec.model, spec.tokenizer)
  oe = plan_overlap.for_plan(odd, mcfg, plan, V5P_64)
  row = next(x for x in oe["splits"] if x["rollout_chips"] == 12)
  assert row["configured"] and "do not tile rollout tensor=8" in row["refused"]
  assert oe["recommended"] == 16
  assert "R= 12 T= 20: refused" in "\n".join(plan_overlap.format_lines(oe))


def test_rollout_bound_split_by_hand():
  """Training phases made tiny (a compiled estimate stands in): every split is rollout bound and
  its step is the rollout + the hand-off + the training once per save_every steps."""
  spec = _spec("dapo_qwen2_5_math_7b.py", "--config.rollout.max_concurrent_decodes=16")
  mcfg = plan_lib.plan_model_config(spec.model, spec.tokenizer)
  target = plan_targets.Target("tpu", "v5p:2x4x4", 32, int(95.74 * 2**30), None, "test")
  plan = plan_lib.make_plan(spec, target)
  # Pretend the training phases are tiny next to rollout: the rollout then decides.
  fast = dict(plan, estimate={"phases": {"old_logprob": {"seconds": 1.0},
                                         "update": {"seconds": 2.0}}})
  oe = plan_overlap.for_plan(spec, mcfg, fast, target)
  assert oe["training_basis"].startswith("compiled roofline")
  assert oe["old_logprob_n"] == 1.0 and oe["update_n"] == 2.0
  best = next(x for x in oe["splits"] if x["rollout_chips"] == oe["recommended"])
  assert best["bound"] == "rollout" and best["fits"]
  assert best["step"] == pytest.approx(best["rollout"] + best["handoff"]
                                       + best["training"] / spec.checkpoint.save_every)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None,
                    reason="libtpu installed: TPU targets compile")
def test_dapo_plan_plans_a_tpu_slice_analytically_without_libtpu(capsys):
  t = plan_overlap.analytic_target("tpu:v5p:2x4x4")
  assert t.analytic and t.num_devices == 32 and t.chip == plan_est.CHIPS["v5p"]
  assert "pip install 'jax[tpu]'" in t.why_analytic
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "dapo_qwen2_5_math_7b.py"),
                        "--target", "tpu:v5p:2x2x2"])
  text = capsys.readouterr().out
  assert "analytic estimate" in text and "overlap ESTIMATE" in text
  assert [x["rollout_chips"] for x in plan["overlap_estimate"]["splits"]] == [4]
