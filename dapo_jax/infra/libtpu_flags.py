"""libtpu compiler options a run sets through ``LIBTPU_INIT_ARGS`` before the TPU backend starts.

``config.tpu_windowed_einsum`` (default False) turns off libtpu's windowed einsum (collective
matmul) for all-gathers and reduce-scatters. From an fsdp degree of 8 up, libtpu rewrites every
layer matmul whose weight is gathered over ``fsdp`` into a windowed-einsum loop whose output
buffers have no inputs, so they are allocated at the top of a micro-batch and stay live through
the forward pass of every layer: the 32B train step's temporaries grow from about 0.17 GB per
layer at fsdp 4 to 1.27 GB at fsdp 8 and 16, and with the loops off drop to 0.24 GB (docs/scale.md,
"libtpu's collective matmuls"). The loops overlap the gathers with compute, so turning them on
may be faster where memory allows.

Every command that compiles for a TPU (dapo-train, dapo-eval, dapo-serve, dapo-plan) applies the
config's options (`apply`, given ``tpu_windowed_einsum``) before JAX starts its backends, so the
plan compiles the program the trainer runs. An option the environment already sets in
``LIBTPU_INIT_ARGS`` wins. The variable is read by libtpu only: CPU and GPU runs ignore it.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping

_log = logging.getLogger(__name__)

ENV = "LIBTPU_INIT_ARGS"
WINDOWED_EINSUM_OFF = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false",
                       "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")


def options(windowed_einsum: bool) -> list[str]:
  """The libtpu options for ``config.tpu_windowed_einsum`` = ``windowed_einsum``."""
  if not isinstance(windowed_einsum, bool):
    raise ValueError(f"config.tpu_windowed_einsum must be True or False, got "
                     f"{windowed_einsum!r}.")
  return [] if windowed_einsum else list(WINDOWED_EINSUM_OFF)


def _name(option: str) -> str:
  return option.split("=", 1)[0]


def apply(windowed_einsum: bool, environ: MutableMapping[str, str] | None = None) -> list[str]:
  """Appends the `options` for ``config.tpu_windowed_einsum`` = ``windowed_einsum`` to
  ``LIBTPU_INIT_ARGS`` (not those the variable already names); returns the options added. Call
  before anything asks JAX for devices."""
  environ = os.environ if environ is None else environ
  current = environ.get(ENV, "").split()
  have = {_name(o) for o in current}
  added = [o for o in options(windowed_einsum) if _name(o) not in have]
  if added:
    environ[ENV] = " ".join(current + added)
    if environ is os.environ and _backends_started():
      _log.warning("%s was set after JAX started its backends: a TPU backend already running "
                   "ignores %s.", ENV, " ".join(added))
  return added


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False
