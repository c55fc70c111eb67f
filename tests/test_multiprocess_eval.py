"""`dapo-eval` on 2 processes x 4 CPU devices: the same avg@k and samples as 1 process x 8, with
each process verifying only its share of the answers.

This file is also the worker: ``python tests/test_multiprocess_eval.py CKPT OUT`` evaluates with
the process layout given by the JAX_* environment variables.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.processes import free_port, process_env, wait_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config.data.eval=arithmetic", "--config.data.arithmetic.num_eval=8",
        "--config.eval.num_samples=4", "--config.eval.batch_size=4",
        "--config.rollout.max_response_length=8", "--config.data.max_prompt_length=16",
        "--config.tokenizer.kind=char", "--config.reward.num_workers=1",
        "--config.mesh=data=2,tensor=4"]


def _worker(ckpt: str, out: str) -> None:
  sys.path.insert(0, ROOT)
  from dapo_jax.infra import distributed  # pylint: disable=g-import-not-at-top
  distributed.maybe_initialize()
  import jax  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import evaluate, run_setup  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import policy
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  from dapo_jax.rewards import batch  # pylint: disable=g-import-not-at-top
  scored = []
  real_call = batch.RewardScorer.__call__

  def counting_call(self, responses, *args, **kwargs):
    scored.append(len(responses))
    return real_call(self, responses, *args, **kwargs)

  batch.RewardScorer.__call__ = counting_call
  config = evaluate._parse([f"--config.model.checkpoint={ckpt}", *ARGS]).config  # pylint: disable=protected-access
  spec = RunSpec.read(config)  # as dapo-eval reads it
  mesh = policy.sampling_mesh(spec.mesh, spec.rollout_mesh, spec.dcn_mesh)
  pol = policy.load_policy(spec, mesh=mesh)
  records = run_setup.load_dataset(spec.data.eval, spec.data, spec.seed, "eval")
  summary, ev = evaluate.evaluate_policy(spec, pol, records)
  with open(os.path.join(out, f"worker{jax.process_index()}.json"), "w") as f:
    json.dump({"summary": summary, "texts": ev.last_texts, "rows_scored": sum(scored),
               "devices": jax.device_count()}, f)



def _spawn(ckpt, out, local_devices, env_extra):
  env = process_env(ROOT, local_devices, env_extra)
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), ckpt, out], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_processes_evaluate_like_one(tmp_path):
  pytest.importorskip("torch")
  from dapo_jax.tokenizers import CharTokenizer  # pylint: disable=g-import-not-at-top
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  ckpt = hf_fixtures.write_tiny_qwen2(str(tmp_path / "ckpt"), vocab_size=64,
                                      num_key_value_heads=4, seed=5)
  CharTokenizer().save(ckpt)
  one, two = tmp_path / "one", tmp_path / "two"
  one.mkdir()
  two.mkdir()
  coord = f"localhost:{free_port()}"
  procs = [_spawn(ckpt, str(one), 8, {})]
  procs += [_spawn(ckpt, str(two), 4, {"JAX_COORDINATOR_ADDRESS": coord,
                                       "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
            for i in range(2)]
  wait_all(procs, 420, "an evaluation process")
  single = json.load(open(one / "worker0.json"))
  workers = [json.load(open(two / f"worker{i}.json")) for i in range(2)]
  assert [w["devices"] for w in workers] == [8, 8]
  for w in workers:  # every process ends with the whole table
    assert w["summary"] == single["summary"] and w["texts"] == single["texts"]
  # Each process verified its half; together every answer exactly once.
  assert single["rows_scored"] == 32
  assert [w["rows_scored"] for w in workers] == [16, 16]


if __name__ == "__main__":
  _worker(sys.argv[1], sys.argv[2])
