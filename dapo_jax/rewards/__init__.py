"""Host-side rewards (docs/algorithm.md section 2): strict and symbolic verifiers, batch scoring."""
from dapo_jax.rewards.batch import RewardBatch
from dapo_jax.rewards.batch import RewardScorer
from dapo_jax.rewards.batch import VERIFIERS
from dapo_jax.rewards.batch import compute_batch_rewards
from dapo_jax.rewards.batch import overlong_penalty
from dapo_jax.rewards.deadline_pool import DeadlinePool
from dapo_jax.rewards.math_dapo import INVALID_PRED
from dapo_jax.rewards.math_dapo import compute_score
from dapo_jax.rewards.math_dapo import normalize_final_answer
from dapo_jax.rewards.symbolic import ERROR_PRED
from dapo_jax.rewards.symbolic import SymbolicVerifier
from dapo_jax.rewards.symbolic import TIMEOUT_PRED
from dapo_jax.rewards.symbolic import compute_score_symbolic
from dapo_jax.rewards.symbolic import extract_answer

__all__ = [
    "DeadlinePool",
    "ERROR_PRED",
    "INVALID_PRED",
    "RewardBatch",
    "RewardScorer",
    "SymbolicVerifier",
    "TIMEOUT_PRED",
    "VERIFIERS",
    "compute_batch_rewards",
    "compute_score",
    "compute_score_symbolic",
    "extract_answer",
    "normalize_final_answer",
    "overlong_penalty",
]
