"""Figures of the reliability tests for docs/reliability.md (`python bench/faults.py`).

Each test calls `record(name, figures)`: the figures are printed (`pytest -s` shows them) and,
when `DAPO_FAULT_REPORT_DIR` is set, written to `<dir>/<name>.json`.
"""

import json
import os

ENV = "DAPO_FAULT_REPORT_DIR"


def record(name: str, figures: dict) -> None:
  print(f"[fault report] {name}: {json.dumps(figures, sort_keys=True)}")
  out_dir = os.environ.get(ENV)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
      json.dump(figures, f, indent=2, sort_keys=True)
