"""Statistics of the CPU ablation (bench/table1_cpu.py): seed spreads, paired differences, and
the effects of a replicated 2^k factorial with confidence intervals. Pure numpy (+ scipy's t).

Seeds are blocks: every variant of a seed starts from that seed's warm start, so differences are
taken within a seed (paired) and the factorial's error term is the cell x seed interaction.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np
from scipy import stats as sp_stats


def t_quantile(df: int, level: float = 0.95) -> float:
  """Two-sided Student-t critical value (inf for df < 1: no interval)."""
  return float(sp_stats.t.ppf(0.5 + level / 2, df)) if df >= 1 else float("inf")


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A mean with its sample standard deviation (ddof 1), standard error and confidence interval."""
  mean: float
  std: float  # of the values (for a factorial effect: nan, see `se`)
  se: float
  lo: float
  hi: float
  df: int

  @property
  def excludes_zero(self) -> bool:
    return self.lo > 0 or self.hi < 0


def mean_ci(values: Sequence[float], level: float = 0.95) -> Estimate:
  """Mean +- t(n-1) x std / sqrt(n) of independent values (std with ddof=1; nan for n=1)."""
  x = np.asarray(values, np.float64).reshape(-1)
  if x.size == 0:
    raise ValueError("mean_ci needs at least one value.")
  n = x.size
  std = float(x.std(ddof=1)) if n > 1 else float("nan")
  se = std / np.sqrt(n) if n > 1 else float("nan")
  half = t_quantile(n - 1, level) * se if n > 1 else float("nan")
  mean = float(x.mean())
  return Estimate(mean, std, float(se), mean - half, mean + half, n - 1)


def paired_difference(a: dict[int, float], b: dict[int, float], level: float = 0.95
                      ) -> Estimate:
  """``a - b`` seed by seed (the seeds both have), then `mean_ci` of the differences."""
  seeds = sorted(set(a) & set(b))
  if not seeds:
    raise ValueError(f"No common seed between {sorted(a)} and {sorted(b)}.")
  return mean_ci([a[s] - b[s] for s in seeds], level)


@dataclasses.dataclass(frozen=True)
class Effect:
  """One factorial term: the mean response at its +1 level minus at its -1 level."""
  term: str  # "A" or "A x B"
  estimate: Estimate


def factorial_effects(y_CxS: np.ndarray, levels_CxK: np.ndarray, names: Sequence[str],
                      level: float = 0.95, max_order: int = 2) -> list[Effect]:
  """Main effects and interactions (up to ``max_order``) of a 2^k factorial replicated in blocks.

  Args:
    y_CxS: responses, one row per cell, one column per seed (block); complete.
    levels_CxK: 0/1 level of each factor in each cell; the 2^k cells each once.
    names: the K factor names.

  An effect is the classical contrast ``mean(y | x = +1) - mean(y | x = -1)`` with ``x`` the
  product of the term's factors in +-1 coding (twice the regression coefficient). The error
  variance is the cell x seed interaction mean square, ``df = (C - 1)(S - 1)`` (a randomised
  complete block design), so each effect's standard error is ``2 sigma / sqrt(C S)``.
  """
  y = np.asarray(y_CxS, np.float64)
  x = np.asarray(levels_CxK)
  c, s = y.shape
  k = len(names)
  if x.shape != (c, k) or c != 2 ** k:
    raise ValueError(f"levels {x.shape} must be the {2 ** k} x {k} cells of a 2^{k} design "
                     f"(responses {y.shape}).")
  if len({tuple(r) for r in x.tolist()}) != c or not np.isin(x, (0, 1)).all():
    raise ValueError("each 0/1 level combination must appear exactly once.")
  if not np.isfinite(y).all():
    raise ValueError("the factorial needs every cell x seed response (found nan/inf).")
  signs = 2.0 * x - 1.0
  cell_mean = y.mean(axis=1)
  resid = y - cell_mean[:, None] - y.mean(axis=0)[None, :] + y.mean()
  df = (c - 1) * (s - 1)
  sigma = np.sqrt((resid ** 2).sum() / df) if df > 0 else float("nan")
  se = 2.0 * sigma / np.sqrt(c * s)
  half = t_quantile(df, level) * se if df > 0 else float("nan")
  out = []
  for order in range(1, max_order + 1):
    for combo in itertools.combinations(range(k), order):
      contrast = signs[:, list(combo)].prod(axis=1)
      est = float((contrast * cell_mean).sum() * 2.0 / c)
      out.append(Effect(" x ".join(names[i] for i in combo),
                        Estimate(est, float("nan"), float(se), est - half, est + half, df)))
  return out
