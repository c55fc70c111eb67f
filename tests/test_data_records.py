"""Row validation and the parquet / JSONL loaders (dapo_jax/data/records.py, loaders.py)."""
import copy
import json
import subprocess
import sys

import pytest

from dapo_jax.data import loaders, records
from dapo_jax.data.records import MalformedRowError, MathRecord, parse_row

from tests import dapo_rows


def _good_row():
  return dapo_rows.dapo_row("What is $1+1$?", "2", "uuid-0001")


def test_parse_row_reads_the_official_schema():
  record = parse_row(_good_row(), source="f.parquet", row_number=0)
  assert record == MathRecord(
      prompt=dapo_rows.spec_prompt("What is $1+1$?"), ground_truth="2", data_source="math_dapo",
      index="uuid-0001", extra={"ability": "MATH", "style": "rule-lighteval/MATH_v2"})
  assert parse_row(record.to_row(), source="f", row_number=0) == record


def test_package_template_is_the_spec_template():
  assert records.make_dapo_prompt("P") == dapo_rows.spec_prompt("P")
  assert records.DAPO_PROMPT_TEMPLATE.format(problem="{x}") == dapo_rows.spec_prompt("{x}")
  # LaTeX braces must survive (no str.format on the problem).
  assert records.extract_problem(records.make_dapo_prompt(r"\frac{1}{2}")) == r"\frac{1}{2}"
  assert records.extract_problem("12+7=") is None


def _set(path, value):
  def mutate(row):
    *parents, leaf = path
    target = row
    for key in parents:
      target = target[key]
    if value is _DELETE:
      del target[leaf]
    else:
      target[leaf] = value
  return mutate


_DELETE = object()

MALFORMED_CASES = {
    "missing ground truth": (_set(["reward_model", "ground_truth"], None),
                             "reward_model.ground_truth", "missing ground truth"),
    "int ground truth": (_set(["reward_model", "ground_truth"], 2),
                         "reward_model.ground_truth", "expected a string, got int"),
    "blank ground truth": (_set(["reward_model", "ground_truth"], "  "),
                           "reward_model.ground_truth", "empty ground truth"),
    "no reward_model": (_set(["reward_model"], _DELETE), "reward_model", "missing"),
    "empty prompt list": (_set(["prompt"], []), "prompt", "empty message list"),
    "empty prompt text": (_set(["prompt", 0, "content"], " \n"), "prompt[0].content",
                          "empty prompt"),
    "prompt is a string": (_set(["prompt"], "hi"), "prompt", "got str"),
    "system turn": (_set(["prompt"], [{"role": "system", "content": "s"},
                                      {"role": "user", "content": "u"}]),
                    "prompt", "exactly one message with role 'user'"),
    "assistant role": (_set(["prompt", 0, "role"], "assistant"), "prompt", "roles ['assistant']"),
    "content not text": (_set(["prompt", 0, "content"], 7), "prompt[0].content", "got int"),
    "no index": (_set(["extra_info", "index"], _DELETE), "extra_info.index", "missing"),
    "float index": (_set(["extra_info", "index"], 1.5), "extra_info.index", "got float"),
    "bool index": (_set(["extra_info", "index"], True), "extra_info.index", "got bool"),
    "empty data_source": (_set(["data_source"], ""), "data_source", "non-empty string"),
    "style not text": (_set(["reward_model", "style"], 3), "reward_model.style", "got int"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CASES))
def test_parse_row_names_source_row_and_field(case):
  mutate, field, problem = MALFORMED_CASES[case]
  row = copy.deepcopy(_good_row())
  mutate(row)
  with pytest.raises(MalformedRowError) as info:
    parse_row(row, source="data/train.parquet", row_number=17)
  message = str(info.value)
  assert message.startswith("data/train.parquet: row 17: ")
  assert f"field '{field}'" in message and problem in message
  assert (info.value.row_number, info.value.field) == (17, field)


def test_parse_row_rejects_non_object():
  with pytest.raises(MalformedRowError, match=r"f.jsonl: row 0 \(line 3\): .*got list"):
    parse_row([1], source="f.jsonl", row_number=0, line=3)


def test_load_parquet_keeps_every_row_in_order(tmp_path):
  path = dapo_rows.write_duplicated(tmp_path / "dup.parquet")
  got, stats = loaders.load_records(path)
  assert [r.index for r in got] == [dapo_rows.PROBLEMS[i][2] for i in dapo_rows.DUPLICATED_ORDER]
  assert (stats.rows_read, stats.kept, stats.duplicates_removed) == (12, 12, 0)


def test_dedup_keeps_first_occurrences_in_order(tmp_path):
  path = dapo_rows.write_duplicated(tmp_path / "dup.parquet")
  got, stats = loaders.load_records(path, dedup=True)
  expected = [dapo_rows.PROBLEMS[i] for i in dapo_rows.FIRST_OCCURRENCE_ORDER]
  assert [(r.ground_truth, r.index) for r in got] == [(gt, idx) for _, gt, idx in expected]
  assert [records.extract_problem(r.prompt) for r in got] == [p for p, _, _ in expected]
  assert (stats.rows_read, stats.duplicates_removed, stats.kept) == (12, 7, 5)


def test_dedup_key_is_prompt_and_ground_truth(tmp_path):
  # Same prompt, different ground truth: two different rows, both kept.
  rows = [dapo_rows.dapo_row("Q", "1", "a"), dapo_rows.dapo_row("Q", "2", "b"),
          dapo_rows.dapo_row("Q", "1", "c")]
  path = dapo_rows.write_parquet(rows, tmp_path / "q.parquet")
  got, stats = loaders.load_records(path, dedup=True)
  assert [r.index for r in got] == ["a", "b"] and stats.duplicates_removed == 1


def test_malformed_parquet_raises_naming_file_row_field(tmp_path):
  path = dapo_rows.write_malformed(tmp_path / "bad.parquet")
  with pytest.raises(MalformedRowError) as info:
    loaders.load_records(path)
  assert str(info.value).startswith(
      f"{path}: row {dapo_rows.MALFORMED_ROW}: field 'reward_model.ground_truth'")


def test_malformed_parquet_skip_counts_it(tmp_path, caplog):
  path = dapo_rows.write_malformed(tmp_path / "bad.parquet")
  got, stats = loaders.load_records(path, on_malformed="skip")
  assert len(got) == 4 and dapo_rows.PROBLEMS[dapo_rows.MALFORMED_ROW][2] not in [
      r.index for r in got]
  assert (stats.rows_read, stats.malformed_skipped, stats.kept) == (5, 1, 4)
  assert f"row {dapo_rows.MALFORMED_ROW}" in stats.malformed_messages[0]
  assert "skipped 1 malformed row" in caplog.text  # never silent


def test_jsonl_round_trip_and_bad_lines(tmp_path):
  rows = [dapo_rows.dapo_row(*p) for p in dapo_rows.PROBLEMS]
  good = tmp_path / "good.jsonl"
  loaders.write_rows(rows, good)
  parquet = dapo_rows.write_parquet(rows, tmp_path / "good.parquet")
  assert loaders.load_records(good)[0] == loaders.load_records(parquet)[0]

  bad = tmp_path / "bad.jsonl"
  lines = [json.dumps(r) for r in rows]
  lines.insert(2, "")            # blank line: not a row
  lines.insert(3, "{not json")   # row 2, line 4
  bad.write_text("\n".join(lines) + "\n")
  with pytest.raises(MalformedRowError, match=r"bad.jsonl: row 2 \(line 4\): .*invalid JSON"):
    loaders.load_records(bad)
  got, stats = loaders.load_records(bad, on_malformed="skip")
  assert len(got) == 5 and (stats.rows_read, stats.malformed_skipped) == (6, 1)


def test_file_errors_name_the_file(tmp_path):
  missing = tmp_path / "nope.parquet"
  with pytest.raises(FileNotFoundError, match="nope.parquet"):
    loaders.load_records(missing)
  with pytest.raises(records.DataFormatError, match=r"notes.txt: unknown file type"):
    (tmp_path / "notes.txt").write_text("x")
    loaders.load_records(tmp_path / "notes.txt")
  with pytest.raises(ValueError, match="on_malformed"):
    loaders.load_records(missing, on_malformed="ignore")


def test_missing_column_fails_once_for_the_file(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  path = tmp_path / "nocol.parquet"
  pq.write_table(pa.table({"data_source": ["x"], "prompt": [[{"role": "user", "content": "q"}]]}),
                 path)
  with pytest.raises(records.DataFormatError, match=r"missing column\(s\) \['reward_model', "
                     r"'extra_info'\]"):
    loaders.load_records(path, on_malformed="skip")


def test_importing_data_does_not_import_tensorflow():
  code = ("import sys, dapo_jax.data, dapo_jax.data.arithmetic; "
          "print(any(m.split('.')[0] in ('tensorflow', 'tensorflow_datasets', 'pandas') "
          "for m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"
