"""`TraceCounter`: how often each compiled program was traced, so tests catch silent recompiles.

`jax.jit` runs a function's Python body once per trace (not per call), so a counter bumped in
the body counts compilations. Every compiled entry point of the package counts with this class:
per object (`Sampler.traces`, `TrainStep.traces`) or per module (`rollout/continuous.TRACES`,
`rollout/jetstream_engine.TRACES`).

    before = sampler.traces.snapshot()
    sampler.generate(...)                       # same shapes again
    assert sampler.traces.snapshot() == before
"""

import collections


class TraceCounter:
  """Trace counts per program name (one name, `"program"`, for single-program owners)."""

  def __init__(self) -> None:
    self._counts: collections.Counter[str] = collections.Counter()

  def record(self, name: str = "program") -> None:
    """Call inside the traced function's body: runs once per trace."""
    self._counts[name] += 1

  def __getitem__(self, name: str) -> int:
    return self._counts[name]

  @property
  def total(self) -> int:
    """Traces of all programs together."""
    return sum(self._counts.values())

  def snapshot(self) -> dict[str, int]:
    """A copy of the counts, to compare after more calls."""
    return dict(self._counts)
