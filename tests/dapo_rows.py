"""Fixture rows and parquet files in the official DAPO schema, for the data tests."""
from __future__ import annotations

import os
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

# The user turn of spec section 7, typed out here independently of the package's
# constant so a typo there is caught.
SPEC_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n{PROBLEM}\n\n"
    'Remember to put your answer on its own line after "Answer:".')

# The column types of the published DAPO-Math-17k file (extra_info holds only the UUID index).
DAPO_17K_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])


def spec_prompt(problem: str) -> str:
  return SPEC_TEMPLATE.replace("{PROBLEM}", problem)


def dapo_row(problem: str, answer: str | None, index: str) -> dict:
  return {
      "data_source": "math_dapo",
      "prompt": [{"content": spec_prompt(problem), "role": "user"}],
      "ability": "MATH",
      "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
      "extra_info": {"index": index},
  }


# Five distinct problems; the duplicated file repeats them out of order.
PROBLEMS = [(f"What is ${i}^2 + {i}$?", str(i * i + i), f"uuid-{i:04d}") for i in range(5)]
DUPLICATED_ORDER = [3, 1, 3, 0, 1, 4, 3, 2, 0, 4, 4, 1]
FIRST_OCCURRENCE_ORDER = [3, 1, 0, 4, 2]
MALFORMED_ROW = 2  # its ground truth is null


def write_parquet(rows: list[dict], path: os.PathLike) -> pathlib.Path:
  pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_17K_SCHEMA), path)
  return pathlib.Path(path)


def write_duplicated(path: os.PathLike) -> pathlib.Path:
  return write_parquet([dapo_row(*PROBLEMS[i]) for i in DUPLICATED_ORDER], path)


def write_malformed(path: os.PathLike) -> pathlib.Path:
  rows = [dapo_row(*p) for p in PROBLEMS]
  rows[MALFORMED_ROW]["reward_model"]["ground_truth"] = None
  return write_parquet(rows, path)


def find_shared_aime() -> pathlib.Path | None:
  """The official AIME-2024 parquet in shared/ beside (or inside) the checkout, if present."""
  repo = pathlib.Path(__file__).resolve().parents[1]
  for path in (repo.parent / "shared/data/aime-2024.parquet",
               repo / "shared/data/aime-2024.parquet"):
    if path.is_file():
      return path
  return None
