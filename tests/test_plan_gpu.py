"""``dapo-plan`` on GPU targets: the analytic fall-back without the CUDA plugin (any host), and,
where the plugin is installed (``pip install -e '.[cuda]'``; no GPU needed), the GPU programs
compiled for H100 descriptions: the train step with cuDNN attention, the paged engine's chunk
with the Triton kernel reading the stacked pool in place, and the plan's compiled rows.

Run the compiled cases (skipped without the plugin) in a venv that has it:
``python -m pytest -q tests/test_plan_gpu.py`` (docs/planning.md, "GPU targets").
"""

import dataclasses
import os
import re

import pytest

from dapo_jax.planner import gpu_targets
from dapo_jax.planner import plan as plan_lib
from dapo_jax.planner import plan_paged
from dapo_jax.planner import programs as plan_programs
from dapo_jax.planner import targets as plan_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
NO_PLUGIN = gpu_targets.cuda_plugin_missing()

def needs_plugin(test):
  """Compiled by the CUDA plugin: skipped without it (`gpu_compile`: see tests/conftest.py)."""
  return pytest.mark.gpu_compile(
      pytest.mark.skipif(NO_PLUGIN is not None, reason=str(NO_PLUGIN))(test))


def test_without_the_plugin_gpu_targets_are_analytic_and_say_how_to_compile(monkeypatch, capsys):
  """No CUDA plugin: the analytic rows, and the method line says what to install."""
  monkeypatch.setattr(gpu_targets, "cuda_plugin_missing", lambda: "the CUDA plugin is not "
                      "installed; for compiled GPU rows: pip install -e '.[cuda]'")
  assert gpu_targets.prepare_cuda_env("gpu:h100:1x8", environ={}) == {}
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "tiny_cpu.py"),
                        "--target", "gpu:h100:1x8"])
  assert plan["method"].startswith("analytic estimate")
  assert "pip install -e '.[cuda]'" in plan["method"] and "gpu_flags" not in plan
  assert plan["fits"] and plan["train"]["peak"] > 0
  out = capsys.readouterr().out
  assert "analytic estimate" in out and "pip install -e '.[cuda]'" in out
  # No roofline from XLA's cost analysis on GPU (it counts no cuBLAS/cuDNN/Triton call):
  # the update at peak from the analytic FLOPs, a floor.
  floor = plan["gpu_compute_floor"]
  assert floor["update_seconds"] == pytest.approx(
      plan["flops_analytic"]["train"] / (8 * 989e12))
  assert "estimate" not in plan and "compute floor" in out


def test_cuda_env_is_set_before_the_plugin_starts_and_never_over_the_users(monkeypatch):
  """On a host without a GPU the driver check is skipped and the assumed XLA flags appended;
  a value the user set stays; TPU and CPU targets are left alone."""
  monkeypatch.setattr(gpu_targets, "cuda_plugin_missing", lambda: None)
  monkeypatch.setattr(gpu_targets, "_has_local_gpu", lambda: False)
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  added = gpu_targets.prepare_cuda_env("gpu:h200:16x8", environ=env)
  assert added == {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
                   "XLA_FLAGS": "--xla_dump_to=/tmp/x " + " ".join(gpu_targets.XLA_GPU_FLAGS)}
  assert gpu_targets.prepare_cuda_env("gpu:h200:16x8", environ=env) == {}  # already there
  user = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "0",
          "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
  assert gpu_targets.prepare_cuda_env("gpu:h100:1x8", environ=user) == {}
  assert gpu_targets.prepare_cuda_env("tpu:v5p:2x2x1", environ={}) == {}


def test_target_configs_hold_the_datasheet_values():
  h100, h200 = gpu_targets.target_config("h100"), gpu_targets.target_config("h200")
  assert "core_count: 132" in h100 and "memory_bandwidth: 3350000000000" in h100
  assert "cuda_compute_capability { major: 9 minor: 0 }" in h100
  assert "device_memory_size: 150754820096" in h200  # 143,771 MiB (nvidia-smi's H200 figure)
  assert 'platform_name: "CUDA"' in gpu_targets.target_config("a100")


# ---- compiled by the CUDA plugin (skipped without it) ----

def _spec(*extra):
  """A small 0.5B-shaped run (2 layers) for GPU compiles."""
  args = plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "smoke_qwen2_5_0_5b.py"), "--target", "gpu:h100:1x8",
      "--config.rollout.max_response_length=128", "--config.reward.overlong_buffer_len=32",
      "--config.data.max_prompt_length=128", "--config.rollout.engine=continuous",
      "--config.rollout.max_concurrent_decodes=16", "--config.rollout.page_size=16", *extra])
  spec = plan_lib.configure(args)
  return dataclasses.replace(spec, model=dataclasses.replace(
      spec.model, overrides=dict(num_hidden_layers=2)))


def _h100s(shape="1x8"):
  gpu_targets.prepare_cuda_env("gpu:h100:" + shape)
  return plan_targets.parse_target("gpu:h100:" + shape)


@needs_plugin
def test_train_step_compiles_for_8_h100_with_cudnn_attention():
  """The train step at a small config for a 1x8 H100 description: compiled, with "auto"
  attention as the cuDNN flash kernel (its custom call in the HLO), not the XLA einsums."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  target = _h100s()
  assert not target.analytic and target.num_devices == 8
  spec = _spec("--config.mesh=data=1,fsdp=-1,tensor=1")
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", 1)], devices=list(target.devices))
  with attention.compile_for("gpu"):
    assert attention.resolve_impl("auto", dtype=mcfg.jnp_dtype, seq_len=256,
                                  head_dim=mcfg.dim_per_head) == "cudnn"
    lowered = plan_programs._train_program(spec, mcfg, mesh)[0]  # pylint: disable=protected-access
    hlo = lowered.compile().as_text()
  assert "__cudnn$fmha" in hlo  # cuDNN flash attention, forward and backward
  assert "__cudnn$fmhaSoftmaxBackward" in hlo or "Backward" in hlo
  # The padding reaches cuDNN as one bf16 bias per row, built from the keys alone: no [T, T]
  # int32 positions, comparison or dense mask (about 0.5 GiB a GPU at the 32B's 22,528 tokens).
  t = spec.sizes.max_length
  assert re.findall(rf"\w+\[[\d,]*\b{t},{t}\]", hlo) and not re.findall(
      rf"(?:s32|pred)\[[\d,]*\b{t},{t}\]", hlo), t


@needs_plugin
@pytest.mark.parametrize("prompts", [6, 8])
def test_static_prefill_compiles_on_8_h100_whatever_the_prompts_per_call(prompts):
  """The static sampler's prefill of 6 prompts on 8 GPUs failed to compile: cuDNN's partitioner
  refused the batch (IndivisibleError). It takes the XLA attention there; 8 keep cuDNN."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  target = _h100s()
  spec = _spec("--config.rollout.engine=static", f"--config.rollout.prompts_per_call={prompts}",
               f"--config.algorithm.gen_batch_size={4 * prompts}",
               f"--config.optim.train_batch_size={2 * prompts}",
               f"--config.optim.mini_batch_size={2 * prompts}")
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  mesh = shd.make_mesh([("data", 1), ("fsdp", -1), ("tensor", 1)], devices=list(target.devices))
  with attention.compile_for("gpu"):
    rollout = plan_programs.compile_rollout(spec, mcfg, mesh, mesh)
  assert "memory" in rollout and rollout["peak"] > 0


@needs_plugin
def test_paged_chunk_with_the_triton_kernel_reads_the_stacked_pool_in_place():
  """The continuous engine's paged chunk for 2 scanned layers on 8 H100s (data 4, tensor 2):
  pallas_gpu (the GPU's "auto") is the Triton kernel in the compiled chunk, and its
  temporaries hold no layer's pool (a layer's slice was copied for every kernel call)."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  target = _h100s()
  spec = _spec("--config.mesh=data=4,fsdp=1,tensor=2")
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  assert mcfg.scan_layers and mcfg.num_hidden_layers == 2
  mesh = shd.make_mesh([("data", 4), ("fsdp", 1), ("tensor", 2)], devices=list(target.devices))
  paged = plan_paged.engine_spec(spec, mcfg, "gpu", 2, 4, target.hbm_bytes, 0)
  paged = dataclasses.replace(paged, num_pages=65536)  # large next to the other temporaries
  with attention.compile_for("gpu"):
    c = plan_programs.compile_continuous_rollout(
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg), paged)
  assert c["paged"]["impl"] == "pallas_gpu" and "oom" not in c
  layer_pool = 65536 * 16 * plan_paged.kv_bytes_per_token(mcfg.replace(num_hidden_layers=1), 2)
  pool = 2 * layer_pool  # per device: its shard's pages, its KV head, both layers
  assert pool <= c["parts"]["engine_state"] <= pool + 2**21
  assert c["kernel_calls"] >= 1  # the Triton kernel is in the compiled chunk
  # No layer's K and V (half the pool) copied: what is left is the logits and the like.
  assert c["memory"]["temp"] < min(0.05 * pool, layer_pool / 4)


@needs_plugin
def test_dapo_plan_prints_compiled_gpu_rows(capsys):
  """`dapo-plan --target gpu:h100:1x8` compiles: compiled peaks, the fit verdict against the
  H100's memory at the launchers' fraction, and the flags the launchers set."""
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "tiny_cpu.py"), "--target",
                        "gpu:h100:1x8", "--noestimate", "--config.rollout.engine=static"])
  assert plan["method"] == "compiled ahead of time for 8 gpu devices"
  assert "memory" in plan["train"] and "memory" in plan["rollout"] and plan["fits"]
  assert plan["hbm_bytes"] == int(81559 * 2**20 * 0.92)
  out = capsys.readouterr().out
  assert "peak (compiled)" in out and "FITS" in out
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out


@needs_plugin
def test_overlap_split_compiles_each_set_on_its_own_chips(capsys):
  """`rollout_devices=8` of 16 H100s: the overlap block compiles the training set's train step
  on the first 8 (micro-batch halved, a chip keeps its rows) and the rollout set's paged chunk
  on the last 8 with the pool the estimate gave it, each next to the estimate's figure."""
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "tiny_cpu.py"), "--target",
                        "gpu:h100:2x8", "--noestimate", "--config.rollout_devices=8",
                        "--config.algorithm.max_staleness=1",
                        "--config.algorithm.rollout_is=token_truncated"])
  oe = plan["overlap_estimate"]
  cs = oe["compiled_split"]
  assert (cs["rollout_chips"], cs["train_chips"]) == (8, 8)
  assert cs["train_micro_batch_size"] * 2 == plan["micro_batch_size"]
  row = next(s for s in oe["splits"] if s["rollout_chips"] == 8)
  assert cs["slots"] == row["slots"] > 0
  assert cs["rollout"]["paged"]["pages_per_shard"] == row["pool_pages"]
  assert cs["rollout"]["paged"]["impl"] == "pallas_gpu"
  assert cs["train"]["peak"] > 0 and cs["train_fits"] and cs["rollout_fits"]
  # The pool takes most of the rollout chips: their compiled peak is near the estimate's.
  assert 0.9 < cs["rollout"]["peak"] / cs["estimate"]["rollout"] < 1.1
  out = capsys.readouterr().out
  assert "compiled split R=8 T=8: rollout set" in out and "training set" in out
