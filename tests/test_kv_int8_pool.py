"""The page pool counts an 8-bit cache's bytes (rollout.kv_cache_dtype): the engine's pool sizing,
the pool's own arrays and dapo-plan's paged estimate all use the quantized sizes, scales
included, so the same kv_hbm_fraction holds about twice a bf16 pool's tokens."""

import dataclasses
import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from dapo_jax.models import create_model, get_preset, kv_quant
from dapo_jax.models import paged_kv as pkv
from dapo_jax.planner import plan_estimates as plan_est
from dapo_jax.planner import plan_paged
from dapo_jax.planner import programs as plan_programs
from dapo_jax.rollout import continuous
from tests.test_plan_paged import CONFIGS, _replace, _spec


def test_an_int8_page_is_its_values_plus_one_scale_per_token_and_head():
  # Qwen2.5-32B's shard at tensor 8: 64 layers, 1 KV head, E = 128, pages of 64, bf16.
  bf16 = pkv.page_bytes(64, 1, 128, 64, "bfloat16")
  int8 = pkv.page_bytes(64, 1, 128, 64, "int8")
  assert bf16 == 2 * 64 * 64 * 128 * 2
  assert int8 == 2 * 64 * 64 * (128 + 4)  # values + a 4-byte fp32 scale per token and head
  assert bf16 / int8 == pytest.approx(1.94, abs=0.01)


@pytest.mark.parametrize("name", ["", "int8", "float8_e4m3fn"])
def test_the_pool_arrays_are_the_bytes_the_engine_counts(name):
  model = create_model(get_preset("test", kv_cache_dtype=name), seed=0)
  cfg = model.config
  cache = jax.eval_shape(lambda: model.init_paged_cache(4, num_pages=10, page_size=8,
                                                        max_pages_per_slot=3))
  pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
  assert pool == 10 * pkv.page_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                     cfg.dim_per_head, 8, cfg.kv_dtype)
  assert jax.tree.leaves(cache.k)[0].dtype == cfg.kv_dtype


class _Device:
  """A device reporting a fixed memory budget (the CPU reports none)."""

  def memory_stats(self):
    return {"bytes_limit": 64 * 2**20, "bytes_in_use": 4 * 2**20}


def test_the_engine_sizes_an_int8_pool_by_its_quantized_bytes(split_model, monkeypatch):
  graphdef, state = split_model
  monkeypatch.setattr(continuous.jax, "local_devices", lambda: [_Device()])

  def pages(kv_cache_dtype):
    model = nnx.merge(graphdef, state)
    model.config = model.config.replace(kv_cache_dtype=kv_cache_dtype)
    sampler = continuous.ContinuousSampler(nnx.split(model)[0], num_slots=4, kv_cache="paged",
                                           page_size=8, kv_hbm_fraction=0.5)
    return sampler._pages_in_budget(state, 8)  # pylint: disable=protected-access

  cfg = nnx.merge(graphdef, state).config  # 2 layers, 2 KV heads, E = 16, fp32
  assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.dim_per_head) == (2, 2, 16)
  budget = int(0.5 * 60 * 2**20)
  per_token_head = {"": 16 * 4, "int8": 16 + 4}
  for name, b in per_token_head.items():
    assert pages(name) == budget // (2 * 2 * 2 * 8 * b), name
  assert pages("int8") / pages("") == pytest.approx(64 / 20, rel=1e-3)


def test_plan_estimate_prices_the_int8_pool_and_its_reads():
  """The by-hand tiny plan of tests/test_plan_paged.py with an int8 cache: a token's K and V on
  a chip are 4 layers x 2 x 1 head x (32 + 4) bytes; the pool, the slots that fit and the
  bytes a step reads follow; the weights' read does not change."""
  spec = _spec("tiny_cpu.py", "--config.mesh=data=2,fsdp=2,tensor=2",
               "--config.rollout.max_concurrent_decodes=16")
  spec = _replace(spec, "data", max_prompt_length=20)
  base = _replace(spec, "rollout", page_size=8, kv_hbm_fraction=0.5)
  int8 = _replace(base, "rollout", kv_cache_dtype="int8")
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  chip = plan_est.Chip(flops_per_s=1e12, hbm_bytes_per_s=1e9, source="by hand")
  mib = 2**20
  run = lambda s: plan_paged.estimate(s, mcfg, chip, 8, 10 * mib, 2 * mib,
                                      mix=plan_paged.LengthMix(at_max=1.0))
  e0, e8 = run(base), run(int8)
  assert e0["kv_bytes_per_token"] == 1024
  assert e8["kv_bytes_per_token"] == 4 * 2 * 1 * (32 + 4) == 288
  assert e8["pool_pages"] == (4 * mib) // (8 * 288) == 1820
  assert e8["slots_fit_per_shard"] == 1820 // 4
  weights = (mcfg.num_params() - 64 * 128) * 4 / 2
  assert e8["dense"]["bytes"] == pytest.approx(weights + 4 * 52 * 288)
  assert e8["paged_configured"]["bytes"] == pytest.approx(weights + 0.85 * 4 * 36.5 * 288)
  # The engine spec dapo-plan compiles sizes its pool the same way.
  paged = plan_paged.engine_spec(int8, mcfg, "tpu", 2, 4, 10 * mib, 2 * mib)
  assert paged.num_pages == min(1820, 16 // 4 * 7 + 4 * 3 + 1)  # capped at every slot full
  assert kv_quant.bytes_per_token_head(32, "int8") * 4 * 2 == 288
  assert np.isclose(e0["pool_pages"] * 1024, e8["pool_pages"] * 288, rtol=1e-3)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install 'jax[tpu]')")
@pytest.mark.parametrize("impl", ["auto", "pallas_tpu", "ragged_tpu"])
def test_tpu_plan_compiles_the_int8_paged_engine_chunk(impl):
  """dapo-plan's int8 paged engine chunk for a v5p slice, compiled by libtpu (one layer of the
  0.5B at head_dim 128, tensor 2): the pool is int8 pages of (128 + 4) bytes a token and KV
  head. "auto" runs the XLA paged path, which reads the pages in place: temporaries below the
  pool. A named kernel is in the chunk, but takes its scales in arrays of its own, so the
  layer's pool is split (pallas_tpu) or dequantized (ragged_tpu) for the call: temporaries
  several times the int8 pool (measured 5.1x and 4.1x), which is why "auto" does not pick it."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  from dapo_jax.planner import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.planner import targets as plan_targets  # pylint: disable=g-import-not-at-top
  args = plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "smoke_qwen2_5_0_5b.py"), "--target", "tpu:v5p:2x2x1",
      "--config.rollout.max_response_length=64", "--config.reward.overlong_buffer_len=16",
      "--config.data.max_prompt_length=64", "--config.rollout.engine=continuous",
      "--config.rollout.max_concurrent_decodes=8", "--config.mesh=data=2,fsdp=1,tensor=2",
      "--config.rollout.page_size=16", f"--config.rollout.attention_impl={impl}",
      "--config.rollout.kv_cache_dtype=int8", "--config.algorithm.rollout_is=token_truncated"])
  spec = _replace(plan_lib.configure(args), "model",
                  overrides=dict(num_hidden_layers=1, head_dim=128))
  target = plan_targets.parse_target(args.target)
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  mesh = shd.make_mesh([("data", 2), ("fsdp", 1), ("tensor", 2)], devices=list(target.devices))
  paged = plan_paged.engine_spec(spec, mcfg, "tpu", 2, 2, target.hbm_bytes, 0)
  paged = dataclasses.replace(paged, num_pages=8192)
  with attention.compile_for("tpu"):
    c = plan_programs.compile_continuous_rollout(
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg), paged)
  assert "oom" not in c
  pool = 8192 * 16 * 2 * (128 + 4)  # per chip: its shard's pool, one KV head, int8 + scales
  assert pool <= c["parts"]["engine_state"] <= pool + 2**20
  if impl == "auto":
    assert c["kernel_calls"] == 0 and c["memory"]["temp"] < pool  # no pool copied
  else:
    assert c["kernel_calls"] >= 1 and c["memory"]["temp"] > 2 * pool  # the split's copies
