"""dapo_objective.ipynb: the four DAPO techniques plotted with the library's own functions."""

TITLE = r'''
# The DAPO objective, made visible

DAPO (arXiv 2503.14476) changes four things in GRPO and drops the KL term
(`docs/algorithm.md` section 1): **Clip-Higher**, **dynamic sampling**, a **token-level loss**
and **overlong reward shaping**. Each section below plots one of them with the functions the
trainer itself calls: `dapo_jax.trainer.objective` (advantages, clipped loss, aggregation),
`dapo_jax.trainer.dynamic_sampling` and `dapo_jax.rewards`. No model is involved; it runs in
seconds on a CPU.
'''

RUNS_ON = r'''
**Where it runs:** any runtime. The plots use small `jax.numpy` arrays on the default device; a
CPU runtime is plenty.
'''

CELLS = [
    ("code", r'''
import itertools

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from dapo_jax.trainer import dynamic_sampling, objective
from dapo_jax import rewards
'''),
    ("md", r'''
## 1. Clip-Higher and the dual clip (spec section 4)

Per response token, with `ratio = exp(logp - old_logp)` and the sequence's advantage `A`:

    loss = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    if A < 0: loss = min(loss, -A * c)          # dual clip, c = 10

Where the clipped term wins the loss is flat in the ratio: **no gradient**. With `A > 0` a token
stops being pushed up at `1 + eps_high`; DAPO decouples the two bounds and raises `eps_high` from
0.2 to 0.28, so an unlikely token (`old p = 0.01`) may reach 0.0128 instead of 0.012 in one
update, which keeps exploration (entropy) from collapsing. With `A < 0` the token is pushed down
until `1 - eps_low`; the dual clip caps the loss (and zeroes the gradient) of a token whose ratio
has blown up. Curves below come from `objective.compute_policy_loss` on one token.
'''),
    ("code", r'''
def token_loss(ratio, advantage, eps_low, eps_high, clip_c=10.0):
  """compute_policy_loss on a single token whose old log-prob is 0, so ratio = exp(log_prob)."""
  loss, _ = objective.compute_policy_loss(
      jnp.zeros((1, 1)), jnp.log(ratio).reshape(1, 1), jnp.full((1,), advantage),
      jnp.ones((1, 1)), clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=clip_c)
  return loss


def curve(advantage, eps_low, eps_high, ratios, clip_c=10.0):
  f = lambda r: token_loss(r, advantage, eps_low, eps_high, clip_c)
  return jax.vmap(f)(ratios), jax.vmap(jax.grad(f))(ratios)


# Offset so that no point sits exactly on a kink, where max() splits the gradient.
ratios = jnp.linspace(0.4, 1.6, 400) + 1e-3
clips = {"symmetric 0.2 / 0.2 (PPO, GRPO)": (0.2, 0.2), "decoupled 0.2 / 0.28 (DAPO)": (0.2, 0.28)}
fig, axes = plt.subplots(2, 3, figsize=(16, 7), sharex="col")
for col, adv in enumerate((1.0, -1.0)):
  for (label, (lo, hi)), style in zip(clips.items(), ("-", "--")):
    loss, grad = curve(adv, lo, hi, ratios)
    axes[0, col].plot(ratios, loss, style, lw=2, label=label)
    axes[1, col].plot(ratios, grad, style, lw=2, label=label)
  axes[0, col].plot(ratios, -adv * ratios, ":", color="gray", label="unclipped  -A * ratio")
  axes[0, col].set_title(f"A = {adv:+g}: per-token loss")
  axes[1, col].set_title(f"A = {adv:+g}: d loss / d ratio (0 = clipped)")

wide = jnp.linspace(0.05, 14.0, 400) + 1e-3
for c, style in ((10.0, "-"), (1e9, "--")):
  loss, grad = curve(-1.0, 0.2, 0.28, wide, clip_c=c)
  label = "dual clip c = 10" if c == 10.0 else "no dual clip"
  axes[0, 2].plot(wide, loss, style, lw=2, label=label)
  axes[1, 2].plot(wide, grad, style, lw=2, label=label)
axes[0, 2].set_title("A = -1, large ratios: the dual clip")
axes[1, 2].set_title("A = -1: d loss / d ratio")
for ax in axes.flat:
  ax.axvline(1.0, color="k", lw=0.5)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
for ax in axes[1]:
  ax.set_xlabel("ratio = p / p_old")
fig.tight_layout()
plt.show()
'''),
    ("md", r'''
The same function reports how often clipping fired, as the trainer logs it: `pg_clipfrac`
(tokens where the clipped term won) and `pg_clipfrac_lower` (tokens capped by the dual clip).
Here for a batch of ratios spread log-uniformly over [1/4, 4], half the tokens with `A = +1` and
half with `A = -1`:
'''),
    ("code", r'''
rng = np.random.default_rng(0)
log_ratio = rng.uniform(np.log(0.25), np.log(4.0), size=(2, 4096)).astype(np.float32)
adv = np.array([1.0, -1.0], np.float32)
for label, (lo, hi) in clips.items():
  for c in (10.0, 2.0):
    _, m = objective.compute_policy_loss(np.zeros_like(log_ratio), log_ratio, adv,
                                         np.ones_like(log_ratio), clip_ratio_low=lo,
                                         clip_ratio_high=hi, clip_ratio_c=c)
    print(f"{label:32s} c={c:<4g} pg_clipfrac {float(m['pg_clipfrac']):.3f}  "
          f"pg_clipfrac_lower {float(m['pg_clipfrac_lower']):.3f}")
'''),
    ("md", r'''
## 2. Group advantages (spec section 3)

Each prompt's G responses are compared with each other: `A_i = (R_i - mean R) / (std R + 1e-6)`
with the unbiased std (ddof = 1). With +/-1 rewards and k of G correct this has a closed form,
`A+ = sqrt((G-k)/k) * sqrt((G-1)/G)` and `A- = -sqrt(k/(G-k)) * sqrt((G-1)/G)`. A group with k = 0
or k = G has **zero advantage everywhere, hence zero gradient**: that is why dynamic sampling
(next section) drops such groups instead of training on them.
'''),
    ("code", r'''
G = 16
ks = np.arange(0, G + 1)
a_pos, a_neg = [], []
for k in ks:
  scores = np.where(np.arange(G) < k, 1.0, -1.0)
  a = np.asarray(objective.compute_grpo_outcome_advantage(scores, np.zeros(G, np.int32)))
  a_pos.append(a[0] if k > 0 else np.nan)
  a_neg.append(a[-1] if k < G else np.nan)
inner = ks[1:-1]
scale = np.sqrt((G - 1) / G)
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(ks, a_pos, "o", label="A of a correct answer (compute_grpo_outcome_advantage)")
ax.plot(ks, a_neg, "s", label="A of a wrong answer")
ax.plot(inner, np.sqrt((G - inner) / inner) * scale, "k-", lw=0.8, label="closed form (ddof=1)")
ax.plot(inner, -np.sqrt(inner / (G - inner)) * scale, "k-", lw=0.8)
ax.set(xlabel=f"k correct of G = {G}", ylabel="advantage", title="GRPO outcome advantage")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()
print("k = 0 and k = G:", a_neg[0], a_pos[-1], "(all zero: no learning signal)")
'''),
    ("md", r'''
## 3. Dynamic sampling (spec section 5)

DAPO keeps generating until `train_batch_size` groups have at least one correct and one wrong
answer (`std(acc) > 0`). A prompt answered correctly with probability `p` yields a kept group with
probability `1 - p^G - (1-p)^G` (`dynamic_sampling.acceptance_probability`). Lines: that formula.
Points: the kept ratio `DynamicSampler` actually measures when its `generate_fn` is a simulated
policy that answers each prompt correctly with probability `p` (the prompt *is* `p` here).
'''),
    ("code", r'''
def simulated_policy(group_size, seed=0):
  """A DynamicSampler generate_fn: each prompt is its correctness p; G Bernoulli(p) answers."""
  rng = np.random.default_rng(seed)

  def generate_fn(prompts):
    groups = []
    for p in prompts:
      acc = rng.random(group_size) < p
      groups.append(dynamic_sampling.Group(prompt=p, acc=acc, reward=np.where(acc, 1.0, -1.0)))
    return groups

  return generate_fn


def measured_kept_ratio(p, group_size, gen_batch_size=200, max_gen_batches=10):
  sampler = dynamic_sampling.DynamicSampler(
      simulated_policy(group_size, seed=round(1000 * p) + group_size),
      train_batch_size=gen_batch_size,
      max_num_gen_batches=max_gen_batches)
  try:
    _, stats = sampler.sample(itertools.repeat([p] * gen_batch_size))
  except dynamic_sampling.MaxGenBatchesExceededError as err:  # p near 0 or 1: too few kept
    stats = err.stats
  return stats.kept_ratio


print("spec check, G = 16:", {p: round(float(dynamic_sampling.acceptance_probability(p, 16)), 6)
                              for p in (0.01, 0.1, 0.5)})
p_line = np.linspace(0.0, 1.0, 401)
p_points = np.linspace(0.0, 1.0, 21)
fig, ax = plt.subplots(figsize=(8, 4))
for g, color in zip((2, 4, 8, 16), ("C0", "C1", "C2", "C3")):
  ax.plot(p_line, dynamic_sampling.acceptance_probability(p_line, g), color=color, label=f"G = {g}")
  if g in (4, 16):
    ax.plot(p_points, [measured_kept_ratio(p, g) for p in p_points], "o", color=color, ms=5,
            label=f"G = {g}, measured by DynamicSampler")
ax.set(xlabel="per-sample correctness p", ylabel="P(group kept)",
       title="dynamic sampling acceptance: 1 - p^G - (1-p)^G")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()
'''),
    ("md", r'''
What one training step costs when prompts vary in difficulty, at the paper's proportions scaled
down 16x (generation batch 96 prompts, 32 kept per step, G = 16, at most 10 generation batches).
Early in training most prompts are too hard (per-prompt correctness `p ~ Beta(0.1, 1)`), late
most are solved (`p ~ Beta(1, 0.1)`); either way only about a quarter of the groups carry a
signal and the sampler often needs a second generation batch. These are the statistics the
trainer logs under `sampling/` every step.
'''),
    ("code", r'''
policies = {"early, p ~ Beta(0.1, 1)": (0.1, 1.0), "late, p ~ Beta(1, 0.1)": (1.0, 0.1)}
for label, (a, b) in policies.items():
  rng = np.random.default_rng(1)
  prompt_batches = iter(lambda: list(rng.beta(a, b, size=96)), None)  # an endless prompt stream
  sampler = dynamic_sampling.DynamicSampler(simulated_policy(16, seed=1), train_batch_size=32,
                                            max_num_gen_batches=10)
  print(label)
  for step in range(3):
    groups, stats = sampler.sample(prompt_batches)
    s = stats.to_dict()
    print(f"  step {step}: {s['num_gen_batches']:.0f} generation batch(es), kept "
          f"{s['kept_ratio']:.2f} (all-correct {s['all_correct_ratio']:.2f}, all-wrong "
          f"{s['all_wrong_ratio']:.2f}), rollouts generated {s['rollouts_generated']:.0f} -> "
          f"trained {s['rollouts_trained']:.0f}")
'''),
    ("md", r'''
## 4. Token-level loss (spec section 4)

How the per-token losses `l[b, t]` of a mini-batch become one number decides how much each token
weighs. The weight of a token is `d loss / d l[b, t]`, read here with `jax.grad` of
`objective.agg_loss` for three responses of 4, 16 and 64 tokens. GRPO's `seq-mean-token-mean`
averages within each sequence first, so a token of a long response weighs 16x less than a token
of a short one, and long (often wrong, rambling) responses are under-penalised. DAPO's
`token-mean` gives every token the same weight, so a sequence weighs in proportion to its length.
`seq-mean-token-sum` and Dr.GRPO's `seq-mean-token-sum-norm` split a batch in the same
proportions as `token-mean` and differ from it only in overall scale.
'''),
    ("code", r'''
lengths = np.array([4, 16, 64])
T = int(lengths.max())
mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
weights = {mode: np.asarray(jax.grad(lambda l: objective.agg_loss(l, mask, mode))(
               jnp.zeros(mask.shape))) for mode in objective.LOSS_AGG_MODES}

fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
x = np.arange(len(lengths))
width = 0.8 / len(weights)
for i, (mode, w) in enumerate(weights.items()):
  axes[0].bar(x + i * width, w[:, 0], width, label=mode)  # every token of a row weighs the same
  axes[1].bar(x + i * width, w.sum(axis=1) / w.sum(), width, label=mode)
for ax, title in zip(axes, ("weight of ONE token of the response (log scale)",
                            "share of the batch loss carried by the whole response")):
  ax.set_xticks(x + 0.4 - width / 2, [f"{n} tokens" for n in lengths])
  ax.set_title(title)
  ax.grid(alpha=0.3, axis="y")
axes[0].set_yscale("log")
axes[1].legend(fontsize=8)
plt.show()
for mode, w in weights.items():
  print(f"{mode:24s} per-token {np.round(w[:, 0], 4)}  per-response {np.round(w.sum(1), 3)}")
'''),
    ("md", r'''
The token mean is over the whole optimizer **mini-batch**, even when memory forces it into
micro-batches: each micro-batch is divided by the mini-batch's `loss_denominator`, so the pieces
sum exactly to the full loss. verl's reproduction weighted per-micro-batch token means by sequence
count instead (`agg_loss_verl_microbatch`), which is not the same number when lengths differ:
'''),
    ("code", r'''
loss_mat = np.random.default_rng(2).normal(size=mask.shape).astype(np.float32)
full = objective.agg_loss(loss_mat, mask, "token-mean")
den = objective.loss_denominator(mask, "token-mean")
micro = [slice(0, 2), slice(2, 3)]  # responses {4, 16} and {64}
exact = sum(objective.agg_loss(loss_mat[s], mask[s], "token-mean", den) for s in micro)
verl = sum(objective.agg_loss_verl_microbatch(loss_mat[s], mask[s], "token-mean", len(lengths))
           for s in micro)
print(f"full batch {float(full):+.5f}  micro-batched (exact) {float(exact):+.5f}  "
      f"verl approximation {float(verl):+.5f}")
'''),
    ("md", r'''
## 5. Rewards and overlong shaping (spec section 2)

The strict verifier (`rewards.compute_score`) reads the last `Answer:` line in the final 300
characters and compares normalised strings: +1 or -1. Then every response, right or wrong, gets
the soft overlong penalty `min(-(L - (max_len - buffer)) / buffer * factor, 0)`
(`rewards.overlong_penalty`): zero up to the expected length, falling linearly to `-factor` at the
maximum. With the paper's 20480 tokens and a 4096 buffer, correct answers earn rewards in [0, 1]
and wrong ones in [-2, -1]; the two ranges never overlap.
'''),
    ("code", r'''
MAX_LEN, BUFFER = 20480, 4096
L = np.arange(0, MAX_LEN + 1, 16)
penalty = rewards.overlong_penalty(L, MAX_LEN, BUFFER, 1.0)
fig, ax = plt.subplots(figsize=(9, 4))
ax.plot(L, 1.0 + penalty, lw=2, label="correct answer: 1 + penalty")
ax.plot(L, -1.0 + penalty, lw=2, label="wrong answer: -1 + penalty")
ax.axhspan(0, 1, color="C0", alpha=0.08)
ax.axhspan(-2, -1, color="C1", alpha=0.08)
ax.axvline(MAX_LEN - BUFFER, color="k", ls="--", lw=0.8)
ax.text(MAX_LEN - BUFFER, 0.5, "  expected length 16384:\n  the overlong buffer starts", fontsize=8)
ax.set(xlabel="response length L (tokens, EOS included)", ylabel="shaped reward",
       title="overlong reward shaping (max 20480, buffer 4096, factor 1)")
ax.grid(alpha=0.3)
ax.legend(fontsize=8, loc="lower left")
plt.show()
'''),
    ("md", r'''
The same through `rewards.compute_batch_rewards`, the trainer's per-generation-batch scorer, on
a few responses to a problem whose answer is 42 (the strict verifier's known cases included:
a trailing period or a bare `\boxed{}` is wrong). The last two rows form an all-wrong group whose
rewards differ because of their lengths: dynamic sampling filters on `acc`, so it still drops it.
'''),
    ("code", r'''
responses = ["so the total is 42.\nAnswer: 42", "Answer: $42$", "Answer: \\boxed{42}",
             "Answer: 42.", "the answer is \\boxed{42}", "Answer: x = 42", "Answer: 41",
             "Answer: 41"]
lengths = [900, 17000, 20480, 300, 300, 18000, 12000, 20000]
out = rewards.compute_batch_rewards(responses, ["42"] * len(responses), lengths,
                                    max_response_length=MAX_LEN, overlong_buffer_len=BUFFER)
print(f"{'response':40s} {'L':>6s} {'pred':>8s} {'acc':>5s} {'score':>6s} {'penalty':>8s} "
      f"{'reward':>7s}")
for i, r in enumerate(responses):
  print(f"{r!r:40s} {lengths[i]:6d} {out.pred[i]:>8s} {str(out.acc[i]):>5s} "
        f"{out.score[i]:+6.1f} {out.overlong_penalty[i]:+8.3f} {out.reward[i]:+7.3f}")
wrong_pair = dynamic_sampling.Group(prompt="p", acc=out.acc[-2:], reward=out.reward[-2:])
print(f"\nlast two as a group: reward std {np.std(wrong_pair.reward):.3f} > 0, yet kept = "
      f"{wrong_pair.is_valid} (filtering uses acc, spec 2)")
'''),
]
