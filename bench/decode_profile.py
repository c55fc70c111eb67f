r"""Where a sampler call's time goes, by phase and piece, from one traced call on this CPU.

    python bench/decode_profile.py                    # decode_throughput.py's tiny shape
    python bench/decode_profile.py --batch 64 --new_tokens 128 --out /tmp/decode_profile.json

Traces one `dapo_jax.rollout.Sampler.generate` call (after warm-up) with `jax.profiler`, reads
XLA:CPU's thunk events (each names its HLO instruction) and the optimised HLO of the sampler's
program (dumped with ``--xla_dump_to``), and adds up the thunks' time by the named scope of the
op they run (`dapo_jax.infra.profiling`: prefill or decode step; dense weight matmuls,
attention core, KV-cache write, RoPE, norms, LM head, sampling). Loops (``while``) are not
counted themselves, their bodies' thunks are; what is left of the call's wall time is the
executor's own time.
Next to it, the same run's medians of the call and of the decode's matmul floor
(`decode_throughput.matmul_bound_fn`, the decode's weight matmuls alone) and of the prefill's
weight matmuls alone, so each piece reads against the matmul work the call cannot avoid.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

_DUMP = tempfile.mkdtemp(prefix="decode_profile_hlo_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP}"
                           " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=generate_program")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table1_cpu  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import decode_throughput as dt  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.models import create_model, get_preset  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from dapo_jax.infra.profiling import PHASES, SCOPES  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"")
_LOOPS = ("while", "conditional", "call")


def hlo_op_names(dump_dir: str, module: str) -> dict[str, str]:
  """Instruction name -> ``op_name`` metadata in the module's optimised HLO."""
  files = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations.txt")))
  if not files:
    raise FileNotFoundError(f"No optimised HLO of {module} in {dump_dir}.")
  out = {}
  for line in open(files[-1], encoding="utf-8"):
    m = _INSTR.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def classify(op_name: str) -> tuple[str, str]:
  """(phase, piece) of an op from its name stack."""
  parts = op_name.split("/")
  phase = next((p for p in PHASES if p in parts), "sampler loop")
  piece = next((s for s in SCOPES if s in parts), "other")
  if piece in ("dense", "lm_head", "attention_core") and parts[-1] == "dot_general":
    piece += " (matmul)"
  elif piece in ("dense", "lm_head", "attention_core"):
    piece += " (elementwise)"
  return phase, piece


def thunk_times(trace_dir: str, module: str) -> list[tuple[str, float]]:
  """(HLO instruction, ms) of every thunk of ``module`` in the trace, loops left out."""
  files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  out = []
  for e in events:
    args = e.get("args", {})
    if e.get("ph") == "X" and args.get("hlo_module") == module:
      op = args.get("hlo_op", e["name"])
      if op.split(".")[0] not in _LOOPS:
        out.append((op, e["dur"] / 1e3))
  return out


def prefill_floor_fn(model, batch: int, prompt_len: int):
  """The prefill's weight matmuls alone ([B*P, D] through every layer and the LM head once)."""
  d = model.config.hidden_size
  ws, head = dt.dense_weights(model)

  @jax.jit
  def run(x):
    for wq, wk, wv, wo, wg, wu, wd in ws:
      x = x + ((x @ wq) @ wo) + jnp.sum(x @ wk, -1, keepdims=True) + jnp.sum(x @ wv, -1,
                                                                             keepdims=True)
      x = x + ((x @ wg) * (x @ wu)) @ wd
    return x + jnp.sum(x @ head, -1, keepdims=True) * 1e-6
  x = jnp.ones((batch * prompt_len, d), jnp.float32) * 1e-3
  return lambda: run(x).block_until_ready()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  b, p, r = args.batch, args.prompt_len, args.new_tokens
  model = create_model(get_preset("test", **dt.TINY), seed=0)
  ids = np.random.RandomState(0).randint(1, dt.TINY["vocab_size"], (b, p)).astype(np.int32)
  fns = {"sampler call": dt.jax_generate_fn(model, ids, r),
         "decode matmul floor": dt.matmul_bound_fn(model, b, r),
         "prefill matmul floor": prefill_floor_fn(model, b, p)}
  times = collections.defaultdict(list)
  for fn in fns.values():
    fn()
  for _ in range(args.repeats):  # interleaved, as decode_throughput.py does
    for name, fn in fns.items():
      times[name].append(dt.once(fn) * 1e3)
  med = {k: statistics.median(v) for k, v in times.items()}
  trace_dir = tempfile.mkdtemp(prefix="decode_profile_trace_")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    t0 = time.perf_counter()
    fns["sampler call"]()
    traced_ms = (time.perf_counter() - t0) * 1e3
  module = "jit__generate_program"
  names = hlo_op_names(_DUMP, "generate_program")
  thunks = thunk_times(trace_dir, module)
  if not thunks:
    raise RuntimeError(f"No thunk events of {module} in the trace.")
  by = collections.Counter()
  for op, ms in thunks:
    by[classify(names.get(op, ""))] += ms
  counted = sum(by.values())
  host = table1_cpu.host_info()
  cpu = f"{host['cpu']} ({host['cpu_count']} cores)"
  print(f"jax {jax.__version__}, {jax.devices()[0].platform} {cpu}; B={b} P={p} R={r}; "
        f"median of {args.repeats}: sampler call {med['sampler call']:.1f} ms, decode matmul "
        f"floor {med['decode matmul floor']:.1f} ms, prefill matmul floor "
        f"{med['prefill matmul floor']:.1f} ms")
  floors = med["decode matmul floor"] + med["prefill matmul floor"]
  call = med["sampler call"]
  print(f"floor share of the call: decode's matmuls {med['decode matmul floor'] / call:.0%}, "
        f"prefill's and decode's {floors / call:.0%}")
  print(f"traced call {traced_ms:.1f} ms, thunks counted {counted:.1f} ms "
        f"(the rest is the executor and loop control)")
  print("\n| phase | piece | ms per call | share of thunk time |\n|---|---|---|---|")
  rows = []
  for (phase, piece), ms in sorted(by.items(), key=lambda kv: -kv[1]):
    rows.append({"phase": phase, "piece": piece, "ms": ms, "share": ms / counted})
    print(f"| {phase} | {piece} | {ms:.1f} | {ms / counted:.1%} |")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"host": host, "batch": b, "prompt_len": p, "new_tokens": r, "medians_ms": med,
                 "traced_ms": traced_ms, "thunk_ms": counted, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
