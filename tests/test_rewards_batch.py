"""Batch rewards (docs/algorithm.md section 2): overlong shaping closed forms, failures, order."""
import time

import numpy as np
import pytest

from dapo_jax.rewards import batch
from dapo_jax.rewards import compute_score
from dapo_jax.rewards.batch import RewardScorer, compute_batch_rewards, overlong_penalty

MAX_LEN, BUFFER = 20480, 4096  # spec 2 / 8: expected length 16384


@pytest.mark.parametrize("length,penalty", [
    (0, 0.0), (16384, 0.0), (16385, -1 / 4096), (18432, -0.5), (20480, -1.0)])
def test_overlong_penalty_closed_forms(length, penalty):
  out = overlong_penalty(np.array([length]), MAX_LEN, BUFFER, 1.0)
  assert out.dtype == np.float32 and out.shape == (1,)
  np.testing.assert_allclose(out, [penalty], rtol=0, atol=1e-7)


def test_overlong_penalty_scales_with_factor_and_small_settings():
  np.testing.assert_allclose(overlong_penalty([18432, 20480], MAX_LEN, BUFFER, 0.5),
                             [-0.25, -0.5])
  # The 7B smoke setting of spec 8: response 2048, buffer 512 -> expected 1536.
  np.testing.assert_allclose(overlong_penalty([1536, 1792, 2048], 2048, 512, 1.0),
                             [0.0, -0.5, -1.0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_response_length=1000, buffer_len=2000, factor=1.0), "overlong_buffer_len"),
    (dict(max_response_length=1000, buffer_len=0, factor=1.0), "overlong_buffer_len"),
    (dict(max_response_length=1000, buffer_len=10, factor=-1.0), "factor"),
])
def test_overlong_penalty_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    overlong_penalty([1], **kwargs)


def test_overlong_penalty_rejects_bad_lengths():
  with pytest.raises(ValueError, match="1-D"):
    overlong_penalty([[1]], MAX_LEN, BUFFER, 1.0)
  with pytest.raises(ValueError, match=">= 0"):
    overlong_penalty([-1], MAX_LEN, BUFFER, 1.0)


def test_rewards_ranges_with_shaping_on_every_response():
  rng = np.random.default_rng(0)
  n = 256
  lengths = rng.integers(1, MAX_LEN + 1, size=n)
  lengths[:4] = [1, 16384, 18432, 20480]
  right = rng.random(n) < 0.5
  responses = [f"Answer: {i if r else i + 1}" for i, r in enumerate(right)]
  gts = [str(i) for i in range(n)]
  out = compute_batch_rewards(responses, gts, lengths, max_response_length=MAX_LEN,
                              overlong_buffer_len=BUFFER, overlong_penalty_factor=1.0)
  np.testing.assert_array_equal(out.acc, right)
  np.testing.assert_array_equal(out.score, np.where(right, 1.0, -1.0))
  assert np.all((out.reward[right] >= 0) & (out.reward[right] <= 1))
  assert np.all((out.reward[~right] >= -2) & (out.reward[~right] <= -1))
  np.testing.assert_allclose(out.overlong_penalty[:4], [0, 0, -0.5, -1.0])
  # Penalty depends on length only, never on correctness (spec 2: EVERY response).
  np.testing.assert_allclose(out.overlong_penalty,
                             overlong_penalty(lengths, MAX_LEN, BUFFER, 1.0))
  np.testing.assert_allclose(out.reward, out.score + out.overlong_penalty)
  assert out.pred == [compute_score(r, g)["pred"] for r, g in zip(responses, gts)]
  assert out.num_errors == 0 and out.num_timeouts == 0


def test_enable_flag_off_means_no_penalty():
  lengths = [20480, 20480]
  kwargs = dict(max_response_length=MAX_LEN, overlong_buffer_len=BUFFER)
  off = compute_batch_rewards(["Answer: 1", "Answer: 2"], ["1", "1"], lengths,
                              overlong_buffer_enable=False, **kwargs)
  on = compute_batch_rewards(["Answer: 1", "Answer: 2"], ["1", "1"], lengths, **kwargs)
  np.testing.assert_array_equal(off.overlong_penalty, [0, 0])
  np.testing.assert_array_equal(off.reward, [1, -1])
  np.testing.assert_array_equal(on.reward, [0, -2])
  # Disabled shaping does not validate the unused buffer setting.
  compute_batch_rewards(["Answer: 1"], ["1"], [5], max_response_length=10,
                        overlong_buffer_len=4096, overlong_buffer_enable=False)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(verifier="lenient"), ValueError, "Unknown verifier 'lenient'"),
    (dict(verifier=3), TypeError, "verifier"),
    (dict(verifier=lambda r, g: {}), TypeError, "cannot be pickled"),
    (dict(overlong_buffer_len=30000), ValueError, "overlong_buffer_len"),
    (dict(timeout_s=0), ValueError, "timeout_s"),
    (dict(num_workers=0), ValueError, "num_workers"),
])
def test_scorer_rejects_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    RewardScorer(max_response_length=MAX_LEN, **kwargs)


def test_batch_size_mismatch_is_an_error():
  with RewardScorer(max_response_length=MAX_LEN) as scorer:
    with pytest.raises(ValueError, match="Batch sizes differ"):
      scorer(["Answer: 1"], ["1", "2"], [1, 2])


def test_strict_exception_is_counted_and_wrong():
  # A non-string response makes compute_score raise; only that item suffers.
  out = compute_batch_rewards(["Answer: 1", None, "Answer: 3"], ["1", "2", "3"], [5, 5, 5],
                              max_response_length=MAX_LEN)
  assert out.num_errors == 1 and out.num_timeouts == 0
  assert out.pred == ["1", "[ERROR]", "3"]
  np.testing.assert_array_equal(out.acc, [True, False, True])
  np.testing.assert_array_equal(out.score, [1, -1, 1])


# Custom verifiers run in worker processes, so they must be module-level (picklable).
def _flaky_verifier(response: str, ground_truth: str):
  if response == "boom":
    raise RuntimeError("injected failure")
  if response == "hang":
    time.sleep(60)
  if response == "bad":
    return {"score": 1.0}  # missing keys: treated as an error
  if response.startswith("sleep "):
    time.sleep(float(response.split()[1]))
  return compute_score(f"Answer: {response.split()[-1]}", ground_truth)


def test_injected_exception_and_timeout_are_counted_and_wrong():
  responses = ["boom", "sleep 0 1", "hang", "bad", "sleep 0 2"]
  with RewardScorer(_flaky_verifier, max_response_length=MAX_LEN, timeout_s=0.5,
                    num_workers=2) as scorer:
    start = time.monotonic()
    out = scorer(responses, ["1", "1", "1", "1", "3"], [16384, 16384, 20480, 16384, 16384])
    elapsed = time.monotonic() - start
  assert out.num_errors == 2 and out.num_timeouts == 1
  assert out.pred == ["[ERROR]", "1", "[TIMEOUT]", "[ERROR]", "2"]
  np.testing.assert_array_equal(out.acc, [False, True, False, False, False])
  np.testing.assert_array_equal(out.reward, [-1, 1, -2, -1, -1])
  assert elapsed < 10  # the 60 s sleep was cut off


def test_order_is_preserved_under_parallelism():
  # Earlier items sleep longer, so workers finish them out of order.
  n = 12
  responses = [f"sleep {0.02 * (n - i):.2f} {i}" for i in range(n)]
  gts = [str(i) if i % 3 else "x" for i in range(n)]
  with RewardScorer(_flaky_verifier, max_response_length=MAX_LEN, timeout_s=10.0,
                    num_workers=3) as scorer:
    out = scorer(responses, gts, np.full(n, 100))
  assert out.pred == [str(i) for i in range(n)]
  np.testing.assert_array_equal(out.acc, [i % 3 != 0 for i in range(n)])


def test_symbolic_scorer_end_to_end():
  responses = ["Answer: 0.5", "Answer: \\sqrt{8}", "Answer: 3", "Answer: 9^{9^{9^{9^9}}}",
               "so \\boxed{\\frac{3}{4}}", "Answer: 12"]
  gts = ["\\frac{1}{2}", "2\\sqrt{2}", "4", "5", "0.75", "12"]
  lengths = [18432, 100, 100, 100, 20480, 100]
  with RewardScorer("symbolic", max_response_length=MAX_LEN, timeout_s=2.0,
                    num_workers=2) as scorer:
    out = scorer(responses, gts, lengths)
    # The pool survives a timeout and is reused for the next step.
    again = scorer(["Answer: 1/3"], ["\\frac{1}{3}"], [1], timeout_s=10.0)
  np.testing.assert_array_equal(out.acc, [True, True, False, False, True, True])
  np.testing.assert_allclose(out.reward, [0.5, 1, -1, -1, 0, 1])
  assert out.num_timeouts == 1 and out.num_errors == 0
  assert out.pred[3] == "[TIMEOUT]"
  assert again.acc.tolist() == [True]


def test_verifier_names():
  assert batch.VERIFIERS == ("strict", "symbolic")
