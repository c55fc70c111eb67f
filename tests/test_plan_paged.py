"""``dapo-plan``'s paged-vs-dense rollout estimate (dapo_jax/planner/plan_paged.py): the closed form
against hand arithmetic, and its length mix against the long-tail bench's sampler."""

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

from dapo_jax.planner import plan as plan_lib
from dapo_jax.planner import programs as plan_programs
from dapo_jax.planner import targets as plan_targets
from dapo_jax.planner import plan_estimates as plan_est
from dapo_jax.planner import plan_paged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def _spec(name, *extra):
  """The run spec dapo-plan builds for ``configs/<name>`` with the flags ``extra``."""
  return plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, name), "--target", "cpu:8", *extra]))


def _replace(spec, section, **changes):
  """``spec`` with ``changes`` to one of its sections (a spec is frozen)."""
  return dataclasses.replace(spec, **{section: dataclasses.replace(getattr(spec, section),
                                                                   **changes)})


def test_mix_is_the_long_tail_benchs():
  """The pmf's moments are those of bench/continuous_vs_static.py's draws (mean R/4, 5% at R)."""
  spec = importlib.util.spec_from_file_location(
      "continuous_vs_static", os.path.join(ROOT, "bench", "continuous_vs_static.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  r, g = 20480, 16
  draws = bench.long_tail_lengths(16 * 40_000, r, 0.05, np.random.default_rng(0)).astype(float)
  pmf = plan_paged.LONG_TAIL.pmf(r)
  assert pmf.shape == (r,) and pmf.sum() == pytest.approx(1.0) and pmf[-1] == 0.05
  stats = plan_paged.mix_stats(pmf, 2048, 64, g)
  assert stats.mean == pytest.approx(draws.mean(), rel=0.01)
  assert stats.mean == pytest.approx(plan_est.MEAN_RESPONSE_FRACTION * r, rel=0.01)
  live = (draws * (draws + 1) / 2).sum() / draws.sum()  # tokens a busy slot reads, time-weighted
  assert stats.live_response == pytest.approx(live, rel=0.01)
  assert stats.max_of_group == pytest.approx(draws.reshape(-1, g).max(1).mean(), rel=0.01)


def test_closed_form_by_hand():
  """Tiny shapes, every response at R: pool, pages per busy slot, slots that fit, bytes per
  step and steps, each against the arithmetic written out."""
  spec = _spec("tiny_cpu.py", "--config.mesh=data=2,fsdp=2,tensor=2",
               "--config.rollout.max_concurrent_decodes=16")
  # Pages of 8: two full prompt pages and a partial one.
  spec = _replace(spec, "data", max_prompt_length=20)
  spec = _replace(spec, "rollout", page_size=8, kv_hbm_fraction=0.5)
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  r, g = spec.rollout.max_response_length, spec.rollout.n
  assert (r, g, spec.algorithm.gen_batch_size) == (32, 8, 32)
  chip = plan_est.Chip(flops_per_s=1e12, hbm_bytes_per_s=1e9, source="by hand")
  mib = 2**20
  e = plan_paged.estimate(spec, mcfg, chip, 8, 10 * mib, 2 * mib,
                          mix=plan_paged.LengthMix(at_max=1.0))
  # One token's K and V on a chip: 4 layers x (K, V) x 1 of 2 KV heads x 32 x 4 bytes.
  assert e["kv_bytes_per_token"] == 4 * 2 * 1 * 32 * 4 == 1024
  assert e["page_bytes"] == 8 * 1024 and (e["data_shards"], e["tensor"]) == (4, 2)
  # Half of the 8 MiB left: 4 MiB of 8 KiB pages.
  assert e["kv_budget_bytes"] == 4 * mib and e["pool_pages"] == 512
  # A sample's own pages at response token j: ceil((20 + j) / 8) - 2 (its copy of the partial
  # prompt page first): 1 for j <= 4, then 2, 3, 4 for 8 tokens each, 5 for the last 4:
  # (4 + 16 + 24 + 32 + 20) / 32 = 3 a step. The 2 full prompt pages serve the group's 8
  # samples (all end together): 2 / 8. The queue: 2 / 8 prompts of 3 pages per slot.
  pages = e["pages_per_busy_slot"]
  assert pages["own"] == pytest.approx(3.0)
  assert pages["shared_prompt"] == pytest.approx(0.25)
  assert pages["queue"] == pytest.approx(0.75) and pages["total"] == pytest.approx(4.0)
  assert e["slots_fit_per_shard"] == 512 // 4 == 128
  assert e["full_sample_pages"] == 7  # ceil(52 / 8)
  # Bytes per step on a chip: the matmul weights (untied: the embedding is a lookup) over
  # tensor 2, plus the KV read.
  weights = (mcfg.num_params() - 64 * 128) * 4 / 2
  assert weights == 796_800 * 2
  dense = e["dense"]  # 16 slots, 4 a shard, each reading all 52 positions
  assert dense["bytes"] == pytest.approx(weights + 4 * 52 * 1024)
  # 32 x 8 requests of 32 tokens on 16 slots, 85% busy.
  assert dense["steps"] == pytest.approx(256 * 32 / (16 * 0.85))
  assert dense["seconds"] == pytest.approx(dense["steps"] * dense["bytes"] / 1e9)
  assert dense["bound"] == "memory"
  # Paged at the same 16 slots: 85% of them busy, each reading prompt + (32 + 1) / 2 tokens.
  paged = e["paged_configured"]
  assert paged["bytes"] == pytest.approx(weights + 0.85 * 4 * (20 + 16.5) * 1024)
  assert paged["steps"] == dense["steps"]
  assert e["speedup_configured"] == pytest.approx(dense["bytes"] / paged["bytes"])
  # At the 128 slots a shard that fit: 256 x 32 / (512 x 0.85) = 18.8 steps, but no fewer
  # than the longest response's 32.
  fit = e["paged_fit"]
  assert fit["slots"] == 512 and fit["steps"] == 32
  assert fit["bytes"] == pytest.approx(weights + 0.85 * 128 * 36.5 * 1024)
  # FLOPs: every slot through the matmuls, busy ones attend (4 x layers x heads x 32 x ctx).
  attn = 4.0 * 4 * 4 * 32 * 36.5
  assert fit["flops"] == pytest.approx((128 * 2.0 * 796_800 + 0.85 * 128 * attn) / 2)
  # The dense engine in the same 4 MiB: each slot reserves 52 positions, its queue share
  # 2 x 20 / 8: 4 MiB / (57 x 1024 B) = 71 slots a shard.
  assert e["dense_fit"]["slots"] == 71 * 4
  # A fixed pool (rollout.kv_pages) overrides the budget; too small for one sample, none fit.
  small = plan_paged.estimate(_replace(spec, "rollout", kv_pages=6), mcfg, chip, 8, 10 * mib,
                              2 * mib,
                              mix=plan_paged.LengthMix(at_max=1.0))
  assert small["pool_pages"] == 6 and small["slots_fit_per_shard"] == 0
  assert "paged_fit" not in small
  assert "cannot hold one full-length sample (7 pages)" in "\n".join(
      plan_paged.format_lines(small))


def test_plan_prints_the_paged_estimate_for_the_32b(capsys):
  """The 32B on an analytic target: the issue's per-token figure, and the printed lines."""
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target",
                        "gpu:h200:4x8", "--config.mesh=data=1,fsdp=-1,tensor=8",
                        "--config.optim.micro_batch_size=4"])
  e = plan["paged_estimate"]
  assert e["kv_bytes_per_token"] == 32 * 1024  # 64 layers x (K, V) x 1 KV head x 128 x 2 B
  assert e["dense"]["kv_bytes"] == 64 * 22528 * 32 * 1024  # 64 slots a shard of 704 MiB
  assert e["slots_fit_per_shard"] > 64 and e["speedup_fit"] > e["speedup_configured"] > 1
  text = capsys.readouterr().out
  assert "paged KV rollout ESTIMATE" in text and "slots that fit" in text


def _libtpu_missing() -> str | None:
  if importlib.util.find_spec("libtpu") is None:
    return "libtpu is not installed (pip install 'jax[tpu]' to plan TPU slices on any host)"
  return None


@pytest.mark.skipif(_libtpu_missing() is not None, reason=str(_libtpu_missing()))
@pytest.mark.parametrize("impl,layers", [("ragged_tpu", 1), ("pallas_tpu", 1), ("ragged_tpu", 2)])
def test_tpu_plan_compiles_the_paged_engine_chunk(impl, layers):
  """dapo-plan's paged engine for a v5p slice, compiled by libtpu: the pool sized as the
  engine sizes it (90% of the HBM left, capped at every slot at full length plus the queue),
  laid out per data shard and KV head, the kernel inside the chunk (ragged_tpu with the
  combined K/V pool) and run per device: no operand gathered (temporaries far below the
  pool). One layer of the 0.5B at head_dim 128 (the ragged kernel's lane width); two scanned
  layers with the ragged kernel: the stacked pool read in place, no layer's pool copied (its
  copy-on-write once made libtpu relay the whole stacked pool out, three copies a step)."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  args = plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "smoke_qwen2_5_0_5b.py"), "--target", "tpu:v5p:2x2x1",
      "--config.rollout.max_response_length=64", "--config.reward.overlong_buffer_len=16",
      "--config.data.max_prompt_length=64", "--config.rollout.engine=continuous",
      "--config.rollout.max_concurrent_decodes=8", "--config.mesh=data=2,fsdp=1,tensor=2",
      "--config.rollout.page_size=16", f"--config.rollout.attention_impl={impl}"])
  spec = _replace(plan_lib.configure(args), "model",
                  overrides=dict(num_hidden_layers=layers, head_dim=128))
  target = plan_targets.parse_target(args.target)
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  mesh = shd.make_mesh([("data", 2), ("fsdp", 1), ("tensor", 2)], devices=list(target.devices))
  assert mcfg.scan_layers
  page_bytes = 16 * plan_paged.kv_bytes_per_token(mcfg, 2)
  assert page_bytes == 16 * layers * 2 * 128 * 2  # layers, K and V, 1 of 2 KV heads, bf16
  roomy = plan_paged.engine_spec(spec, mcfg, "tpu", 2, 2, target.hbm_bytes, 0)
  queue = max(2, -(-2 * 8 // spec.rollout.n))  # the sampler's queued prompts of 4 pages
  # The cap: a shard's 4 of the 8 slots x 8 pages (128 tokens), the queue's prompts, + 1.
  assert roomy.num_pages == 4 * 8 + queue * 4 + 1
  resident = target.hbm_bytes - 2**18  # 0.25 MiB left: 0.225 MiB of pages, below the cap
  paged = plan_paged.engine_spec(spec, mcfg, "tpu", 2, 2, target.hbm_bytes, resident)
  assert paged.num_pages == int(0.9 * 2**18) // page_bytes == 28 // layers < roomy.num_pages
  assert paged.shards == 2
  # Compiled with a pool large next to the chunk's other temporaries (the logits' vocabulary).
  paged = dataclasses.replace(paged, num_pages=8192)
  with attention.compile_for("tpu"):
    c = plan_programs.compile_continuous_rollout(
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg), paged)
  assert "oom" not in c and c["paged"] == {"pages_per_shard": 8192, "page_size": 16,
                                           "shards": 2, "impl": impl}
  pool = 8192 * page_bytes  # per chip: its shard's pool, its KV head (64 MiB a layer)
  assert pool <= c["parts"]["engine_state"] <= pool + 2**20
  assert c["kernel_calls"] >= 1  # the Pallas kernel is in the compiled chunk
  assert c["memory"]["temp"] < pool / (4 if layers > 1 else 1)  # no pool gathered or copied
