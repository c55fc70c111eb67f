"""Reading compiled HLO text in tests."""

from __future__ import annotations

import re

import numpy as np


def big_copies(hlo: str, min_elems: int) -> list[str]:
  """The `copy` and `transpose` instructions of `hlo` whose result holds >= `min_elems`
  elements (e.g. a whole KV-cache layer)."""
  return [m.group(0) for m in re.finditer(r"\w+\[([\d,]+)\]\{[^}]*\} (transpose|copy)\(", hlo)
          if np.prod([int(d) for d in m.group(1).split(",")]) >= min_elems]
