"""Every config file loads and validates; the 32B config is the paper's table, field by field."""

import glob
import importlib.util
import os

import pytest

from dapo_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def _load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_loads_validates_and_names_its_command(path):
  text = open(path).read()
  assert text.startswith("# "), "each config opens with the exact command that runs it"
  assert "dapo-train --config configs/" in text.splitlines()[0] or "launch/" in text.splitlines()[0]
  cfg = _load(path).get_config()
  config_lib.validate(cfg)


@pytest.mark.parametrize("name,preset", [("dapo_qwen2_5_32b", "qwen2.5-32b"),
                                         ("dapo_qwen3_8b_base", "qwen3-8b"),
                                         ("dapo_qwen3_32b_base", "qwen3-32b")])
def test_32b_config_matches_the_paper_table(name, preset):
  """The paper's recipe (32B), and the Qwen3 configs that restate it at 8B and 32B."""
  c = _load(os.path.join(ROOT, "configs", f"{name}.py")).get_config()
  expected = {  # docs/algorithm.md section 8 (and sections 1, 2, 6)
      "model.preset": preset,
      "optim.train_batch_size": 512, "rollout.n": 16,
      "algorithm.gen_batch_size": 1536, "algorithm.max_num_gen_batches": 10,
      "optim.mini_batch_size": 32, "optim.ppo_epochs": 1,
      "data.max_prompt_length": 2048, "rollout.max_response_length": 20480,
      "reward.overlong_buffer_len": 4096, "reward.overlong_penalty_factor": 1.0,
      "reward.overlong_buffer_enable": True, "algorithm.overlong_filter": False,
      "optim.lr": 1e-6, "optim.warmup_steps": 20, "optim.weight_decay": 0.1,
      "optim.grad_clip": 1.0, "optim.b1": 0.9, "optim.b2": 0.999, "optim.eps": 1e-8,
      "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.28,
      "algorithm.clip_ratio_c": 10.0, "algorithm.loss_agg_mode": "token-mean",
      "algorithm.dynamic_sampling": True, "algorithm.use_kl_loss": False,
      "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0,
      "eval.temperature": 1.0, "eval.top_p": 0.7, "data.eval": "aime_2024",
      "data.train": "dapo_math_17k", "reward.verifier": "strict",
  }
  for field, value in expected.items():
    got = c
    for part in field.split("."):
      got = got[part]
    assert got == value, f"{field}: {got!r} != {value!r}"
  assert c.optim.train_batch_size // c.optim.mini_batch_size == 16  # updates per step


def test_32b_table1_rows_add_one_technique_each():
  mod = _load(os.path.join(ROOT, "configs", "dapo_qwen2_5_32b.py"))
  rows = {r: mod.get_config(r) for r in mod.TABLE1_ROWS}
  naive = rows["naive_grpo"]
  assert (naive.algorithm.clip_ratio_high, naive.algorithm.loss_agg_mode,
          naive.algorithm.dynamic_sampling, naive.reward.overlong_buffer_enable,
          naive.algorithm.overlong_filter) == (0.2, "seq-mean-token-mean", False, False, False)
  assert rows["overlong_filtering"].algorithm.overlong_filter
  assert rows["clip_higher"].algorithm.clip_ratio_high == 0.28
  assert rows["soft_overlong"].reward.overlong_buffer_enable
  assert rows["token_level_loss"].algorithm.loss_agg_mode == "token-mean"
  assert not rows["token_level_loss"].algorithm.dynamic_sampling
  assert rows["dapo"].to_dict() == mod.get_config().to_dict()
  for cfg in rows.values():
    config_lib.validate(cfg)


@pytest.mark.parametrize("field,value,match", [
    ("rollout.engine", "vllm", "rollout.engine"),
    ("algorithm.loss_agg_mode", "token-sum", "loss_agg_mode"),
    ("optim.mini_batch_size", 7, "divide optim.train_batch_size=512"),
    ("reward.overlong_buffer_len", 999999, "overlong_buffer_len"),
    ("rollout.top_p", 0.0, "top_p"),
    ("algorithm.kl_loss_type", "full", "kl_loss_type"),
    ("algorithm.kl_loss_coef", -0.1, "kl_loss_coef"),
    ("checkpoint.save_every", 0, r"checkpoint.save_every=0: must be >= 1"),
    ("optim.max_tokens_per_row", 100, r"max_tokens_per_row=100: must be 0 .* 22528"),
])
def test_bad_values_name_the_field(field, value, match):
  c = config_lib.default_config()
  section, leaf = field.split(".")
  c[section][leaf] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)


def test_verl_warmup_and_micro_batch_loss_are_run_config_keys():
  """Issue 17 D3: both of verl's choices (docs/algorithm.md table) reach the compiled update
  from the command line; bad values name the field."""
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "dapo_qwen2_5_32b.py")
  verl = [f"--config={path}", "--config.optim.warmup_style=verl",
          "--config.optim.micro_batch_loss=verl"]
  # verl's per-micro-batch weighting counts whole rows: refused with packed rows in one line.
  with pytest.raises(ValueError, match=r"micro_batch_loss='verl'.*optim.packing=False"):
    config_lib.validate(cli.parse("dapo-train", "", verl).config)
  fv = cli.parse("dapo-train", "", verl + ["--config.optim.packing=False"])
  config_lib.validate(fv.config)
  tcfg = RunSpec.from_config(fv.config).train_config()
  assert (tcfg.warmup_style, tcfg.micro_batch_loss) == ("verl", "verl")
  default = RunSpec.from_config(config_lib.default_config()).train_config()
  assert (default.warmup_style, default.micro_batch_loss) == ("paper", "exact")
  for field in ("warmup_style", "micro_batch_loss"):
    c = config_lib.default_config()
    c.optim[field] = "linear"
    with pytest.raises(ValueError, match=f"optim.{field}"):
      config_lib.validate(c)


def test_the_cpu_demo_keeps_every_prompt_whole():
  """configs/tiny_cpu.py's prompt limit is the longest prompt it renders (issue 41: at 24 left
  truncation cut the opening <|im_start|> from the 3-operand prompts, 25 tokens)."""
  from dapo_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  spec = RunSpec.from_config(_load(os.path.join(ROOT, "configs", "tiny_cpu.py")).get_config(), 1)
  tok = run_setup.build_tokenizer(spec.tokenizer)
  for split, name in (("train", spec.data.train), ("eval", spec.data.eval)):
    records = run_setup.load_dataset(name, spec.data, spec.seed, split)
    over, distinct, longest = pipeline.overlong_prompts(records, tok, spec.data.max_prompt_length)
    assert over == 0 and distinct > 100, (split, over, distinct)
    assert longest == spec.data.max_prompt_length, (split, longest)  # no padding to spare
