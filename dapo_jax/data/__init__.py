"""Datasets in the DAPO schema: records, loaders, TFDS builders, prompt pipeline, arithmetic task.

Importing this package does not import TensorFlow or TFDS; `builders` does so
only when a builder is used.
"""
from dapo_jax.data.builders import load_split
from dapo_jax.data.loaders import LoadStats, iter_records, load_records, write_rows
from dapo_jax.data.pipeline import PromptIterator, left_pad, render_prompt
from dapo_jax.data.records import (DAPO_PROMPT_TEMPLATE, DataFormatError, MalformedRowError,
                                   MathRecord, extract_problem, make_dapo_prompt, parse_row)

__all__ = [
    "DAPO_PROMPT_TEMPLATE", "DataFormatError", "LoadStats", "MalformedRowError", "MathRecord",
    "PromptIterator", "extract_problem", "iter_records", "left_pad", "load_records",
    "load_split", "make_dapo_prompt", "parse_row", "render_prompt", "write_rows",
]
