"""One validated dataset row in the DAPO schema (spec section 7).

A DAPO parquet / JSONL row looks like::

  {"data_source": "math_dapo",
   "prompt": [{"role": "user", "content": "<DAPO template around the problem>"}],
   "ability": "MATH",
   "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
   "extra_info": {"index": "9a9b...", ...}}

`parse_row` checks that shape and returns a `MathRecord`; anything else raises a
`MalformedRowError` naming the file, the row and the field, so a user can fix the
data instead of training on a silently mangled prompt.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

# The user turn of DAPO-Math-17k and AIME-2024, verbatim (spec section 7).
DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_PROMPT_TEMPLATE = DAPO_PROMPT_PREFIX + "{problem}" + DAPO_PROMPT_SUFFIX

# Top-level columns every row must carry; checked once per file by the loaders.
REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model", "extra_info")


def make_dapo_prompt(problem: str) -> str:
  """Wraps a bare problem statement in the DAPO user-turn template."""
  # str.format would choke on the braces of LaTeX problems, so concatenate.
  return DAPO_PROMPT_PREFIX + problem + DAPO_PROMPT_SUFFIX


def extract_problem(prompt: str) -> str | None:
  """Inverse of `make_dapo_prompt`; None when `prompt` is not in the DAPO template."""
  if prompt.startswith(DAPO_PROMPT_PREFIX) and prompt.endswith(DAPO_PROMPT_SUFFIX):
    return prompt[len(DAPO_PROMPT_PREFIX):len(prompt) - len(DAPO_PROMPT_SUFFIX)]
  return None


class DataFormatError(ValueError):
  """A dataset file cannot be read as the DAPO schema at all."""


class MalformedRowError(DataFormatError):
  """One row of a dataset file violates the DAPO schema."""

  def __init__(self, source: str, row_number: int, field: str, problem: str,
               line: int | None = None):
    where = f"{source}: row {row_number}" + (f" (line {line})" if line is not None else "")
    super().__init__(f"{where}: field '{field}': {problem}")
    self.source = source
    self.row_number = row_number
    self.field = field
    self.problem = problem
    self.line = line


@dataclasses.dataclass(frozen=True)
class MathRecord:
  """One prompt with its verifiable answer.

  Attributes:
    prompt: content of the single user turn (already in the dataset's template).
    ground_truth: reference answer string handed to the verifier.
    data_source: the row's `data_source` (e.g. "math_dapo"), used to pick a scorer.
    index: `extra_info.index`; an int (AIME) or a UUID string (DAPO-Math-17k).
    extra: everything else worth keeping: `ability`, `style` and the other
      `extra_info` keys (e.g. AIME's `raw_problem`).
  """
  prompt: str
  ground_truth: str
  data_source: str
  index: int | str
  extra: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

  def to_row(self) -> dict[str, Any]:
    """Returns the DAPO-schema row this record was parsed from (inverse of `parse_row`)."""
    extra = dict(self.extra)
    ability = extra.pop("ability", None)
    style = extra.pop("style", None)
    row: dict[str, Any] = {
        "data_source": self.data_source,
        "prompt": [{"role": "user", "content": self.prompt}],
        "reward_model": {"ground_truth": self.ground_truth},
        "extra_info": {"index": self.index, **extra},
    }
    if ability is not None:
      row["ability"] = ability
    if style is not None:
      row["reward_model"]["style"] = style
    return row


def _type_name(value: Any) -> str:
  return type(value).__name__


def parse_row(row: Any, *, source: str, row_number: int, line: int | None = None) -> MathRecord:
  """Validates one DAPO-schema row and returns its `MathRecord`.

  Args:
    row: the row as plain Python data (a `pyarrow` `to_pylist()` item or a JSON object).
    source: where the row came from (a file path), quoted in errors.
    row_number: 0-based position of the row in `source`, quoted in errors.
    line: optional 1-based line number (JSONL), quoted in errors.

  Raises:
    MalformedRowError: naming `source`, the row and the offending field.
  """

  def fail(field: str, problem: str) -> MalformedRowError:
    return MalformedRowError(source, row_number, field, problem, line=line)

  if not isinstance(row, Mapping):
    raise fail("<row>", f"expected an object with DAPO columns, got {_type_name(row)}")
  missing = [c for c in REQUIRED_COLUMNS if row.get(c) is None]
  if missing:
    raise fail(missing[0], f"missing (a DAPO row needs {', '.join(REQUIRED_COLUMNS)})")

  data_source = row["data_source"]
  if not isinstance(data_source, str) or not data_source:
    raise fail("data_source", f"expected a non-empty string, got {data_source!r}")

  prompt = _parse_prompt(row["prompt"], fail)

  reward_model = row["reward_model"]
  if not isinstance(reward_model, Mapping):
    raise fail("reward_model", f"expected an object {{ground_truth, style}}, got "
               f"{_type_name(reward_model)}")
  ground_truth = reward_model.get("ground_truth")
  if ground_truth is None:
    raise fail("reward_model.ground_truth", "missing ground truth")
  if not isinstance(ground_truth, str):
    # An int here would be scored by string equality after normalisation, so
    # demand the string the verifier compares against instead of guessing.
    raise fail("reward_model.ground_truth",
               f"expected a string, got {_type_name(ground_truth)} {ground_truth!r} (quote it)")
  if not ground_truth.strip():
    raise fail("reward_model.ground_truth", "empty ground truth")
  style = reward_model.get("style")
  if style is not None and not isinstance(style, str):
    raise fail("reward_model.style", f"expected a string, got {_type_name(style)}")

  extra_info = row["extra_info"]
  if not isinstance(extra_info, Mapping):
    raise fail("extra_info", f"expected an object with 'index', got {_type_name(extra_info)}")
  index = extra_info.get("index")
  if index is None:
    raise fail("extra_info.index", "missing")
  if isinstance(index, bool) or not isinstance(index, (int, str)):
    raise fail("extra_info.index", f"expected an int or a string, got {_type_name(index)}")

  ability = row.get("ability")
  if ability is not None and not isinstance(ability, str):
    raise fail("ability", f"expected a string, got {_type_name(ability)}")

  extra: dict[str, Any] = {}
  if ability is not None:
    extra["ability"] = ability
  if style is not None:
    extra["style"] = style
  extra.update((k, v) for k, v in extra_info.items() if k != "index")
  return MathRecord(prompt=prompt, ground_truth=ground_truth, data_source=data_source,
                    index=index, extra=extra)


def _parse_prompt(prompt: Any, fail) -> str:
  """Returns the content of the one user turn of a `prompt` list."""
  if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
    raise fail("prompt", f"expected a list of {{role, content}} messages, got {_type_name(prompt)}")
  if not prompt:
    raise fail("prompt", "empty message list")
  for i, message in enumerate(prompt):
    if not isinstance(message, Mapping):
      raise fail(f"prompt[{i}]", f"expected a {{role, content}} object, got {_type_name(message)}")
    for key in ("role", "content"):
      if not isinstance(message.get(key), str):
        raise fail(f"prompt[{i}].{key}",
                   f"expected a string, got {_type_name(message.get(key))}")
  roles = [m["role"] for m in prompt]
  # DAPO prompts are exactly one user turn; a system turn would be dropped by
  # MathRecord, so reject it rather than lose it silently.
  if roles != ["user"]:
    raise fail("prompt", f"expected exactly one message with role 'user', got roles {roles}")
  content = prompt[0]["content"]
  if not content.strip():
    raise fail("prompt[0].content", "empty prompt")
  return content
