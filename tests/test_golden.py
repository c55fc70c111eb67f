"""Golden regression tests: one train step on fixed inputs and a 3-step tiny run.

Two checks of the same two computations (each computed once per module):

* bit-exact: metrics and final parameters identical to a recording of this very CPU. XLA:CPU
  results depend on the host's vector units, so these are kept per CPU in
  ``tests/golden/<cpu>.json``, ``<cpu>`` being the model name and a hash of the family, model and
  feature flags (what XLA:CPU compiles for). Only the file of this exact key is read: a recording
  of another revision of the same model (the old files named by the model name alone) says nothing
  bit for bit about this one. Each record names the jax, jaxlib, flax, optax and numpy versions it
  was made with. On a CPU with no file, or under other versions, this check skips, saying how to
  record. Metrics added since a recording are not pinned by it (a host that made it may be out of
  reach); a recorded metric that is gone fails.
* cross-host: the metrics within a stated tolerance of ``tests/golden/cross_host.json`` (its
  ``why`` says how the tolerance was measured). This one runs on every host and never skips: it is
  what covers a CPU nobody recorded.

To record this CPU's exact file (a new host; the cross-host reference is left alone):

    DAPO_UPDATE_GOLDEN=cpu python -m pytest -q tests/test_golden.py

When a change is MEANT to alter the numerics, re-record this CPU's file and the cross-host
reference with

    DAPO_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py

and say in the commit why the numbers moved (other CPUs' files then skip until re-recorded there).
"""

import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.trainer import train_step as ts
from dapo_jax.models import create_model, get_preset
from dapo_jax.trainer.train import train_and_evaluate
from tests.test_train_e2e import _small_config

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
CROSS_HOST = os.path.join(GOLDEN_DIR, "cross_host.json")
# "1": re-record this CPU's file and the cross-host reference; "cpu": this CPU's file only.
UPDATE = os.environ.get("DAPO_UPDATE_GOLDEN", "")
RECORD = "DAPO_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py"
RECORD_CPU = "DAPO_UPDATE_GOLDEN=cpu python -m pytest -q tests/test_golden.py"


def _cpuinfo() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return f.read()
  except OSError:
    return ""


def _cpu_model(info: str) -> str:
  """The model name as a slug (and -avx512), e.g. amd-epyc-avx512."""
  m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
  slug = re.sub(r"[^a-z0-9]+", "-", (m.group(1) if m else "unknown-cpu").lower()).strip("-")
  return f"{slug}{'-avx512' if ' avx512f' in info else ''}"


def _cpu_key(info: str) -> str:
  """The model name and a hash of the first core's family, model and feature flags."""
  def field(name: str) -> str:
    m = re.search(rf"^{name}\s*:\s*(.*)$", info, re.M)
    return m.group(1).strip() if m else ""
  ident = "|".join([field("cpu family"), field("model"), " ".join(sorted(field("flags").split()))])
  return f"{_cpu_model(info)}-{hashlib.sha256(ident.encode()).hexdigest()[:8]}"


def _golden_path() -> str:
  """The recording of this exact CPU key, whether or not it exists: never another revision's."""
  return os.path.join(GOLDEN_DIR, f"{_cpu_key(_cpuinfo())}.json")


def _versions() -> dict[str, str]:
  import importlib.metadata as md  # pylint: disable=g-import-not-at-top
  return {p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy")}


def _digest(tree) -> dict[str, str]:
  """sha256 of every leaf's bytes, keyed by its tree path (names, shapes and values)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]:
    a = np.ascontiguousarray(np.asarray(leaf))
    h = hashlib.sha256(f"{a.dtype}{a.shape}".encode())
    h.update(a.tobytes())
    out[jax.tree_util.keystr(path)] = h.hexdigest()
  return out


def _scalars(metrics: dict) -> dict[str, float]:
  """Everything but wall-clock figures and the diagnostics (tests/test_diagnostics.py pins those;
  they include wall-clock shares), as exact float reprs."""
  return {k: float(v) for k, v in sorted(metrics.items())
          if not k.startswith(("time/", "perf/", "diag/"))}


def _check(name: str, record: dict) -> None:
  path = _golden_path()
  golden = {}
  if os.path.exists(path):
    with open(path) as f:
      golden = json.load(f)
  if UPDATE in ("1", "cpu"):
    golden[name] = {**record, "versions": _versions()}
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    with open(path, "w") as f:
      json.dump(golden, f, indent=1, sort_keys=True)
    return
  if name not in golden:
    pytest.skip(f"No golden values for {name!r} on this CPU ({os.path.basename(path)}); the "
                f"cross-host check covers it. Record them with {RECORD_CPU}")
  want = golden[name]
  recorded = want.get("versions")  # None: an older recording, made before versions were kept
  if recorded is not None and recorded != _versions():
    pytest.skip(f"Golden values for {name!r} were recorded under {recorded}, this is "
                f"{_versions()}; record them with {RECORD_CPU}")
  how = (f" If this change is meant to alter the numerics, re-record with {RECORD} and say why "
         "in the commit.")
  moved = {k: (v, record["metrics"].get(k)) for k, v in want["metrics"].items()
           if record["metrics"].get(k) != v}
  assert not moved, "metrics moved: " + ", ".join(
      f"{k}: {old} -> {new}" for k, (old, new) in sorted(moved.items())) + "." + how
  changed = sorted(k for k in set(want["params"]) | set(record["params"])
                   if want["params"].get(k) != record["params"].get(k))
  assert not changed, f"parameters moved: {changed[:8]} ({len(changed)} leaves).{how}"


# Defaults of a fresh cross_host.json; the file's values are the ones checked.
RTOL, ATOL = 1e-4, 1e-6
# Metrics whose value is a property of the host, not of the algorithm.
HOST_METRICS = {
    "rollout/bit_equal": "the share of tokens whose sampler and training log-probs have the "
                         "same float32 bits: what differs between vector units by design",
}
CROSS_HOST_WHY = (
    "Reference metrics of test_golden's one update (train_step) and 3-step run (tiny_run), "
    "checked on every host as |got - want| <= atol + rtol * |want|. Measured between the hosts "
    "recorded in tests/golden: an AMD EPYC without AVX-512 (family 25 model 1, the host of this "
    "recording, amd-epyc-6a62dbd2.json) and AMD EPYC AVX-512 hosts "
    "(amd-epyc-avx512-fe2b22db.json), same jax/jaxlib/flax/optax/numpy: at most 2.4e-7 absolute "
    "(grad_norm ~2.1) and 7e-7 relative on values above 1e-2 (the update's ppo_kl, 0.024); the "
    "3-step run's ppo_kl (~6e-5) differs by 1.7e-8, 2.6e-4 relative, as a difference of "
    "log-probs of order 1 carries their float32 rounding as an absolute error, hence atol. The "
    "worst metric uses 1.7% of rtol 1e-4 + atol 1e-6 (a ~60x margin), far below what a real "
    "change moves (a loss, clip fraction or advantage going wrong moves them by 1e-3 or more). "
    "Discrete metrics (token counts, rewards) hold while every sampled token is the same on both "
    "hosts, as on the hosts measured; a near-tie flipping a token would fail here and is a "
    "reason to re-record, not to widen the tolerance.")


def _check_close(name: str, metrics: dict[str, float]) -> None:
  """The cross-host check: every metric within the file's tolerance of its reference."""
  ref = {}
  if os.path.exists(CROSS_HOST):
    with open(CROSS_HOST) as f:
      ref = json.load(f)
  metrics = {k: v for k, v in metrics.items() if k.split(":")[-1] not in HOST_METRICS}
  if UPDATE == "1":
    ref.update(why=CROSS_HOST_WHY, rtol=ref.get("rtol", RTOL), atol=ref.get("atol", ATOL),
               excluded=HOST_METRICS, versions=_versions(), cpu=_cpu_key(_cpuinfo()))
    ref[name] = metrics
    with open(CROSS_HOST, "w") as f:
      json.dump(ref, f, indent=1, sort_keys=True)
    return
  how = (f" If this change is meant to alter the numerics, re-record with {RECORD} and say why "
         f"in the commit (reference: {ref.get('cpu')}, {ref.get('versions')}; this host: "
         f"{_cpu_key(_cpuinfo())}, {_versions()}).")
  assert name in ref, f"No cross-host reference for {name!r} in {CROSS_HOST}.{how}"
  want, rtol, atol = ref[name], ref["rtol"], ref["atol"]
  missing, added = sorted(set(want) - set(metrics)), sorted(set(metrics) - set(want))
  assert not missing and not added, f"metrics gone: {missing}; metrics new: {added}.{how}"
  off = {k: (want[k], v) for k, v in metrics.items() if not abs(v - want[k]) <= atol + rtol * abs(
      want[k])}
  assert not off, (f"{len(off)} metrics beyond rtol={rtol}, atol={atol}: " + ", ".join(
      f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(off.items())[:12]) + "." + how)


@pytest.fixture(name="train_step_record", scope="module")
def _train_step_record():
  """One compiled update (2 micro-batches, clip branches engaged) on fixed inputs."""
  model = create_model(get_preset("test"), seed=0)
  cfg = ts.TrainConfig(lr=1e-3, warmup_steps=0, logit_chunk_size=5, num_micro_batches=2)
  graphdef, state = ts.init_train_state(model, cfg)
  b, p, r = 8, 5, 11
  rng = np.random.RandomState(1234)
  attn = np.ones((b, p + r), np.int32)
  for i in range(b):
    attn[i, :rng.randint(0, p - 1)] = 0
    attn[i, p + rng.randint(1, r + 1):] = 0
  ids = np.where(attn == 1, rng.randint(1, 128, (b, p + r)), 0).astype(np.int32)
  logp, _ = ts.LogProbForward(graphdef, cfg)(state.params, jnp.asarray(ids), jnp.asarray(attn), r)
  old = (np.asarray(logp) + rng.normal(0, 0.3, (b, r))).astype(np.float32)
  adv = (np.where(np.arange(b) % 2 == 0, 1.0, -1.0) * rng.uniform(0.5, 1.5, b)).astype(np.float32)
  batch = ts.TrainBatch(input_ids=ids, attention_mask=attn,
                        response_mask=attn[:, p:].astype(np.float32), old_log_probs=old,
                        advantages=adv)
  state, metrics = ts.TrainStep(graphdef, cfg)(state, jax.tree.map(jnp.asarray, batch), 0)
  return {"metrics": _scalars(jax.device_get(metrics)), "params": _digest(state.params)}


@pytest.fixture(name="tiny_run_record", scope="module")
def _tiny_run_record(tmp_path_factory):
  """train_and_evaluate for 3 steps on the 8 simulated devices, with a final evaluation."""
  c = _small_config()
  c.num_steps = 3
  c.eval.every = 3
  c.checkpoint.save_every = 3
  workdir = str(tmp_path_factory.mktemp("golden") / "run")
  result = train_and_evaluate(c, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  per_step = {f"{row['step']}:{k}": v for row in rows for k, v in _scalars(
      {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}).items()}
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  params = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", "3", "params"))
  return {"metrics": {**per_step, **{f"final:{k}": v for k, v in _scalars(result).items()}},
          "params": _digest(params)}


def test_golden_train_step(train_step_record):
  _check("train_step", train_step_record)


def test_golden_tiny_run(tiny_run_record):
  _check("tiny_run", tiny_run_record)


def test_cross_host_train_step(train_step_record):
  _check_close("train_step", train_step_record["metrics"])


def test_cross_host_tiny_run(tiny_run_record):
  _check_close("tiny_run", tiny_run_record["metrics"])


_UNRECORDED_CPU = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 999\n"
                   "model name\t: AMD EPYC\nflags\t\t: fpu sse sse2 avx avx2 fma\n")


def test_golden_file_choice_on_an_unrecorded_cpu(tmp_path, monkeypatch):
  """A CPU whose exact key has no file skips the bit-exact check, even where a file of the same
  model name (another revision's recording, with other numbers) exists; nothing there can fail."""
  monkeypatch.setitem(globals(), "_cpuinfo", lambda: _UNRECORDED_CPU)
  monkeypatch.setitem(globals(), "GOLDEN_DIR", str(tmp_path))
  monkeypatch.setitem(globals(), "UPDATE", "")
  key = _cpu_key(_UNRECORDED_CPU)
  assert key.startswith("amd-epyc-") and key != "amd-epyc"
  other = {"metrics": {"ppo_kl": 0.02382166124880314}, "params": {"w": "0" * 64}}
  for name in ("amd-epyc.json", "amd-epyc-6a62dbd2.json"):  # same model, not this key
    (tmp_path / name).write_text(json.dumps({"train_step": other}))
  assert _golden_path() == str(tmp_path / f"{key}.json")
  moved = {"metrics": {"ppo_kl": 0.023821653798222542}, "params": {"w": "1" * 64}}
  with pytest.raises(pytest.skip.Exception, match="cross-host check covers it"):
    _check("train_step", moved)
  # The same record on the CPU it was recorded on does fail: the skip above is the key's doing.
  (tmp_path / f"{key}.json").write_text(json.dumps({"train_step": other}))
  with pytest.raises(AssertionError, match="metrics moved: ppo_kl"):
    _check("train_step", moved)
