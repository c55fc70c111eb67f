"""Plain parquet / JSONL loaders for datasets in the DAPO schema (local paths or ``gs://``).

For custom datasets and quick experiments; the official files also have TFDS
builders (`builders.py`) for random-access reading at training time. Parquet is
read with pyarrow in batches, so deduplicating the ~1.8M-row DAPO-Math-17k file
only ever holds its ~17.9k unique records.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from etils import epath

from dapo_jax.infra import run_files
from dapo_jax.data.records import (REQUIRED_COLUMNS, DataFormatError, MalformedRowError,
                                   MathRecord, parse_row)

_PARQUET_SUFFIXES = (".parquet",)
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_MAX_KEPT_MESSAGES = 20  # enough to diagnose a bad file without holding every message


@dataclasses.dataclass
class LoadStats:
  """What `load_records` did with a file; every dropped row is counted here."""
  path: str
  rows_read: int = 0
  malformed_skipped: int = 0
  duplicates_removed: int = 0
  kept: int = 0
  malformed_messages: list[str] = dataclasses.field(default_factory=list)


def _check_path(path: str | os.PathLike) -> epath.Path:
  """The file as an `epath.Path`: a local path (``~`` expanded) or a URL such as ``gs://``."""
  path = run_files.resolve(path)
  if not path.exists():
    raise FileNotFoundError(f"Dataset file not found: {str(path)!r}. Check the path (and that "
                            "the file was downloaded; see dapo_jax/data/builders.py for sources).")
  if path.is_dir():
    raise IsADirectoryError(f"Expected a dataset file, got the directory {str(path)!r}.")
  return path


def _iter_parquet(path: epath.Path, batch_size: int = 4096) -> Iterator[tuple[Any, int | None]]:
  try:
    # A remote file is read through a seekable file object (ranged reads, batch by batch).
    file = pq.ParquetFile(path.open("rb") if run_files.is_remote(path) else os.fspath(path))
  except (pa.ArrowInvalid, OSError) as e:
    raise DataFormatError(f"{path}: not a readable parquet file ({e})") from e
  names = set(file.schema_arrow.names)
  missing = [c for c in REQUIRED_COLUMNS if c not in names]
  if missing:
    # A missing column breaks every row; fail once instead of once per row.
    raise DataFormatError(f"{path}: missing column(s) {missing}; a DAPO file needs "
                          f"{list(REQUIRED_COLUMNS)}, this one has {sorted(names)}")
  for batch in file.iter_batches(batch_size=batch_size):
    for row in batch.to_pylist():
      yield row, None


def _iter_jsonl(path: epath.Path) -> Iterator[tuple[Any, int | None]]:
  with path.open("r", encoding="utf-8") as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue  # blank lines (e.g. a trailing newline) are not rows
      try:
        yield json.loads(line), line_number
      except json.JSONDecodeError as e:
        yield _BadJson(str(e)), line_number


class _BadJson:
  """Marks a JSONL line that is not valid JSON, so it flows through the skip logic."""

  def __init__(self, message: str):
    self.message = message


def iter_rows(path: str | os.PathLike) -> Iterator[tuple[Any, int | None]]:
  """Yields `(raw_row, line_number_or_None)` for every row of a parquet / JSONL file."""
  path = _check_path(path)
  lower = path.name.lower()
  if lower.endswith(_PARQUET_SUFFIXES):
    return _iter_parquet(path)
  if lower.endswith(_JSONL_SUFFIXES):
    return _iter_jsonl(path)
  raise DataFormatError(f"{path}: unknown file type; expected one of "
                        f"{_PARQUET_SUFFIXES + _JSONL_SUFFIXES}")


def iter_records(
    path: str | os.PathLike,
    *,
    on_malformed: Literal["raise", "skip"] = "raise",
    dedup: bool = False,
    stats: LoadStats | None = None,
) -> Iterator[MathRecord]:
  """Streams the records of a file; see `load_records`. Fills `stats` as it goes."""
  if on_malformed not in ("raise", "skip"):
    raise ValueError(f"on_malformed must be 'raise' or 'skip', got {on_malformed!r}")
  source = os.fspath(path)
  stats = stats if stats is not None else LoadStats(path=source)
  rows = iter_rows(path)  # raises now, not at first next(), for a missing file
  return _iter_records(rows, source, on_malformed, dedup, stats)


def _iter_records(rows, source, on_malformed, dedup, stats) -> Iterator[MathRecord]:
  seen: set[tuple[str, str]] = set()
  for row_number, (row, line) in enumerate(rows):
    stats.rows_read += 1
    try:
      if isinstance(row, _BadJson):
        raise MalformedRowError(source, row_number, "<row>", f"invalid JSON ({row.message})",
                                line=line)
      record = parse_row(row, source=source, row_number=row_number, line=line)
    except MalformedRowError as e:
      if on_malformed == "raise":
        raise
      stats.malformed_skipped += 1
      if len(stats.malformed_messages) < _MAX_KEPT_MESSAGES:
        stats.malformed_messages.append(str(e))
      continue
    if dedup:
      key = (record.prompt, record.ground_truth)
      if key in seen:
        stats.duplicates_removed += 1
        continue
      seen.add(key)
    stats.kept += 1
    yield record
  if stats.malformed_skipped:
    logging.warning("%s: skipped %d malformed row(s) of %d; first: %s", source,
                    stats.malformed_skipped, stats.rows_read, stats.malformed_messages[0])


def load_records(
    path: str | os.PathLike,
    *,
    on_malformed: Literal["raise", "skip"] = "raise",
    dedup: bool = False,
) -> tuple[list[MathRecord], LoadStats]:
  """Reads every row of a DAPO-schema parquet or JSONL file.

  Args:
    path: a `.parquet`, `.jsonl` or `.ndjson` file.
    on_malformed: "raise" stops at the first bad row; "skip" drops it, counts it in
      `LoadStats.malformed_skipped` and logs a warning.
    dedup: drop rows whose (prompt, ground truth) was already seen, keeping the
      first occurrence and the file's order (DAPO-Math-17k repeats each ~100x).

  Returns:
    The records and a `LoadStats`.
  """
  stats = LoadStats(path=os.fspath(path))
  records = list(iter_records(path, on_malformed=on_malformed, dedup=dedup, stats=stats))
  return records, stats


def write_rows(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> None:
  """Writes DAPO-schema rows to `.parquet` (pyarrow) or `.jsonl`, chosen by suffix."""
  path = run_files.resolve(path)
  rows = list(rows)
  lower = path.name.lower()
  if lower.endswith(_PARQUET_SUFFIXES):
    with path.open("wb") as f:
      pq.write_table(pa.Table.from_pylist(rows), f)
  elif lower.endswith(_JSONL_SUFFIXES):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                    encoding="utf-8")
  else:
    raise ValueError(f"{path}: unknown file type; expected one of "
                     f"{_PARQUET_SUFFIXES + _JSONL_SUFFIXES}")
