"""Learning curves of a run: ``curves.png`` drawn from ``metrics.jsonl``, and the end-of-run files.

    plot_curves(workdir / "metrics.jsonl", workdir / "curves.png")
    rows = write_final_files(workdir, result)   # curves.png + final_metrics.json, robust to outages

The default panels match metric names by glob (see `dapo_jax.infra.metrics` for the names).
"""

from __future__ import annotations

import fnmatch
import io
import math
from typing import Any, Sequence

from etils import epath

from dapo_jax.infra import metrics
from dapo_jax.infra import run_files

Panel = tuple[str, Sequence[str]]
DEFAULT_PANELS: tuple[Panel, ...] = (
    ("reward / accuracy (train)", ("*reward_mean", "*acc_mean")),
    ("held-out accuracy", ("*avg@*", "*pass@*", "*maj@*")),  # eval_metrics.summarize names.
    ("response length", ("*response_length_mean", "*response_length_max")),
    ("entropy", ("*entropy",)),
    ("clip fraction", ("*pg_clipfrac", "*pg_clipfrac_lower")),
    ("ppo_kl", ("*ppo_kl",)),
    ("grad norm", ("*grad_norm",)),
    ("dynamic sampling: group ratios", ("*kept_ratio", "*all_correct_ratio", "*all_wrong_ratio")),
    ("generation batches per step", ("*num_gen_batches", "*gen_batches_admitted")),
    ("decoded tokens per kept group", ("*decoded_tokens_per_kept_group",)),
    ("skip filter: decoded tokens per kept group / ideal (1: every group kept)",
     ("skip/decoded_per_kept_vs_ideal",)),
    # The pre-rollout skip filter (algorithm.skip_filter, trainer/skip_filter.py).
    ("skip filter: prompts skipped by kind, retried, retried and informative",
     ("skip/skipped_right", "skip/skipped_wrong", "skip/retried", "skip/retried_informative")),
    ("skip filter: zero-variance share before / after, retry bases",
     ("skip/zero_var_share_*", "skip/explore_*")),
    ("decode slot utilisation", ("*slot_utilization",)),
    # dapo_jax.trainer.diagnostics (read the first next to the group ratios and generation batches).
    ("distinct final answers per group", ("diag/distinct_answers_*",)),
    ("gradient-weight share: length quarter x correct", ("diag/grad_weight/*",)),
    ("pass rate of generated groups", ("diag/pass_rate_generated/*",)),
    ("pass rate of trained groups", ("diag/pass_rate_trained/*",)),
    ("share of generated groups trained, by pass rate", ("diag/accepted/*",)),
    ("decode seconds by length quarter (proxy)", ("time/decode_by_length/*",)),
    # dapo_jax.trainer.logprob_gap: sampler vs training forward on the same tokens (issue 29).
    ("sampler vs trainer: |delta logp| and k3 KL",
     ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/kl_k3")),
    ("sampler vs trainer: bit-equal share, seqs outside [0.5, 2]",
     ("rollout/bit_equal", "rollout/seq_outside_band")),
    ("sampler vs trainer: token IS weight", ("rollout/is_weight_*",)),
    # An overlapped run (algorithm.max_staleness >= 1, trainer/experience.py).
    ("overlap: idle and weight hand-off seconds",
     ("time/trainer_idle", "time/rollout_idle", "time/weight_sync")),
    ("overlap: share of trained tokens by staleness", ("staleness/tokens_at_*",)),
    ("behaviour weights: mean, share capped or masked",
     ("*rollout_is_weight", "*rollout_is_capped", "*rollout_is_masked")),
)


def plot_curves(jsonl_path: epath.PathLike, out_png: epath.PathLike,
                panels: Sequence[str | Panel] | None = None, *, ncols: int = 3) -> list[str]:
  """A grid of learning curves from ``metrics.jsonl`` as a PNG; returns the panel titles drawn.

  ``panels``: a metric name or glob per panel, or ``(title, [globs])``; default `DEFAULT_PANELS`.
  """
  # The object-oriented API draws without a display and leaves the process's pyplot backend
  # alone (a notebook's inline figures keep working after a run).
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  rows = metrics.read_jsonl(jsonl_path)
  names = sorted({k for r in rows for k in r if k != "step"})
  panels = DEFAULT_PANELS if panels is None else panels
  drawn: list[tuple[str, list[str]]] = []
  for panel in panels:
    title, patterns = (panel, (panel,)) if isinstance(panel, str) else panel
    keys = [k for k in names if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    if keys:
      drawn.append((title, keys))
  if not drawn:
    raise ValueError(f"No metric in {jsonl_path} matches the panels; its metrics are {names}.")

  ncols = min(ncols, len(drawn))
  nrows = math.ceil(len(drawn) / ncols)
  width, height = 5.0 * ncols, 3.4 * nrows
  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False)
  for ax, (title, keys) in zip(axes.flat, drawn):
    for k in keys:
      pts = [(r["step"], r[k]) for r in rows if k in r]
      xs, ys = zip(*pts)
      # Sparse series (evaluation every N steps) get markers so single points show.
      ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=k)
    # A fixed height, above an offset text ("1e-5"): placing it measured every tick label.
    ax.set_title(title, y=1.06)
    ax.locator_params(nbins=5)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(keys) > 1:
      ax.legend(fontsize=7, loc="upper left")  # "best" searches every point of every line
  for ax in list(axes.flat)[len(drawn):]:
    ax.axis("off")
  # Fixed margins in inches (room for tick labels, a raised title and "step"): tight_layout measured
  # every label first, a second full draw (1 of the 2 s a 21-panel figure took; issue 41).
  fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, bottom=0.55 / height,
                      top=1 - 0.5 / height, wspace=0.3, hspace=0.5)
  out_png = run_files.resolve(out_png)
  image = io.BytesIO()  # Drawn in memory: matplotlib cannot write to gs:// itself.
  fig.savefig(image, format=out_png.suffix.lstrip(".") or "png", dpi=100)
  run_files.write_bytes_atomic(out_png, image.getvalue())
  return [t for t, _ in drawn]


def write_final_files(workdir: epath.PathLike, result: dict[str, Any]) -> list[dict[str, Any]]:
  """End of a run: ``curves.png`` and ``final_metrics.json``; returns the rows of metrics.jsonl.

  The metrics are written by process 0 only, so only process 0 draws and returns them (other
  processes get []; on a local disk of another host the file does not exist).
  """
  import jax  # pylint: disable=g-import-not-at-top
  workdir = run_files.resolve(workdir)

  def write() -> list[dict[str, Any]]:
    rows = []
    if jax.process_index() == 0:
      plot_curves(workdir / metrics.METRICS_FILE, workdir / run_files.CURVES_FILE)
      rows = metrics.read_jsonl(workdir / metrics.METRICS_FILE)
    run_files.write_final_metrics(workdir, result)
    return rows
  # The checkpoint and the metrics are written by now: a brief outage here must not fail the run.
  return run_files.retry_transient(write, what=f"Final files of {workdir}",
                                   timeout_s=run_files.FINAL_RETRY_S)
