"""``dapo-plan``: the ahead-of-time figures are those of the programs the trainer runs."""

import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dapo_jax.planner import plan as plan_lib
from dapo_jax.planner import programs as plan_programs
from dapo_jax.planner import report as plan_report
from dapo_jax.planner import targets as plan_targets
from dapo_jax.infra import sharding as shd
from dapo_jax.models import abstract_model
from dapo_jax.planner import plan_estimates as plan_est
from dapo_jax.trainer import run_setup
from dapo_jax.models import create_model
from dapo_jax.rollout import continuous
from dapo_jax.trainer.train_step import TrainBatch, TrainStep, init_train_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
MESH = "data=2,fsdp=2,tensor=2"


def _tiny_args(*extra):
  return plan_lib._parse(["--config", os.path.join(CONFIGS, "tiny_cpu.py"), "--target", "cpu:8",
                          f"--config.mesh={MESH}", "--config.optim.micro_batch_size=16", *extra])


def _replace(spec, section, **changes):
  """``spec`` with ``changes`` to one of its sections (a spec is frozen)."""
  return dataclasses.replace(spec, **{section: dataclasses.replace(getattr(spec, section),
                                                                   **changes)})


def _model_config(spec):
  return plan_programs.plan_model_config(spec.model, spec.tokenizer)


def _scalars_bytes(n=3):
  return 4 * n  # int32 update step, skipped-update count and rollout step


def test_layers_flag_on_a_config_without_overrides():
  """--layers adds num_hidden_layers to an empty (locked) model.overrides, as the 32B's is."""
  spec = plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target", "cpu:8",
      "--layers", "4"]))
  cfg = _model_config(spec)
  assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.scan_layers) == (4, 5120, True)


@pytest.fixture(scope="module")
def tiny_plan():
  """A 2-layer tiny config's plan on 8 CPU devices, with the estimate's programs compiled."""
  spec = plan_lib.configure(_tiny_args("--layers", "2"))
  return spec, plan_lib.make_plan(spec, plan_targets.parse_target("cpu:8"), estimate=True)


def test_cpu_plan_matches_the_trainers_compiled_step(tiny_plan):
  spec, plan = tiny_plan
  assert _model_config(spec).num_hidden_layers == 2
  train = plan["train"]
  # The plan's memory is XLA's own analysis of the program it compiled ...
  mem = train["memory"]
  assert train["peak"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
  # ... whose inputs are exactly the parts it names (params, Adam moments, batch, 3 scalars).
  p = train["parts"]
  assert mem["argument"] == p["params"] + p["opt_state"] + p["batch"] + _scalars_bytes()
  assert mem["alias"] == p["params"] + p["opt_state"] + _scalars_bytes(2)  # the donated state

  # The same numbers as the step the trainer compiles from real, sharded arrays.
  mesh = run_setup.build_mesh(spec.mesh, spec.dcn_mesh)
  mcfg = _model_config(spec)
  tcfg = spec.train_config()
  graphdef, state = init_train_state(create_model(mcfg, mesh=mesh), tcfg, mesh)
  rows, r = spec.sizes.rows_per_update, spec.rollout.max_response_length
  t = spec.sizes.max_length
  batch = TrainBatch(jnp.zeros((rows, t), jnp.int32), jnp.ones((rows, t), bool),
                     jnp.ones((rows, r), bool), jnp.zeros((rows, r)), jnp.zeros((rows,)),
                     truncated=jnp.zeros((rows,), bool))
  step = TrainStep(graphdef, tcfg, mesh)
  real = step.lower(state, batch).compile().memory_analysis()
  assert mem["argument"] == real.argument_size_in_bytes
  assert mem["output"] == real.output_size_in_bytes
  assert mem["temp"] == real.temp_size_in_bytes

  roll = plan["rollout"]
  assert roll["peak"] == roll["memory"]["argument"] + roll["memory"]["output"] - roll["memory"][
      "alias"] + roll["memory"]["temp"]
  assert 0 < roll["parts"]["kv_cache_estimate"] <= roll["memory"]["temp"]
  # The configured engine (continuous, the default) is the rollout phase's program: the chunk
  # of decode steps, whose inputs hold the engine state the trainer's sampler allocates.
  assert spec.rollout.engine == "continuous"
  cont = plan["continuous_rollout"]
  assert cont["peak"] == cont["memory"]["argument"] + cont["memory"]["output"] - cont["memory"][
      "alias"] + cont["memory"]["temp"]
  sampler = continuous.ContinuousSampler(
      nnx.split(create_model(mcfg))[0], num_slots=spec.rollout.max_concurrent_decodes,
      mesh=mesh, max_prefill_length=spec.data.max_prompt_length)
  stream = sampler.open_stream(nnx.split(create_model(mcfg))[1],
                               params=plan_programs.sampling_params(spec.rollout, mcfg),
                               num_samples=spec.rollout.n, key=jax.random.key(0))
  engine_bytes = sum(x.addressable_shards[0].data.nbytes
                     for x in jax.tree.leaves(stream._engine))  # pylint: disable=protected-access
  assert cont["slots"] == 256 and cont["parts"]["engine_state"] == engine_bytes
  # Phases: the training state stays resident while the rollout copy exists.
  assert plan["phase_peaks"]["rollout"] == train["state_bytes"] + cont["peak"]
  assert plan["peak_bytes"] == max(plan["phase_peaks"].values())
  # Analytic FLOPs of the updates against the compiled count (XLA counts the micro-batch loop
  # body once).
  updates = spec.optim.train_batch_size // spec.optim.mini_batch_size
  compiled = train["flops_compiled"] * train["num_micro_batches"] * plan["num_devices"] * updates
  np.testing.assert_allclose(plan["flops_analytic"]["train"], compiled, rtol=0.1)


def test_static_decode_steps_follow_the_samplers_loops():
  # R = 20480 in 4 loops ending at R/8, R/4, R/2, R; loop i holds P + end_i - 1 cache slots.
  steps = plan_est.static_decode_steps(20480, 4, 2048)
  assert steps == [(2559, 4607), (2560, 7167), (5120, 12287), (10240, 22527)]
  assert sum(n for n, _ in steps) == 20480 - 1  # column 0 comes from the prefill
  # What the cost analysis misses, on the 32B config over 64 chips: 40 head chunks of 512
  # (one counted) and the splash attention (causal: 2 x 40 heads x 128 x T^2 per row, layer).
  spec = plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target", "gpu:h100:1x1",
      "--config.optim.micro_batch_size=8"]))
  mcfg = _model_config(spec)
  miss = plan_est.uncounted_flops(spec, mcfg, 64, splash=True, logit_chunk_size=512)
  head = 39 * 512 * 2.0 * mcfg.vocab_size * 5120 / 64
  attn = 64 * 2.0 * 40 * 128 * 22528**2 / 64
  assert miss["logprob"] == pytest.approx(8 * (attn + head))
  assert miss["train"] == pytest.approx(8 * (3 * 4 / 3 * attn + 4 * head))
  assert miss["prefill"] == pytest.approx(1536 * 64 * 2.0 * 40 * 128 * 2048**2 / 64)
  a, b = plan_est.Cost(10.0, 100.0), plan_est.Cost(30.0, 500.0)
  assert plan_est.interpolate(a, b, 100, 300, 200) == plan_est.Cost(20.0, 300.0)


def test_step_time_estimate_by_hand(tiny_plan):
  spec, plan = tiny_plan
  assert "estimate" not in plan  # no datasheet peaks for a CPU
  chip = plan_est.Chip(flops_per_s=2e9, hbm_bytes_per_s=1e9, source="by hand")
  e = plan_est.step_estimate(spec, plan, chip)
  assert set(e["phases"]) == {"rollout", "old_logprob", "update", "rollout_continuous"}
  roofline = lambda c: max(c["flops"] / 2e9, c["bytes"] / 1e9)
  # Updates: 16 / 4 = 4 per step, each 32 trajectories in 2 micro-batches of 16.
  t = plan["train"]
  assert t["num_micro_batches"] == 2
  assert plan["cost_depths"] == [1, 2]  # the estimate's costs: 1 and 2 layers, extrapolated
  assert plan["train_cost"]["num_micro_batches"] == 2
  update = 4 * 2 * roofline(plan["train_cost"]["cost"])
  assert e["phases"]["update"]["seconds"] == pytest.approx(update)
  # Old log-probs: 16 x 8 = 128 trajectories, 16 per forward micro-batch.
  assert e["phases"]["old_logprob"]["seconds"] == pytest.approx(
      8 * roofline(plan["logprob"]["cost"]))
  # Rollout: one call of 32 prompts (256 rows): a prefill, then R - 1 = 31 decode steps, 15 in
  # the loop over P + 16 - 1 cache slots and 16 in the one over P + 32 - 1 (P: the prompt, 25).
  d, p = plan["decode"], spec.data.max_prompt_length
  short, full = f"decode_step@{p + 15}", f"decode_step@{p + 31}"
  rollout = (roofline(d["prefill"]["cost"]) + 15 * roofline(d[short]["cost"])
             + 16 * roofline(d[full]["cost"]))
  assert e["phases"]["rollout"]["seconds"] == pytest.approx(rollout)
  # The step total takes the configured engine's rollout (the continuous engine by default).
  assert spec.rollout.engine == "continuous" and e["rollout_engine"] == "continuous"
  static = plan_est.step_estimate(_replace(spec, "rollout", engine="static"), plan, chip)
  assert static["step_seconds"] == pytest.approx(
      rollout + update + e["phases"]["old_logprob"]["seconds"])
  # A decode step re-reads the weights and the whole cache: its bytes grow with the cache.
  assert d[full]["cost"]["bytes"] > d[short]["cost"]["bytes"]
  # Continuous: 256 requests of 0.25 x 32 tokens on 256 slots, 85% busy; each of the 32 prompts
  # prefilled once (one enqueue each).
  c = plan["continuous"]
  assert c["enqueue_rows"] == 1 and c["slots"] == spec.rollout.max_concurrent_decodes == 256
  steps = 256 * 0.25 * 32 / (256 * 0.85)
  assert e["phases"]["rollout_continuous"]["seconds"] == pytest.approx(
      32 * roofline(c["enqueue"]["cost"]) + steps * roofline(c["decode_chunk"]["cost"]))
  # MFU: the updates' model FLOPs (6 x params x tokens, no recomputation) over 8 chips' peak.
  assert e["update_mfu"] == pytest.approx(
      plan["flops_analytic"]["update_model"] / (update * 2e9 * 8))
  assert e["missing"] == []
  assert e["step_seconds"] == pytest.approx(e["phases"]["rollout_continuous"]["seconds"] + update
                                            + e["phases"]["old_logprob"]["seconds"])
  # A program that did not compile leaves its phase out, named, and no step total.
  broken = plan | {"logprob": {"error": "TraceContextError: ..."}}
  partial = plan_est.step_estimate(spec, broken, chip)
  assert partial["missing"] == ["old_logprob"] and partial["step_seconds"] is None
  assert partial["phases"]["update"] == e["phases"]["update"]
  assert "old log-probs" in "\n".join(plan_report.format_estimate(broken | {"estimate": partial}))
  text = "\n".join(plan_report.format_estimate(plan | {"estimate": e}))
  for phase in ("rollout (static sampler)", "old log-probs", "updates",
                "rollout (continuous engine)", "ESTIMATE", "MFU"):
    assert phase in text, text


def test_estimate_costs_count_every_layer_of_a_scanned_model():
  """XLA's cost analysis counts a loop body once: a scanned decoder's compiled step counts one
  of its layers. The estimate's cost, extrapolated from 1- and 2-layer unrolled compiles, is the
  full unrolled model's (3 layers here), scanned or not."""
  spec = plan_lib.configure(_tiny_args("--layers", "3"))
  mesh = run_setup.build_mesh(spec.mesh, spec.dcn_mesh)
  unrolled = _model_config(spec).replace(scan_layers=False)
  scanned = unrolled.replace(scan_layers=True)
  full = plan_programs.compile_train_step(spec, unrolled, mesh)
  loop = plan_programs.compile_train_step(spec, scanned, mesh)
  assert loop["flops_compiled"] < 0.8 * full["flops_compiled"]
  est = plan_lib._costs_at_depth(  # pylint: disable=protected-access
      plan_programs.compile_train_cost, mesh, spec=spec, mcfg=scanned)
  assert est["num_micro_batches"] == full["num_micro_batches"]
  assert est["cost"]["flops"] == pytest.approx(full["flops_compiled"], rel=0.02)
  assert est["cost"]["bytes"] == pytest.approx(full["bytes_compiled"], rel=0.1)
  # The merge: costs extrapolated in the depth, compile times added, a failure kept.
  a = {"x": {"cost": {"flops": 10.0, "bytes": 4.0}, "compile_seconds": 1.0, "rows": 8}}
  b = {"x": {"cost": {"flops": 14.0, "bytes": 5.0}, "compile_seconds": 2.0, "rows": 8}}
  assert plan_est.costs_at_depth(a, b, (1, 2), 64) == {
      "x": {"cost": {"flops": 10.0 + 63 * 4.0, "bytes": 4.0 + 63 * 1.0},
            "compile_seconds": 3.0, "rows": 8}}
  oom = {"x": {"oom": {"what": "HLO temporaries"}}}
  assert plan_est.costs_at_depth(a, oom, (1, 2), 64) == oom


def test_cli_overrides_and_json(tmp_path, capsys):
  out = tmp_path / "plan.json"
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target",
                        "gpu:h100:16x8", "--config.mesh=fsdp=-1,tensor=4",
                        "--config.rollout_mesh=[('data', -1), ('tensor', 8)]",
                        "--config.optim.micro_batch_size=64", "--config.model.remat=dots",
                        "--set", "rollout.max_response_length=8192",  # the deprecated alias
                        "--json", str(out)])
  captured = capsys.readouterr()
  text = captured.out
  assert "--set is deprecated" in captured.err
  assert "gpu:h100:16x8 (128 devices)" in text and "phase rollout" in text
  assert plan["mesh"] == [["fsdp", -1], ["tensor", 4]]
  assert plan["rollout_mesh"] == [["data", -1], ["tensor", 8]]
  assert (plan["micro_batch_size"], plan["remat"]) == (64, "dots")
  assert json.loads(out.read_text())["peak_bytes"] == plan["peak_bytes"]
  # A shorter response budget shrinks the KV cache proportionally to P + R.
  short = plan["rollout"]["parts"]["kv_cache_estimate"]
  full = plan_lib.main(["--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target",
                        "gpu:h100:16x8", "--config.rollout_mesh=data=-1,tensor=8"])
  assert full["rollout"]["parts"]["kv_cache_estimate"] * (2048 + 8192) == short * (2048 + 20480)


def test_gpu_plan_is_an_analytic_estimate(capsys):
  plan = plan_lib.main(["--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target",
                        "gpu:h100:16x8", "--config.rollout.prompts_per_call=32"])
  assert "analytic estimate" in capsys.readouterr().out
  assert "memory" not in plan["train"]  # nothing was compiled
  # 32B parameters trained as fp32 master weights split over fsdp=4 x tensor=8 (the config's
  # mesh; data=4 takes the rest), Adam's two moments likewise; rollout holds the bf16 model
  # split over tensor=8.
  n = plan["model_params"]
  assert plan["train"]["parts"]["params"] == n * 4 // 32
  assert plan["train"]["parts"]["opt_state"] == 2 * plan["train"]["parts"]["params"]
  assert plan["rollout"]["parts"]["params"] == n * 2 // 8
  # The paper's micro-batch of 2 trajectories cannot split over 16 batch shards.
  assert any("micro-batch of 2" in w for w in plan["warnings"])


def test_targets_fail_with_a_fix():
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
    plan_targets.parse_target("cpu:64")
  with pytest.raises(ValueError, match="Unknown TPU generation"):
    plan_targets.parse_target("tpu:v9:2x2")
  with pytest.raises(ValueError, match="gpu:<"):
    plan_targets.parse_target("gpu:h100")


def _libtpu_missing() -> str | None:
  if importlib.util.find_spec("libtpu") is None:
    return "libtpu is not installed (pip install 'jax[tpu]' to plan TPU slices on any host)"
  return None


@pytest.mark.skipif(_libtpu_missing() is not None, reason=str(_libtpu_missing()))
def test_tpu_plan_compiles_for_a_topology_on_this_host():
  # The 0.5B preset's shapes with 2 of its 24 layers: the compile takes seconds, not minutes.
  args = plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "smoke_qwen2_5_0_5b.py"), "--target", "tpu:v5p:2x2x1",
      "--config.rollout.max_response_length=64", "--config.reward.overlong_buffer_len=16",
      "--config.data.max_prompt_length=64"])
  spec = _replace(plan_lib.configure(args), "model", overrides=dict(num_hidden_layers=2))
  plan = plan_lib.make_plan(spec, plan_targets.parse_target(args.target))
  assert plan["num_devices"] == 4 and plan["fits"] is True
  assert plan["attention"] == "splash"  # 64 + 64 tokens: the TPU kernel, compiled by libtpu
  mem, p = plan["train"]["memory"], plan["train"]["parts"]
  # TPU buffers are padded to (8, 128) tiles: biases and norm scales take a little more than
  # their logical bytes.
  logical = p["params"] + p["opt_state"] + p["batch"] + _scalars_bytes()
  assert logical <= mem["argument"] <= 1.01 * logical
  assert plan["train"]["peak"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
  assert plan["rollout"]["parts"]["kv_cache_estimate"] <= plan["rollout"]["memory"]["temp"]
  # The step-time estimate: every phase compiled for the topology, decode bound by HBM.
  e = plan["estimate"]
  assert e["missing"] == [] and e["step_seconds"] > 0 and 0 < e["update_mfu"] < 1
  decode = [v for k, v in e["phases"]["rollout"]["programs"].items() if k.startswith("decode")]
  assert decode and all(v["bound"] == "memory" for v in decode)


# What libtpu compiled for the Qwen2.5-32B paper config (one trajectory per chip, 22528 tokens;
# README table): (topology, mesh, micro-batch, activations_and_temp GiB per chip).
_COMPILED_32B = [("v5p:2x4x4", "data=1,fsdp=-1,tensor=8", 4, 36.76),
                 ("v5p:4x4x4", "data=2,fsdp=-1,tensor=8", 8, 35.87),
                 ("v5p:4x4x4", "data=1,fsdp=-1,tensor=8", 8, 28.22),
                 ("v5p:4x4x8", "data=1,fsdp=-1,tensor=8", 16, 24.33)]


@pytest.mark.parametrize("topology,mesh,micro,compiled_gib", _COMPILED_32B)
def test_analytic_rates_reproduce_the_compiles_they_were_fitted_to(topology, mesh, micro,
                                                                   compiled_gib):
  spec = plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target", "gpu:h100:1x1",
      f"--config.mesh={mesh}", f"--config.optim.micro_batch_size={micro}"]))
  chips = int(np.prod([int(x) for x in topology.split(":")[1].split("x")]))
  mem = plan_est.analytic_memory(spec, _model_config(spec), chips)
  estimate = mem["train"]["parts"]["activations_and_temp"] / 2**30
  assert abs(estimate - compiled_gib) <= 0.1 * compiled_gib, (estimate, compiled_gib)


def test_libtpu_compile_env_fills_only_what_the_user_left_unset(monkeypatch):
  env = plan_targets.libtpu_compile_env("tpu:v5p:2x2x1")
  assert env == {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5p-8",
                 "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}
  assert plan_targets.libtpu_compile_env("tpu:v5e:4x4")["TPU_ACCELERATOR_TYPE"] == "v5litepod-16"
  assert plan_targets.libtpu_compile_env("gpu:h100:1x8") == {}
  monkeypatch.setattr(plan_targets, "_has_local_tpu", lambda: False)
  environ = {"TPU_ACCELERATOR_TYPE": "v4-32"}  # the user's value stays
  added = plan_targets.prepare_libtpu_env("tpu:v5p:2x2x1", environ)
  assert environ["TPU_ACCELERATOR_TYPE"] == "v4-32" and "TPU_ACCELERATOR_TYPE" not in added
  assert environ["TPU_WORKER_HOSTNAMES"] == "localhost"
  monkeypatch.setattr(plan_targets, "_has_local_tpu", lambda: True)  # a TPU VM: libtpu's own
  environ = {}
  assert plan_targets.prepare_libtpu_env("tpu:v5p:2x2x1", environ) == {} and environ == {}


@pytest.mark.skipif(_libtpu_missing() is not None, reason=str(_libtpu_missing()))
def test_plan_on_a_cpu_host_opens_without_libtpu_start_up_errors(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  env.update(JAX_PLATFORMS="", XLA_FLAGS="", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, "-c", "from dapo_jax.planner import plan; plan.run()",
       "--config", os.path.join(CONFIGS, "smoke_qwen2_5_0_5b.py"), "--target", "tpu:v5p:2x2x1",
       "--layers=1", "--config.rollout.max_response_length=64",
       "--config.reward.overlong_buffer_len=16", "--config.data.max_prompt_length=64"],
      env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES"):
    assert name not in proc.stderr, proc.stderr[-3000:]


def test_cost_analysis_charges_a_scatter_its_whole_operand():
  """The README's caveat on the continuous engine's estimate, as XLA's cost analysis has it:
  a one-slot-per-row scatter into a cache is charged reading and writing the whole array (2x),
  the static sampler's one-slot dynamic_update_slice nothing of it."""
  n, s = 16, 512
  cache = jnp.zeros((n, 4, s, 32), jnp.float32)
  row = jnp.zeros((n, 4, 1, 32), jnp.float32)

  def bytes_accessed(fn, *args):
    cost = jax.jit(fn, donate_argnums=0).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"] / cache.nbytes

  dus = bytes_accessed(lambda c, u: jax.lax.dynamic_update_slice(c, u, (0, 0, 3, 0)), cache, row)
  scatter = bytes_accessed(
      lambda c, u, i: c.at[jnp.arange(n), :, i].set(u[:, :, 0], unique_indices=True), cache,
      row, jnp.zeros((n,), jnp.int32))
  assert dus < 0.1 and 1.9 < scatter < 2.1, (dus, scatter)


@pytest.mark.skipif(_libtpu_missing() is not None, reason=str(_libtpu_missing()))
def test_tpu_continuous_chunk_takes_the_engine_state_in_the_compilers_layout():
  # With XLA's default layout at the call boundary, libtpu copied the whole stacked KV cache
  # into its loop layout on every chunk call and back out; compiled with the engine state's
  # layouts left to the compiler (what the trainer and the plan run), no whole-cache copy.
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import slot_programs  # pylint: disable=g-import-not-at-top
  from tests.hlo_checks import big_copies  # pylint: disable=g-import-not-at-top
  args = plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "smoke_qwen2_5_0_5b.py"), "--target", "tpu:v5p:2x2x1",
      "--config.rollout.max_response_length=256", "--config.reward.overlong_buffer_len=16",
      "--config.data.max_prompt_length=64", "--config.rollout.max_concurrent_decodes=64"])
  spec = _replace(plan_lib.configure(args), "model", overrides=dict(num_hidden_layers=2))
  target = plan_targets.parse_target(args.target)
  mcfg = _model_config(spec)
  assert mcfg.scan_layers
  mesh = shd.make_mesh([tuple(a) for a in spec.mesh], devices=list(target.devices))
  with attention.compile_for("tpu"):
    progs = plan_programs._continuous_programs(  # pylint: disable=protected-access
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg))
    auto = progs["chunk"].compile()
    state, engine = progs["chunk"].args_info[0][:2]
    graphdef = nnx.graphdef(abstract_model(mcfg))
    sampler = continuous.ContinuousSampler(
        graphdef, num_slots=spec.rollout.max_concurrent_decodes, mesh=mesh)
    shardings = auto.input_shardings[0]
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a._aval.dtype, sharding=s)  # pylint: disable=protected-access
    key_data = jax.random.key_data(jax.random.key(0))
    default = slot_programs.chunk_program.lower(
        jax.tree.map(sds, state, shardings[0]), jax.tree.map(sds, engine, shardings[1]),
        jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=shardings[2]),
        jax.ShapeDtypeStruct((), bool, sharding=shardings[3]), graphdef=graphdef,
        params=plan_programs.sampling_params(spec.rollout, mcfg), mesh=mesh,
        chunk_steps=sampler.chunk_steps, max_admit=sampler.max_admit).compile()
  k = engine.slots.decode.cache.k  # [L, N, K, E, S], N over the 4 chips
  whole_cache = int(np.prod(k.shape)) // 4
  # Copies in the cache's dtype: the fp32 logits [N, V] (151,936 ids) are bigger than this
  # small cache, and the fixed-order log-prob sum relays them out ([16, 1, 16, 9496]).
  hlo_dtype = {"bfloat16": "bf16", "float32": "f32"}[np.dtype(k.dtype).name]
  cache_copies = lambda hlo: [c for c in big_copies(hlo, whole_cache)
                              if c.startswith(hlo_dtype + "[")]
  assert cache_copies(default.as_text())  # the relayout the default layout costs
  assert cache_copies(auto.as_text()) == []
  assert auto.memory_analysis().temp_size_in_bytes < 0.6 * (
      default.memory_analysis().temp_size_in_bytes)


def test_lora_step_flops_and_memory_by_hand():
  """With adapters the updates lose the frozen base's weight gradients and gain the adapters'
  (x @ A) @ B: forward, activation and weight gradients; the old-log-prob forward gains their
  forward; the rollout (merged weights) is unchanged. The adapter count is the one
  `lora.add_adapters` creates, for short names and for a one-layer path pattern."""
  from dapo_jax.models import lora  # pylint: disable=g-import-not-at-top
  from dapo_jax.models.qwen2 import Qwen2ForCausalLM  # pylint: disable=g-import-not-at-top
  full = plan_lib.configure(_tiny_args("--config.model.remat=full"))
  adapted = _replace(full, "model", lora=dataclasses.replace(full.model.lora, rank=4,
                                                             targets=("q", "down")))
  mcfg = _model_config(full)
  d, f, h, e, layers = (mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_attention_heads,
                        mcfg.dim_per_head, mcfg.num_hidden_layers)
  n_ad, n_kernels = layers * 4 * (d + h * e + f + d), layers * (d * h * e + f * d)
  for cfg, targets, want in ((mcfg, ("q", "down"), (n_ad, n_kernels)),
                             (mcfg.replace(scan_layers=False), ("layers.1.self_attn.q_proj",),
                              (4 * (d + h * e), d * h * e))):
    lcfg = lora.LoRAConfig(rank=4, targets=targets)
    assert plan_est.adapter_sizes(cfg, lcfg) == want
    model = nnx.eval_shape(lambda c=cfg, l=lcfg: lora.add_adapters(
        Qwen2ForCausalLM(c, rngs=nnx.Rngs(0)), l))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, lora.Adapter))) == want[0]
  a, b = plan_est.step_flops(full, mcfg), plan_est.step_flops(adapted, mcfg)
  rows, p, r = 16 * full.rollout.n, full.data.max_prompt_length, full.rollout.max_response_length
  t, head = p + r, mcfg.vocab_size * d
  weights = rows * (t * 2 * (plan_est._matmul_params(mcfg) - head) + r * 2 * head)  # pylint: disable=protected-access
  attn = rows * t * 4 * layers * h * e * t
  ad = rows * t * 2 * n_ad
  assert full.optim.train_batch_size == 16 and full.optim.ppo_epochs == 1
  assert a["train"] == pytest.approx(4 * (weights + attn))  # 3 passes + remat's forward
  assert a["update_model"] == pytest.approx(3 * (weights + attn)) and a["merge"] == 0
  assert b["logprob"] == pytest.approx(weights + attn + ad)
  assert b["update_model"] == pytest.approx(2 * weights + 3 * attn + 3 * ad)
  assert b["train"] == pytest.approx(b["update_model"] + weights + attn + ad)
  assert b["rollout"] == a["rollout"] and b["merge"] == 2 * 4 * n_kernels
  assert b["total"] == pytest.approx(b["rollout"] + b["logprob"] + b["train"] + b["merge"])
  # The analytic memory (GPU targets): the adapters trained in fp32 with Adam, the base frozen.
  mem_a = plan_est.analytic_memory(full, mcfg, 8)["train"]
  mem_b = plan_est.analytic_memory(adapted, mcfg, 8)["train"]
  shards, pbytes = 2 * 2, np.dtype(mcfg.param_dtype).itemsize  # fsdp 2 x tensor 2
  assert mem_b["parts"]["params"] == n_ad * 4 // shards
  assert mem_b["parts"]["opt_state"] == 2 * mem_b["parts"]["params"]
  assert mem_b["parts"]["frozen_base"] == mcfg.num_params() * pbytes // shards
  assert mem_a["parts"]["frozen_base"] == 0
  assert mem_b["state_bytes"] == sum(mem_b["parts"][k] for k in
                                     ("params", "opt_state", "frozen_base"))
  # The rollout reads merged kernels over the base: a rollout-layout copy of the base is kept
  # only where training splits it over fsdp (SAMPLE_RULES replicate that axis).
  target = plan_targets.parse_target("gpu:h100:1x8")
  plan = plan_lib.make_plan(adapted, target)
  lr, rparams = plan["lora_rollout"], plan["rollout"]["parts"]["params"]
  assert lr == {"merged": int(rparams * n_kernels / mcfg.num_params()), "resident": rparams}
  assert plan["phase_peaks"]["rollout"] == (mem_b["state_bytes"] + lr["merged"] + rparams
                                            + plan["rollout"]["peak"] - rparams)
  adapted = dataclasses.replace(adapted, mesh=(("data", 4), ("fsdp", 1), ("tensor", 2)))
  assert plan_est.lora_rollout_bytes(adapted, mcfg, 8, rparams)["resident"] == 0
  assert "lora_rollout" not in plan_lib.make_plan(full, target)


class _RefusedProgram:
  """A lowered program whose compile fails as libtpu's scoped-VMEM check did (issue 40)."""

  def as_text(self):
    return "module @jit_chunk_program attributes {mhlo.num_partitions = 8 : i32} {\n..."

  def compile(self):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom: Ran out of memory in memory space vmem "
        "while allocating on stack for %ragged_paged_attention.\nScoped allocation with size "
        "16.41M and limit 16.00M exceeded for scoped vmem\n" + "detail line\n" * 50)


def test_a_compiler_refusal_other_than_hbm_is_one_line_naming_the_program(capsys):
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    cli.exit_on_error("dapo-plan", lambda argv: plan_programs._compile(_RefusedProgram()), [])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith("dapo-plan: error: The compiler refused the program "
                                            "jit_chunk_program: RESOURCE_EXHAUSTED"), err
  assert "16.41M and limit 16.00M" in err and "detail line" not in err


def test_a_refusal_raised_inside_the_compiler_names_its_python_error():
  class _Partitioner(_RefusedProgram):
    def compile(self):
      raise jax.errors.JaxRuntimeError(
          "INTERNAL: custom_partitioner: Traceback (most recent call last):\n  File \"x.py\", "
          "line 3, in f\nIndivisibleError: shape=[2, 1] is incompatible with mesh_shape ...\n")
  with pytest.raises(plan_programs.ProgramCompileError,
                     match=r"jit_chunk_program: IndivisibleError: shape=\[2, 1\]"):
    plan_programs._compile(_Partitioner())


def _uncompilable(x):
  """A program no backend compiles: a call to an FFI handler nobody registered."""
  return jax.ffi.ffi_call("dapo_no_such_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def test_a_refused_program_is_one_line_after_the_plan_of_the_others(monkeypatch, capsys):
  """Issue 50 (13): a compiler error other than an HBM OOM in one of the plan's programs (here
  the train step's builder gives a program the CPU compiler genuinely refuses) ended dapo-plan
  with that error alone. Now the plan of the other programs is printed, then one line naming
  the program, the target and the compiler's message (exit 2)."""
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  real = plan_programs._train_program  # pylint: disable=protected-access

  def train_program(spec, mcfg, mesh):
    _, state, batch, tcfg = real(spec, mcfg, mesh)
    lowered = jax.jit(_uncompilable).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    return lowered, state, batch, tcfg

  monkeypatch.setattr(plan_programs, "_train_program", train_program)
  argv = ["--config", os.path.join(CONFIGS, "tiny_cpu.py"), "--target", "cpu:8", "--layers=1",
          f"--config.mesh={MESH}", "--config.optim.micro_batch_size=16",
          "--config.rollout.engine=static"]  # one rollout program to compile, not two
  with pytest.raises(SystemExit) as e:
    cli.exit_on_error("dapo-plan", plan_lib.main, argv)
  out, err = capsys.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  assert e.value.code == 2 and len(lines) == 1, err
  assert lines[0].startswith("dapo-plan: error: The compiler refused the train step "
                             "(jit__uncompilable) for cpu:8: NOT_FOUND: No FFI handler "
                             "registered for dapo_no_such_kernel"), lines[0]
  assert "the plan above has the other programs" in lines[0], lines[0]
  # The plan was printed: the refused program's row and the others' compiled figures.
  assert "train   peak (refused: no temp)" in out, out
  assert "peak (compiled)" in out and "reshard train->rollout peak" in out, out
  assert "the compiler refused the train step (jit__uncompilable): NOT_FOUND" in out, out
