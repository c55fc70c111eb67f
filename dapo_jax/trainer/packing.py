"""Sequence packing for the trainer's forwards (optim.packing): the real tokens of a mini-batch's
rows go into fixed-length rows of ``optim.max_tokens_per_row`` tokens, each sequence a segment of
its own whose positions restart at 0, so the old log-probs, the KL reference and the update
compute on the tokens that exist instead of P + R padded positions a row.

    layout = pack_layout(traj.attention_mask[sl], budget, num_shards, rows_per_micro)
    rows = packed_rows(layout, traj.input_ids[sl], traj.attention_mask[sl], R)  # PackedRows
    slots_CpxR = layout.to_slots(old_logp[sl])  # a row-layout input, in sequence slots
    old_NxR = layout.unpack_rows(out_CpxR)      # a forward's output, back in the row layout

Layout. Sequences go to the mesh's batch shards most tokens first, each to the shard with the
fewest (shards differ by at most one sequence's tokens), and are packed first-fit decreasing
into rows of the budget within their shard. The rows then form micro-batches of at most
``rows_per_micro`` rows a shard: the tokens a padded micro-batch holds (`rows_per_micro`), so
memory stays what the padded update needs while the count of micro-batches falls with the
tokens (a token-budget micro-batch, as verl's dynamic batch size). Each (shard, micro-batch)
cell has ``r`` packed rows and ``c`` sequence slots; the micro-batch count n, r and c are
rounded up to a bucket (`bucket`: four sizes an octave), so the distinct compiled programs are
the distinct (n, r, c) a run meets: a handful (logged as packing/train_programs).

The per-token inputs of the loss (mask, old log-probs, advantages, ...) stay in the row layout,
``[Cp, R]`` with Cp = shards x micro x c: the loss code is the padded path's, on rows that are
the mini-batch's sequences in another order plus empty ones (mask 0: no token, no sequence, in
no denominator). ``token_index [Cp, R]`` says where each response token's log-prob lies in its
cell's packed rows, and the compiled forward gathers it there (`models.logprobs`).

Global row order is the one `models.logprobs.split_micro` and the batch sharding expect: shard
s holds a contiguous block of rows, and within it local row k belongs to micro-batch k % num_micro.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dapo_jax.infra import distributed
from dapo_jax.infra import sharding as shd
from dapo_jax.spec.run_spec import RunSpec
from dapo_jax.trainer.train_step import LogProbForward, PackedRows

# Bucket mantissas: a cell's row / sequence count is rounded up to m x 2^k with m in these (1,
# 2, 3 below 4): at most 25% of padding rows, four sizes per octave.
_MANTISSAS = (4, 5, 6, 7)


def bucket(n: int) -> int:
  """``n`` rounded up to the next of 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ..."""
  if n <= 4:
    return max(int(n), 1)
  k = max(0, int(math.floor(math.log2(n))) - 2)
  while True:
    for m in _MANTISSAS:
      if m << k >= n:
        return m << k
    k += 1


class SequenceTooLongError(ValueError):
  """A sequence has more real tokens than a packed row holds (optim.max_tokens_per_row)."""


@dataclasses.dataclass(frozen=True)
class PackLayout:
  """Where every sequence of one mini-batch sits in the packed rows (host arrays).

  ``num_shards x num_micro`` cells of ``rows_per_cell`` packed rows of ``budget`` tokens and
  ``seqs_per_cell`` sequence slots. For sequence slot q (global row of the ``[Cp, R]`` arrays):
  ``source[q]`` is the mini-batch row it holds (-1: an empty slot); its tokens lie in packed row
  ``pack_row[q]`` from column ``start[q]``, ``length[q]`` of them.
  """
  budget: int
  num_rows: int  # rows of the mini-batch (N)
  num_shards: int
  num_micro: int
  rows_per_cell: int
  seqs_per_cell: int
  source: np.ndarray  # [Cp] int32
  pack_row: np.ndarray  # [Cp] int32, global packed row (-1: empty slot)
  start: np.ndarray  # [Cp] int32
  length: np.ndarray  # [Cp] int32
  segment: np.ndarray  # [Cp] int32, the slot's segment id in its packed row (1..; 0: empty)
  real_tokens: int  # tokens in the packed rows (the rest is padding)

  @property
  def num_packed_rows(self) -> int:
    return self.num_shards * self.num_micro * self.rows_per_cell

  @property
  def num_slots(self) -> int:
    return self.num_shards * self.num_micro * self.seqs_per_cell

  @property
  def fill(self) -> float:
    """Share of the packed rows' positions that are real tokens."""
    return self.real_tokens / max(self.num_packed_rows * self.budget, 1)

  @property
  def shape_key(self) -> tuple[int, int]:
    """What the compiled programs depend on: (packed rows, sequence slots)."""
    return self.num_packed_rows, self.num_slots

  def pack_tokens(self, input_ids_NxL: np.ndarray, attention_mask_NxL: np.ndarray
                  ) -> dict[str, np.ndarray]:
    """``input_ids``, ``positions`` and ``segment_ids`` ([Bp, Lb] int32) of the packed rows:
    each sequence's real tokens (the mask's), positions 0.. restarting per sequence, segment
    ids 1.. per row (0 = padding, position 0, token 0)."""
    bp, lb = self.num_packed_rows, self.budget
    ids = np.zeros((bp, lb), np.int32)
    pos = np.zeros((bp, lb), np.int32)
    seg = np.zeros((bp, lb), np.int32)
    mask = np.asarray(attention_mask_NxL, bool)
    for q in np.flatnonzero(self.source >= 0):
      n, row, s, ln = self.source[q], self.pack_row[q], self.start[q], self.length[q]
      ids[row, s:s + ln] = input_ids_NxL[n][mask[n]]
      pos[row, s:s + ln] = np.arange(ln, dtype=np.int32)
      seg[row, s:s + ln] = self.segment[q]
    return {"input_ids": ids, "positions": pos, "segment_ids": seg}

  def token_index(self, attention_mask_NxL: np.ndarray, response_len: int) -> np.ndarray:
    """[Cp, R] int32: for each slot's response column t, the index, in its cell's packed rows
    of one shard flattened (local row x budget + column), of the position whose hidden state
    predicts that token (the one before it). 0 at masked columns and empty slots."""
    mask = np.asarray(attention_mask_NxL, bool)
    p = mask.shape[1] - response_len
    out = np.zeros((self.num_slots, response_len), np.int32)
    rows_per_shard = self.num_micro * self.rows_per_cell
    for q in np.flatnonzero(self.source >= 0):
      n, row = self.source[q], self.pack_row[q]
      # Local row of this packed row within its shard's block of one micro-batch.
      local = (row % rows_per_shard) // self.num_micro
      compact = np.cumsum(mask[n]) - 1  # position of each padded column in the sequence
      cols = compact[p:] - 1  # the position before the token
      live = mask[n, p:]
      if live.any() and cols[live].min() < 0:
        raise ValueError(f"Row {n}: a response token with no token before it (an empty "
                         f"prompt); nothing predicts it.")
      out[q] = np.where(live, local * self.budget + self.start[q] + cols, 0)
    return out

  def to_slots(self, x_Nx: np.ndarray, fill: Any = 0) -> np.ndarray:
    """Row-layout ``[N, ...]`` -> slot layout ``[Cp, ...]`` (empty slots: ``fill``)."""
    x = np.asarray(x_Nx)
    out = np.full((self.num_slots,) + x.shape[1:], fill, x.dtype)
    live = self.source >= 0
    out[live] = x[self.source[live]]
    return out

  def unpack_rows(self, x_Cpx: np.ndarray) -> np.ndarray:
    """Slot layout ``[Cp, ...]`` -> the mini-batch's row layout ``[N, ...]`` (0 in a row of
    no token)."""
    x = np.asarray(x_Cpx)
    out = np.zeros((self.num_rows,) + x.shape[1:], x.dtype)
    live = self.source >= 0
    out[self.source[live]] = x[live]
    return out


def _ffd(items: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
  """First-fit decreasing of ``items`` (indices into ``lengths``) into rows of ``budget``."""
  rows: list[list[int]] = []
  room: list[int] = []
  for i in sorted(items, key=lambda i: (-lengths[i], i)):
    ln = int(lengths[i])
    for j, free in enumerate(room):
      if free >= ln:
        rows[j].append(i)
        room[j] -= ln
        break
    else:
      rows.append([i])
      room.append(budget - ln)
  return rows


def _lpt(weights: list[int], bins: int, cap: int | None = None) -> list[list[int]]:
  """Indices of ``weights`` to ``bins`` bins, heaviest first, each to the lightest bin (with
  fewer than ``cap`` items); ties by index, so the result is deterministic."""
  out: list[list[int]] = [[] for _ in range(bins)]
  load = [0] * bins
  for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
    b = min((k for k in range(bins) if cap is None or len(out[k]) < cap),
            key=lambda k: (load[k], k))
    out[b].append(i)
    load[b] += weights[i]
  return out


def pack_layout(attention_mask_NxL: np.ndarray, budget: int, num_shards: int = 1,
                rows_per_micro: int = 1) -> PackLayout:
  """Packs the mini-batch whose rows have ``attention_mask`` (real tokens) into rows of
  ``budget`` tokens, ``num_shards`` batch shards and micro-batches of at most
  ``rows_per_micro`` packed rows a shard (see the module docstring).

  Raises SequenceTooLongError naming the row when a sequence is longer than the budget.
  """
  lengths = np.asarray(attention_mask_NxL, bool).sum(axis=1).astype(np.int64)
  if budget < 1 or num_shards < 1 or rows_per_micro < 1:
    raise ValueError(f"budget={budget}, num_shards={num_shards}, rows_per_micro="
                     f"{rows_per_micro}: all must be >= 1.")
  if lengths.size and lengths.max() > budget:
    n = int(lengths.argmax())
    raise SequenceTooLongError(
        f"Row {n} has {int(lengths[n])} tokens, more than optim.max_tokens_per_row={budget} "
        f"holds; set it to at least the longest sequence (data.max_prompt_length + "
        f"rollout.max_response_length).")
  live = [i for i in range(lengths.size) if lengths[i] > 0]  # a row of no token: no slot
  # Sequences to shards, most tokens first, each to the shard with the fewest (the shards'
  # token counts differ by at most one sequence); first-fit decreasing into rows within each.
  shard_rows = []
  for members in _lpt([int(lengths[i]) for i in live], num_shards):
    shard_rows.append(_ffd([live[k] for k in members], lengths, budget))
  most = max(max(len(rows) for rows in shard_rows), 1)
  num_micro = bucket(-(-most // rows_per_micro))
  r = min(bucket(-(-most // num_micro)), rows_per_micro)
  # Each shard's rows to its micro-batches (r a cell), most tokens first, to the lightest.
  cells: list[list[list[int]]] = []  # cell s * num_micro + m: its packed rows' sequences
  for rows in shard_rows:
    for members in _lpt([int(sum(lengths[i] for i in row)) for row in rows], num_micro, r):
      cells.append([rows[k] for k in members])
  c = bucket(max(sum(len(row) for row in rows) for rows in cells))
  cp = num_shards * num_micro * c
  source = np.full(cp, -1, np.int32)
  pack_row = np.full(cp, -1, np.int32)
  start = np.zeros(cp, np.int32)
  length = np.zeros(cp, np.int32)
  segment = np.zeros(cp, np.int32)
  # Cell (shard s, micro m): packed slot u is global row s*r*n + u*n + m, sequence slot v is
  # s*c*n + v*n + m (the order split_micro and the batch sharding expect).
  for cell, rows in enumerate(cells):
    s, m = divmod(cell, num_micro)
    v = 0
    for u, members in enumerate(rows):
      row = s * r * num_micro + u * num_micro + m
      col = 0
      for k, i in enumerate(members):
        q = s * c * num_micro + v * num_micro + m
        source[q], pack_row[q], start[q], length[q] = i, row, col, lengths[i]
        segment[q] = k + 1
        col += int(lengths[i])
        v += 1
  return PackLayout(budget=int(budget), num_rows=int(lengths.size), num_shards=num_shards,
                    num_micro=num_micro, rows_per_cell=r, seqs_per_cell=c, source=source,
                    pack_row=pack_row, start=start, length=length, segment=segment,
                    real_tokens=int(lengths.sum()))


def rows_per_micro(micro_batch_rows: int, padded_len: int, budget: int, num_shards: int) -> int:
  """Packed rows a micro-batch gets on each shard: the tokens a padded micro-batch held there
  (``micro_batch_rows`` rows of ``padded_len`` over ``num_shards``), so a packed micro-batch
  never needs more memory than a padded one; at least one."""
  per_shard = -(-micro_batch_rows // num_shards) * padded_len
  return max(1, per_shard // budget)


def num_batch_shards(mesh: Mesh | None, rules: shd.Rules = shd.TRAIN_RULES) -> int:
  """How many blocks the batch sharding cuts a batch into (1 without a mesh)."""
  return 1 if mesh is None else math.prod(shd.batch_axes(mesh, rules).values())


def layouts(attention_mask_NxL: np.ndarray, rows_per_update: int, budget: int,
            num_shards: int, rows_per_micro: int) -> list[PackLayout]:
  """One `PackLayout` per optimizer mini-batch (consecutive ``rows_per_update`` rows), as
  `trajectories.mini_batches` cuts them."""
  n = attention_mask_NxL.shape[0]
  return [pack_layout(attention_mask_NxL[s:s + rows_per_update], budget, num_shards,
                      rows_per_micro) for s in range(0, n, rows_per_update)]


def packed_rows(layout: PackLayout, input_ids_NxL: np.ndarray, attention_mask_NxL: np.ndarray,
                response_len: int) -> PackedRows:
  """The compiled programs' packed inputs (host arrays) of one mini-batch."""
  tok = layout.pack_tokens(input_ids_NxL, attention_mask_NxL)
  return PackedRows(input_ids=tok["input_ids"], positions=tok["positions"],
                    segment_ids=tok["segment_ids"],
                    token_index=layout.token_index(attention_mask_NxL, response_len),
                    num_shards=layout.num_shards, num_micro=layout.num_micro)


def metrics(all_layouts: list[PackLayout], budget: int, padded_len: int) -> dict[str, float]:
  """What packing did this step: the packed rows' fill, the positions computed against the
  padded layout's, and the sequences a packed row held on average."""
  packed = sum(lay.num_packed_rows for lay in all_layouts) * budget
  real = sum(lay.real_tokens for lay in all_layouts)
  seqs = sum(int((lay.source >= 0).sum()) for lay in all_layouts)
  rows = sum(int(len(set(lay.pack_row[lay.source >= 0].tolist()))) for lay in all_layouts)
  return {"packing/fill": real / max(packed, 1),
          "packing/positions_vs_padded": packed / max(seqs * padded_len, 1),
          "packing/seqs_per_row": seqs / max(rows, 1)}


def spec_layouts(spec: RunSpec, mesh: Mesh | None, attention_mask_NxL: np.ndarray,
                 rows_per_batch: int | None = None, micro_batch_rows: int | None = None
                 ) -> list[PackLayout] | None:
  """The run's layouts of these rows (optim.packing; None: padded), cut as the trainer's
  mini-batches (``rows_per_batch``, default ``spec.sizes.rows_per_update``), each micro-batch
  the tokens of a padded one of ``micro_batch_rows`` rows (default optim.micro_batch_size)."""
  if not spec.optim.packing:
    return None
  rows = rows_per_batch or spec.sizes.rows_per_update
  budget = spec.optim.max_tokens_per_row or spec.sizes.max_length
  shards = num_batch_shards(mesh)
  micro = min(micro_batch_rows or spec.optim.micro_batch_size, rows)
  return layouts(attention_mask_NxL, rows, budget, shards,
                 rows_per_micro(micro, spec.sizes.max_length, budget, shards))


def forward_rows(logp_fn: LogProbForward, params: Any, input_ids_NxL: np.ndarray,
                 attention_mask_NxL: np.ndarray, response_len: int, mesh: Mesh | None,
                 layouts: list[PackLayout] | None = None, ref_params: Any = None
                 ) -> tuple[np.ndarray, ...]:
  """The training forward's ``(logp, entropy[, ref])`` [N, R] host arrays of ``params`` (and the
  reference's) on host rows: padded, or with ``layouts`` batch by batch packed (consecutive
  rows, as `layouts` cut them). The same on every process."""
  dev = lambda x: distributed.rows_on_device(x, mesh)
  ref = {} if ref_params is None else {"ref_params": ref_params}
  if layouts is None:
    out = logp_fn(params, dev(input_ids_NxL), dev(attention_mask_NxL), response_len, **ref)
    return tuple(np.asarray(x) for x in distributed.global_to_host(out))
  per_batch, start = [], 0
  for lay in layouts:
    sl = slice(start, start + lay.num_rows)
    start += lay.num_rows
    rows = packed_rows(lay, input_ids_NxL[sl], attention_mask_NxL[sl], response_len)
    out = distributed.global_to_host(logp_fn.packed(params, jax.tree.map(dev, rows), **ref))
    per_batch.append(tuple(lay.unpack_rows(np.asarray(x)) for x in out))
  return tuple(np.concatenate(parts) for parts in zip(*per_batch))
