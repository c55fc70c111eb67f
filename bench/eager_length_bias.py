r"""Length bias of eager streaming dynamic sampling, on a simulated continuous engine.

    python bench/eager_length_bias.py       # the paper's batch shape: 512 of 1536 prompts, G=16

`DynamicSampler.sample_stream` fills one training batch with ``wait=True`` (groups in admission
order, every admitted prompt waited for: the batch-level loop's groups) and with ``wait=False``
(groups in the order they finish). The rollout is a stand-in for a continuous engine: ``slots``
decode slots, one token per slot per step, a freed slot takes the next waiting response at once;
a group finishes with its longest response. Responses follow the issue's long-tail mix (mean
about a quarter of the budget, about 5% truncated at it) and, as in real reasoning traces,
longer responses are more often wrong (truncated ones always are). Reported per mode: mean
response length of the kept groups and decode steps to fill the batch; the ratio eager / exact is
the bias. Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools

import numpy as np

from dapo_jax.trainer.dynamic_sampling import DynamicSampler, Group


def _lengths(rng: np.random.Generator, g: int, r_max: int) -> np.ndarray:
  # Log-normal around r_max / 5, clipped at the budget: mean ~ r_max / 4, ~5% at r_max.
  return np.minimum(rng.lognormal(np.log(r_max / 5.2), 0.8, g), r_max).astype(int).clip(1)


class _Prompt:
  """One prompt's G responses, fixed by its id (same in both modes)."""

  def __init__(self, pid: int, seed: int, g: int, r_max: int):
    rng = np.random.default_rng([seed, pid])
    difficulty = rng.beta(0.3, 0.3)  # most prompts near always-right or always-wrong
    self.lengths = _lengths(rng, g, r_max)
    p_correct = (1 - difficulty) * (1 - self.lengths / r_max) ** 0.5
    self.acc = (rng.uniform(size=g) < p_correct) & (self.lengths < r_max)
    self.pid = pid


class SimulatedEngine:
  """`GroupStream` of a continuous engine with `slots` slots (FIFO admission)."""

  def __init__(self, slots: int):
    self.slots, self.step = slots, 0
    self.queue: collections.deque = collections.deque()  # (index, sample) waiting for a slot
    self.finishing: list[tuple[int, int]] = []  # heap of (finish step, index) of running ones
    self.prompts: dict[int, _Prompt] = {}
    self.left: dict[int, int] = {}  # index -> responses not finished

  def admit(self, prompt: _Prompt, index: int) -> None:
    self.prompts[index] = prompt
    self.left[index] = len(prompt.lengths)
    self.queue.extend((index, s) for s in range(len(prompt.lengths)))

  def poll(self) -> list[tuple[int, Group]]:
    done: list[tuple[int, Group]] = []
    while not done and (self.queue or self.finishing):
      while self.queue and len(self.finishing) < self.slots:
        i, s = self.queue.popleft()
        heapq.heappush(self.finishing, (self.step + int(self.prompts[i].lengths[s]), i))
      self.step, i = heapq.heappop(self.finishing)  # the next response to finish
      self.left[i] -= 1
      if self.left[i] == 0:
        p = self.prompts.pop(i)
        done.append((i, Group(prompt=p, acc=p.acc, reward=np.where(p.acc, 1.0, -1.0))))
    return done


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
  ap.add_argument("--train-batch-size", type=int, default=512)
  ap.add_argument("--gen-batch-size", type=int, default=1536)
  ap.add_argument("--group-size", type=int, default=16)
  ap.add_argument("--max-len", type=int, default=20480)
  ap.add_argument("--slots", type=int, default=4096)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--seeds", type=int, default=3)
  args = ap.parse_args()
  modes = ("batch loop", "stream exact (wait=True)", "stream eager (wait=False)")
  rows = {m: [] for m in modes}
  for seed, step in itertools.product(range(args.seeds), range(args.steps)):
    for mode in modes:
      ids = itertools.count(step * 100 * args.gen_batch_size)
      batches = ([_Prompt(next(ids), seed, args.group_size, args.max_len)
                  for _ in range(args.gen_batch_size)] for _ in itertools.count())
      engine = SimulatedEngine(args.slots)
      sampler = DynamicSampler(train_batch_size=args.train_batch_size)
      if mode == "batch loop":
        groups, stats = sampler.sample(batches, generate_fn=lambda ps, e=engine: _whole(e, ps))
      else:
        groups, stats = sampler.sample_stream(batches, engine, wait=mode != modes[2])
      rows[mode].append((np.mean([g.prompt.lengths.mean() for g in groups]), engine.step,
                         stats.prompts_admitted, stats.kept_ratio))
  print(f"{args.seeds} seeds x {args.steps} batches of {args.train_batch_size} groups "
        f"(G={args.group_size}, R={args.max_len}, {args.slots} slots, generation batch "
        f"{args.gen_batch_size})")
  means = {m: np.array(r).mean(0) for m, r in rows.items()}
  for m in modes:
    r = np.array(rows[m])
    print(f"  {m:26s} kept-group mean length {r[:, 0].mean():7.1f} +- {r[:, 0].std():5.1f}  "
          f"decode steps {r[:, 1].mean():8.0f}  prompts decoded {r[:, 2].mean():6.0f}  "
          f"kept ratio {r[:, 3].mean():.3f}")
  for m in modes[1:]:
    print(f"  {m} / batch loop: length {means[m][0] / means[modes[0]][0]:.3f}, decode steps "
          f"{means[m][1] / means[modes[0]][1]:.3f}, prompts decoded "
          f"{means[m][2] / means[modes[0]][2]:.3f}")


def _whole(engine: SimulatedEngine, prompts: list) -> list[Group]:
  """The batch-level loop: a whole generation batch admitted, every group waited for."""
  first = len(engine.left)
  for j, p in enumerate(prompts):
    engine.admit(p, first + j)
  done: dict[int, Group] = {}
  while len(done) < len(prompts):
    done.update(engine.poll())
  return [done[first + j] for j in range(len(prompts))]


if __name__ == "__main__":
  main()
