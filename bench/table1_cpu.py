"""The CPU ablation: the paper's cumulative Table 1, a 2^4 factorial and Figure 2, resumable.

  python bench/table1_cpu.py                        # everything, 3 seeds, 160 RL steps a run
  python bench/table1_cpu.py --parts table1 --max_runs 6   # one sitting's share
  python bench/table1_cpu.py --dry_run              # what is done, what is left, the estimate
  python bench/table1_cpu.py --shard 0/2 & python bench/table1_cpu.py --shard 1/2   # 2 processes

Every run is `dapo-train --config configs/tiny_cpu.py:dapo` with the techniques switched by
--config overrides, from a warm start shared per seed: the supervised phase (``sft.steps``) runs
once per seed into ``--scratch`` as a HF directory, and every run of that seed loads it
(``model.checkpoint``, ``sft.steps=0``), so all variants of a seed start from the same weights
and held-out accuracy before RL is the same for them. A warm start that is missing is made again
(the same on the same machine and XLA build); each result records the sha256 of the weights it
started from.

Each finished run writes ``<results>/<run>/seed<S>.json`` (held-out avg@k before/after RL, the
per-step curves of entropy, train accuracy, length, kept ratio, and the eval curve, wall time,
host). Runs whose JSON exists are skipped (a JSON made with other settings is an error), and an
interrupted run resumes from its checkpoint in ``--scratch``, so the ablation can be spread over
sittings. Every invocation then rewrites ``<results>/tables.md`` and ``figure2.png`` from
whatever results exist.

The techniques (all on = configs/tiny_cpu.py:dapo, all off = :naive_grpo):
  clip_higher       algorithm.clip_ratio_high 0.28 (off: 0.2; clip_ratio_low stays 0.2)
  dynamic_sampling  algorithm.dynamic_sampling (off: gen_batch_size = train_batch_size)
  token_loss        algorithm.loss_agg_mode token-mean (off: seq-mean-token-mean)
  soft_overlong     reward.overlong_buffer_enable (the soft overlong punishment)
  overlong_filter   algorithm.overlong_filter (Table 1 rows 2-3 only)
Every cell trains the same batch per step: optim.train_batch_size groups x rollout.n responses,
in the same number of updates (trained tokens then differ only by response lengths, which each
result records). Table 1 rows are cumulative as in the paper, except that the soft overlong
punishment replaces overlong filtering from row 4 on (they are two answers to one problem, and
the last row is then exactly the DAPO recipe, configs/tiny_cpu.py:dapo).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ablation_stats as st  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position

TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
FACTORS = ("clip_higher", "dynamic_sampling", "token_loss", "soft_overlong")
FILTER = "overlong_filter"
ABBREV = {"clip_higher": "ch", "dynamic_sampling": "ds", "token_loss": "tl",
          "soft_overlong": "so", FILTER: "of"}
TABLE1_ROWS: tuple[tuple[str, frozenset[str]], ...] = (
    ("naive GRPO", frozenset()),
    ("+ overlong filtering", frozenset({FILTER})),
    ("+ clip-higher", frozenset({FILTER, "clip_higher"})),
    ("+ soft overlong punishment", frozenset({"clip_higher", "soft_overlong"})),
    ("+ token-level loss", frozenset({"clip_higher", "soft_overlong", "token_loss"})),
    ("+ dynamic sampling (= DAPO)", frozenset(FACTORS)),
)
FIGURE2 = {"clip 0.2/0.2": frozenset(FACTORS) - {"clip_higher"},
           "clip 0.2/0.28": frozenset(FACTORS)}
PARTS = ("table1", "factorial", "figure2")
CURVE_KEYS = {"entropy": "actor/entropy", "acc_mean": "train/acc_mean",
              "response_length_mean": "response/response_length_mean",
              "kept_ratio": "sampling/kept_ratio", "num_gen_batches": "sampling/num_gen_batches",
              "pg_clipfrac": "actor/pg_clipfrac",
              "distinct_answers": "diag/distinct_answers_generated"}


def tiny_config(variant: str = "dapo"):
  spec = importlib.util.spec_from_file_location("tiny_cpu", TINY)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(variant)


def run_name(techniques: frozenset[str]) -> str:
  """``ch1_ds0_tl1_so1_of0``: one name per configuration, shared by the parts that use it."""
  unknown = set(techniques) - set(ABBREV)
  if unknown:
    raise ValueError(f"Unknown techniques {sorted(unknown)}; known: {sorted(ABBREV)}.")
  return "_".join(f"{ABBREV[t]}{int(t in techniques)}" for t in (*FACTORS, FILTER))


def overrides(techniques: frozenset[str], train_batch_size: int) -> list[str]:
  """The --config flags that switch the techniques on top of configs/tiny_cpu.py:dapo."""
  on = lambda t: t in techniques
  flags = [f"--config.algorithm.clip_ratio_high={0.28 if on('clip_higher') else 0.2}",
           f"--config.algorithm.dynamic_sampling={on('dynamic_sampling')}",
           "--config.algorithm.loss_agg_mode="
           + ("token-mean" if on("token_loss") else "seq-mean-token-mean"),
           f"--config.reward.overlong_buffer_enable={on('soft_overlong')}",
           f"--config.algorithm.overlong_filter={on(FILTER)}"]
  if not on("dynamic_sampling"):  # one generation batch = the trained batch
    flags.append(f"--config.algorithm.gen_batch_size={train_batch_size}")
  return flags


def factorial_cells() -> list[frozenset[str]]:
  """The 16 cells, in standard order (clip_higher varies fastest)."""
  return [frozenset(f for j, f in enumerate(FACTORS) if (i >> j) & 1)
          for i in range(2 ** len(FACTORS))]


def planned(parts: Sequence[str]) -> list[frozenset[str]]:
  """The distinct configurations the parts need, Table 1's first."""
  out: list[frozenset[str]] = []
  for part in PARTS:
    if part not in parts:
      continue
    cells = {"table1": [t for _, t in TABLE1_ROWS], "factorial": factorial_cells(),
             "figure2": list(FIGURE2.values())}[part]
    out += [c for c in cells if c not in out]
  return out


@dataclasses.dataclass(frozen=True)
class Spec:
  """What every result of one ablation shares; a result made under another Spec is not reused."""
  steps: int
  sft_steps: int
  eval_every: int
  base: str = "configs/tiny_cpu.py:dapo"

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def result_path(results: str, name: str, seed: int) -> str:
  return os.path.join(results, name, f"seed{seed}.json")


def load_result(path: str, spec: Spec) -> dict[str, Any] | None:
  """The result at ``path``, None if absent; a result of another Spec raises (no silent mix)."""
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    res = json.load(f)
  if res.get("spec") != spec.to_json():
    raise ValueError(f"{path} was made with {res.get('spec')}, not {spec.to_json()}: use "
                     "another --results directory for other settings (or delete it).")
  return res


def _finite(x: float) -> float | None:
  return float(x) if x is not None and math.isfinite(float(x)) else None


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Before/after held-out accuracy and the curves from ``metrics.jsonl`` rows (by step)."""
  avg = next((k for r in rows for k in sorted(r) if k.startswith("eval/avg@")), None)
  if avg is None:
    raise ValueError("No eval/avg@k in the run's metrics: is eval.every > 0?")
  pass_k = avg.replace("avg@", "pass@")
  evals = [r for r in rows if _finite(r.get(avg)) is not None]
  train = [r for r in rows if r["step"] > 0]
  return {
      "metric": avg, "before": evals[0][avg], "after": evals[-1][avg],
      "pass_before": _finite(evals[0].get(pass_k)), "pass_after": _finite(evals[-1].get(pass_k)),
      "eval_curve": {"step": [r["step"] for r in evals], "value": [r[avg] for r in evals]},
      "curve": {"step": [r["step"] for r in train],
                **{name: [_finite(r.get(key)) for r in train] for name, key in CURVE_KEYS.items()}},
  }


def host_info() -> dict[str, Any]:
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = ""
  import jax  # pylint: disable=g-import-not-at-top
  return {"cpu": cpu, "cpu_count": os.cpu_count(), "jax": jax.__version__, "commit": commit}


def weights_hash(directory: str) -> str:
  """sha256 over the warm start's safetensors files (names and bytes, sorted)."""
  h = hashlib.sha256()
  files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"No safetensors in {directory}.")
  for name in files:
    h.update(name.encode())
    with open(os.path.join(directory, name), "rb") as f:
      h.update(f.read())
  return h.hexdigest()


def make_warm_start(seed: int, sft_steps: int, out: str) -> None:
  """The supervised warm start of configs/tiny_cpu.py for ``seed`` as a HF directory (this is
  what a dapo-train run does before RL, saved instead of kept in memory)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import run_setup, sft  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints import hf  # pylint: disable=g-import-not-at-top
  config = tiny_config()
  config.seed, config.sft.steps = seed, sft_steps
  stage = f"{out}.partial-{os.getpid()}"  # per process: shards may make the same one at once
  shutil.rmtree(stage, ignore_errors=True)
  spec = RunSpec.from_config(config)
  with tempfile.TemporaryDirectory() as tmp:
    run, state = run_setup.build_run(spec, tmp)
    with run:
      state, metrics = sft.warm_start(spec, run.graphdef, state, run.tokenizer,
                                      run.train_records, run.mesh)
      model = nnx.merge(run.graphdef, state.params, state.rest)
      hf.save_pretrained(model, stage)
      run.tokenizer.save(stage)
  with open(os.path.join(stage, "warm_start.json"), "w", encoding="utf-8") as f:
    json.dump({"seed": seed, "sft_steps": sft_steps, **metrics}, f, indent=1)
  publish_once(stage, out)


def publish_once(stage: str, out: str) -> str:
  """Renames the finished directory ``stage`` to ``out`` unless another process published
  ``out`` first; then ``stage`` is dropped, so every run of the seed uses the first one."""
  try:
    os.replace(stage, out)
  except OSError:
    if not os.path.isdir(out):
      raise
    shutil.rmtree(stage)
  return out


def ensure_warm_start(results: str, seed: int, sft_steps: int) -> tuple[str, str]:
  """The warm start's directory (made now, in a child process, if absent) and its hash. It
  lives next to the results (`results/warm_starts/`, committed: a few MB of safetensors), so
  a later sitting, on whatever host, trains from the same weights."""
  out = os.path.join(results, "warm_starts", f"seed{seed}_sft{sft_steps}")
  if not os.path.isdir(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(f"warm start seed {seed} ({sft_steps} SFT steps) -> {out}", flush=True)
    start, cpu0 = time.perf_counter(), _children_cpu_s()
    subprocess.run([sys.executable, os.path.abspath(__file__), "--make_warm_start", str(seed),
                    "--sft_steps", str(sft_steps), "--results", results], cwd=ROOT, check=True)
    print(f"  warm start seed {seed}: {time.perf_counter() - start:.0f} s "
          f"({_children_cpu_s() - cpu0:.0f} CPU-s)", flush=True)
  return out, weights_hash(out)


def train_run(techniques: frozenset[str], seed: int, spec: Spec, warm_start: str,
              workdir: str) -> list[dict[str, Any]]:
  """One dapo-train run from the warm start (resumes from ``workdir``); its metrics rows."""
  from dapo_jax.infra.metrics import read_jsonl  # pylint: disable=g-import-not-at-top
  base = tiny_config()
  cmd = [sys.executable, "-m", "dapo_jax.main", f"--config={TINY}:dapo", f"--workdir={workdir}",
         f"--config.seed={seed}", f"--config.model.checkpoint={warm_start}",
         "--config.sft.steps=0", f"--config.num_steps={spec.steps}",
         f"--config.eval.every={spec.eval_every}", "--config.logging.console=lines",
         *overrides(techniques, base.optim.train_batch_size)]
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "run.log"), "a", encoding="utf-8") as log:
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
  return read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def _children_cpu_s() -> float:
  """User + system CPU seconds of the finished child processes so far."""
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


RunFn = Callable[[frozenset, int, Spec, str, str], list[dict[str, Any]]]
WarmFn = Callable[[str, int, int], tuple[str, str]]


def run_all(configs: Sequence[frozenset[str]], seeds: Sequence[int], spec: Spec, results: str,
            scratch: str, *, max_runs: int = 0, dry_run: bool = False, shard: str = "0/1",
            train: RunFn = train_run, warm: WarmFn = ensure_warm_start) -> dict[str, int]:
  """Runs what has no result yet, seed by seed; returns counts (planned, done, ran, left).

  ``shard="i/n"``: only every n-th run of the plan from the i-th, so that n processes (or
  machines sharing ``results``) split one plan without running anything twice.
  """
  i, n = parse_shard(shard)
  jobs = [(c, s) for s in seeds for c in configs][i::n]
  todo = [(c, s) for c, s in jobs if load_result(result_path(results, run_name(c), s), spec)
          is None]
  done = [r for c, s in jobs if (r := load_result(result_path(results, run_name(c), s), spec))
          is not None]
  per_run = float(np.median([r["wall_s"] for r in done])) if done else float("nan")
  cpu = float(np.median([r.get("cpu_s", np.nan) for r in done])) if done else float("nan")
  part = f" (shard {shard} of {len(configs) * len(seeds)})" if n > 1 else ""
  print(f"planned: {len(jobs)} runs{part} ({len(configs)} configurations x {len(seeds)} seeds) of "
        f"{spec.steps} RL steps; {len(jobs) - len(todo)} done, {len(todo)} to go; median per "
        f"finished run {per_run:.0f} s wall, {cpu:.0f} CPU-s -> about "
        f"{per_run * len(todo) / 3600:.1f} h left (plus one warm start per new seed)", flush=True)
  ran = 0
  for techniques, seed in todo:
    if dry_run or (max_runs and ran >= max_runs):
      break
    ws_dir, ws_hash = warm(results, seed, spec.sft_steps)
    name = run_name(techniques)
    workdir = os.path.join(scratch, "runs", ws_hash[:12],
                           f"steps{spec.steps}_eval{spec.eval_every}", f"{name}_seed{seed}")
    resumed = os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    start, cpu0 = time.perf_counter(), _children_cpu_s()
    rows = train(techniques, seed, spec, ws_dir, workdir)
    wall, cpu = time.perf_counter() - start, _children_cpu_s() - cpu0
    res = {"name": name, "seed": seed, "techniques": sorted(techniques), "spec": spec.to_json(),
           "warm_start_sha256": ws_hash, "wall_s": wall, "cpu_s": cpu, "resumed": resumed,
           "host": host_info(), **summarize_run(rows)}
    path = result_path(results, name, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(res, f, indent=1, allow_nan=False)
    os.replace(path + ".tmp", path)
    ran += 1
    print(f"{name} seed {seed}: {res['metric']} {res['before']:.3f} -> {res['after']:.3f} in "
          f"{wall:.0f} s ({cpu:.0f} CPU-s){' (resumed)' if resumed else ''} [{ran}/{len(todo)}]",
          flush=True)
  return {"planned": len(jobs), "done": len(jobs) - len(todo) + ran, "ran": ran,
          "left": len(todo) - ran}


def parse_shard(shard: str) -> tuple[int, int]:
  try:
    i, n = (int(x) for x in shard.split("/"))
  except ValueError:
    i, n = -1, 0
  if not 0 <= i < n:
    raise ValueError(f"--shard={shard!r}: expected i/n with 0 <= i < n, e.g. 0/2.")
  return i, n


def collect(configs: Sequence[frozenset[str]], seeds: Sequence[int], spec: Spec, results: str
            ) -> dict[frozenset[str], dict[int, dict[str, Any]]]:
  """The finished results by configuration and seed."""
  out = {}
  for c in configs:
    found = {s: r for s in seeds
             if (r := load_result(result_path(results, run_name(c), s), spec)) is not None}
    out[c] = found
  return out


def _pm(e: st.Estimate, sign: str = "+") -> str:
  """``mean +- std``; the mean alone for one seed."""
  mean = f"{e.mean:{sign}.1f}"
  return f"{mean} +- {e.std:.1f}" if math.isfinite(e.std) else mean


def table1_markdown(res: dict[frozenset[str], dict[int, dict[str, Any]]]) -> str:
  """The cumulative table: before/after/gain (points, mean +- std over seeds, ddof 1) and the
  paired per-seed difference of the gain to the row above (mean, 95% t interval)."""
  lines = ["| row | held-out before RL | after RL | gain | vs row above: paired diff [95% CI] "
           "| seeds |", "|---|---|---|---|---|---|"]
  prev = None
  for label, tech in TABLE1_ROWS:
    runs = res.get(tech, {})
    if not runs:
      lines.append(f"| {label} | | | | | 0 |")
      prev = None
      continue
    gain = {s: 100 * (r["after"] - r["before"]) for s, r in runs.items()}
    before = st.mean_ci([100 * r["before"] for r in runs.values()])
    after = st.mean_ci([100 * r["after"] for r in runs.values()])
    diff = ""
    if prev and set(prev) & set(gain):
      d = st.paired_difference(gain, prev)
      ci = f" [{d.lo:+.1f}, {d.hi:+.1f}]" if math.isfinite(d.lo) else ""
      diff = f"{d.mean:+.1f}{ci}"
    lines.append(f"| {label} | {_pm(before, '')} | {_pm(after, '')} | "
                 f"{_pm(st.mean_ci(list(gain.values())))} | {diff} | {len(runs)} |")
    prev = gain
  return "\n".join(lines)


def missing_factorial_runs(res: dict[frozenset[str], dict[int, dict[str, Any]]],
                           seeds: Sequence[int]) -> int:
  """How many factorial cell x seed runs have no result yet."""
  return sum(s not in res.get(c, {}) for c in factorial_cells() for s in seeds)


def factor_levels(cells: Sequence[frozenset[str]], factors: Sequence[str] = FACTORS) -> np.ndarray:
  """The 0/1 level of each factor in each cell, [cells, factors]."""
  return np.array([[int(f in c) for f in factors] for c in cells])


def factorial_markdown(res: dict[frozenset[str], dict[int, dict[str, Any]]],
                       seeds: Sequence[int]) -> str:
  """Main effects and two-way interactions on the gain (points), 95% CIs; needs every cell x
  seed."""
  cells = factorial_cells()
  missing = missing_factorial_runs(res, seeds)
  if missing:
    return f"(factorial incomplete: {missing} of {len(cells) * len(seeds)} runs missing)"
  y = np.array([[100 * (res[c][s]["after"] - res[c][s]["before"]) for s in seeds]
                for c in cells])
  levels = factor_levels(cells)
  lines = ["| term | effect on gain (points) | 95% CI | CI excludes 0 |", "|---|---|---|---|"]
  for e in st.factorial_effects(y, levels, FACTORS):
    est = e.estimate
    lines.append(f"| {e.term} | {est.mean:+.2f} | [{est.lo:+.2f}, {est.hi:+.2f}] | "
                 f"{'yes' if est.excludes_zero else 'no'} |")
  lines.append(f"\nError: cell x seed interaction, df = {est.df}; effect = mean gain with the "
               "term at +1 minus at -1 (+-1 coding).")
  return "\n".join(lines)


DIAGNOSTICS = (  # (curve, label, scale, format) for the per-cell table, run means over steps
    ("entropy", "entropy", 1.0, ".4f"),
    ("distinct_answers", "distinct answers / group", 1.0, ".2f"),
    ("kept_ratio", "mixed-group share", 1.0, ".3f"),
    ("pg_clipfrac", "clip fraction (%)", 100.0, ".3f"),
    ("num_gen_batches", "gen. batches / step", 1.0, ".2f"),
    ("response_length_mean", "response length", 1.0, ".2f"))
DIAG_TERMS = ("clip_higher", "dynamic_sampling", "clip_higher x dynamic_sampling")


def run_mean(run: dict[str, Any], curve: str) -> float:
  """The mean over the run's steps of one logged curve (nan where it was never finite)."""
  vals = [v for v in run["curve"][curve] if v is not None]
  return float(np.mean(vals)) if vals else float("nan")


def diagnostics_markdown(res: dict[frozenset[str], dict[int, dict[str, Any]]],
                         seeds: Sequence[int]) -> str:
  """Per factorial cell, the run means of the logged diagnostics (mean over seeds), then the
  factorial effects of clip-higher, dynamic sampling and their interaction on each, and
  clip-higher's effect on the generation batches dynamic sampling needs (its 8 cells)."""
  if missing_factorial_runs(res, seeds):
    return "(needs the complete factorial)"
  cells = factorial_cells()
  lines = ["| cell | " + " | ".join(d[1] for d in DIAGNOSTICS) + " |",
           "|---|" + "---|" * len(DIAGNOSTICS)]
  for c in cells:
    vals = [np.mean([run_mean(res[c][s], key) for s in seeds]) * scale
            for key, _, scale, _ in DIAGNOSTICS]
    lines.append(f"| {run_name(c)[:-4]} | "
                 + " | ".join(f"{v:{fmt}}" for v, (_, _, _, fmt) in zip(vals, DIAGNOSTICS)) + " |")
  levels = factor_levels(cells)
  lines += ["", "Factorial effects on the run means (mean at +1 minus at -1, 95% CI; * where the "
            "interval excludes 0):", "",
            "| diagnostic | " + " | ".join(DIAG_TERMS) + " |", "|---|" + "---|" * len(DIAG_TERMS)]

  def fmt(e: st.Estimate, f: str) -> str:
    return (f"{e.mean:+{f}} [{e.lo:+{f}}, {e.hi:+{f}}]{' *' if e.excludes_zero else ''}")

  for key, label, scale, f in DIAGNOSTICS:
    if key == "num_gen_batches":
      continue  # 1 by construction without dynamic sampling: below, on its own 8 cells
    y = np.array([[scale * run_mean(res[c][s], key) for s in seeds] for c in cells])
    eff = {e.term: e.estimate for e in st.factorial_effects(y, levels, FACTORS)}
    lines.append(f"| {label} | " + " | ".join(fmt(eff[t], f) for t in DIAG_TERMS) + " |")
  ds_cells = [c for c in cells if "dynamic_sampling" in c]
  others = [f for f in FACTORS if f != "dynamic_sampling"]
  y = np.array([[run_mean(res[c][s], "num_gen_batches") for s in seeds] for c in ds_cells])
  eff = {e.term: e.estimate for e in st.factorial_effects(
      y, factor_levels(ds_cells, others), others)}
  lines += ["", "Generation batches per step with dynamic sampling (its 8 cells, a 2^3 "
            f"factorial): clip-higher's effect {fmt(eff['clip_higher'], '.3f')}."]
  return "\n".join(lines)


def two_by_two_markdown(res: dict[frozenset[str], dict[int, dict[str, Any]]],
                        seeds: Sequence[int], a: str = "dynamic_sampling",
                        b: str = "soft_overlong") -> str:
  """Mean gain (points), train accuracy and mixed-group share over the cells x seeds of each
  level pair of two factors (the means behind their interaction), and Figure 2's arms' entropy
  over the last 20 steps and held-out accuracy after RL (mean +- std over seeds)."""
  if missing_factorial_runs(res, seeds):
    return "(needs the complete factorial)"
  cells = factorial_cells()
  lines = [f"| {a} | {b} | mean gain (points) | train accuracy | mixed-group share |",
           "|---|---|---|---|---|"]
  for la in (0, 1):
    for lb in (0, 1):
      runs = [res[c][s] for c in cells if (a in c) == la and (b in c) == lb for s in seeds]
      gain = np.mean([100 * (r["after"] - r["before"]) for r in runs])
      lines.append(f"| {la} | {lb} | {gain:.2f}"
                   f" | {np.mean([run_mean(r, 'acc_mean') for r in runs]):.3f}"
                   f" | {np.mean([run_mean(r, 'kept_ratio') for r in runs]):.3f} |")
  lines.append("")
  for label, tech in FIGURE2.items():
    last = st.mean_ci([np.mean([v for v in r["curve"]["entropy"][-20:] if v is not None])
                       for r in res[tech].values()])
    after = st.mean_ci([100 * r["after"] for r in res[tech].values()])
    lines.append(f"Figure 2, {label}: entropy over the last 20 steps {last.mean:.4f} +- "
                 f"{last.std:.4f}; held-out after RL {after.mean:.1f} +- {after.std:.1f}.")
  return "\n".join(lines)


def _band(runs: dict[int, dict[str, Any]], curve: str, key: str):
  """Steps and the per-seed values of one curve (the steps all seeds share)."""
  series = [dict(zip(r[curve]["step"], r[curve][key])) for r in runs.values()]
  steps = sorted(set.intersection(*(set(s) for s in series)))
  vals = np.array([[np.nan if s[t] is None else s[t] for t in steps] for s in series], float)
  return np.array(steps), vals


def plot_figure2(res: dict[frozenset[str], dict[int, dict[str, Any]]], out_png: str) -> bool:
  """Entropy and held-out accuracy over steps, clip 0.2/0.2 vs 0.2/0.28: mean and +-1 std band
  over seeds. False (nothing drawn) until both have a result."""
  if not all(res.get(t) for t in FIGURE2.values()):
    return False
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(10, 3.6))
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, 2)
  for label, tech in FIGURE2.items():
    runs = res[tech]
    for ax, (curve, key, scale) in zip(axes, (("curve", "entropy", 1.0),
                                              ("eval_curve", "value", 100.0))):
      steps, vals = _band(runs, curve, key)
      mean, std = np.nanmean(vals, 0) * scale, np.nanstd(vals, 0) * scale
      ax.plot(steps, mean, label=f"{label} ({len(runs)} seeds)",
              marker="o" if len(steps) < 30 else None, markersize=3)
      ax.fill_between(steps, mean - std, mean + std, alpha=0.25)
  axes[0].set_title("policy entropy (train batch)")
  axes[1].set_title("held-out avg@k (%)")
  for ax in axes:
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  return True


def report(configs, seeds, spec: Spec, results: str) -> str:
  res = collect(configs, seeds, spec, results)
  hashes = {s: {r["warm_start_sha256"] for c in res for ss, r in res[c].items() if ss == s}
            for s in seeds}
  mixed = [s for s, h in hashes.items() if len(h) > 1]
  text = [f"# CPU ablation ({spec.steps} RL steps, {spec.sft_steps} SFT steps, seeds "
          f"{list(seeds)})", "", "## Table 1 (cumulative)", "", table1_markdown(res), "",
          "## 2^4 factorial", "", factorial_markdown(res, seeds), "",
          "## Diagnostics by factorial cell", "", diagnostics_markdown(res, seeds), "",
          "## Dynamic sampling x soft overlong punishment, and Figure 2's arms", "",
          two_by_two_markdown(res, seeds)]
  if mixed:
    text += ["", f"WARNING: seeds {mixed} have results from different warm starts (another "
             "machine or XLA build): paired differences mix them."]
  done = [r for c in res for r in res[c].values()]
  if done:
    whole = [r for r in done if not r.get("resumed")]  # a resumed run's time is its last part
    hosts = sorted({f"{r['host']['cpu']}, {r['host']['cpu_count']} cores" for r in done})
    if whole:
      walls = [r["wall_s"] for r in whole]
      text += ["", f"Wall time per run: median {np.median(walls):.0f} s, range "
               f"{min(walls):.0f}-{max(walls):.0f} s, total {sum(walls) / 3600:.1f} h over "
               f"{len(walls)} runs made in one go ({'; '.join(hosts)}); "
               f"{len(done) - len(whole)} resumed runs left out."]
  if plot_figure2(res, os.path.join(results, "figure2.png")):
    text += ["", "![Figure 2](figure2.png)"]
  return "\n".join(text) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {PARTS}")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=None, help="RL steps (default: tiny_cpu's)")
  p.add_argument("--sft_steps", type=int, default=None, help="default: tiny_cpu's sft.steps")
  p.add_argument("--eval_every", type=int, default=None, help="default: tiny_cpu's eval.every")
  p.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "ablation"))
  p.add_argument("--scratch", default=os.path.join(ROOT, "workdirs", "ablation"))
  p.add_argument("--max_runs", type=int, default=0, help="stop after this many new runs (0: all)")
  p.add_argument("--shard", default="0/1", help="i/n: run only every n-th planned run from the "
                 "i-th (n processes or machines sharing --results split the plan)")
  p.add_argument("--dry_run", action="store_true", help="print the plan and the tables only")
  p.add_argument("--make_warm_start", type=int, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  base = tiny_config()
  sft_steps = base.sft.steps if args.sft_steps is None else args.sft_steps
  if args.make_warm_start is not None:  # the child process of ensure_warm_start
    import logging  # pylint: disable=g-import-not-at-top
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax"):
      logging.getLogger(noisy).setLevel(logging.WARNING)
    make_warm_start(args.make_warm_start, sft_steps, os.path.join(
        args.results, "warm_starts", f"seed{args.make_warm_start}_sft{sft_steps}"))
    return
  parts = [x for x in args.parts.split(",") if x]
  if not parts or any(x not in PARTS for x in parts):
    p.error(f"--parts={args.parts!r}: choose from {PARTS}")
  spec = Spec(steps=base.num_steps if args.steps is None else args.steps, sft_steps=sft_steps,
              eval_every=base.eval.every if args.eval_every is None else args.eval_every)
  seeds = [int(s) for s in args.seeds.split(",")]
  try:
    parse_shard(args.shard)
  except ValueError as e:
    p.error(str(e))
  configs = planned(parts)
  start = time.perf_counter()
  counts = run_all(configs, seeds, spec, args.results, args.scratch, max_runs=args.max_runs,
                   shard=args.shard,
                   dry_run=args.dry_run)
  os.makedirs(args.results, exist_ok=True)
  text = report(planned(PARTS), seeds, spec, args.results)
  with open(os.path.join(args.results, "tables.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  print(f"{counts}; this sitting {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
