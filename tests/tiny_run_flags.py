"""`dapo-train` flags that shrink configs/tiny_cpu.py to a seconds-long run (subprocess tests)."""

TINY_RUN_FLAGS = [
    "--config.model.overrides.hidden_size=32", "--config.model.overrides.intermediate_size=64",
    "--config.model.overrides.num_hidden_layers=1",
    "--config.model.overrides.num_attention_heads=2",
    "--config.model.overrides.num_key_value_heads=1", "--config.sft.steps=0",
    "--config.rollout.n=4", "--config.rollout.max_response_length=12",
    "--config.reward.overlong_buffer_len=4", "--config.algorithm.dynamic_sampling=False",
    "--config.algorithm.gen_batch_size=4", "--config.optim.train_batch_size=4",
    "--config.optim.mini_batch_size=2", "--config.eval.every=0",
    "--config.data.arithmetic.num_train=64"]
