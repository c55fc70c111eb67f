"""Named scopes on the model's and sampler's pieces, so a profile says where the time goes.

`scoped("rope")` wraps a function in `jax.named_scope`: every op it emits carries the scope in
its HLO ``op_name`` metadata (``.../decode_step/rope/mul``), which XProf, Perfetto traces and
`bench/decode_profile.py` group by. Metadata only: the compiled arithmetic is unchanged.

The scopes, outermost first (`SCOPES` is the order a classifier should try them, innermost
first): ``prefill`` and ``decode_step`` (the model's two inference passes), then inside a layer
``norm``, ``dense`` (every weight matmul, biases included), ``rope``, ``kv_cache_write``,
``attention_core`` (scores, mask, softmax, the value product), and ``lm_head``; ``sample``
(temperature, top-p/top-k, the draw and its log-prob) is the sampler's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])

# Innermost first: the first of these found in an op's name stack is the op's piece.
SCOPES = ("attention_core", "kv_cache_write", "rope", "norm", "lm_head", "dense", "sample")
PHASES = ("prefill", "decode_step")


def scoped(name: str) -> Callable[[F], F]:
  """Decorator: the function's ops are emitted under ``jax.named_scope(name)``."""
  def wrap(fn: F) -> F:
    @functools.wraps(fn)
    def inner(*args, **kwargs):
      with jax.named_scope(name):
        return fn(*args, **kwargs)
    return inner  # type: ignore[return-value]
  return wrap
