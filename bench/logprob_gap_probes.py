# python bench/logprob_gap_probes.py   (~2-4 min on a 2-core CPU; 8 simulated devices)
"""Where the rollout/trainer log-prob gap comes from (issue 29): each probe compares the log-probs
of the SAME tokens computed two ways, with `logprob_gap.logprob_gap_metrics`, in fp32 and bf16.

The model is configs/tiny_cpu.py's (random init, char vocabulary); the responses are fixed token
sequences (teacher forcing), so every pair sees identical tokens. Probes:

- batch invariance: one prompt's decode alone, in slot 0 of a full batch, in slot 5;
- decode vs prefill: the one-token decode steps over the KV cache against one prefill pass over
  prompt + response, both with the one log-prob formula (`logprobs.token_log_probs`);
- head and formula: the same hidden states through the sampler's shape (one [B, V] logits matmul
  and `token_log_probs` per response column) and the trainer's (`logprobs.chunked_token_stats`,
  one [B, C, V] chunk). Before issue 29 part 4 the two sides used two formulas
  (log_softmax-and-gather against target-minus-logsumexp; bench/results/
  logprob_gap_probes_two_formulas.json);
- prefill vs training forward: the prefill pass against `LogProbForward` (the old log-probs), and
  `LogProbForward` against the update's own forward under `jax.grad` (remat none / full);
- meshes: `LogProbForward` on one device against fsdp=8 and data=2 x tensor=4;
- end to end: `logprob_measure.measure` (the real static and continuous engines against the
  training forward; rollout mesh = training mesh, or data=2 x tensor=4 against fsdp=8);
- negative control: one ULP added to one token's log-prob must turn the gate red.

Writes bench/results/logprob_gap_probes.json and prints one markdown table per dtype. On CPU the
only full-pass attention kernel for these shapes is XLA's (splash is a TPU kernel, cuDNN a GPU
one); the probe says so rather than comparing kernels it cannot run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

if __name__ == "__main__":  # before jax is imported: 8 simulated CPU devices for the mesh probes
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

import tiny_cpu  # noqa: E402  # pylint: disable=wrong-import-position

from dapo_jax.spec.run_spec import RunSpec, read_section  # noqa: E402
from dapo_jax.trainer import logprob_gap, logprob_measure, run_setup  # noqa: E402
from dapo_jax.infra import sharding as shd  # noqa: E402
from dapo_jax.trainer.generation import render_batch  # noqa: E402
from dapo_jax.models.logprobs import chunked_token_stats, response_log_probs, token_log_probs  # noqa: E402
from dapo_jax.models import abstract_model, create_model, default_positions  # noqa: E402
from dapo_jax.trainer.train_step import LogProbForward  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "logprob_gap_probes.json")
NUM_PROMPTS = 8  # a "full batch"
SLOT = 5  # "another slot"


def tiny_config(dtype: str = "float32", engine: str = "static", *, small: bool = False):
  """configs/tiny_cpu.py's model and lengths, no warm start, small rollouts; ``small``: one
  narrow layer and 8 response tokens (the CI test's size)."""
  c = tiny_cpu.get_config()
  if small:
    c.model.overrides.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    c.rollout.max_response_length, c.reward.overlong_buffer_len = 8, 2
  c.model.dtype = dtype
  c.sft.steps = 0
  c.rollout.engine = engine
  c.rollout.max_concurrent_decodes = 16
  c.rollout.n = 4
  c.data.arithmetic.num_train = c.data.arithmetic.num_eval = 64
  return c


def build(config, seed: int = 0):
  """(graphdef, params, rest, tokenizer) of a random-init model on one device."""
  m, tok = read_section(config, "model"), read_section(config, "tokenizer")
  tokenizer = run_setup.build_tokenizer(tok, m.checkpoint)
  model = create_model(run_setup.model_config(m, tok.kind, tokenizer), seed=seed)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest, tokenizer


def fixed_rows(config, tokenizer, num: int = NUM_PROMPTS, seed: int = 0):
  """Rendered prompts [num, P] and fixed responses [num, R] (random tokens, random lengths)."""
  records = run_setup.load_dataset("arithmetic", read_section(config, "data"),
                                   read_section(config, "seed"), "eval")[:num]
  prompt_ids, prompt_mask = render_batch(records, tokenizer, config.data.max_prompt_length)
  rng = np.random.RandomState(seed)
  r = config.rollout.max_response_length
  response = rng.randint(4, tokenizer.vocab_size, (num, r)).astype(np.int32)
  lengths = rng.randint(r // 4, r + 1, num)
  response_mask = np.arange(r)[None] < lengths[:, None]
  return records, prompt_ids, prompt_mask.astype(bool), response, response_mask


@functools.partial(jax.jit, static_argnums=0)
def decode_logp(graphdef, params, rest, prompt_ids, prompt_mask, response):
  """Teacher-forced rollout: prefill the prompt, then one `decode_step` per response column over
  the KV cache (every row at the same slot, as the static sampler), log-probs of `response`."""
  model = nnx.merge(graphdef, params, rest)
  b, p = prompt_ids.shape
  r = response.shape[1]
  h, cache = model.prefill(prompt_ids, default_positions(prompt_mask), prompt_mask)
  last = jnp.max(jnp.where(prompt_mask, jnp.arange(p), 0), axis=-1)
  h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)
  logits0 = model.logits_from_hidden(h_last)[:, 0]
  cache = cache.grow(r - 1)
  prompt_len = prompt_mask.sum(-1, dtype=jnp.int32)

  def step(cache, xs):
    col, tok = xs
    logits, cache = model.decode_step(tok, prompt_len + col - 1, cache, same_slot=True)
    return cache, logits

  _, rest_logits = jax.lax.scan(step, cache, (jnp.arange(1, r), response[:, :-1].T))
  logits = jnp.concatenate([logits0[None], rest_logits], axis=0)  # [R, B, V]
  return token_log_probs(jnp.swapaxes(logits, 0, 1), response)


def _full_rows(prompt_ids, prompt_mask, response, response_mask):
  return (jnp.concatenate([prompt_ids, response], axis=1),
          jnp.concatenate([prompt_mask, response_mask], axis=1))


@functools.partial(jax.jit, static_argnums=0)
def prefill_logp(graphdef, params, rest, ids, mask, response):
  """One prefill pass over prompt + response, the one formula on every position."""
  model = nnx.merge(graphdef, params, rest)
  r = response.shape[1]
  h, _ = model.prefill(ids, default_positions(mask), mask)
  logits = model.logits_from_hidden(h[:, -r - 1:-1])
  return token_log_probs(logits, response)


@functools.partial(jax.jit, static_argnums=0)
def head_pair(graphdef, params, rest, ids, mask, response):
  """The same training-pass hidden states through the sampler's shape (a [B, V] logits matmul
  and `token_log_probs` per response column, as a decode step) and the trainer's
  (`chunked_token_stats`): (sampler's, trainer's)."""
  model = nnx.merge(graphdef, params, rest)
  r = response.shape[1]
  h, _ = model.hidden_states(ids, default_positions(mask), mask)
  h_BxRxD = h[:, -r - 1:-1]
  step = lambda h_BxD, tok_B: token_log_probs(model.logits_from_hidden(h_BxD[:, None])[:, 0],
                                              tok_B)
  sampler = jax.lax.map(lambda xs: step(*xs), (jnp.swapaxes(h_BxRxD, 0, 1), response.T)).T
  trainer, _ = chunked_token_stats(h_BxRxD, model.lm_head_kernel(), response)
  return sampler, trainer


def graphdef_with(config, tokenizer, **model_fields):
  """The graphdef of the same architecture with other run-time fields (remat, attention_impl):
  the params of `build` fit it unchanged."""
  m = dataclasses.replace(read_section(config, "model"), **model_fields)
  kind = read_section(config, "tokenizer").kind
  return nnx.split(abstract_model(run_setup.model_config(m, kind, tokenizer)), nnx.Param, ...)[0]


@functools.partial(jax.jit, static_argnums=(0, 5))
def update_logp(graphdef, params, rest, ids, mask, r):
  """The log-probs the update itself computes (its ratio's numerator at the first micro-batch),
  under `jax.grad` as in `train_step._micro_loss`."""
  def loss(p):
    lp, _ = response_log_probs(nnx.merge(graphdef, p, rest), ids, mask, None, r)
    return jnp.sum(lp), lp
  return jax.grad(loss, has_aux=True)(params)[1]


def train_logp(config, graphdef, params, rest, ids, mask, r, mesh=None):
  """`LogProbForward`: the trainer's old log-probs, on `mesh` (None: one device)."""
  fwd = LogProbForward(graphdef, RunSpec.from_config(config).train_config(), mesh, rest=rest)
  if mesh is not None:
    params = jax.device_put(params, shd.state_shardings(params, mesh, shd.TRAIN_RULES))
  return fwd(params, ids, mask, r)[0]


def one_ulp_up(logp: np.ndarray, row: int, col: int) -> np.ndarray:
  """The negative control: the same array with one entry moved to the next float32 up."""
  out = np.array(logp, np.float32, copy=True)
  out[row, col] = np.nextafter(out[row, col], np.float32(np.inf))
  return out


def probes(dtype: str = "float32", *, small: bool = False, meshes: bool = True,
           engines: tuple[str, ...] = ("static", "static_mesh", "continuous")
           ) -> list[tuple[str, dict[str, float]]]:
  """Every probe's `logprob_gap_metrics` (first argument: the rollout-side way) for one dtype."""
  config = tiny_config(dtype, small=small)
  graphdef, params, rest, tokenizer = build(config)
  records, pids, pmask, resp, rmask = fixed_rows(config, tokenizer)
  r = resp.shape[1]
  gap = logprob_gap.logprob_gap_metrics
  out = []
  one = lambda i: decode_logp(graphdef, params, rest, pids[i:i + 1], pmask[i:i + 1],
                              resp[i:i + 1])
  batch = np.asarray(decode_logp(graphdef, params, rest, pids, pmask, resp))
  alone0, alone5 = np.asarray(one(0)), np.asarray(one(SLOT))
  out.append(("decode: alone vs slot 0 of a batch of 8", gap(alone0, batch[:1], rmask[:1])))
  out.append((f"decode: alone vs slot {SLOT} of a batch of 8",
               gap(alone5, batch[SLOT:SLOT + 1], rmask[SLOT:SLOT + 1])))
  moved = np.roll(np.arange(NUM_PROMPTS), SLOT)  # prompt 0 now sits in slot SLOT
  shifted = np.asarray(decode_logp(graphdef, params, rest, pids[moved], pmask[moved],
                                   resp[moved]))
  out.append((f"decode: prompt 0 in slot 0 vs in slot {SLOT}",
               gap(batch[:1], shifted[SLOT:SLOT + 1], rmask[:1])))
  ids, mask = _full_rows(pids, pmask, resp, rmask)
  prefill = np.asarray(prefill_logp(graphdef, params, rest, ids, mask, resp))
  out.append(("decode vs prefill (same formula)", gap(batch, prefill, rmask)))
  sampler_f, trainer_f = (np.asarray(x) for x in head_pair(graphdef, params, rest, ids, mask,
                                                            resp))
  out.append(("head and formula: sampler's [B, V] steps vs trainer's chunk (same hidden states)",
              gap(sampler_f, trainer_f, rmask)))
  old = np.asarray(train_logp(config, graphdef, params, rest, ids, mask, r))
  out.append(("prefill vs training forward (LogProbForward)", gap(prefill, old, rmask)))
  out.append(("decode vs training forward", gap(batch, old, rmask)))
  for remat in ("none", "full"):
    g = graphdef_with(config, tokenizer, remat=remat)
    upd = np.asarray(update_logp(g, params, rest, ids, mask, r))
    out.append((f"training forward vs the update's forward (remat={remat})",
                gap(old, upd, rmask)))
  out.append(("negative control: training forward vs itself + 1 ULP on one token",
              gap(old, one_ulp_up(old, 2, 3), rmask)))
  if meshes and jax.device_count() >= 8:
    for axes in ([("fsdp", 8)], [("data", 2), ("tensor", 4)]):
      mesh = shd.make_mesh(axes)
      sharded = np.asarray(jax.device_get(train_logp(config, graphdef, params, rest, ids, mask,
                                                     r, mesh)))
      name = " x ".join(f"{a}={n}" for a, n in axes)
      out.append((f"training forward: 1 device vs {name}", gap(old, sharded, rmask)))
  runs = {"static": ("static", []), "static_mesh": ("static", [("data", 2), ("tensor", 4)]),
          "continuous": ("continuous", [])}
  for engine, roll in ([runs[e] for e in engines] if jax.device_count() >= 8 else []):
    c = tiny_config(dtype, engine, small=small)
    c.mesh, c.rollout_mesh = [("fsdp", 8)], roll
    name = f"end to end: {engine} engine" + (" on data=2 x tensor=4" if roll else "")
    out.append((name + " vs training forward on fsdp=8",
                logprob_measure.measure(RunSpec.from_config(c), params, records[:4],
                                        jax.random.key(1))))
  return out


def main(argv=None) -> dict:
  del argv
  results, start = {}, time.perf_counter()
  for dtype in ("float32", "bfloat16"):
    rows = probes(dtype)
    results[dtype] = {name: m for name, m in rows}
    print(f"\n### compute dtype {dtype}\n")
    print(logprob_gap.markdown_table(rows))
  results["meta"] = {"devices": jax.device_count(), "backend": jax.default_backend(),
                     "jax": jax.__version__, "seconds": round(time.perf_counter() - start, 1),
                     "attention_impl": "xla (the only full-pass kernel on CPU for these shapes)"}
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  with open(RESULTS, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  print(f"\nwrote {RESULTS} ({results['meta']['seconds']} s)")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
