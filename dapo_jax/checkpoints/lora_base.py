"""Which frozen base a LoRA checkpoint's adapters belong to (``meta["lora_base"]``).

Adapters only mean something on the base they trained on. Each step checkpoint of a LoRA run
saves the base's source and a fingerprint of its weights. Every reader checks it: a resume
(``dapo-train``), ``dapo-eval``, ``dapo-serve`` and ``dapo-export``. A different base is refused
in one line instead of evaluating, serving or exporting the wrong model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # run_spec imports the trainer; this module stays light
  from dapo_jax.spec.run_spec import ModelSpec


def source(m: ModelSpec, seed: int) -> str:
  """The base as ``m`` (the config's ``model``) names it: the HF directory, or the preset and
  the run's ``seed``."""
  return m.checkpoint or f"preset {m.preset} (random init, seed {seed})"


def record(m: ModelSpec, seed: int, base: Any) -> dict[str, Any]:
  """``{"source", "fingerprint", "signature"}`` of ``base`` (the frozen base weights; their
  source as `source` names it)."""
  from dapo_jax.checkpoints import orbax_read  # pylint: disable=g-import-not-at-top
  return {"source": source(m, seed), **orbax_read.fingerprint_record(base)}


def check(where: str, saved: dict[str, Any] | None, have: dict[str, Any] | None,
          fix: str) -> None:
  """Raises ValueError, in one line, when the checkpoint at ``where`` (its ``lora_base``
  record ``saved``) does not belong to the base ``have`` (None: no LoRA on that side).
  ``fix`` is what the user does instead (ends the message)."""
  if saved is None and have is None:
    return
  if saved is None or have is None:
    raise ValueError(f"{where} was written {'without' if saved is None else 'with'} "
                     f"model.lora, and this launch has it {'on' if saved is None else 'off'}: "
                     "use the run's model.lora settings (its config.json) or another workdir.")
  if (saved["fingerprint"], saved["signature"]) != (have["fingerprint"], have["signature"]):
    raise ValueError(f"{where} holds LoRA adapters of the base {saved['source']} (fingerprint "
                     f"{saved['fingerprint']}), not of this launch's {have['source']} "
                     f"(fingerprint {have['fingerprint']}): {fix}.")
