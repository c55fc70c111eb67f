"""TFDS builders for the official DAPO parquet files: `dapo_math_17k` and `aime_2024`.

Both read a parquet file the user placed in the TFDS manual directory and write
ArrayRecord shards, so training reads them by random access through
`tfds.data_source` with no TensorFlow graph at read time::

  records = load_split("aime_2024", data_dir="/data/tfds", manual_dir="/data/dapo", split="test")
  records[0].prompt, records[0].ground_truth

Each builder has two configs: "raw" (default; every row of the file in order,
repeats included, as the paper trained and evaluated) and "dedup" (first
occurrence of each (prompt, ground truth) pair). Select one with
`"dapo_math_17k/dedup"`.

TensorFlow Datasets is imported only when a builder is first needed, so
`import dapo_jax.data` stays light.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from collections.abc import Sequence
from typing import Any

from etils import epath

from dapo_jax.infra import run_files
from dapo_jax.data.loaders import iter_records
from dapo_jax.data.records import MathRecord

_VERSION = "1.0.0"

_COMMON_INSTRUCTIONS = """
Put the parquet file in the manual directory (default `~/tensorflow_datasets/downloads/manual/`,
or pass `manual_dir`), either directly or under the sub-folder it has in its source repository.
The machine building the dataset needs no network access after that.
"""

DAPO_MATH_17K_INSTRUCTIONS = """
Download `data/dapo-math-17k.parquet` from the Hugging Face dataset
`BytedTsinghua-SIA/DAPO-Math-17k`
(https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k), e.g.
`huggingface-cli download BytedTsinghua-SIA/DAPO-Math-17k data/dapo-math-17k.parquet \\
 --repo-type dataset --local-dir <manual_dir>`.
""" + _COMMON_INSTRUCTIONS

AIME_2024_INSTRUCTIONS = """
Download `aime-2024.parquet`: either `data/aime-2024.parquet` from the Hugging Face dataset
`BytedTsinghua-SIA/AIME-2024` (https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024), or
`eval/aime-2024.parquet` from the DAPO repository (https://github.com/BytedTsinghua-SIA/DAPO).
""" + _COMMON_INSTRUCTIONS


@dataclasses.dataclass(frozen=True)
class _Spec:
  """What distinguishes the two builders."""
  name: str
  filename: str
  split: str
  instructions: str
  description: str
  homepage: str


SPECS = {
    "dapo_math_17k": _Spec(
        name="dapo_math_17k", filename="dapo-math-17k.parquet", split="train",
        instructions=DAPO_MATH_17K_INSTRUCTIONS,
        description="DAPO-Math-17k: ~17.9k integer-answer math prompts in the DAPO template, "
        "each repeated ~100 times in the published file (spec section 7).",
        homepage="https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k"),
    "aime_2024": _Spec(
        name="aime_2024", filename="aime-2024.parquet", split="test",
        instructions=AIME_2024_INSTRUCTIONS,
        description="AIME 2024: 30 problems in the DAPO template, each repeated 32 times so one "
        "sample per row gives avg@32 (spec section 7).",
        homepage="https://github.com/BytedTsinghua-SIA/DAPO"),
}


def find_manual_file(manual_dir: str | os.PathLike, filename: str) -> str:
  """Returns `manual_dir/filename` or the same under `data/` or `eval/`; raises if absent.

  `manual_dir` may be a URL (``gs://``): the file is read through epath.
  """
  root = run_files.resolve(manual_dir)
  candidates = [os.fspath(root / sub / filename) if sub else os.fspath(root / filename)
                for sub in ("", "data", "eval")]
  for path in candidates:
    if epath.Path(path).is_file():
      return path
  raise FileNotFoundError(f"{filename} not found in the manual directory; looked at "
                          f"{candidates}. See MANUAL_DOWNLOAD_INSTRUCTIONS of the builder.")


def record_to_example(record: MathRecord) -> dict[str, Any]:
  """Flattens a record into the builders' features."""
  try:
    extra_json = json.dumps(record.extra, sort_keys=True, ensure_ascii=False)
  except TypeError as e:
    raise ValueError(f"record {record.index!r}: extra fields must be JSON-serialisable "
                     f"to be stored by TFDS ({e})") from e
  return {
      "prompt": record.prompt,
      "ground_truth": record.ground_truth,
      "data_source": record.data_source,
      # Index is an int (AIME) or a UUID string (DAPO-Math-17k): store both ways.
      "index": str(record.index),
      "index_is_int": isinstance(record.index, int),
      "extra_json": extra_json,
  }


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def example_to_record(example: dict[str, Any]) -> MathRecord:
  """Inverse of `record_to_example` on a deserialized (numpy / bytes) example."""
  index = _text(example["index"])
  return MathRecord(
      prompt=_text(example["prompt"]),
      ground_truth=_text(example["ground_truth"]),
      data_source=_text(example["data_source"]),
      index=int(index) if bool(example["index_is_int"]) else index,
      extra=json.loads(_text(example["extra_json"])),
  )


@functools.cache
def builder_classes() -> dict[str, type]:
  """Defines (once) and returns the TFDS builder classes, keyed by dataset name.

  Defined lazily so TensorFlow Datasets is imported only when needed; defining a
  class registers its name with TFDS, so `tfds.data_source("aime_2024")` works
  after this has run.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  @dataclasses.dataclass(eq=False)
  class DapoBuilderConfig(tfds.core.BuilderConfig):
    dedup: bool = False

  configs = [
      DapoBuilderConfig(name="raw", description="Every row of the file, repeats included."),
      DapoBuilderConfig(name="dedup", dedup=True,
                        description="First occurrence of each (prompt, ground truth)."),
  ]

  class _DapoParquetBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Reads one official DAPO parquet file from the manual directory."""
    SPEC: _Spec
    VERSION = tfds.core.Version(_VERSION)
    RELEASE_NOTES = {_VERSION: "Initial release."}
    BUILDER_CONFIGS = configs

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
      # TFDS's default looks the module up as a package resource, which needs the
      # `importlib_resources` backport (etils' `epath` extra) even on Python 3.11;
      # the source file is the same answer without it.
      return epath.Path(inspect.getfile(cls))

    def __init__(self, *, file_format: str | None = "array_record", **kwargs):
      # ArrayRecord by default: it is what makes `tfds.data_source` random access work.
      super().__init__(file_format=file_format, **kwargs)

    def _info(self):
      return self.dataset_info_from_configs(
          description=self.SPEC.description,
          homepage=self.SPEC.homepage,
          features=tfds.features.FeaturesDict({
              "prompt": tfds.features.Text(),
              "ground_truth": tfds.features.Text(),
              "data_source": tfds.features.Text(),
              "index": tfds.features.Text(),
              "index_is_int": tfds.features.Scalar(dtype=np.bool_),
              "extra_json": tfds.features.Text(),
          }),
          # Keep the file's row order: AIME rows and dedup's first occurrences stay put.
          disable_shuffling=True,
      )

    def _split_generators(self, dl_manager):
      path = find_manual_file(dl_manager.manual_dir, self.SPEC.filename)
      return {self.SPEC.split: self._generate_examples(path)}

    def _generate_examples(self, path):
      # Official files are clean: a malformed row is a corrupt download, so raise.
      records = iter_records(path, on_malformed="raise", dedup=self.builder_config.dedup)
      for i, record in enumerate(records):
        yield i, record_to_example(record)

  class DapoMath17k(_DapoParquetBuilder):
    """DAPO-Math-17k training prompts."""
    name = "dapo_math_17k"
    SPEC = SPECS["dapo_math_17k"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = SPEC.instructions

  class Aime2024(_DapoParquetBuilder):
    """AIME 2024 validation prompts (30 x 32)."""
    name = "aime_2024"
    SPEC = SPECS["aime_2024"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = SPEC.instructions

  return {"dapo_math_17k": DapoMath17k, "aime_2024": Aime2024}


class RecordSequence(Sequence):
  """A random-access `Sequence[MathRecord]` over a TFDS data source."""

  def __init__(self, source: Sequence[Any]):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self.__getitems__(range(*i.indices(len(self))))
    n = len(self)
    if not -n <= i < n:
      raise IndexError(f"record index {i} out of range for {n} records")
    return example_to_record(self._source[i % n])

  def __getitems__(self, indices: Sequence[int]) -> list[MathRecord]:
    """Batched read; ArrayRecord fetches many indices in one call."""
    indices = [int(i) for i in indices]
    getitems = getattr(self._source, "__getitems__", None)
    examples = getitems(indices) if getitems else [self._source[i] for i in indices]
    return [example_to_record(e) for e in examples]


def _expand(path: str | os.PathLike | None) -> str | None:
  return None if path is None else os.fspath(run_files.resolve(path))


def load_split(
    name: str,
    data_dir: str | os.PathLike | None,
    manual_dir: str | os.PathLike | None,
    split: str,
) -> RecordSequence:
  """Prepares (if needed) and opens one split as a random-access record sequence.

  Args:
    name: "dapo_math_17k" or "aime_2024", optionally with a config: "aime_2024/dedup".
    data_dir: TFDS data directory (None: the TFDS default).
    manual_dir: directory holding the parquet file; only needed for the first build.
    split: "train" for dapo_math_17k, "test" for aime_2024; TFDS slices such as
      "test[:10]" work too.

  A prepared dataset is reused as is: delete `data_dir/<name>/<config>` to rebuild
  after replacing the parquet file. In a multi-process job, prepare on one process
  (or ahead of time) before the others open it.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  base = name.split("/")[0]
  if base not in SPECS:
    raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(SPECS)}")
  builder_classes()  # registers the names with TFDS
  download_config = tfds.download.DownloadConfig(
      manual_dir=_expand(manual_dir),
      try_download_gcs=False)  # the official files are not on GCS; never go online
  source = tfds.data_source(
      name,
      split=split,
      data_dir=_expand(data_dir),
      builder_kwargs={"file_format": "array_record"},
      download_and_prepare_kwargs={"download_config": download_config},
  )
  return RecordSequence(source)
