"""Packed sequences (optim.packing, trainer/packing.py): the packer's layout, and the packed
forward, loss and gradients against the padded path's on batches of mixed lengths (fp32)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.infra import sharding as shd
from dapo_jax.models import create_model, get_preset
from dapo_jax.trainer import objective as obj
from dapo_jax.trainer import packing
from dapo_jax.trainer import train_step as ts

B, P, R = 16, 5, 13  # rows, prompt length (left-padded), response length (right-padded)
VOCAB = 128
TOL = 1e-5


def _rows(rng, b=B, p=P, r=R):
  """Left-padded prompts and right-padded responses of random lengths (the extremes kept)."""
  prompt_pad = rng.randint(0, p - 1, b)
  resp_len = rng.randint(1, r + 1, b)
  resp_len[:2] = (r, 1)
  attn = np.ones((b, p + r), bool)
  for i in range(b):
    attn[i, :prompt_pad[i]] = False
    attn[i, p + resp_len[i]:] = False
  ids = np.where(attn, rng.randint(1, VOCAB, (b, p + r)), 0).astype(np.int32)
  return ids, attn


# --- the packer -------------------------------------------------------------------------------


@pytest.mark.parametrize("budget,shards,rows_per_micro", [(18, 1, 1), (18, 2, 2), (40, 4, 1),
                                                          (64, 2, 4), (30, 1, 100)])
def test_the_packer_keeps_every_sequence_whole_within_the_budget_and_balanced(
    budget, shards, rows_per_micro):
  rng = np.random.RandomState(budget + shards)
  ids, attn = _rows(rng, b=24)
  lay = packing.pack_layout(attn, budget, shards, rows_per_micro)
  tok = lay.pack_tokens(ids, attn)
  lengths = attn.sum(1)
  live = lay.source >= 0
  # Every row is in exactly one slot, whole, with its own tokens in order.
  assert sorted(lay.source[live].tolist()) == list(range(24))
  for q in np.flatnonzero(live):
    n, row, s, ln = lay.source[q], lay.pack_row[q], lay.start[q], lay.length[q]
    assert ln == lengths[n] and s + ln <= budget
    np.testing.assert_array_equal(tok["input_ids"][row, s:s + ln], ids[n][attn[n]])
    np.testing.assert_array_equal(tok["positions"][row, s:s + ln], np.arange(ln))
    assert np.all(tok["segment_ids"][row, s:s + ln] == lay.segment[q]) and lay.segment[q] > 0
  # Nothing overlaps: a packed row's real tokens are the lengths of the sequences in it.
  assert (tok["segment_ids"] > 0).sum() == lengths.sum() == lay.real_tokens
  assert tok["input_ids"].shape == (lay.num_packed_rows, budget)
  # A micro-batch has at most rows_per_micro rows a shard; no more micro-batches than needed.
  n, r = lay.num_micro, lay.rows_per_cell
  assert r <= rows_per_micro and lay.num_packed_rows == shards * n * r
  used = {}
  for q in np.flatnonzero(live):
    used[lay.pack_row[q]] = used.get(lay.pack_row[q], 0) + lay.length[q]
  rows_per_shard = n * r
  most = max(sum(1 for row in used if row // rows_per_shard == s) for s in range(shards))
  assert n == packing.bucket(-(-most // rows_per_micro))
  # Slots and rows of one (shard, micro-batch) cell: sequences stay in their cell.
  slots_per_shard = lay.num_slots // shards
  for q in np.flatnonzero(live):
    row = lay.pack_row[q]
    assert (q // slots_per_shard, q % n) == (row // rows_per_shard, row % n)
  # Balanced: the shards' real-token counts differ by at most one sequence's length.
  per_shard = [(tok["segment_ids"][s * rows_per_shard:(s + 1) * rows_per_shard] > 0).sum()
               for s in range(shards)]
  assert max(per_shard) - min(per_shard) <= lengths.max()
  # First-fit decreasing within a shard: no two of its packed rows could have been merged.
  for s in range(shards):
    fill = sorted(v for row, v in used.items() if row // rows_per_shard == s)
    assert len(fill) < 2 or fill[0] + fill[1] > budget


def test_micro_batches_hold_a_padded_micro_batchs_tokens():
  """A micro-batch of 8 padded rows of 100 over 2 shards holds 400 tokens a shard: 2 rows of
  200, or 1 of 300."""
  assert packing.rows_per_micro(8, 100, 200, 2) == 2
  assert packing.rows_per_micro(8, 100, 300, 2) == 1
  assert packing.rows_per_micro(1, 100, 100, 4) == 1


def test_a_sequence_longer_than_the_budget_gets_one_line():
  attn = np.ones((3, 20), bool)
  attn[1, :2] = False
  with pytest.raises(packing.SequenceTooLongError,
                     match=r"^Row 0 has 20 tokens, more than optim.max_tokens_per_row=19"):
    packing.pack_layout(attn, 19)


def test_buckets_are_few_per_octave():
  sizes = sorted({packing.bucket(n) for n in range(1, 257)})
  assert sizes[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
  assert all(packing.bucket(n) >= n and packing.bucket(n) <= 1.25 * n + 1 for n in range(1, 999))
  assert len(sizes) == 8 + 4 * 5  # 1..8, then four per octave up to 256


def test_slots_round_trip():
  rng = np.random.RandomState(1)
  _, attn = _rows(rng)
  lay = packing.pack_layout(attn, 30, 2, 2)
  assert lay.num_micro > 1
  x = rng.normal(size=(B, R)).astype(np.float32)
  np.testing.assert_array_equal(lay.unpack_rows(lay.to_slots(x)), x)
  assert (lay.to_slots(x)[lay.source < 0] == 0).all()


# --- packed forward, loss and gradients against the padded path ------------------------------


@pytest.fixture(scope="module")
def setup():
  model = create_model(get_preset("test"), seed=0)
  cfg = ts.TrainConfig(lr=1e-3, warmup_steps=0, logit_chunk_size=5)
  graphdef, state = ts.init_train_state(model, cfg)
  rng = np.random.RandomState(0)
  ids, attn = _rows(rng)
  resp_mask = attn[:, P:]
  adv = (np.where(np.arange(B) % 2 == 0, 1.0, -1.0) * rng.uniform(0.5, 1.5, B)).astype(np.float32)
  fwd = ts.LogProbForward(graphdef, cfg)
  logp, _ = fwd(state.params, jnp.asarray(ids), jnp.asarray(attn), R)
  old = np.asarray(logp) + rng.normal(0, 0.3, (B, R)).astype(np.float32)
  old[3] = np.asarray(logp)[3] - 3.0  # the dual clip
  truncated = np.zeros(B, bool)
  truncated[[0, 5]] = True
  ref = np.asarray(logp) + rng.normal(0, 0.1, (B, R)).astype(np.float32)
  sampler = np.asarray(logp) + rng.normal(0, 0.2, (B, R)).astype(np.float32)
  host = dict(ids=ids, attn=attn, resp=resp_mask, old=old.astype(np.float32), adv=adv,
              truncated=truncated, ref=ref, sampler=sampler)
  return dict(cfg=cfg, graphdef=graphdef, state=jax.tree.map(np.asarray, state), host=host,
              logp=np.asarray(logp), fwd=fwd)


def _padded_batch(h):
  return ts.TrainBatch(input_ids=h["ids"], attention_mask=h["attn"], response_mask=h["resp"],
                       old_log_probs=h["old"], advantages=h["adv"], truncated=h["truncated"],
                       ref_log_probs=h["ref"], sampler_log_probs=h["sampler"])


def _packed_batch(h, lay):
  slots = lambda x, fill=0: lay.to_slots(x, fill)
  return ts.TrainBatch(
      input_ids=None, attention_mask=None, response_mask=slots(h["resp"], False),
      old_log_probs=slots(h["old"]), advantages=slots(h["adv"]),
      truncated=slots(h["truncated"], False), ref_log_probs=slots(h["ref"]),
      sampler_log_probs=slots(h["sampler"]),
      packed=packing.packed_rows(lay, h["ids"], h["attn"], R))


def _grads(setup, batch, **overrides):
  cfg = setup["cfg"].replace(**overrides)
  fn = jax.jit(functools.partial(ts.loss_and_grads, setup["graphdef"], cfg))
  state = setup["state"]
  grads, metrics, _ = fn(state.params, state.rest, batch)
  return jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, metrics)


def test_packed_old_log_probs_equal_the_padded_forward(setup):
  lay = packing.pack_layout(setup["host"]["attn"], 24, 1, 2)
  assert lay.num_packed_rows < B and lay.num_micro > 1  # several sequences a row
  rows = packing.packed_rows(lay, setup["host"]["ids"], setup["host"]["attn"], R)
  logp, ent = setup["fwd"].packed(setup["state"].params, rows)
  got = lay.unpack_rows(np.asarray(logp))
  mask = setup["host"]["resp"]
  np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, setup["logp"], 0),
                             atol=TOL, rtol=TOL)
  _, ent_pad = setup["fwd"](setup["state"].params, setup["host"]["ids"], setup["host"]["attn"], R)
  np.testing.assert_allclose(np.where(mask, lay.unpack_rows(np.asarray(ent)), 0),
                             np.where(mask, np.asarray(ent_pad), 0), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("mode", obj.LOSS_AGG_MODES)
def test_packed_loss_and_gradients_equal_the_padded_path_in_every_mode(setup, mode):
  """Every loss aggregation, with the KL term, the entropy bonus, the overlong filter and a
  sequence-mask rollout correction live, in 2 micro-batches: the same loss, metrics, gradients."""
  h = setup["host"]
  cfg = setup["cfg"].replace(
      loss_agg_mode=mode, num_micro_batches=2, use_kl_loss=True, entropy_coeff=0.01,
      overlong_filter=True, rollout_is="sequence_mask", rollout_is_band=(0.05, 20.0))
  lay = packing.pack_layout(h["attn"], 24, 1, 4)
  assert lay.num_micro > 1
  grads = functools.partial(ts.loss_and_grads, setup["graphdef"], cfg)
  state = setup["state"]
  # Both paths in one program: one compile a mode.
  both = jax.jit(lambda a, b: (grads(state.params, state.rest, a)[:2],
                               grads(state.params, state.rest, b)[:2]))
  (g_pad, m_pad), (g_pk, m_pk) = jax.tree.map(
      np.asarray, both(_padded_batch(h), _packed_batch(h, lay)))
  assert m_pad["rollout_is_weight"] < 1.0  # some sequences left the loss
  for k in m_pad:
    np.testing.assert_allclose(m_pk[k], m_pad[k], atol=TOL, rtol=TOL, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), g_pk, g_pad)


def test_packed_batches_refuse_verls_micro_batch_loss(setup):
  lay = packing.pack_layout(setup["host"]["attn"], 24, 1, 2)
  with pytest.raises(ValueError, match="micro_batch_loss='exact'"):
    _grads(setup, _packed_batch(setup["host"], lay), num_micro_batches=2,
           micro_batch_loss="verl")


@pytest.fixture(scope="module")
def padded_steps(setup):
  """Two padded updates on one device (2 micro-batches): the sharded packed runs' reference."""
  cfg = setup["cfg"].replace(num_micro_batches=2, eps=1e-6)
  ref_step = ts.TrainStep(setup["graphdef"], cfg)
  state = jax.tree.map(jnp.asarray, setup["state"])
  for s in range(2):
    state, metrics = ref_step(state, jax.tree.map(jnp.asarray, _padded_batch(setup["host"])), s)
  return cfg, jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, metrics)


@pytest.mark.parametrize("axes", [(("data", 2), ("fsdp", 2), ("tensor", 2)),
                                  (("data", 1), ("fsdp", 8), ("tensor", 1))])
def test_packed_step_sharded_over_8_devices_equals_the_padded_step(setup, padded_steps, axes):
  """Two updates of the compiled step on 8 simulated devices, packed for the mesh's batch
  shards, against the padded step on one device."""
  h = setup["host"]
  cfg, ref_params, ref_metrics = padded_steps

  mesh = shd.make_mesh(axes)
  shards = packing.num_batch_shards(mesh)
  lay = packing.pack_layout(h["attn"], 24, shards, 1)
  assert lay.num_micro > 1 or shards == 8  # 8 shards: two sequences a shard, one row
  step = ts.TrainStep(setup["graphdef"], cfg, mesh)
  state = jax.tree.map(jnp.asarray, setup["state"])
  state = jax.device_put(state, shd.state_shardings(state, mesh, shd.TRAIN_RULES))
  for s in range(2):
    state, metrics = step(state, _packed_batch(h, lay), s)
  for k in ("loss", "grad_norm", "pg_clipfrac", "entropy", "num_tokens"):
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=TOL, atol=TOL, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL),
               jax.tree.map(np.asarray, state.params), ref_params)
  fwd = ts.LogProbForward(setup["graphdef"], setup["cfg"], mesh)
  params = jax.device_put(jax.tree.map(jnp.asarray, setup["state"].params),
                          shd.state_shardings(setup["state"].params, mesh, shd.TRAIN_RULES))
  logp, _ = fwd.packed(params, packing.packed_rows(lay, h["ids"], h["attn"], R))
  mask = h["resp"]
  np.testing.assert_allclose(np.where(mask, lay.unpack_rows(np.asarray(logp)), 0),
                             np.where(mask, setup["logp"], 0), atol=TOL, rtol=TOL)


def test_a_response_with_no_token_before_it_gets_one_line():
  attn = np.zeros((2, P + R), bool)
  attn[0, P - 2:P + 3] = True
  attn[1, P:P + 4] = True  # no prompt token: nothing predicts the first response token
  lay = packing.pack_layout(attn, 24)
  with pytest.raises(ValueError, match="^Row 1: a response token with no token before it"):
    lay.token_index(attn, R)
