"""Prompt rendering, padding and PromptIterator (dapo_jax/data/pipeline.py)."""
import json

import numpy as np
import pytest

from dapo_jax.data import loaders
from dapo_jax.data.pipeline import PromptIterator, epoch_permutation, left_pad, render_prompt
from dapo_jax.data.records import MathRecord, make_dapo_prompt

from tests import dapo_rows


class StubTokenizer:
  """ChatML-like template, one id per character; records what it was asked."""
  pad_id = 0

  def __init__(self):
    self.calls = []

  def apply_chat_template(self, messages, add_generation_prompt=True):
    self.calls.append((messages, add_generation_prompt))
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

  def encode(self, text):
    return [ord(c) for c in text]

  @staticmethod
  def decode(ids):
    return "".join(chr(i) for i in ids)


def _record(prompt):
  return MathRecord(prompt=prompt, ground_truth="1", data_source="t", index=0)


def test_render_prompt_uses_one_user_turn_and_generation_prompt():
  tok = StubTokenizer()
  ids = render_prompt(_record("What is 1+1?"), tok, max_prompt_length=1000)
  assert tok.calls == [([{"role": "user", "content": "What is 1+1?"}], True)]
  assert tok.decode(ids) == ("<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
                             "<|im_start|>assistant\n")


def test_render_prompt_truncates_on_the_left():
  tok = StubTokenizer()
  prompt = make_dapo_prompt("x" * 500 + " What is the final question?")
  full = render_prompt(_record(prompt), tok, max_prompt_length=10_000)
  cut = render_prompt(_record(prompt), tok, max_prompt_length=100)
  assert len(cut) == 100 and cut == full[-100:]
  # The end survives: the answer-format instruction and the generation prompt.
  assert tok.decode(cut).endswith('after "Answer:".<|im_end|>\n<|im_start|>assistant\n')
  assert render_prompt(prompt, tok, 100) == cut  # a bare string works too
  with pytest.raises(ValueError, match="max_prompt_length"):
    render_prompt(prompt, tok, 0)


def test_render_prompt_keeps_the_official_aime_text_exactly():
  aime = dapo_rows.find_shared_aime()
  if aime is None:
    pytest.skip("shared/data/aime-2024.parquet not present beside the checkout")
  records, _ = loaders.load_records(aime, dedup=True)
  tok = StubTokenizer()
  for r in records:
    text = tok.decode(render_prompt(r, tok, max_prompt_length=4096))
    user = text.removeprefix("<|im_start|>user\n").removesuffix(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert user == dapo_rows.spec_prompt(r.extra["raw_problem"])


def test_render_prompt_with_the_project_char_tokenizer():
  try:
    from dapo_jax.tokenizers import char_tokenizer  # pylint: disable=g-import-not-at-top
  except ImportError:
    pytest.skip("dapo_jax.tokenizers.char_tokenizer not written yet")
  from dapo_jax.data import arithmetic  # pylint: disable=g-import-not-at-top
  tok = char_tokenizer.CharTokenizer()
  record = arithmetic.make_records(1, seed=0)[0]
  full = render_prompt(record, tok, max_prompt_length=512)
  expected = tok.apply_chat_template([{"role": "user", "content": record.prompt}],
                                     add_generation_prompt=True)
  assert tok.decode(full) == expected and record.prompt in expected
  assert render_prompt(record, tok, 3) == full[-3:]


def test_left_pad():
  ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=-1)
  np.testing.assert_array_equal(ids, [[5, 6, 7], [-1, -1, 8], [-1, -1, -1]])
  np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1], [0, 0, 0]])
  assert ids.dtype == np.int32 and mask.dtype == np.int32
  ids, mask = left_pad([[1, 2]], pad_id=0, length=4)
  np.testing.assert_array_equal(ids, [[0, 0, 1, 2]])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1]])
  with pytest.raises(ValueError, match="more than length=1"):
    left_pad([[1, 2]], pad_id=0, length=1)
  with pytest.raises(ValueError):
    left_pad([], pad_id=0)


RECORDS = list(range(23))  # any sequence works; ints make orders easy to compare


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_iterator_is_deterministic_and_reshuffles_per_epoch():
  a = PromptIterator(RECORDS, batch_size=5, seed=7)
  b = PromptIterator(RECORDS, batch_size=5, seed=7)
  assert a.batches_per_epoch == 4  # 23 // 5, the remainder dropped
  run_a, run_b = _take(a, 12), _take(b, 12)
  assert run_a == run_b
  epochs = [sum(run_a[i:i + 4], []) for i in (0, 4, 8)]
  assert all(len(e) == len(set(e)) == 20 for e in epochs)  # no repeats within an epoch
  assert epochs[0] != epochs[1] != epochs[2]
  assert _take(PromptIterator(RECORDS, 5, seed=8), 4) != run_a[:4]
  assert epochs[1] == list(epoch_permutation(23, 7, 1)[:20])


def test_iterator_without_shuffle_or_drop():
  it = PromptIterator(RECORDS, batch_size=5, seed=0, shuffle=False, drop_remainder=False)
  assert _take(it, 5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14],
                          [15, 16, 17, 18, 19], [20, 21, 22]]
  assert next(it) == [0, 1, 2, 3, 4] and it.epoch == 1
  shuffled = PromptIterator(RECORDS, batch_size=5, seed=0, drop_remainder=False)
  assert sorted(sum(_take(shuffled, 5), [])) == RECORDS  # every record once per epoch


@pytest.mark.parametrize("stop_after", [0, 3, 4, 9])
def test_state_restore_resumes_exactly(stop_after):
  uninterrupted = _take(PromptIterator(RECORDS, 5, seed=3), 14)
  first = PromptIterator(RECORDS, 5, seed=3)
  before = _take(first, stop_after)
  state = json.loads(json.dumps(first.get_state()))  # what a checkpoint would store
  resumed = PromptIterator(RECORDS, 5, seed=3)
  resumed.set_state(state)
  assert before + _take(resumed, 14 - stop_after) == uninterrupted


def test_state_from_another_setup_is_refused():
  state = PromptIterator(RECORDS, 5, seed=3).get_state()
  with pytest.raises(ValueError, match="saved seed=3"):
    PromptIterator(RECORDS, 5, seed=4).set_state(state)
  with pytest.raises(ValueError, match="saved num_records=23"):
    PromptIterator(RECORDS[:20], 5, seed=3).set_state(state)
  with pytest.raises(ValueError, match="invalid iterator state"):
    PromptIterator(RECORDS, 5, seed=3).set_state({**state, "position": 4})


def test_finite_epochs_end_with_stop_iteration():
  it = PromptIterator(RECORDS, batch_size=5, seed=1, num_epochs=2)
  assert len(list(it)) == 8 and it.exhausted
  with pytest.raises(StopIteration, match="exhausted: all 2 epoch"):
    next(it)
  assert list(PromptIterator(RECORDS, 5, seed=1, num_epochs=0)) == []


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_process_slices_are_disjoint_and_cover_the_global_batch(drop_remainder):
  kwargs = dict(batch_size=8, seed=11, drop_remainder=drop_remainder)
  steps = 9
  global_batches = _take(PromptIterator(RECORDS, **kwargs), steps)
  local = [_take(PromptIterator(RECORDS, process_index=p, process_count=4, **kwargs), steps)
           for p in range(4)]
  for step, batch in enumerate(global_batches):
    parts = [local[p][step] for p in range(4)]
    assert sum(parts, []) == batch  # contiguous slices in process order: disjoint, covering
    if len(batch) == 8:
      assert all(len(part) == 2 for part in parts)


def test_bad_arguments():
  with pytest.raises(ValueError, match="not divisible by process_count 3"):
    PromptIterator(RECORDS, batch_size=8, seed=0, process_count=3)
  with pytest.raises(ValueError, match="cannot fill one batch"):
    PromptIterator(RECORDS, batch_size=24, seed=0)
  with pytest.raises(ValueError, match="process_index"):
    PromptIterator(RECORDS, batch_size=4, seed=0, process_index=2, process_count=2)


class _Recorder:
  """A rollout stream that keeps what it is admitted (no decoding)."""

  def __init__(self):
    self.admitted = []

  def admit(self, ids, index):
    self.admitted.append(list(ids))


def test_a_prompt_one_token_too_long_is_counted_cut_as_asked_or_refused():
  from dapo_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import char_tokenizer  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import generation  # pylint: disable=g-import-not-at-top
  tok = char_tokenizer.CharTokenizer()
  short, long_ = MathRecord(prompt="1+2=", ground_truth="3", data_source="t", index=0), MathRecord(
      prompt="1+2+3=", ground_truth="6", data_source="t", index=1)
  full = pipeline.render_full(long_, tok)
  limit = len(full) - 1  # the longer prompt is one token over, the shorter one fits
  assert len(pipeline.render_full(short, tok)) <= limit
  assert pipeline.fit_prompt(full, limit, "left") == full[1:]
  assert pipeline.fit_prompt(full, limit, "right") == full[:-1]
  with pytest.raises(pipeline.PromptTooLongError, match=f"renders to {len(full)} tokens"):
    pipeline.fit_prompt(full, limit, "error")
  assert pipeline.overlong_prompts([short, long_, long_], tok, limit) == (1, 2, len(full))
  gen = generation.Generator(None, tok, None, None, num_samples=1, max_prompt_length=limit)
  recorder = _Recorder()
  stream = generation.ScoringStream(gen, recorder)
  stream.admit(short, 0)
  stream.admit(long_, 1)
  assert stream.prompts_truncated == 1 and recorder.admitted[1] == full[1:]


def test_start_up_warns_of_truncated_prompts_and_refuses_under_error(caplog):
  from dapo_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import read_section  # pylint: disable=g-import-not-at-top
  from dapo_jax.config import default_config  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizers import char_tokenizer  # pylint: disable=g-import-not-at-top
  tok = char_tokenizer.CharTokenizer()
  records = [MathRecord(prompt="1+2+3=", ground_truth="6", data_source="t", index=0)]
  c = default_config()
  c.data.max_prompt_length = len(pipeline.render_full(records[0], tok)) - 1
  d = read_section(c, "data")
  pipeline.check_prompt_lengths(records, tok, d.max_prompt_length, d.truncate)
  assert "1 of the 1 distinct training prompts" in caplog.text
  assert f"data.max_prompt_length={c.data.max_prompt_length + 1} keeps them whole" in caplog.text
  with pytest.raises(pipeline.PromptTooLongError, match="Raise data.max_prompt_length"):
    pipeline.check_prompt_lengths(records, tok, d.max_prompt_length, "error")
