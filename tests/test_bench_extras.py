"""setup.py's `[bench]` extra installs what the benches need beyond the project's requirements."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assigned(path: str, name: str):
  """The literal value of a module-level ``name = ...`` in ``path`` (read, not imported)."""
  tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in node.targets):
      return ast.literal_eval(node.value)
  raise AssertionError(f"{path} has no module-level {name}")


def _project(requirement: str) -> str:
  return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_bench_extra_has_what_tunix_sampler_imports():
  """bench/README's Tunix recipe (`pip install -e '.[bench]'`, Tunix --no-deps beside it) needs
  every package decode_throughput.py checks for before loading Tunix's sampler."""
  bench = {_project(r) for r in _assigned("setup.py", "EXTRAS_REQUIRE")["bench"]}
  needed = set(_assigned("bench/decode_throughput.py", "TUNIX_REQUIRES").values())
  assert {"jaxtyping", "sentencepiece"} <= needed
  assert needed <= bench, f"add {sorted(needed - bench)} to setup.py's [bench] extra"
