"""Generated hostile model answers for the verifier fuzz (issue #8, item 2).

`hostile_answers(n, seed, canary_path)` draws `n` distinct responses from the families below:
power towers, huge factorials and sums, deep nesting, megabyte lines, unicode and control
characters, TeX macros that expand exponentially, regex-hostile text, random LaTeX token soup,
and canaries that create `canary_path` if anything evaluates them (Python, shell or TeX).
Most families are cheap for SymPy; the expensive ones (towers, factorials, deep nesting in the
tail) are a few percent, so 10,000 answers fit a CI run while every deadline path is exercised.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

# LaTeX and plain-math tokens the policy could emit; the soup family strings them at random.
_TOKENS = ("\\frac", "{", "}", "{", "}", "^", "_", "\\sqrt", "(", ")", "[", "]", "\\left(",
           "\\right)", "\\right.", "x", "y", "n", "\\pi", "e", "i", "\\infty", "=", ",", "+", "-",
           "*", "/", "!", "\\cdot", "\\times", "\\cup", "\\cap", "\\in", "\\le", "\\ne", "\\{",
           "\\}", "\\sin", "\\log", "\\ln", "\\exp", "\\binom", "\\sum", "\\int", "\\lim",
           "\\text{", "\\mathrm{", "\\boxed{", "$", "%", "\\%", "&", "\\\\", "\\begin{matrix}",
           "\\end{matrix}", "\\dfrac", "\\overline", "\\circ", "\\degree", "\\approx", ".", "0",
           "1", "2", "7", "9", "10", "99", "1000", "0.5", "3.14", "1e9", "-1")

# Python and shell payloads; each creates the file at {p} when evaluated or run.
_PY_CANARIES = (
    "__import__('os').system('touch {p}')",
    "__import__(\"os\").system(\"touch {p}\")",
    "open('{p}', 'w').write('x')",
    "exec(\"open('{p}', 'w')\")",
    "eval(\"open('{p}', 'w')\")",
    "(lambda: __import__('pathlib').Path('{p}').touch())()",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0]"
    "(['touch', '{p}'])",
    "getattr(__builtins__, 'open', None)('{p}', 'w') if not isinstance(__builtins__, dict) else "
    "__builtins__['open']('{p}', 'w')",
)
_SHELL_CANARIES = ("$(touch {p})", "`touch {p}`", "; touch {p}", "| touch {p}")
_TEX_CANARIES = ("\\immediate\\write18{{touch {p}}}", "\\input{{|touch {p}}}",
                 "\\openout1={p}\\write1{{x}}\\closeout1")
# Wrappers: where a canary sits in the response.
_CANARY_FORMS = ("Answer: {c}", "Answer: ${c}$", "\\boxed{{{c}}}", "Answer: \\text{{{c}}}",
                 "Answer: \\boxed{{{c}}}", "Answer: \\({c}\\)", "Answer: x = {c}")


def python_canaries(path: str) -> list[str]:
  return [c.format(p=path) for c in _PY_CANARIES]


def shell_canaries(path: str) -> list[str]:
  return [c.format(p=path) for c in _SHELL_CANARIES]


def _power_tower(rng: random.Random, _: str) -> str:
  depth, base = rng.randint(3, 6), rng.randint(2, 99)
  if rng.random() < 0.2:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(20, 200)))
    return "Answer: " + rng.choice((f"{digits}^{{{digits[:6]}}}", f"10^{{-{digits[:15]}}}",
                                    f"2^{{2^{{{rng.randint(20, 60)}}}}}"))
  if rng.random() < 0.5:
    return "Answer: " + "^".join(str(rng.choice((base, 9, 10))) for _ in range(depth))
  s = str(base)
  for _ in range(depth):
    s = f"{rng.randint(2, 99)}^{{{s}}}"
  return rng.choice(("Answer: ${}$", "\\boxed{{{}}}", "Answer: {}")).format(s)


def _factorial(rng: random.Random, _: str) -> str:
  n = rng.randint(10**4, 10**12)
  return "Answer: " + rng.choice((f"{n}!", f"({n})!", f"\\Gamma({n})", f"{n}!!",
                                  f"\\binom{{{n}}}{{{n // 3}}}", f"\\sum_{{k=1}}^{{{n}}} k^k",
                                  f"\\prod_{{k=1}}^{{{n}}} k", f"{n}^{{{n}}}"))


def _nesting(rng: random.Random, _: str) -> str:
  depth = rng.choice((rng.randint(2, 40), rng.randint(40, 5000)))
  opener, closer = rng.choice((("{", "}"), ("(", ")"), ("\\frac{1}{", "}"), ("\\sqrt{", "}"),
                               ("\\left(", "\\right)"), ("[", "]"), ("x^{", "}")))
  closing = closer * depth if rng.random() < 0.8 else closer * rng.randint(0, depth)
  return f"Answer: ${opener * depth}1{closing}$"


def _megabyte(rng: random.Random, canary: str) -> str:
  filler = rng.choice(("9^", "{", "x" * 63 + "\n", "\\frac{", "Answer: 1\n", "\x00", "\u202e"))
  body = filler * (2**20 // len(filler))
  tail = rng.choice(("", f"\nAnswer: {rng.randint(0, 10**6)}", "\nAnswer: 9^9^9^9",
                     "\\boxed{" + "1" * rng.randint(1, 400) + "}",
                     "\nAnswer: " + python_canaries(canary)[0]))
  return body + tail


def _unicode(rng: random.Random, _: str) -> str:
  def char():
    r = rng.random()
    if r < 0.3:
      return chr(rng.randint(0, 0x1F))  # control characters, NUL included
    if r < 0.4:
      return chr(rng.choice((0x7F, 0x85, 0x200B, 0x200E, 0x202E, 0x2066, 0xFEFF, 0xFFFD)))
    if r < 0.45:
      return chr(rng.randint(0xD800, 0xDFFF))  # lone surrogates: not even encodable
    if r < 0.55:
      return chr(rng.randint(0x300, 0x36F))  # combining marks
    return chr(rng.randint(0x20, 0x10FFFF))
  text = "".join(char() for _ in range(rng.randint(1, 120)))
  return rng.choice(("Answer: {}", "Answer: ${}$", "\\boxed{{{}}}", "{}\nAnswer: 5")).format(text)


def _tex_macros(rng: random.Random, _: str) -> str:
  levels = rng.randint(5, 30)
  defs = "\\def\\a0{xx}" + "".join(f"\\def\\a{i}{{\\a{i - 1}\\a{i - 1}}}" for i in
                                     range(1, levels))
  form = rng.choice((
      f"Answer: ${defs}\\a{levels - 1}$",
      "Answer: \\newcommand{\\b}[1]{#1#1}" + "\\b{" * levels + "1" + "}" * levels,
      f"Answer: \\expandafter\\csname a{levels}\\endcsname",
      "Answer: \\input{/etc/passwd}", "Answer: \\include{/dev/zero}",
      f"Answer: \\begin{{pmatrix}}{'&'.join(['1'] * levels)}\\\\" * 3 + "\\end{pmatrix}",
      f"Answer: \\det\\begin{{pmatrix}}{' & '.join(str(rng.randint(0, 9)) for _ in range(9))}"
      "\\end{pmatrix}"))
  return form


def _numbers(rng: random.Random, _: str) -> str:
  digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(50, 290)))
  return "Answer: " + rng.choice((
      digits, f"0.{digits}", f"1e{rng.randint(10**5, 10**9)}", f"-{digits}",
      f"{digits[:30]}.{digits[30:60]}\\%", f"\\frac{{{digits[:40]}}}{{0}}", "0^0", "nan",
      f"\\infty - {digits[:9]}", f"{rng.randint(0, 9)},{digits[:3]},{digits[3:6]}",
      f"\\sqrt{{-{digits[:12]}}}", f"{digits[:9]} \\text{{{digits[9:20]}}}"))


def _regex_hostile(rng: random.Random, _: str) -> str:
  n = rng.randint(10, 200)
  return rng.choice((
      "Answer: " + "$" * n, "Answer: " * n, "Answer: \\boxed{" * n, "\\text{" * n + "1",
      "Answer: " + "frac" * n, "Answer: " + "sqrt" * n, "Answer: " + "=" * n + "5",
      "Answer: " + "\\ " * n, "Answer: " + "$1$" * n, "Answer:" + " " * n + "\n" * n,
      "Answer: " + "a " * n + "units", "Answer: " + "{,}" * n))


def _canary(rng: random.Random, canary: str) -> str:
  payload = rng.choice(python_canaries(canary) + shell_canaries(canary)
                       + [c.format(p=canary) for c in _TEX_CANARIES])
  # A reasoning line in front keeps the draws distinct; the canary stays in the tail.
  return f"Step {rng.randint(0, 10**9)}.\n" + rng.choice(_CANARY_FORMS).format(c=payload)


def _soup(rng: random.Random, _: str) -> str:
  text = " ".join(rng.choice(_TOKENS) for _ in range(rng.randint(1, 60)))
  return rng.choice(("Answer: {}", "Answer: ${}$", "\\boxed{{{}}}", "so \\boxed{{{}}} done",
                     "Answer: \\({}\\)")).format(text)


# (family, weight): weights are per 1,000 answers.
FAMILIES: tuple[tuple[Callable[[random.Random, str], str], int], ...] = (
    (_power_tower, 8), (_factorial, 5), (_nesting, 30), (_megabyte, 10), (_unicode, 200),
    (_tex_macros, 50), (_numbers, 100), (_regex_hostile, 100), (_canary, 150), (_soup, 347),
)


def hostile_answers(n: int, seed: int, canary_path: str) -> Iterator[tuple[str, str]]:
  """`n` distinct (family name, response) pairs, deterministic in `seed`; made lazily, so
  megabyte answers do not pile up in memory."""
  rng = random.Random(seed)
  fams = [f for f, w in FAMILIES for _ in range(w)]
  seen: set[int] = set()
  while len(seen) < n:
    fam = rng.choice(fams)
    text = fam(rng, canary_path)
    key = hash(text)
    if key not in seen:
      seen.add(key)
      yield fam.__name__.lstrip("_"), text
