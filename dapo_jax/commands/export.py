"""``dapo-export``: a training run's checkpoint as a Hugging Face directory (vLLM, lm-eval, ...).

  dapo-export --workdir gs://bucket/run --out ~/exports/run-step200 --step 200
  dapo-export --workdir /tmp/dapo_tiny --out /tmp/tiny_hf --config.model.param_dtype=float32

The run's saved config.json names the architecture; params are restored sharded over every
device (``--config.mesh`` / ``--config.rollout_mesh``), cast to ``config.model.param_dtype``
(the run's dtype; fp32 masters with ``--config.model.param_dtype=float32``) and written one
tensor at a time as safetensors with config.json and the tokenizer files. ``--workdir`` and
``--out`` may be local or any etils.epath location (gs://...).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Sequence

import jax
from absl import flags
from etils import epath

from dapo_jax.spec import cli
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer import policy as policy_lib
from dapo_jax.checkpoints import hf

_log = logging.getLogger(__name__)


def _define(fv) -> None:
  flags.DEFINE_string("workdir", None, "The dapo-train workdir (local or gs://).",
                      flag_values=fv)
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest readable one).",
                       flag_values=fv)
  flags.DEFINE_string("out", None, "Output directory (local or gs://).", flag_values=fv)
  flags.DEFINE_integer("max_shard_gib", 2, "Largest safetensors file, GiB.", flag_values=fv)
  flags.DEFINE_bool("peft", False, "A model.lora run: write its adapters as a peft adapter "
                    "directory (adapter_config.json + adapter_model.safetensors) instead of the "
                    "merged weights.", flag_values=fv)
  flags.mark_flags_as_required(["workdir", "out"], flag_values=fv)
  cli.define_verbose(fv)


def export_peft(spec: RunSpec, workdir: str, out: str, *, step: int | None = None) -> int:
  """Writes the adapters of a LoRA run (``spec``, its config.json's) at ``step`` (default the
  newest readable) to ``out`` as a peft adapter directory; returns the step written."""
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import peft_adapter  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import abstract_model, lora  # pylint: disable=g-import-not-at-top
  m, tok = spec.model, spec.tokenizer
  lcfg = lora.LoRAConfig.from_config(m.lora)
  if not lcfg.rank:
    raise ValueError(f"--peft: {workdir} trained every parameter (model.lora.rank=0), so it has "
                     "no adapters; export it without --peft.")
  tokenizer = run_setup.build_tokenizer(tok, m.checkpoint)
  model = abstract_model(run_setup.model_config(m, tok.kind, tokenizer))
  adapters, step = policy_lib.restore_adapters(m, spec.seed, model, workdir, step)
  stage = out if "://" not in out else tempfile.mkdtemp(prefix="dapo_export_")
  try:
    if jax.process_index() == 0:
      peft_adapter.save_peft_adapter(adapters, lcfg, stage, base_model=m.checkpoint)
      if stage != out:
        epath.Path(out).mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(stage)):
          epath.Path(stage, name).copy(epath.Path(out) / name, overwrite=True)
  finally:
    if stage != out:
      shutil.rmtree(stage, ignore_errors=True)
  return step


def export(spec: RunSpec, workdir: str, out: str, *, step: int | None = None,
           max_shard_bytes: int = 2 << 30) -> int:
  """Writes ``workdir``'s checkpoint (``step``, default the newest readable) to ``out`` as HF
  files, as ``spec`` (its config.json's, with the command's overrides) lays out and casts it;
  returns the step written. A model.lora run's adapters are merged into its base."""
  mesh = policy_lib.sampling_mesh(spec.mesh, spec.rollout_mesh, spec.dcn_mesh)
  policy = policy_lib.load_policy(spec, workdir=workdir, step=step, mesh=mesh)
  dest = epath.Path(out)
  local = "://" not in out
  stage = out if local else tempfile.mkdtemp(prefix="dapo_export_")
  try:
    tok_dir = spec.tokenizer.path or spec.model.checkpoint or None
    hf.save_pretrained(policy.model, stage, max_shard_bytes=max_shard_bytes,
                       tokenizer_dir=tok_dir)
    if jax.process_index() == 0:
      has_tokenizer = any(os.path.exists(os.path.join(stage, f)) for f in hf.TOKENIZER_FILES)
      if not has_tokenizer and hasattr(policy.tokenizer, "save"):
        policy.tokenizer.save(stage)  # the char tokenizer, built in code
      elif not has_tokenizer:
        _log.warning("No tokenizer files found to copy (config.tokenizer.path / "
                     "config.model.checkpoint): add them to %s before loading it elsewhere.", out)
      if not local:
        dest.mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(stage)):
          epath.Path(stage, name).copy(dest / name, overwrite=True)
  finally:
    if not local:
      shutil.rmtree(stage, ignore_errors=True)
  return policy.step


def main(argv: Sequence[str]) -> str:
  fv = cli.parse("dapo-export", __doc__, argv, _define, cli.workdir_default)
  from dapo_jax.infra import console_log  # pylint: disable=g-import-not-at-top
  console_log.configure_logging(stderr=True, verbose=fv.verbose)  # third-party chatter off
  from dapo_jax.infra import distributed  # pylint: disable=g-import-not-at-top
  distributed.maybe_initialize()
  workdir, out = cli.expand(fv.workdir), cli.expand(fv.out)
  spec = RunSpec.read(fv.config)  # the run's saved config, not judged again
  if fv.peft:
    step = export_peft(spec, workdir, out, step=fv.step)
  else:
    step = export(spec, workdir, out, step=fv.step, max_shard_bytes=fv.max_shard_gib << 30)
  if jax.process_index() == 0:
    print(f"dapo-export: wrote step {step} of {workdir} "
          f"({policy_lib.checkpoint_dir(workdir) / str(step)}) to {out} "
          f"({spec.model.param_dtype})", flush=True)
  return out


def run() -> None:
  """Console entry point of ``dapo-export``."""
  cli.exit_on_error("dapo-export", main)
