"""Evaluation maths on the host: pass@k, avg@k, maj@k and a per-problem table.

A problem sampled n times with c correct answers:
  * pass@k: probability that at least one of k samples drawn without replacement from the n is
    correct; the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1).
  * avg@k: mean accuracy of the first k samples (DAPO reports AIME avg@32; spec 8).
  * maj@k: accuracy of the most frequent answer among the first k samples.
Dataset figures are unweighted means over problems.
"""

from __future__ import annotations

import collections
from typing import Any, Hashable, Iterable, Sequence

import numpy as np


def _check_acc(accs: Sequence[Any], what: str = "acc") -> np.ndarray:
  a = np.asarray(accs, dtype=np.float64).reshape(-1)
  if not np.all((a == 0.0) | (a == 1.0)):
    raise ValueError(f"{what} must be 0/1 correctness (not a reward), got {sorted(set(a))[:5]}.")
  return a


def _check_k(k: int | None, n: int) -> int:
  k = n if k is None else int(k)
  if not 1 <= k <= n:
    raise ValueError(f"k={k} needs 1 <= k <= n={n} samples.")
  return k


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct."""
  if not 0 <= c <= n:
    raise ValueError(f"c={c} correct out of n={n} samples is impossible.")
  _check_k(k, n)
  if n - c < k:  # Every k-subset holds a correct sample.
    return 1.0
  # C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i): no factorials, so no overflow at n=1024.
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def avg_at_k(accs: Sequence[Any], k: int | None = None) -> float:
  """Mean 0/1 accuracy of the first k samples (default: all)."""
  a = _check_acc(accs)
  return float(a[:_check_k(k, a.size)].mean())


def majority_vote(preds: Sequence[Hashable | None]) -> int | None:
  """Index of the first sample holding the most frequent answer; None if no sample answered.

  ``None`` and ``""`` (no answer extracted) abstain. Ties go to the answer seen first, so the
  result does not depend on hashing or sort order.
  """
  counts: collections.Counter = collections.Counter()
  first: dict[Hashable, int] = {}
  for i, p in enumerate(preds):
    if p is None or p == "":
      continue
    counts[p] += 1
    first.setdefault(p, i)
  if not counts:
    return None
  return first[min(counts, key=lambda p: (-counts[p], first[p]))]


def maj_at_k(preds: Sequence[Hashable | None], accs: Sequence[Any], k: int | None = None) -> float:
  """Accuracy of the majority answer among the first k samples (0 if none answered).

  ``preds`` must be normalised answers ("1/2" and "0.5" vote apart otherwise); the winner's
  accuracy is that of its first sample.
  """
  a = _check_acc(accs)
  if len(preds) != a.size:
    raise ValueError(f"{len(preds)} predictions but {a.size} accuracies.")
  k = _check_k(k, a.size)
  i = majority_vote(list(preds)[:k])
  return 0.0 if i is None else float(a[i])


def default_ks(n: int) -> list[int]:
  """1, 2, 4, ... up to n, and n itself."""
  ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
  return sorted(set(ks + [n]))


def samples_per_problem(problem_ids: Iterable[Hashable], num_samples: int) -> int:
  """The K of ``summarize``'s ``avg@K`` for these rows: the fewest rows of any problem times
  the samples drawn per row (the AIME file's 32 copies x 1 sample -> 32)."""
  counts = collections.Counter(problem_ids)
  if not counts or num_samples < 1:
    raise ValueError(f"need at least one row and num_samples >= 1, got {len(counts)} problems "
                     f"and num_samples={num_samples}.")
  return min(counts.values()) * int(num_samples)


def summarize(results: Iterable[tuple[Hashable, Hashable | None, Any]],
              ks: Sequence[int] | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """Dataset summary and per-problem rows from ``(problem_id, pred, acc)`` triples.

  Problems keep their first-seen order. ``ks`` default to `default_ks` of the smallest sample
  count. The summary holds ``num_problems``, ``num_samples``, ``pass@k`` and ``maj@k`` for every
  k, and ``avg@K`` for the largest K.
  """
  preds: dict[Hashable, list[Any]] = {}
  accs: dict[Hashable, list[Any]] = {}
  for pid, pred, acc in results:
    preds.setdefault(pid, []).append(pred)
    accs.setdefault(pid, []).append(acc)
  if not preds:
    raise ValueError("No results to summarize.")
  n_min = min(len(v) for v in accs.values())
  ks = sorted(set(default_ks(n_min) if ks is None else (int(k) for k in ks)))
  if ks[0] < 1 or ks[-1] > n_min:
    short = [pid for pid, v in accs.items() if len(v) < ks[-1]][:5]
    raise ValueError(f"k={ks[-1]} exceeds the {n_min} samples of problem(s) {short}; pass "
                     f"ks <= {n_min}.")

  rows = []
  for pid in preds:
    a = _check_acc(accs[pid], f"acc of problem {pid!r}")
    n, c = a.size, int(a.sum())
    row: dict[str, Any] = {"problem_id": pid, "n": n, "correct": c, "acc": c / n}
    row.update({f"pass@{k}": pass_at_k(n, c, k) for k in ks})
    row.update({f"maj@{k}": maj_at_k(preds[pid], a, k) for k in ks})
    i = majority_vote(preds[pid])
    row["majority_answer"] = None if i is None else preds[pid][i]
    rows.append(row)

  summary: dict[str, float] = {"num_problems": float(len(rows)),
                               "num_samples": float(sum(r["n"] for r in rows))}
  summary[f"avg@{ks[-1]}"] = float(np.mean([avg_at_k(accs[pid], ks[-1]) for pid in preds]))
  for metric in ("pass", "maj"):
    for k in ks:
      summary[f"{metric}@{k}"] = float(np.mean([r[f"{metric}@{k}"] for r in rows]))
  return summary, rows


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, *,
                 max_width: int = 24) -> str:
  """A plain-text table for the terminal: floats with 3 decimals, long cells cut with '~'."""
  if not rows:
    return "(no rows)"
  if columns is None:
    columns = list(dict.fromkeys(k for r in rows for k in r))

  def cell(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
      s = f"{v:.3f}"
    else:
      s = "" if v is None else " ".join(str(v).split())
    return s if len(s) <= max_width else s[:max_width - 1] + "~"

  body = [[cell(r.get(c)) for c in columns] for r in rows]
  numeric = [all(isinstance(r.get(c), (int, float, np.number)) for r in rows
                 if r.get(c) is not None) for c in columns]
  widths = [max(len(str(c)), *(len(b[j]) for b in body)) for j, c in enumerate(columns)]

  def line(cells: Sequence[str]) -> str:
    return "  ".join(s.rjust(w) if num else s.ljust(w)
                     for s, w, num in zip(cells, widths, numeric)).rstrip()

  sep = "  ".join("-" * w for w in widths)
  return "\n".join([line([str(c) for c in columns]), sep] + [line(b) for b in body])
