"""The export, serve and launch-preflight commands (dapo-train is `dapo_jax.main`; dapo-eval
and dapo-plan are the `run` of `trainer/evaluate.py` and `planner/plan.py`)."""
