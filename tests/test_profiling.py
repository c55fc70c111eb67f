"""Named scopes: every piece of the sampler's compiled program is labelled, numerics unchanged."""

import os
import re
import sys

import jax
import numpy as np
from flax import nnx

from dapo_jax.infra import profiling
from dapo_jax.models import create_model, get_preset
from dapo_jax.rollout import Sampler, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))


def _compiled_op_names(scan_layers: bool) -> set[str]:
  model = create_model(get_preset("test", scan_layers=scan_layers), seed=0)
  graphdef, state = nnx.split(model)
  sampler = Sampler(graphdef)
  ids = np.ones((2, 4), np.int32)
  params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3, eos_ids=())
  text = sampler._program.lower(  # pylint: disable=protected-access
      state, ids, np.ones_like(ids, bool), jax.random.key(0), params=params,
      num_samples=2).compile().as_text()
  return set(re.findall(r'op_name="([^"]*)"', text))


def test_every_scope_labels_ops_of_the_compiled_sampler():
  for scan_layers in (False, True):
    names = _compiled_op_names(scan_layers)
    stacks = [set(n.split("/")) for n in names]
    for scope in profiling.SCOPES + profiling.PHASES:
      assert any(scope in s for s in stacks), (scan_layers, scope)
    for piece in ("dense", "attention_core", "rope", "kv_cache_write", "norm", "lm_head"):
      # The prefill writes no cache step, and the sampler takes the first token's logits
      # outside it.
      one_phase = piece in ("kv_cache_write", "lm_head")
      for phase in ("decode_step",) if one_phase else profiling.PHASES:
        assert any({phase, piece} <= s for s in stacks), (scan_layers, phase, piece)
    # The weight matmuls of a decode step are dense's (not unlabelled dots).
    assert not any(n.endswith("dot_general") and not (
        {"dense", "attention_core", "lm_head"} & set(n.split("/"))) and "decode_step" in n
        for n in names)


def test_decode_profile_classifies_by_innermost_scope():
  import decode_profile  # pylint: disable=g-import-not-at-top
  c = decode_profile.classify
  assert c("jit(_generate_program)/while/body/decode_step/dense/dot_general") == (
      "decode_step", "dense (matmul)")
  assert c("jit(p)/prefill/attention_core/jit(_where)/select_n") == (
      "prefill", "attention_core (elementwise)")
  assert c("jit(p)/while/body/decode_step/kv_cache_write/dynamic_update_slice") == (
      "decode_step", "kv_cache_write")
  assert c("jit(p)/while/body/sample/jit(_gumbel)/add") == ("sampler loop", "sample")
  assert c("jit(p)/while/body/add") == ("sampler loop", "other")


def test_scoped_keeps_the_function():
  @profiling.scoped("piece")
  def f(x, *, y=2):
    """doc"""
    return x * y
  assert f(3, y=4) == 12 and f.__name__ == "f" and f.__doc__ == "doc"
  text = jax.jit(f).lower(np.float32(1)).as_text(debug_info=True)
  assert "piece" in text
