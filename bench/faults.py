"""The fault table of docs/reliability.md: runs the reliability tests and prints what they measured.

  python bench/faults.py                 # about 6 minutes on 2 CPU cores
  python bench/faults.py --out /tmp/f    # keep the per-test JSON reports there

Every figure comes from a test's fault report (`tests/fault_report.py`, written when
`DAPO_FAULT_REPORT_DIR` is set) or from pytest's own pass count; nothing here is typed in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Bad inputs whose error must name the culprit (each test asserts the message).
BAD_INPUT_TESTS = [
    "tests/test_bad_inputs.py",
    "tests/test_data_records.py::test_malformed_parquet_raises_naming_file_row_field",
    "tests/test_data_records.py::test_malformed_parquet_skip_counts_it",
    "tests/test_data_records.py::test_jsonl_round_trip_and_bad_lines",
    "tests/test_data_records.py::test_missing_column_fails_once_for_the_file",
    "tests/test_hf_parity.py::test_missing_tensor_is_named",
    "tests/test_hf_parity.py::test_misshaped_tensor_is_named",
    "tests/test_hf_parity.py::test_pickle_only_checkpoint_is_refused",
    "tests/test_hf_parity.py::test_missing_directory_and_files",
]
CORRUPTION_TEST = "tests/test_orbax_checkpoint.py::test_damaged_latest_step_falls_back_with_warning"
TESTS = ["tests/test_kill_resume.py", "tests/test_reliability.py",
         "tests/test_verifier_fuzz.py", "tests/test_serve_limits.py", CORRUPTION_TEST,
         *BAD_INPUT_TESTS]


def _junit_counts(path: str) -> dict[str, tuple[int, int]]:
  """{test file: (passed, run)} from pytest's JUnit XML."""
  counts: dict[str, list[int]] = {}
  for case in ET.parse(path).iter("testcase"):
    name = case.get("classname", "").replace(".", "/") + ".py"
    failed = any(c.tag in ("failure", "error", "skipped") for c in case)
    c = counts.setdefault(name, [0, 0])
    c[0] += not failed
    c[1] += 1
  return {k: (v[0], v[1]) for k, v in counts.items()}


def table(reports: dict[str, dict], counts: dict[str, tuple[int, int]]) -> str:
  k, t, f = reports["kill_resume"], reports["sigterm"], reports["verifier_fuzz"]
  n, s = reports["non_finite"], reports["serve_limits"]
  bad_files = {b.split("::")[0] for b in BAD_INPUT_TESTS}
  bad_passed = sum(p for name, (p, _) in counts.items() if name in bad_files)
  bad_run = sum(r for name, (_, r) in counts.items() if name in bad_files)
  corrupt_passed, corrupt_run = counts.get(CORRUPTION_TEST.split("::")[0], (0, 0))
  rows = [
      ("SIGKILL at seeded random moments (`tests/test_kill_resume.py`)",
       f"{k['sigkills']} kills ({k['mid_write_kills']} inside an Orbax write) + "
       f"{k['corrupted_checkpoints']} truncated newest checkpoint",
       f"{k['runs_survived']}/{k['runs_survived']} relaunches resumed from the newest complete "
       f"step; final params bit-exact: {k['final_params_bit_exact']}",
       f"{k['steps_lost_total']} in total, at most {k['steps_lost_max']} per kill; "
       f"{k['steps_lost_to_corruption']} more to the truncated checkpoint"),
      ("SIGTERM (`tests/test_reliability.py`)", f"{t['signals']}",
       f"exit {t['exit_code']}, checkpoint at step {t['checkpoint_step']}, resumed",
       f"{t['steps_lost']}"),
      ("damaged newest checkpoint: truncated, bit flip, meta (`tests/test_orbax_checkpoint.py`)",
       f"{corrupt_run}", f"{corrupt_passed}/{corrupt_run} fell back to the previous step "
       "with a warning", "1 each"),
      ("non-finite loss/grad (`tests/test_reliability.py`)",
       f"{n['poisoned_updates']} poisoned updates",
       f"{int(n['skipped_and_counted'])} skipped and counted, finite updates after a skip; "
       f"stopped after {n['stopped_after_consecutive']} in a row keeping step "
       f"{n['kept_checkpoint']}", "0"),
      ("hostile answers, both verifiers (`tests/test_verifier_fuzz.py`)",
       f"{f['answers']:,} answers ({len(f['families'])} families)",
       f"no exception; slowest symbolic call {f['slowest_symbolic_s']} s (deadline "
       f"{f['timeout_s']} s + {f['kill_grace_s']} s kill grace), slowest strict "
       f"{f['slowest_strict_s'] * 1e3:.1f} ms; {f['symbolic_outcomes'].get('timeout', 0)} "
       f"timeouts, {f['workers_killed']} workers killed; canary files: "
       f"{f['canary_files_created']}", "-"),
      ("bad inputs (`tests/test_bad_inputs.py`, `test_data_records.py`, `test_hf_parity.py`)",
       f"{bad_run} checks", f"{bad_passed}/{bad_run} tests passed: each error "
       "names the file and row, tensor, key or limit; sampling failures checkpoint their groups",
       "0"),
      ("malformed and oversized gRPC requests (`tests/test_serve_limits.py`)",
       f"{s['bad_requests']} requests + {s['cancelled_streams']} cancelled streams",
       ", ".join(f"{v} {c}" for c, v in sorted(s["status_codes"].items()))
       + f"; a valid request served after: {s['valid_after_burst']}", "-"),
  ]
  out = ["| fault | injected | outcome | steps lost |", "|---|---|---|---|"]
  out += [f"| {' | '.join(r)} |" for r in rows]
  return "\n".join(out)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="Directory for the JSON reports (default: temp).")
  args = p.parse_args()
  out = args.out or tempfile.mkdtemp(prefix="dapo_faults_")
  junit = os.path.join(out, "junit.xml")
  env = dict(os.environ, DAPO_FAULT_REPORT_DIR=out, PYTHONPATH=ROOT)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
         *TESTS]
  print("+", " ".join(cmd), flush=True)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
  reports = {f[:-5]: json.load(open(os.path.join(out, f)))
             for f in os.listdir(out) if f.endswith(".json")}
  print(table(reports, _junit_counts(junit)))
  print(f"\nReports: {out}")
  sys.exit(proc.returncode)


if __name__ == "__main__":
  main()
