"""The tree shows the architecture (docs/architecture.md): every module sits in a subpackage of
one role, imports only the roles below it, no two modules import each other (even through
function-level imports), and a file over 400 lines says in its docstring why it is one piece.

Reads the sources with `ast` (`bench/code_metrics.py`); imports nothing of dapo_jax."""

import ast
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import code_metrics  # noqa: E402  pylint: disable=wrong-import-position

PKG = pathlib.Path(__file__).resolve().parents[1] / "dapo_jax"
MAX_LINES = 400
MAX_LOOP_LINES = 90  # train_and_evaluate, docstring included
# What each role may import (besides itself), bottom to top. docs/architecture.md has the table.
MAY_IMPORT = {
    "infra": set(),
    "models": {"infra"},
    "tokenizers": {"infra"},
    "data": {"tokenizers", "infra"},
    "rewards": {"infra"},
    "checkpoints": {"models", "infra"},
    "rollout": {"models", "data", "tokenizers", "infra"},
    "spec": {"config", "models", "infra"},
    "config": {"spec", "models", "infra"},
    "trainer": {"spec", "config", "rollout", "checkpoints", "rewards", "data", "tokenizers",
                "models", "infra"},
    "planner": {"trainer", "spec", "config", "rollout", "checkpoints", "data", "tokenizers",
                "models", "infra"},
    "commands": {"planner", "trainer", "spec", "config", "rollout", "checkpoints", "rewards",
                 "data", "tokenizers", "models", "infra"},
    "main": {"commands", "trainer", "spec", "config", "rollout", "checkpoints", "rewards", "data",
             "tokenizers", "models", "infra"},
    "root": {"checkpoints"},  # dapo_jax/__init__.py: load_pretrained
}
# Imports that cross the layers on purpose: the schema checks a choice against the table of the
# code that implements it, and the spec builds the compiled step's static settings.
EXCEPTIONS = {
    ("dapo_jax.config", "dapo_jax.trainer.objective"),
    ("dapo_jax.config", "dapo_jax.trainer.train_step"),
    ("dapo_jax.spec.run_spec", "dapo_jax.trainer.train_step"),
}
ROOT_MODULES = {"dapo_jax", "dapo_jax.config", "dapo_jax.main"}


def _modules() -> dict[str, pathlib.Path]:
  return code_metrics.modules(PKG)


def _role(module: str) -> str:
  parts = module.split(".")
  if len(parts) == 1:
    return "root"
  return parts[1]


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  known = set(mods)
  return {m: code_metrics.imports(ast.parse(p.read_text()), known) - {m}
          for m, p in mods.items()}


def test_every_module_sits_in_a_role():
  roles = {_role(m) for m in _modules()}
  assert roles <= set(MAY_IMPORT), roles - set(MAY_IMPORT)
  flat = {m for m in _modules() if m.count(".") == 1 and not (PKG / m.split(".")[1]).is_dir()}
  assert flat == ROOT_MODULES - {"dapo_jax"}, (
      f"modules at the package root besides config.py and main.py: {sorted(flat)}; "
      "put them in the subpackage of their role (docs/architecture.md)")


def test_roles_import_only_the_roles_below():
  bad = []
  for mod, deps in _graph().items():
    for dep in deps:
      a, b = _role(mod), _role(dep)
      if a != b and b not in MAY_IMPORT[a] and (mod, dep) not in EXCEPTIONS:
        bad.append(f"{mod} ({a}) imports {dep} ({b})")
  assert not bad, "\n".join(bad)


def test_no_import_cycles():
  cycles = code_metrics.cycles(_graph())
  assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_long_files_say_why_they_are_one_piece(path):
  lines = len(path.read_text().splitlines())
  if lines <= MAX_LINES:
    return
  doc = ast.get_docstring(ast.parse(path.read_text())) or ""
  assert "One piece:" in doc, (
      f"{path.relative_to(PKG.parent)} has {lines} lines: split it, or say in its module "
      f"docstring why it is one piece ('One piece: ...')")



def test_the_loop_fits_on_a_screen():
  """`train_and_evaluate` reads as the paper's step in order (STYLE.md, Flax examples): the
  wiring and the step's body live in named functions beside it (issue 50, 17)."""
  tree = ast.parse((PKG / "trainer" / "train.py").read_text())
  [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_and_evaluate"]
  lines = fn.end_lineno - fn.lineno + 1
  assert lines <= MAX_LOOP_LINES, (
      f"trainer/train.py train_and_evaluate has {lines} lines (at most {MAX_LOOP_LINES}): move "
      "wiring or a step's work into a named function beside it")

def test_the_checks_catch_what_they_look_for(tmp_path):
  """The helpers see function-level imports, skip TYPE_CHECKING ones and find a cycle."""
  src = tmp_path / "m.py"
  src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "  from dapo_jax.trainer import train\n"
                 "def f():\n  from dapo_jax.infra import metrics\n")
  known = {"dapo_jax.trainer.train", "dapo_jax.infra.metrics", "dapo_jax.infra"}
  assert code_metrics.imports(ast.parse(src.read_text()), known) == {"dapo_jax.infra.metrics"}
  assert code_metrics.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"]]
  assert _role("dapo_jax.infra.metrics") == "infra" and _role("dapo_jax") == "root"
