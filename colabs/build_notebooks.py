"""Writes colabs/*.ipynb from their cell sources in colabs/cells/, outputs stripped.

    python colabs/build_notebooks.py           # (re)write the three notebooks
    python colabs/build_notebooks.py --check   # exit 1 if a committed notebook differs

The .ipynb files are what Colab opens and what is committed; this script keeps them reviewable
as code. Edit `cells/NAME.py` and rebuild (a notebook edited in Jupyter drifts from its source:
port the change back, then rebuild; `tests/test_colabs.py` checks they agree).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cells  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position
from cells import common  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def build(name: str) -> nbformat.NotebookNode:
  """The notebook `name` (no suffix): badge, install cell, then its cells; no outputs."""
  module = importlib.import_module(f"cells.{name}")
  title = module.TITLE.strip() + "\n\n" + module.RUNS_ON.strip()
  cell_list = [("md", common.badge(name) + "\n\n" + title),
               ("code", common.INSTALL)] + module.CELLS
  nb = nbformat.v4.new_notebook()
  nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"},
                 "colab": {"provenance": [], "toc_visible": True}}
  for i, cell in enumerate(cell_list):
    kind, source = cell[0], cell[1].strip("\n")
    tags = cell[2] if len(cell) > 2 else ()
    new = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
    c = new(source)
    c.id = f"cell-{i:02d}"  # stable ids: a rebuild changes nothing it need not
    if tags:
      c.metadata["tags"] = list(tags)
    nb.cells.append(c)
  nbformat.validate(nb)
  return nb


def path_of(name: str) -> str:
  return os.path.join(HERE, f"{name}.ipynb")


def render(name: str) -> str:
  return nbformat.writes(build(name)) + "\n"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--check", action="store_true", help="Only compare with the committed files.")
  args = p.parse_args(argv)
  stale = []
  for name in cells.NAMES:
    text, path = render(name), path_of(name)
    if args.check:
      current = open(path, encoding="utf-8").read() if os.path.exists(path) else None
      if current != text:
        stale.append(path)
    else:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
      print(f"wrote {os.path.relpath(path)}")
  if stale:
    print("Out of date (run python colabs/build_notebooks.py): " + ", ".join(stale))
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
