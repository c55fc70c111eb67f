"""bench/table1_cpu.py and bench/ablation_stats.py: the statistics on synthetic results (checked
against hand-worked cases and an independent least-squares fit), the run plan, and skip/resume."""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import ablation_stats as st  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position
import table1_cpu as T  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_mean_ci_and_paired_difference_by_hand():
  e = st.mean_ci([1.0, 2.0, 3.0])
  assert (e.mean, e.std, e.df) == (2.0, 1.0, 2)
  half = 4.302652729911275 / np.sqrt(3)  # t(0.975, 2) x 1 / sqrt(3)
  assert (e.lo, e.hi) == pytest.approx((2 - half, 2 + half))
  # Paired on the common seeds only (seed 9 has no partner): differences 2, 4.
  d = st.paired_difference({0: 3.0, 1: 5.0, 9: 100.0}, {0: 1.0, 1: 1.0, 2: 7.0})
  assert (d.mean, d.std, d.df) == pytest.approx((3.0, np.sqrt(2), 1))
  assert d.hi == pytest.approx(3 + 12.706204736174698 * np.sqrt(2) / np.sqrt(2))
  with pytest.raises(ValueError, match="No common seed"):
    st.paired_difference({0: 1.0}, {1: 1.0})


def _design(k):
  return np.array([[(i >> j) & 1 for j in range(k)] for i in range(2 ** k)])


def test_factorial_effects_recover_a_noiseless_model():
  x = _design(4)
  s = 2.0 * x - 1.0
  seeds = np.array([0.0, 5.0, -3.0])  # block offsets cancel
  y = (10 + 1.5 * s[:, 0] - 0.5 * s[:, 2] + 0.75 * s[:, 0] * s[:, 1])[:, None] + seeds[None, :]
  eff = {e.term: e.estimate for e in st.factorial_effects(y, x, ["A", "B", "C", "D"])}
  assert len(eff) == 4 + 6
  want = {"A": 3.0, "C": -1.0, "A x B": 1.5}  # twice the +-1 coefficients
  for term, est in eff.items():
    assert est.mean == pytest.approx(want.get(term, 0.0), abs=1e-12), term
    assert est.se == pytest.approx(0.0, abs=1e-12) and est.df == 15 * 2


def test_factorial_effects_match_least_squares_with_blocks():
  rng = np.random.default_rng(0)
  x = _design(3)
  s = 2.0 * x - 1.0
  y = (2 * s[:, 1] + s[:, 0] * s[:, 2])[:, None] + rng.normal(size=(8, 3))
  eff = st.factorial_effects(y, x, ["A", "B", "C"], max_order=3)
  # Independent check: OLS on seed dummies + all 7 +-1 terms; the error is what it leaves.
  terms = [s[:, [0]], s[:, [1]], s[:, [2]], s[:, [0]] * s[:, [1]], s[:, [0]] * s[:, [2]],
           s[:, [1]] * s[:, [2]], s[:, [0]] * s[:, [1]] * s[:, [2]]]
  rows = [np.concatenate([np.eye(3)[j], [t[i, 0] for t in terms]])
          for i in range(8) for j in range(3)]
  a, yy = np.array(rows), y.reshape(-1)
  coef, res, *_ = np.linalg.lstsq(a, yy, rcond=None)
  df = len(yy) - a.shape[1]
  assert df == 14 and eff[0].estimate.df == df
  cov = res[0] / df * np.linalg.inv(a.T @ a)
  for i, e in enumerate(eff):
    assert e.estimate.mean == pytest.approx(2 * coef[3 + i]), e.term
    assert e.estimate.se == pytest.approx(2 * np.sqrt(cov[3 + i, 3 + i])), e.term
    assert e.estimate.hi - e.estimate.mean == pytest.approx(
        st.t_quantile(df) * e.estimate.se)
  assert [e.term for e in eff][3:] == ["A x B", "A x C", "B x C", "A x B x C"]


def test_factorial_effects_reject_incomplete_designs():
  with pytest.raises(ValueError, match="2\\^2 design"):
    st.factorial_effects(np.zeros((3, 2)), _design(2)[:3], ["A", "B"])
  with pytest.raises(ValueError, match="every cell x seed"):
    st.factorial_effects(np.full((4, 2), np.nan), _design(2), ["A", "B"])


def test_plan_names_and_overrides():
  cells = T.factorial_cells()
  assert len(set(cells)) == 16
  plan = T.planned(T.PARTS)
  # 16 cells + Table 1 rows 2 and 3 (the others are cells); Figure 2 reuses two cells.
  assert len(plan) == 18 and len(T.planned(["table1"])) == 6
  assert T.run_name(frozenset(T.FACTORS)) == "ch1_ds1_tl1_so1_of0"
  flags = T.overrides(frozenset(), 16)
  assert "--config.algorithm.clip_ratio_high=0.2" in flags
  assert "--config.algorithm.gen_batch_size=16" in flags
  assert "--config.algorithm.loss_agg_mode=seq-mean-token-mean" in flags
  assert not any("gen_batch_size" in f for f in T.overrides(frozenset({"dynamic_sampling"}), 16))


def _apply(c, flag):
  key, value = flag[len("--config."):].split("=", 1)
  *parents, leaf = key.split(".")
  node = c
  for name in parents:
    node = node[name]
  old = node[leaf]
  node[leaf] = (value == "True") if isinstance(old, bool) else type(old)(value)


def test_all_on_and_all_off_are_the_configs_dapo_and_naive_grpo():
  for variant, tech in (("dapo", frozenset(T.FACTORS)), ("naive_grpo", frozenset())):
    got = T.tiny_config("dapo")
    for flag in T.overrides(tech, got.optim.train_batch_size):
      _apply(got, flag)
    assert got.to_dict() == T.tiny_config(variant).to_dict(), variant


def _rows(before, after, steps=3):
  rows = [{"step": 0, "eval/avg@4": before, "eval/pass@4": 0.9}]
  rows += [{"step": t, "actor/entropy": 1.0 / t, "train/acc_mean": 0.5} for t in range(1, steps)]
  rows.append({"step": steps, "actor/entropy": 0.1, "eval/avg@4": after})
  return rows


class _Interrupted(Exception):
  pass


def test_run_all_skips_finished_runs_and_resumes(tmp_path):
  spec = T.Spec(steps=3, sft_steps=1, eval_every=3)
  calls, warm_calls = [], []

  def warm(results, seed, sft_steps):
    warm_calls.append(seed)
    return f"{results}/ws{seed}", f"hash{seed}" * 8

  def train(tech, seed, spec_, ws, workdir):
    calls.append((T.run_name(tech), seed))
    if len(calls) == 3 and not warm_calls.count("interrupted"):
      warm_calls.append("interrupted")
      raise _Interrupted  # the sitting is interrupted mid-run
    return _rows(0.5, 0.5 + 0.01 * len(tech) + 0.001 * seed)

  configs, res = T.planned(["table1"]), str(tmp_path / "res")
  kw = dict(train=train, warm=warm)
  assert T.run_all(configs, [0, 1], spec, res, str(tmp_path), max_runs=1, **kw) == {
      "planned": 12, "done": 1, "ran": 1, "left": 11}
  with pytest.raises(_Interrupted):
    T.run_all(configs, [0, 1], spec, res, str(tmp_path), **kw)
  assert len(calls) == 3 and calls[0] != calls[1]  # the finished run was skipped
  calls.clear()
  counts = T.run_all(configs, [0, 1], spec, res, str(tmp_path), **kw)
  assert counts == {"planned": 12, "done": 12, "ran": 10, "left": 0}
  assert calls[0] == ("ch1_ds0_tl0_so0_of1", 0)  # the interrupted run is the first again
  assert T.run_all(configs, [0, 1], spec, res, str(tmp_path), **kw)["ran"] == 0
  with open(T.result_path(res, "ch0_ds0_tl0_so0_of0", 1)) as f:
    r = json.load(f)
  assert (r["before"], r["after"], r["warm_start_sha256"]) == (0.5, 0.501, "hash1" * 8)
  assert r["curve"]["entropy"] == [1.0, 0.5, 0.1] and r["eval_curve"]["step"] == [0, 3]
  with pytest.raises(ValueError, match="another --results"):
    T.run_all(configs, [0, 1], T.Spec(steps=4, sft_steps=1, eval_every=3), res, str(tmp_path),
              **kw)
  text = T.report(T.planned(T.PARTS), [0, 1], spec, res)
  # Row 2 (overlong filter) gains 1 point more than row 1 on both seeds: +1.0, std 0.
  row2 = next(l for l in text.splitlines() if l.startswith("| + overlong filtering"))
  assert "| +1.0 [+1.0, +1.0] | 2 |" in row2, row2
  assert "factorial incomplete: 24 of 32 runs missing" in text


def test_diagnostics_by_cell_and_their_factorial_effects():
  seeds = [0, 1, 2]

  def run(cell, seed):
    ch, ds = int("clip_higher" in cell), int("dynamic_sampling" in cell)
    steps = [1, 2]
    curve = {"step": steps, "entropy": [0.05, 0.07], "pg_clipfrac": [0.001, None],
             "response_length_mean": [20.0, 22.0],
             # +0.3 per clip-higher, a seed offset (a block: it cancels in the effects)
             "distinct_answers": [2.0 + 0.3 * ch + 0.1 * seed] * 2,
             # an interaction only: 0.05 more when both are on
             "kept_ratio": [0.4 + 0.05 * ch * ds, 0.4 + 0.05 * ch * ds],
             "num_gen_batches": [1.0, 1.0] if not ds else [1.6 - 0.2 * ch, 2.0 - 0.2 * ch]}
    return {"curve": curve}

  res = {c: {s: run(c, s) for s in seeds} for c in T.factorial_cells()}
  text = T.diagnostics_markdown(res, seeds)
  lines = text.splitlines()
  dapo = next(l for l in lines if l.startswith("| ch1_ds1_tl1_so1 |"))
  # entropy 0.06, distinct 2.3 + 0.1 (seed mean), kept 0.45, clip 0.1% (None skipped), 1.6 gen
  # batches (mean of 1.4 and 1.8), length 21
  assert dapo == "| ch1_ds1_tl1_so1 | 0.0600 | 2.40 | 0.450 | 0.100 | 1.60 | 21.00 |", dapo
  distinct = next(l for l in lines if l.startswith("| distinct answers"))
  assert distinct.split(" | ")[1:] == ["+0.30 [+0.30, +0.30] *", "+0.00 [+0.00, +0.00]",
                                       "+0.00 [+0.00, +0.00] |"], distinct
  kept = next(l for l in lines if l.startswith("| mixed-group share"))
  assert kept.split(" | ")[1:] == ["+0.025 [+0.025, +0.025] *", "+0.025 [+0.025, +0.025] *",
                                   "+0.025 [+0.025, +0.025] * |"], kept
  assert "clip-higher's effect -0.200 [-0.200, -0.200] *." in text
  assert not any(l.startswith("| gen. batches") for l in lines[18:])  # not in the effects table
  del res[frozenset()][2]
  assert T.diagnostics_markdown(res, seeds) == "(needs the complete factorial)"


def test_shards_split_the_plan_without_overlap(tmp_path):
  spec = T.Spec(steps=3, sft_steps=1, eval_every=3)
  ran = {0: [], 1: [], 2: []}

  def warm(results, seed, sft_steps):
    return f"{results}/ws{seed}", "h" * 64

  def train_as(shard):
    def train(tech, seed, spec_, ws, workdir):
      ran[shard].append((T.run_name(tech), seed))
      return _rows(0.5, 0.6)
    return train

  configs, res = T.planned(T.PARTS), str(tmp_path / "res")
  for i in range(3):
    T.run_all(configs, [0, 1], spec, res, str(tmp_path), shard=f"{i}/3", train=train_as(i),
              warm=warm)
  runs = [r for i in range(3) for r in ran[i]]
  assert len(runs) == len(set(runs)) == 36 and all(len(ran[i]) == 12 for i in range(3))
  # The split depends on the plan only, not on what is done: a rerun of any shard runs nothing.
  assert T.run_all(configs, [0, 1], spec, res, str(tmp_path), shard="1/3", train=train_as(1),
                   warm=warm)["ran"] == 0
  for bad in ("3/3", "1", "a/b", "-1/2"):
    with pytest.raises(ValueError, match="--shard"):
      T.parse_shard(bad)


def test_two_by_two_means_and_figure2_arms():
  seeds = [0, 1]

  def run(cell, seed):
    ds, so = int("dynamic_sampling" in cell), int("soft_overlong" in cell)
    gain = 0.10 + 0.05 * ds - 0.07 * so * (1 - ds)  # the soft penalty hurts only without ds
    entropy = [0.08] * 140 + [0.04 + 0.002 * seed] * 20  # only the last 20 steps count
    return {"before": 0.5, "after": 0.5 + gain + 0.01 * seed,
            "curve": {"acc_mean": [0.6 - 0.1 * so], "kept_ratio": [0.4 + 0.02 * ds],
                      "entropy": entropy}}

  res = {c: {s: run(c, s) for s in seeds} for c in T.factorial_cells()}
  lines = T.two_by_two_markdown(res, seeds).splitlines()
  assert lines[2:6] == ["| 0 | 0 | 10.50 | 0.600 | 0.400 |", "| 0 | 1 | 3.50 | 0.500 | 0.400 |",
                        "| 1 | 0 | 15.50 | 0.600 | 0.420 |", "| 1 | 1 | 15.50 | 0.500 | 0.420 |"]
  # Figure 2's arms are DAPO with and without clip-higher: gain 15 (+1 at seed 1), before 50.
  assert lines[7] == ("Figure 2, clip 0.2/0.2: entropy over the last 20 steps 0.0410 +- 0.0014; "
                      "held-out after RL 65.5 +- 0.7."), lines[7]
  del res[frozenset()][1]
  assert T.two_by_two_markdown(res, seeds) == "(needs the complete factorial)"


def test_two_shards_making_one_warm_start_keep_the_first(tmp_path):
  """Shards that both make seed s's warm start: the first published stays, the second's stage
  is dropped; a failure that published nothing is raised."""
  out = str(tmp_path / "seed0_sft600")
  stages = []
  for pid, weights in ((11, "first"), (12, "second")):
    stage = f"{out}.partial-{pid}"
    os.makedirs(stage)
    with open(os.path.join(stage, "model.safetensors"), "w", encoding="utf-8") as f:
      f.write(weights)
    stages.append(stage)
  assert T.publish_once(stages[0], out) == out
  assert T.publish_once(stages[1], out) == out
  assert open(os.path.join(out, "model.safetensors"), encoding="utf-8").read() == "first"
  assert sorted(os.listdir(tmp_path)) == ["seed0_sft600"]
  with pytest.raises(OSError):
    T.publish_once(str(tmp_path / "never_made"), str(tmp_path / "other"))
