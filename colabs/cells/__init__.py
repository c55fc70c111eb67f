"""Cell sources of the colabs, one module per notebook; `../build_notebooks.py` writes the .ipynb.

Each module defines `TITLE` (markdown after the badge) and `CELLS`: `("md" | "code", source)` or
`("code", source, tags)`. The builder prepends the Open-in-Colab badge and the install cell.
Notebooks import `dapo_jax` and call what the CLI calls; they never copy library code.
"""

NAMES = ("dapo_objective", "train_tiny_dapo", "restore_and_sample")
