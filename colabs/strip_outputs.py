"""Strips outputs, execution counts and run metadata from notebooks, in place (nbstripout-like).

    python colabs/strip_outputs.py                 # every colabs/*.ipynb
    python colabs/strip_outputs.py NB.ipynb ...    # these files
    python colabs/strip_outputs.py --check         # exit 1, listing them, if any is not stripped

Committed notebooks carry no outputs: diffs stay reviewable and no stale numbers or images ship.
Kept: cell sources, ids and tags, and the notebook's kernelspec and Colab settings.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
# Cell metadata an editor or an execution adds (nbclient timings, Colab output ids, UI state).
_KEEP_CELL_METADATA = ("tags",)
_KEEP_NB_METADATA = ("kernelspec", "language_info", "colab")


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """Returns `nb` without outputs, execution counts and volatile metadata (modified in place)."""
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs = []
      cell.execution_count = None
    cell.metadata = {k: v for k, v in cell.metadata.items() if k in _KEEP_CELL_METADATA}
  nb.metadata = {k: v for k, v in nb.metadata.items() if k in _KEEP_NB_METADATA}
  if "language_info" in nb.metadata:  # Jupyter records the Python version here: drop it
    nb.metadata["language_info"] = {"name": nb.metadata["language_info"].get("name", "python")}
  return nb


def is_stripped(path: str) -> bool:
  nb = nbformat.read(path, as_version=4)
  return nbformat.writes(strip(nbformat.read(path, as_version=4))) == nbformat.writes(nb)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("paths", nargs="*", help="Notebooks (default: colabs/*.ipynb).")
  p.add_argument("--check", action="store_true", help="Only report; change nothing.")
  args = p.parse_args(argv)
  paths = args.paths or sorted(glob.glob(os.path.join(HERE, "*.ipynb")))
  dirty = [path for path in paths if not is_stripped(path)]
  if args.check:
    for path in dirty:
      print(f"not stripped: {path} (run python colabs/strip_outputs.py {path})")
    return 1 if dirty else 0
  for path in dirty:
    nb = strip(nbformat.read(path, as_version=4))
    with open(path, "w", encoding="utf-8") as f:
      f.write(nbformat.writes(nb) + "\n")
    print(f"stripped {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
