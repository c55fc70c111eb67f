"""An int8 KV cache through the other samplers: the JetStream engine (dapo-serve; dense and
paged slots give the same tokens, its log-probs the int8 cache's) and the static sampler
(dapo-eval's), each near the default cache's log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dapo_jax
from dapo_jax.rollout import jetstream_engine as je
from dapo_jax.rollout.sampler import generate
from dapo_jax.rollout.sampling import SamplingParams
from tests import rollout_fixtures
from tests.test_jetstream_engine import NEIGHBOUR, PROMPT, R, _requests


def _model(kv_cache_dtype=""):
  model = dapo_jax.load_pretrained(rollout_fixtures.tiny_checkpoint())
  model.config = model.config.replace(kv_cache_dtype=kv_cache_dtype)
  return model


@pytest.fixture(scope="module")
def models():
  return _model(), _model("int8")


def test_jetstream_engine_with_an_int8_cache(models):
  base, int8 = models
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R)
  engine = lambda model, kv: je.QwenEngine(model, max_concurrent_decodes=3,
                                           max_prefill_length=16, sampling=sampling, seed=3,
                                           kv_cache=kv, page_size=4)
  script = [("insert", 0, NEIGHBOUR), ("generate", 3), ("insert", 2, PROMPT), ("generate", 4),
            ("insert", 0, PROMPT[:3]), ("generate", R + 1)]
  dense8, state8 = _requests(engine(int8, "dense"), script)
  paged8, pstate = _requests(engine(int8, "paged"), script)
  ref, _ = _requests(engine(base, "dense"), script)
  assert jax.tree.leaves(state8.cache.k)[0].dtype == jnp.int8
  assert jax.tree.leaves(pstate.decode.cache.k)[0].dtype == jnp.int8
  gaps = []
  for (t8, lp8), (tp, lpp), (t0, lp0) in zip(dense8, paged8, ref):
    assert tp and tp == t8[:len(tp)]  # a replaced request may end sooner (as the default's)
    np.testing.assert_allclose(lpp, lp8[:len(tp)], atol=1e-5)
    same = np.cumprod(np.asarray(t8[:len(t0)]) == np.asarray(t0[:len(t8)])).astype(bool)
    gaps.append(np.abs(np.asarray(lp8[:len(same)]) - np.asarray(lp0[:len(same)]))[same])
  gap = np.concatenate(gaps)
  assert gap.size > 5 and 0 < gap.max() < 0.05, gap


def test_static_sampler_with_an_int8_cache(models):
  base, int8 = models
  ids = jnp.asarray([NEIGHBOUR, [1] * 4 + PROMPT])
  mask = jnp.asarray([[True] * 11, [False] * 4 + [True] * 7])  # left-padded
  params = SamplingParams(temperature=0.0, max_new_tokens=R)
  b0 = generate(base, ids, mask, jax.random.key(0), params)
  b8 = generate(int8, ids, mask, jax.random.key(0), params)
  same = np.cumprod(np.asarray(b8.response_ids) == np.asarray(b0.response_ids), 1).astype(bool)
  gap = np.abs(np.asarray(b8.logprobs) - np.asarray(b0.logprobs))[same]
  assert same[:, :4].all() and 0 < gap.max() < 0.05, gap
