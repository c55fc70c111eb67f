"""`dapo-export`: a trained run's checkpoint as a HF directory that `transformers` loads with the
same logits as the JAX model restored from that checkpoint; `dapo-eval` on the same run."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.commands import export
from dapo_jax.trainer import policy as policy_lib
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
def test_export_round_trips_through_transformers(run_dir, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("HOME", str(tmp_path))
  umask = os.umask(0o027)  # not the usual 022: the files must follow the user's umask
  try:
    out = export.main([f"--workdir={run_dir}", "--step=1", "--out=~/hf_step1"])
  finally:
    os.umask(umask)
  assert out == str(tmp_path / "hf_step1")
  assert {"config.json", "model.safetensors", "char_tokenizer.json"} <= set(os.listdir(out))
  # Issue 27 (8): safetensors wrote model.safetensors 0600 (a tempfile's mode).
  modes = {f: oct(os.stat(os.path.join(out, f)).st_mode & 0o777) for f in os.listdir(out)}
  assert modes == dict.fromkeys(modes, oct(0o640)), modes
  # It says which step it wrote, from which run.
  assert (f"dapo-export: wrote step 1 of {run_dir} ({run_dir}/checkpoints/1) to {out} (float32)"
          in capsys.readouterr().out)
  assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [
      "Qwen2ForCausalLM"]

  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  spec = RunSpec.read(cli.get_config(run_dir))
  step1 = policy_lib.load_policy(spec, workdir=run_dir, step=1)
  step2 = policy_lib.load_policy(spec, workdir=run_dir, step=2)
  assert any(not np.array_equal(a, b) for a, b in  # the step asked for, not the newest
             zip(jax.tree.leaves(step1.params), jax.tree.leaves(step2.params)))

  tok = CharTokenizer.load(out)
  ids = np.asarray([tok.encode("12+34=46"), tok.encode("7*8=56  ")], np.int32)
  ours = np.asarray(step1.model(jnp.asarray(ids)))
  theirs = hf_fixtures.hf_logits(out, ids)
  np.testing.assert_allclose(theirs, ours, atol=2e-5, rtol=1e-4)


def test_eval_on_the_run_names_step_dataset_dtype_and_mesh(run_dir, tmp_path, capsys):
  """Issue 27 (8), on this module's run: ``dapo-eval --workdir`` without ``--step`` names the
  step it found, the checkpoint directory, the dataset, the dtypes and the mesh."""
  from dapo_jax.trainer import evaluate  # pylint: disable=g-import-not-at-top
  out = tmp_path / "eval.json"
  evaluate.main([f"--workdir={run_dir}", "--config.model.dtype=bfloat16",
                 "--config.rollout_mesh=data=2,tensor=4", "--config.eval.max_examples=2",
                 "--config.eval.num_samples=1", f"--output={out}"])
  want = {"workdir": run_dir, "step": 2, "checkpoint": f"{run_dir}/checkpoints/2",
          "dataset": "arithmetic", "num_samples": 1, "dtype": "bfloat16",
          "param_dtype": "float32", "mesh": "data=2,tensor=4", "num_devices": 8}
  assert json.load(open(out))["provenance"] == want
  assert (f"dapo-eval: step 2 of {run_dir} ({run_dir}/checkpoints/2); dataset arithmetic (1 "
          "samples per row); dtype bfloat16 (params float32); mesh data=2,tensor=4 (8 devices)"
          ) in capsys.readouterr().out
