"""Size and shape of the package: what a newcomer has to take in (docs/architecture.md).

  python bench/code_metrics.py [--json out.json] [--root DIR]

Prints, for the ``dapo_jax`` package under ``--root`` (default: this checkout): modules and
lines, files over 400 lines, the functions that take the whole run config (a parameter
annotated ``ConfigDict`` or named ``config`` without another annotation) per file, import
cycles between modules (function-level imports included, ``TYPE_CHECKING`` ones not), the
longest function, and the README's length. Reads the sources with `ast`; imports nothing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LONG_FILE = 400


def modules(pkg: pathlib.Path) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module under ``pkg`` (a package is its __init__)."""
  out = {}
  for path in sorted(pkg.rglob("*.py")):
    name = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
    out[name.removesuffix(".__init__")] = path
  return out


def _takes_config(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
  a = fn.args
  for arg in a.posonlyargs + a.args + a.kwonlyargs:
    ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    if "ConfigDict" in ann or (arg.arg == "config" and not ann):
      return True
  return False


def imports(tree: ast.AST, known: set[str]) -> set[str]:
  """dapo_jax modules ``tree`` imports at run time, at any depth (a function-level import is
  still a dependency); ``if TYPE_CHECKING:`` blocks are left out (they never run)."""
  skip = {id(n) for node in ast.walk(tree)
          if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
          for stmt in node.body for n in ast.walk(stmt)}
  found = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dapo_jax"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if sub in known else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("dapo_jax"))
  return found & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Import cycles of ``graph`` (module -> the modules it imports), each as a path back."""
  state: dict[str, int] = {}
  out = []

  def visit(m, stack):
    state[m] = 1
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        out.append(stack[stack.index(d):] + [d])
      elif d not in state:
        visit(d, stack + [d])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  return out


def measure(root: pathlib.Path) -> dict:
  pkg = root / "dapo_jax"
  mods = modules(pkg)
  known = set(mods)
  lines, config_fns, graph = {}, collections.Counter(), {}
  longest = ("", 0)
  for name, path in mods.items():
    text = path.read_text()
    tree = ast.parse(text)
    rel = str(path.relative_to(root))
    lines[rel] = len(text.splitlines())
    graph[name] = imports(tree, known) - {name}
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if _takes_config(node):
          config_fns[rel] += 1
        n = node.end_lineno - node.lineno + 1
        if n > longest[1]:
          longest = (f"{rel}:{node.name}", n)
  readme = root / "README.md"
  return {
      "modules": len(mods),
      "lines": sum(lines.values()),
      "modules_at_package_root": sorted(
          str(p.relative_to(root)) for p in pkg.glob("*.py") if p.name != "__init__.py"),
      "files_over_400_lines": {f: n for f, n in sorted(lines.items(), key=lambda x: -x[1])
                               if n > LONG_FILE},
      "functions_taking_the_config": sum(config_fns.values()),
      "functions_taking_the_config_by_file": dict(config_fns.most_common()),
      "import_cycles": [" -> ".join(c) for c in cycles(graph)],
      "longest_function": {"name": longest[0], "lines": longest[1]},
      "readme_lines": len(readme.read_text().splitlines()) if readme.exists() else None,
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--root", default=str(ROOT), help="a checkout of dapo_jax")
  ap.add_argument("--json", help="also write the figures here")
  args = ap.parse_args()
  m = measure(pathlib.Path(args.root))
  print(f"{m['modules']} modules, {m['lines']:,} lines; README {m['readme_lines']} lines")
  print(f"modules at the package root: {', '.join(m['modules_at_package_root'])}")
  print(f"files over {LONG_FILE} lines: {len(m['files_over_400_lines'])}")
  for f, n in m["files_over_400_lines"].items():
    print(f"  {n:5d}  {f}")
  print(f"functions taking the run config: {m['functions_taking_the_config']}")
  for f, n in m["functions_taking_the_config_by_file"].items():
    print(f"  {n:3d}  {f}")
  print(f"import cycles: {len(m['import_cycles'])}")
  for c in m["import_cycles"]:
    print(f"  {c}")
  print(f"longest function: {m['longest_function']['name']} "
        f"({m['longest_function']['lines']} lines)")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(m, indent=2) + "\n")


if __name__ == "__main__":
  main()
