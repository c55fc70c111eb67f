"""`dapo-export`: a trained run's checkpoint as a HF directory that `transformers` loads with the
same logits as the JAX model restored from that checkpoint."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import export
from dapo_jax import policy as policy_lib
from dapo_jax.tokenizers import CharTokenizer
from tests import test_train_e2e

pytest.importorskip("transformers")
from tests import hf_fixtures  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  config = test_train_e2e._small_config()  # pylint: disable=protected-access
  config.num_steps = 2
  test_train_e2e.train_and_evaluate(config, workdir)
  return workdir


@pytest.mark.slow
def test_export_round_trips_through_transformers(run_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  out = export.main([f"--workdir={run_dir}", "--step=1", "--out=~/hf_step1"])
  assert out == str(tmp_path / "hf_step1")
  assert {"config.json", "model.safetensors", "char_tokenizer.json"} <= set(os.listdir(out))
  assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [
      "Qwen2ForCausalLM"]

  from dapo_jax import cli  # pylint: disable=g-import-not-at-top
  config = cli.get_config(run_dir)
  step1 = policy_lib.load_policy(config, workdir=run_dir, step=1)
  step2 = policy_lib.load_policy(config, workdir=run_dir, step=2)
  assert any(not np.array_equal(a, b) for a, b in  # the step asked for, not the newest
             zip(jax.tree.leaves(step1.params), jax.tree.leaves(step2.params)))

  tok = CharTokenizer.load(out)
  ids = np.asarray([tok.encode("12+34=46"), tok.encode("7*8=56  ")], np.int32)
  ours = np.asarray(step1.model(jnp.asarray(ids)))
  theirs = hf_fixtures.hf_logits(out, ids)
  np.testing.assert_allclose(theirs, ours, atol=2e-5, rtol=1e-4)
