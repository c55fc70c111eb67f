"""The policy a command evaluates, serves or exports, loaded straight into its sharded layout.

A Hugging Face directory (``spec.model.checkpoint``) is read one tensor at a time
(``load_pretrained``), a training workdir's Orbax checkpoint is restored with target shardings:
either way each device receives only its shard, never a whole copy on one device. The layout is
``sharding.SAMPLE_RULES`` on the run's ``rollout_mesh`` (else its ``mesh``), as the trainer's
rollouts use it; one device gets no mesh at all. ``spec`` is the `RunSpec` of the command's
config (`RunSpec.read` of a workdir's ``config.json``).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from dapo_jax.infra import run_files
from dapo_jax.trainer import run_setup
from dapo_jax.infra import sharding as shd
from dapo_jax.models import abstract_model, create_model, lora
from dapo_jax.spec.run_spec import Mesh as MeshAxes
from dapo_jax.spec.run_spec import ModelSpec, RunSpec


class Policy(NamedTuple):
  graphdef: nnx.GraphDef
  params: nnx.State  # nnx.Param leaves
  rest: nnx.State  # the model's other state (empty for Qwen2ForCausalLM)
  tokenizer: Any
  mesh: Mesh | None
  step: int | None = None  # the Orbax step restored; None for a HF directory

  @property
  def model(self):
    return nnx.merge(self.graphdef, self.params, self.rest)


def sampling_mesh(mesh: MeshAxes, rollout_mesh: MeshAxes = (), dcn_mesh: str = ""
                  ) -> Mesh | None:
  """``rollout_mesh`` (the config's; empty: its ``mesh``) over every device, its slices as
  ``dcn_mesh`` says; None on one device. A mesh that does not fit the devices (one included)
  raises `config.ConfigError`, as dapo-train's validation does."""
  from dapo_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  axes = [tuple(a) for a in (rollout_mesh or mesh)]
  config_lib.check_mesh("rollout_mesh" if rollout_mesh else "mesh", axes, jax.device_count())
  return run_setup.build_mesh(axes, dcn_mesh)


def checkpoint_dir(workdir: str) -> epath.Path:
  return run_files.resolve(workdir) / "checkpoints"


def load_policy(spec: RunSpec, *, workdir: str | None = None, step: int | None = None,
                mesh: Mesh | None = None, rules: shd.Rules = shd.SAMPLE_RULES) -> Policy:
  """The run's tokenizer and params: ``workdir``'s Orbax checkpoint (``step``, default the
  newest readable one), else the HF directory ``spec.model.checkpoint``.

  Params are in ``spec.model.param_dtype`` (an fp32 master checkpoint is cast while read).
  """
  from dapo_jax.checkpoints import orbax as orbax_ckpt  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints.hf import (  # pylint: disable=g-import-not-at-top
      check_checkpoint_dir, load_pretrained)
  m, tok = spec.model, spec.tokenizer
  lora_run = workdir and lora.LoRAConfig.from_config(m.lora).rank
  if not workdir or lora_run:  # its weights (a LoRA run's base) are read: named in one line
    check_checkpoint_dir(m.checkpoint)
  tokenizer = run_setup.build_tokenizer(tok, m.checkpoint)
  if lora_run:
    return _lora_policy(spec, tokenizer, workdir, step, mesh, rules)
  if workdir:
    mcfg = run_setup.model_config(m, tok.kind, tokenizer)
    graphdef, abstract, rest = nnx.split(abstract_model(mcfg), nnx.Param, ...)
    if jax.tree.leaves(rest):
      raise ValueError("The model has non-parameter state that Orbax train checkpoints lack.")
    # A storage outage is waited out as dapo-train's launch waits (checkpoint.storage_wait_s).
    restored = run_files.retry_transient(
        lambda: orbax_ckpt.restore_params_only(
            checkpoint_dir(workdir), step, abstract_params=_targets(abstract, mesh, rules)),
        what=f"--workdir {workdir}", timeout_s=spec.checkpoint.storage_wait_s)
    return Policy(graphdef, restored.params, rest, tokenizer, mesh, restored.step)
  if not m.checkpoint:
    raise ValueError("No weights to load: set --config.model.checkpoint=<HF directory> or pass "
                     "--workdir=<a dapo-train workdir>.")
  run_setup.model_config(m, tok.kind, tokenizer)  # refuses a vocabulary the tokenizer misreads
  model = load_pretrained(os.path.expanduser(m.checkpoint), mesh=mesh, rules=rules,
                          **run_setup.model_runtime(m))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return Policy(graphdef, params, rest, tokenizer, mesh)


def lora_parts(spec: RunSpec, tokenizer, workdir: str, step: int | None, mesh: Mesh | None,
               rules: shd.Rules = shd.SAMPLE_RULES):
  """A LoRA run's pieces: ``(graphdef, base params, rest, adapters (fp32), step)``; the base as
  the run built it (``spec.model.checkpoint``, else the preset at ``spec.seed``), the adapters
  from ``workdir``'s Orbax checkpoint ``step`` (default the newest readable one)."""
  from dapo_jax.checkpoints.hf import load_pretrained  # pylint: disable=g-import-not-at-top
  m = spec.model
  mcfg = run_setup.model_config(m, spec.tokenizer.kind, tokenizer)  # the vocabulary checked first
  if m.checkpoint:
    model = load_pretrained(os.path.expanduser(m.checkpoint), mesh=mesh, rules=rules,
                            **run_setup.model_runtime(m))
  else:
    model = create_model(mcfg, seed=spec.seed, mesh=mesh, rules=rules)
  graphdef, base, rest = nnx.split(model, nnx.Param, ...)
  adapters, step = restore_adapters(m, spec.seed, model, workdir, step, mesh, rules, base=base)
  return graphdef, base, rest, adapters, step


def restore_adapters(m: ModelSpec, seed: int, model, workdir: str, step: int | None,
                     mesh: Mesh | None = None, rules: shd.Rules = shd.SAMPLE_RULES,
                     base: nnx.State | None = None):
  """``(adapters in fp32, step)`` of ``workdir``'s checkpoint for ``model`` (the plain model of
  ``m``, the run's ``model`` with its ``lora`` settings: concrete or abstract; left as it is).
  With ``base`` (``model``'s weights), a checkpoint whose adapters trained on another base is
  refused in one line (``seed``: the run's, a preset base's init)."""
  from dapo_jax.checkpoints import lora_base  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import orbax as orbax_ckpt  # pylint: disable=g-import-not-at-top
  lcfg = lora.LoRAConfig.from_config(m.lora)
  # Shapes only: drawing adapters that the restore replaces would cost a compile and memory.
  adapted = nnx.eval_shape(lambda m: lora.add_adapters(m, lcfg), model)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32),
                          nnx.state(adapted, lora.Adapter))
  restored = orbax_ckpt.restore_params_only(checkpoint_dir(workdir), step,
                                            abstract_params=_targets(abstract, mesh, rules))
  if base is not None:
    lora_base.check(
        f"{checkpoint_dir(workdir)} step {restored.step}", restored.meta.get("lora_base"),
        lora_base.record(m, seed, base),
        "pass the base it trained on "
        "(--config.model.checkpoint=<its HF directory>, or the run's --config.seed for a preset)")
  return restored.params, restored.step


def _lora_policy(spec: RunSpec, tokenizer, workdir, step, mesh, rules) -> Policy:
  """The merged weights (``W + alpha / rank * A @ B``) of a LoRA run's checkpoint."""
  graphdef, base, rest, adapters, step = lora_parts(spec, tokenizer, workdir, step, mesh, rules)
  scale = lora.LoRAConfig.from_config(spec.model.lora).scale
  out = None if mesh is None else shd.state_shardings(base, mesh, rules)
  merged = jax.jit(lambda a, b: lora.merge_adapters(b, a, scale), out_shardings=out)(adapters,
                                                                                   base)
  return Policy(graphdef, merged, rest, tokenizer, mesh, step)


def _targets(abstract: nnx.State, mesh: Mesh | None, rules: shd.Rules) -> nnx.State:
  """Restore targets: shapes and dtypes of ``abstract`` with their sharded layout."""
  if mesh is None:
    return abstract
  shardings = shd.state_shardings(abstract, mesh, rules)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)

