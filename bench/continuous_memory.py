r"""The continuous engine's rollout phase per chip for a `dapo-plan` row, without the rest.

    python bench/continuous_memory.py --target tpu:v5p:2x4x4 --config.optim.micro_batch_size=4 \
        --config.rollout.prompts_per_call=16 --config.rollout.max_concurrent_decodes=256 \
        --config.mesh=data=1,fsdp=-1,tensor=8            # + --default_layouts: the old boundary

Takes `dapo-plan`'s flags (default config: configs/dapo_qwen2_5_32b.py), compiles only the
continuous engine's chunk (`programs.compile_continuous_rollout`, libtpu for TPU targets) and
prints the chunk's memory by part and the rollout phase per chip: the training state (its
parameters and optimizer state per chip, from the lowered train step, not compiled) plus the
chunk's peak, as in `dapo-plan`'s "rollout phase". `--default_layouts` compiles the chunk with
the engine state in XLA's default layout at the call boundary (as before
`rollout/engine_programs.py`), to compare.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dapo_jax.infra import libtpu_flags  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.planner import plan as plan_lib  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.planner import programs as plan_programs  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.planner import targets as plan_targets  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.infra import sharding as shd  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _default_layout_chunk(state, engine, *, graphdef, params, mesh, chunk_steps, max_admit):
  """The chunk as `slot_programs.chunk_program` lowers it: default layouts at the boundary."""
  import jax  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import engine_programs  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import slot_programs  # pylint: disable=g-import-not-at-top
  rep = engine_programs.replicated_sharding(mesh, state)
  key_data = jax.random.key_data(jax.random.key(0))
  return slot_programs.chunk_program.lower(
      state, engine, jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=rep),
      jax.ShapeDtypeStruct((), bool, sharding=rep), graphdef=graphdef, params=params,
      mesh=mesh, chunk_steps=chunk_steps, max_admit=max_admit)


def main() -> None:
  argv = sys.argv[1:]
  default_layouts = "--default_layouts" in argv
  argv = [a for a in argv if a != "--default_layouts"]
  if not any(a == "--config" or a.startswith("--config=") for a in argv):
    argv = ["--config", os.path.join(ROOT, "configs", "dapo_qwen2_5_32b.py")] + argv
  fv = plan_lib._parse(argv)  # pylint: disable=protected-access
  plan_targets.prepare_libtpu_env(fv.target)
  spec = plan_lib.configure(fv)
  libtpu_flags.apply(spec.tpu_windowed_einsum)
  target = plan_targets.parse_target(fv.target)
  if target.analytic:
    raise SystemExit(f"{fv.target}: no compiler for this target on this host.")
  from dapo_jax.models import attention  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout import engine_programs  # pylint: disable=g-import-not-at-top
  mcfg = plan_programs.plan_model_config(spec.model, spec.tokenizer)
  devices = list(target.devices)
  train_mesh = shd.make_mesh([tuple(a) for a in spec.mesh], devices=devices)
  mesh = shd.make_mesh([tuple(a) for a in (spec.rollout_mesh or spec.mesh)], devices=devices)
  _, tstate, _, _ = plan_programs._train_program(spec, mcfg, train_mesh)  # pylint: disable=protected-access
  sh = shd.state_shardings(tstate, train_mesh, shd.TRAIN_RULES)
  state_bytes = (shd.per_device_bytes(tstate.params, sh.params)
                 + shd.per_device_bytes(tstate.opt_state, sh.opt_state))
  if default_layouts:
    engine_programs.lower_chunk = _default_layout_chunk
  start = time.perf_counter()
  with attention.compile_for(target.kind):
    r = plan_programs.compile_continuous_rollout(
        spec, mcfg, mesh, plan_programs.sampling_params(spec.rollout, mcfg))
  gib = lambda b: round(b / 2**30, 2)
  phase = state_bytes + (r.get("peak") or 0)
  out = {"target": fv.target, "slots": r.get("slots"),
         "layouts": "default" if default_layouts else "compiler's",
         "parts_gib": {k: gib(v) for k, v in r["parts"].items()}, "chunk_peak_gib": gib(
             r.get("peak") or 0), "train_state_gib": gib(state_bytes),
         "rollout_phase_gib": gib(phase), "hbm_gib": gib(target.hbm_bytes or 0),
         "fits": bool(target.hbm_bytes and phase <= target.hbm_bytes and "oom" not in r),
         "oom": r.get("oom"), "compile_s": r.get("compile_seconds"),
         "wall_s": round(time.perf_counter() - start, 1)}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
