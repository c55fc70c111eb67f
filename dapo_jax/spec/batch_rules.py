"""Config rules on batch sizes: each must divide what it is cut from and split over the batch
axes of the mesh it runs on. A failing value gets one message naming EVERY rule on it and the
nearest values passing all of them, so following the suggestion never hits a second rule.

``bad(field, value, why)`` is `config.validate`'s error constructor (it raises).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import ml_collections


@dataclasses.dataclass
class _Split:
  axes: dict[str, int]  # the batch axes of a mesh with their sizes
  shards: int
  num_devices: int

  def rule(self, per: int = 1, times: str = "") -> tuple[str, Callable[[int], bool]]:
    """"value x per rows split over the shards", as (text, test); ``times`` names ``per``."""
    return (f"{f'times {times} give' if times else 'be'} a multiple of the {self.shards} batch "
            f"shards (batch axes {self.axes} on {self.num_devices} devices)",
            lambda v: v * per % self.shards == 0)


def batch_shards(axes, num_devices: int, field: str, bad) -> _Split:
  """The batch axes (data, fsdp: both rule tables split the batch over them) of a mesh."""
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  try:
    sizes = shd.resolve_mesh_sizes([(str(n), int(s)) for n, s in axes], num_devices)
  except ValueError as e:
    hint = "" if "-1" in str(e) else (" Use -1 for one axis (the remaining devices), e.g. "
                                      f"--config.{field}=data=1,fsdp=-1,tensor=1")
    bad(field, axes, f"{e}{hint}")
  split = {str(n): s for (n, _), s in zip(axes, sizes) if n in ("data", "fsdp") and s > 1}
  return _Split(split, math.prod(split.values()), num_devices)


Rule = tuple[str, Callable[[int], bool]]


def _require(field: str, value: int, rules: list[Rule], candidates: Iterable[int], bad,
             fallback: str, then: str = "") -> None:
  """Raises naming EVERY rule when ``value`` fails one, with the nearest ``candidates`` that
  pass all of them: following the suggestion never hits another of these rules (``then``
  names what else must change when no candidate can pass them all)."""
  if all(ok(value) for _, ok in rules):
    return
  good = sorted(v for v in candidates if v > 0 and all(ok(v) for _, ok in rules))
  below = [v for v in good if v <= value][-1:]
  above = [v for v in good if v > value][:1]
  hint = f"use e.g. {' or '.join(map(str, below + above))}{then}" if good else fallback
  listed = ", ".join(f"({i}) {text}" for i, (text, _) in enumerate(rules, 1))
  broken = " and ".join(f"({i})" for i, (_, ok) in enumerate(rules, 1) if not ok(value))
  bad(field, value, f"must {listed}; {value} fails {broken}: {hint}")


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def check_mini_batch(c: ml_collections.ConfigDict, split: _Split | None, bad) -> None:
  """optim.mini_batch_size (and then optim.micro_batch_size) against every rule on it."""
  o, n = c.optim, c.rollout.n
  rules = [(f"divide optim.train_batch_size={o.train_batch_size}",
            lambda v: o.train_batch_size % v == 0)]
  if split is not None and split.shards > 1:
    rules.append(split.rule(n, f"rollout.n={n}"))
  micro = o.micro_batch_size
  micro_rule = (f"times rollout.n={n} give a multiple of optim.micro_batch_size={micro} or at "
                f"most {micro} (one micro-batch)", lambda v: micro >= v * n or v * n % micro == 0)
  fallback = (f"no divisor of optim.train_batch_size={o.train_batch_size} does: change "
              "optim.train_batch_size or the mesh")
  then = (f", then set optim.micro_batch_size to a divisor of its x rollout.n={n} rows (or "
          "more: one micro-batch)")
  if micro > 0 and any(micro_rule[1](v) and all(ok(v) for _, ok in rules)
                       for v in _divisors(o.train_batch_size)):
    rules.append(micro_rule)  # a suggestion that keeps the micro-batch size works too
    then = ""
  _require("optim.mini_batch_size", o.mini_batch_size, rules, _divisors(o.train_batch_size),
           bad, fallback, then)
  rows = o.mini_batch_size * n
  _require("optim.micro_batch_size", micro,
           [(f"divide the {rows} trajectories of a mini-batch (optim.mini_batch_size x "
             f"rollout.n = {o.mini_batch_size} x {n}), or be >= {rows} (one micro-batch)",
             lambda v: v > 0 and (v >= rows or rows % v == 0))],
           _divisors(rows), bad, "")


def check_batch_split(c: ml_collections.ConfigDict, num_devices: int, bad) -> None:
  """Every batch-major array must split over the batch axes: a replicated batch makes every
  device compute every row. Names the setting, every rule on it and the nearest sizes that
  pass them all."""
  split = c.get("rollout_devices", 0)  # devices that only roll out (the rest train)
  roll = batch_shards(c.rollout_mesh or c.mesh, split or num_devices,
                       "rollout_mesh" if c.rollout_mesh else "mesh", bad)
  train = batch_shards(c.mesh, num_devices - split, "mesh", bad)
  n, change_mesh = c.rollout.n, "no value nearby does: change the mesh"

  def multiples(value, split, per):
    step = split.shards // math.gcd(split.shards, per)
    return range(step, max(4 * value, 4 * step) + 1, step)

  if c.sft.steps > 0:
    _require("sft.batch_size", c.sft.batch_size, [train.rule()],
             multiples(c.sft.batch_size, train, 1), bad, change_mesh)
  if c.rollout.engine == "continuous":
    _require("rollout.max_concurrent_decodes", c.rollout.max_concurrent_decodes,
             [roll.rule()], multiples(c.rollout.max_concurrent_decodes, roll, 1), bad,
             change_mesh)
  if c.rollout.engine == "static":
    gen, ppc = c.algorithm.gen_batch_size, c.rollout.prompts_per_call
    if 0 < ppc < gen:
      _require("rollout.prompts_per_call", ppc,
               [(f"divide algorithm.gen_batch_size={gen}", lambda v: gen % v == 0),
                roll.rule(n, f"rollout.n={n}")], _divisors(gen), bad,
               f"no divisor of algorithm.gen_batch_size={gen} does: change it, or set "
               "rollout.prompts_per_call=0 (the whole generation batch per call)")
    else:
      rules = [roll.rule(n, f"rollout.n={n}")]
      if not c.algorithm.dynamic_sampling:
        t = c.optim.train_batch_size
        rules.append((f"be >= optim.train_batch_size={t} (no dynamic sampling)",
                      lambda v: v >= t))
      _require("algorithm.gen_batch_size", gen, rules, multiples(gen, roll, n), bad,
               change_mesh)
  if c.eval.every > 0 and c.data.eval:
    k = c.eval.num_samples
    _require("eval.batch_size", c.eval.batch_size, [roll.rule(k, f"eval.num_samples={k}")],
             multiples(c.eval.batch_size, roll, k), bad, change_mesh)
