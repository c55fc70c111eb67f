"""The KL loss's reference policy (``algorithm.use_kl_loss``): built or read once per launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from dapo_jax.infra import run_files
from dapo_jax.models import lora
from dapo_jax.trainer.train_step import TrainState

REFERENCE_DIR = "reference"  # in the workdir: the KL term's reference weights (Orbax)


def reference_policy(use_kl_loss: bool, param_dtype: str, workdir, state: TrainState,
                     resumed: bool) -> nnx.State | None:
  """The KL loss's reference policy: a frozen copy of the weights RL starts from (after any SFT
  warm start), in ``param_dtype`` (``model.param_dtype``); None, and nothing built, without
  ``use_kl_loss`` (``algorithm.use_kl_loss``). A fresh run writes it to
  ``<workdir>/reference``; a resumed run reads it back from there (the start weights are not in
  the step checkpoints).

  A LoRA run's reference is the base without adapters: zero adapters over the same frozen base
  (B = 0 adds exactly nothing), so no second copy of the weights exists or is written.
  """
  if not use_kl_loss:
    return None
  if lora.has_adapters(state.params):
    return jax.tree.map(jnp.zeros_like, state.params)
  dtype = jnp.dtype(param_dtype)
  cast = lambda x: dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
  path = run_files.resolve(workdir) / REFERENCE_DIR
  checkpointer = ocp.StandardCheckpointer()
  try:
    if resumed:
      if not path.exists():
        raise FileNotFoundError(
            f"{path}: the reference weights of this run (algorithm.use_kl_loss=True) are "
            "missing; they are written when a run starts. Resume with the setting the run "
            "started with, or start a new workdir.")
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, cast(x), sharding=x.sharding), state.params)
      return checkpointer.restore(path, abstract)
    # A copy (new buffers): the train step donates the live params.
    ref = jax.tree.map(lambda x: jnp.array(x, dtype=cast(x), copy=True), state.params)
    checkpointer.save(path, ref, force=True)
    checkpointer.wait_until_finished()
    return ref
  finally:
    checkpointer.close()
