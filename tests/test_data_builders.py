"""TFDS builders (dapo_jax/data/builders.py): build from a manual dir, read back randomly."""
import re
import shutil

import pytest

from dapo_jax.data import builders, loaders, pipeline
from dapo_jax.data.records import MalformedRowError, extract_problem

from tests import dapo_rows


@pytest.fixture
def dirs(tmp_path):
  manual = tmp_path / "manual"
  (manual / "data").mkdir(parents=True)  # the Hugging Face repo layout
  return tmp_path / "tfds", manual


def test_dapo_math_17k_round_trip_and_dedup(dirs):
  data_dir, manual = dirs
  parquet = dapo_rows.write_duplicated(manual / "data" / "dapo-math-17k.parquet")
  expected, _ = loaders.load_records(parquet)

  raw = builders.load_split("dapo_math_17k", data_dir, manual, "train")
  assert len(raw) == len(expected) == 12
  assert list(raw) == expected  # order kept, UUID index stays a string
  assert raw[-1] == expected[-1] and raw[2:5] == expected[2:5]
  with pytest.raises(IndexError):
    raw[12]  # pylint: disable=pointless-statement

  deduped = builders.load_split("dapo_math_17k/dedup", data_dir, manual, "train")
  expected_dedup, _ = loaders.load_records(parquet, dedup=True)
  assert list(deduped) == expected_dedup and len(deduped) == 5

  # Prepared once: a second open needs no manual dir, and reads without rebuilding.
  shutil.rmtree(manual)
  again = builders.load_split("dapo_math_17k/dedup", data_dir, None, "train")
  assert list(again) == expected_dedup

  # The random-access sequence feeds the batch iterator directly.
  it = pipeline.PromptIterator(deduped, batch_size=2, seed=0)
  assert all(r in expected_dedup for r in next(it))


def test_missing_manual_file_names_it(dirs):
  data_dir, manual = dirs
  (manual / "unrelated.txt").write_text("x")
  with pytest.raises(FileNotFoundError, match="aime-2024.parquet not found"):
    builders.load_split("aime_2024", data_dir, manual, "test")
  with pytest.raises(ValueError, match="unknown dataset 'gsm8k'"):
    builders.load_split("gsm8k", data_dir, manual, "train")


def test_builder_raises_on_malformed_row(dirs):
  data_dir, manual = dirs
  dapo_rows.write_malformed(manual / "dapo-math-17k.parquet")
  with pytest.raises(MalformedRowError, match=r"row 2: field 'reward_model.ground_truth'"):
    builders.load_split("dapo_math_17k", data_dir, manual, "train")


def test_builders_write_array_record(dirs):
  data_dir, manual = dirs
  dapo_rows.write_duplicated(manual / "dapo-math-17k.parquet")
  builders.load_split("dapo_math_17k", data_dir, manual, "train")
  shards = list(data_dir.glob("dapo_math_17k/raw/*/*array_record*"))
  assert shards, f"no ArrayRecord shard under {data_dir}"
  cls = builders.builder_classes()["dapo_math_17k"]
  assert "BytedTsinghua-SIA/DAPO-Math-17k" in cls.MANUAL_DOWNLOAD_INSTRUCTIONS
  aime_cls = builders.builder_classes()["aime_2024"]
  assert "eval/aime-2024.parquet" in aime_cls.MANUAL_DOWNLOAD_INSTRUCTIONS


AIME = dapo_rows.find_shared_aime()
needs_aime = pytest.mark.skipif(
    AIME is None, reason="shared/data/aime-2024.parquet not present beside the checkout "
    "(see shared/data/README.md); the fixture-based builder tests still run")


@needs_aime
def test_official_aime_file_contents():
  rows, stats = loaders.load_records(AIME)
  assert stats.rows_read == 960 and stats.malformed_skipped == 0
  unique, dstats = loaders.load_records(AIME, dedup=True)
  assert len(unique) == 30 and dstats.duplicates_removed == 930
  assert all(re.fullmatch(r"\d+", r.ground_truth) for r in rows)
  assert {r.data_source for r in rows} == {"math_dapo"}
  # Spec section 7's template, typed out in the test, wraps every raw problem exactly.
  for r in rows:
    assert r.prompt == dapo_rows.spec_prompt(r.extra["raw_problem"])
    assert extract_problem(r.prompt) == r.extra["raw_problem"]
  counts = {}
  for r in rows:
    counts[r.index] = counts.get(r.index, 0) + 1
  assert sorted(counts) == list(range(30)) and set(counts.values()) == {32}


@needs_aime
def test_official_aime_builder(dirs):
  data_dir, manual = dirs
  shutil.copy(AIME, manual / "aime-2024.parquet")
  expected, _ = loaders.load_records(AIME)
  got = builders.load_split("aime_2024", data_dir, manual, "test")
  assert len(got) == 960
  assert got[0] == expected[0] and got[959] == expected[959]
  assert got[100:356] == expected[100:356]  # int index and raw_problem survive
  deduped = builders.load_split("aime_2024/dedup", data_dir, manual, "test")
  assert len(deduped) == 30 and len({r.prompt for r in deduped}) == 30
