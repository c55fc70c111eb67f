"""dapo-plan's packing model (planner/plan_packing.py): its length mix, and the prompt length it
assumes measured again on the official AIME parquet as dapo-train renders it."""

import os

import numpy as np
import pytest

from dapo_jax.data import loaders
from dapo_jax.data.pipeline import render_prompt
from dapo_jax.planner import plan as plan_lib
from dapo_jax.planner import plan_estimates as est
from dapo_jax.planner import plan_packing
from dapo_jax.tokenizers import load_tokenizer
from tests import dapo_rows

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _spec(*extra):
  return plan_lib.configure(plan_lib._parse([  # pylint: disable=protected-access
      "--config", os.path.join(CONFIGS, "dapo_qwen2_5_32b.py"), "--target", "cpu:8", *extra]))


def test_the_assumed_prompt_length_is_the_aime_parquets():
  aime = dapo_rows.find_shared_aime()
  if aime is None:
    pytest.skip("shared/data/aime-2024.parquet not present beside the checkout")
  records, _ = loaders.load_records(aime, dedup=True)
  tok = load_tokenizer(None, fallback="qwen2.5")  # the paper configs' vocabulary and template
  lengths = np.array([len(render_prompt(r, tok, 4096)) for r in records])
  assert round(float(lengths.mean())) == plan_packing.MEAN_PROMPT_TOKENS
  assert (lengths.min(), lengths.max()) == (129, 278)


def test_the_length_mix_is_the_rollout_estimates():
  spec = _spec()
  mask = plan_packing.sample_masks(spec, 4096)
  p, r = spec.data.max_prompt_length, spec.rollout.max_response_length
  prompts, responses = mask[:, :p].sum(1), mask[:, p:].sum(1)
  assert abs(prompts.mean() - plan_packing.MEAN_PROMPT_TOKENS) < 3
  assert abs(responses.mean() / r - est.MEAN_RESPONSE_FRACTION) < 0.01
  assert abs((responses == r).mean() - plan_packing.LIMIT_SHARE) < 0.01
  # Each row: a left-padded prompt then its response, no gap.
  assert (mask[:, p - 1] & mask[:, p]).all()


def test_a_padded_run_has_no_packed_shape_and_a_packed_one_follows_its_budget():
  assert plan_packing.packed_shape(_spec("--config.optim.packing=False"), 4, "splash") is None
  wide = plan_packing.packed_shape(_spec("--config.optim.max_tokens_per_row=45056"), 4,
                                   "splash")
  assert wide["budget"] == 45056 and wide["rows_per_cell"] == 1  # a padded micro-batch's tokens
  # Whole rows' squares without the skipping kernel: about 4x the sequences' own at P + R.
  xla = plan_packing.packed_shape(_spec(), 4, "xla")
  assert xla["attention_block"] is None
  assert xla["attention_pairs"] == xla["packed_rows"] * xla["budget"] ** 2
  cudnn = plan_packing.packed_shape(_spec(), 4, "cudnn")
  assert cudnn["attention_pairs"] == xla["packed_rows"] * 22528 * 22529 // 2
