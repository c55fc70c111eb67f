"""The docs still match the code: every command README.md, docs/*.md and bench/README.md name
parses, and every link between pages resolves.

A command is a line of a code block (fenced, or indented four spaces) or an inline code span
that starts with a program of this project (`dapo-*`, `python bench/X.py`, `python -m X`,
`bash launch/X.sh`, `sbatch ... launch/X.sbatch`, wrappers such as `nice -n 19` first). Nothing
runs: a `dapo-*` command goes through the command's own flag parser (`cli.parse`: the config
file loads with its variant, each `--config.x=y` names a key of it and converts); a bench script
through an argparse parser rebuilt from its `add_argument` calls; a launch script's own flags
are read from its `case` patterns, and what it hands to `dapo-train` is checked as above.
Inline spans are prose ("`dapo-eval --output`"), so only their flag names are checked. Shell
placeholders (`DIR`, `N`, `[--step N]`, `...`) are accepted where a value goes. A block that
shows a mistake on purpose is preceded by the line `<!-- docs-test: skip -->`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "bench/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
SKIP_MARK = "<!-- docs-test: skip -->"
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
# A value written as a placeholder: DIR, RUN_DIR, N, BUCKET, <path>.
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|<[^>]*>)$")
WRAPPERS = {"nice": 0, "flock": 1, "timeout": 1, "time": 0, "/usr/bin/time": 0, "exec": 0,
            "env": 0}
SEPARATORS = {"&&", "||", "|", ";", "&"}
# Launch scripts: how each hands its arguments on ("dapo-train": after its own flags, or after
# `--`, to dapo-train with the script's --config; "positional": CONFIG WORKDIR, then dapo-train
# overrides; a path: every argument to that script; None: not checked).
LAUNCH = {
    "launch/local_cpu.sh": ("rest", "configs/tiny_cpu.py"),
    "launch/tpu_vm.sh": ("after --", None),
    "launch/multinode_gpu.sh": ("after --", None),
    "launch/slurm_gpu.sbatch": ("positional", None),
    "launch/bench_accelerator.sh": ("bench/accelerator.py", None),
    "launch/test.sh": (None, None),  # pytest's arguments
}
# Bench scripts that hand (the rest of) their arguments to a dapo-* parser: (command, the
# --config they use when none is given).
BENCH_FORWARD = {
    "bench/continuous_memory.py": ("dapo-plan", "configs/dapo_qwen2_5_32b.py"),
    "bench/plan_compile_time.py": ("dapo-plan", "configs/dapo_qwen2_5_32b.py"),
    "bench/streaming_cpu_demo.py": ("dapo-train", "configs/tiny_cpu.py"),
}


@dataclasses.dataclass
class Command:
  file: str
  line: int
  text: str
  inline: bool

  def where(self) -> str:
    return f"{self.file}:{self.line}: `{self.text}`"


# --- finding the commands --------------------------------------------------------------------


def _tokens(text: str) -> list[str]:
  lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
  lex.whitespace_split = True
  lex.commenters = "#"
  try:
    return list(lex)
  except ValueError:  # an unbalanced quote in prose: plain words
    return text.split()


def _program_start(words: list[str]) -> list[str] | None:
  """``words`` from the program on (wrappers and VAR=value dropped), or None if the program is
  not one of this project's."""
  i = 0
  while i < len(words):
    w = words[i]
    if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w):
      i += 1
    elif w in WRAPPERS:
      i += 1
      while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] == "-n" else 1
      i += WRAPPERS[w]
    else:
      break
  rest = words[i:]
  if not rest:
    return None
  w = rest[0]
  if re.match(r"^dapo-(train|eval|plan|export|serve)$", w):
    return rest
  if w in ("python", "python3") and len(rest) > 1 and (
      rest[1] == "-m" or rest[1].endswith(".py")):
    return rest
  if w == "pytest" and len(rest) > 1:
    return rest
  if w in ("bash", "sbatch", "sh") and any(x.startswith("launch/") for x in rest[1:]):
    return rest
  if w.startswith(("launch/", "bench/")) and w.endswith((".sh", ".sbatch", ".py")):
    return rest
  return None


def _split(words: list[str]) -> list[list[str]]:
  """Commands of a shell line: split at && | ; &, redirections and their targets dropped."""
  out, cur, skip = [], [], False
  for w in words:
    if skip:
      skip = False
      continue
    if w in SEPARATORS:
      out.append(cur)
      cur = []
    elif w in (">", ">>", "<", ">&", "&>", "2>", "2>&"):
      skip = True
      if cur and cur[-1].isdigit():
        cur.pop()
    else:
      cur.append(w)
  out.append(cur)
  return [c for c in out if c]


def _clean(words: list[str]) -> list[str]:
  """Doc notation out: `...` dropped, `[--step N]` -> `--step N`."""
  out = []
  for w in words:
    if w in ("...", "[...]", "[", "]") or w.startswith("..."):
      continue
    if w.startswith("[-"):
      w = w[1:]
    if w.endswith("]") and w.count("[") < w.count("]"):
      w = w[:-1]
    out.append(w)
  return out


def _commands_of(text: str) -> list[list[str]]:
  found = []
  for words in _split(_tokens(text)):
    start = _program_start(words)
    if start:
      found.append(_clean(start))
  return found


def extract(rel: str, root: str = ROOT) -> list[tuple[Command, list[str]]]:
  """Every command of one page: (where it is, its words from the program on)."""
  lines = open(os.path.join(root, rel), encoding="utf-8").read().split("\n")
  out: list[tuple[Command, list[str]]] = []
  prose = list(lines)  # lines of code blocks blanked, for the inline spans
  fence, skip, i = None, False, 0
  while i < len(lines):
    line = lines[i]
    stripped = line.strip()
    if fence is None and re.match(r"^\s*(```|~~~)", line):
      fence = stripped[:3]
      # Shell blocks only: a diagram (```text) or Python (```python) is not a command line.
      skip = ((i > 0 and lines[i - 1].strip() == SKIP_MARK)
              or stripped[3:].strip() not in SHELL_LANGUAGES)
      prose[i] = ""
      i += 1
      continue
    if fence is not None:
      prose[i] = ""
      if stripped.startswith(fence):
        fence = None
        i += 1
        continue
    indented = (fence is None and line.startswith("    ") and i > 0
                and (not lines[i - 1].strip() or lines[i - 1].startswith("    "))
                and not re.match(r"^\s*([-*]|\d+\.)\s", line))
    if fence is not None or indented:
      start, text = i, stripped
      while text.endswith("\\") and i + 1 < len(lines):
        i += 1
        text = text[:-1] + " " + lines[i].strip()
        prose[i] = ""
      if indented:
        prose[start] = ""
      text = re.sub(r"^\$\s+", "", text)
      if not (fence is not None and skip):
        for words in _commands_of(text):
          out.append((Command(rel, start + 1, text, False), words))
    i += 1
  body = "\n".join(prose)
  for m in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", body):
    if "\n\n" in m.group(1):
      continue
    text = " ".join(m.group(1).split())
    lineno = body.count("\n", 0, m.start()) + 1
    if lineno > 1 and lines[lineno - 2].strip() == SKIP_MARK:
      continue
    for words in _commands_of(text):
      out.append((Command(rel, lineno, text, True), words))
  return out


# --- checking one command ----------------------------------------------------------------------


@functools.cache
def _entry_points() -> dict[str, str]:
  """dapo-* name -> module, from setup.py's console_scripts."""
  text = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
  return {name: module for name, module in re.findall(r'"(dapo-[a-z]+)=([\w.]+):\w+"', text)}


@functools.cache
def _entry(name: str):
  module = importlib.import_module(_entry_points()[name])
  source = open(module.__file__, encoding="utf-8").read()
  return module, "workdir_default" in source


def _own_flags(name: str):
  from absl import flags  # pylint: disable=g-import-not-at-top
  module, _ = _entry(name)
  fv = flags.FlagValues()
  module._define(fv)  # pylint: disable=protected-access
  return fv


def _normalize(args: list[str], fv) -> list[str]:
  """absl argv as `--name=value` (a flag's value may be the next word in the docs)."""
  out, i = [], 0
  while i < len(args):
    a = args[i]
    if a.startswith("--") and "=" not in a:
      name = a[2:]
      takes_value = name == "config" or (name in fv and not fv[name].boolean)
      if takes_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
        out.append(f"{a}={args[i + 1]}")
        i += 2
        continue
    out.append(a)
    i += 1
  return out


def _typed_dummy(value) -> str | None:
  if isinstance(value, bool):
    return "true"
  if isinstance(value, (int, float)):
    return str(value)
  return None


def _parse_entry(name: str, args: list[str], default_config: str | None = None):
  """`cli.parse` of a dapo-* command, placeholders replaced by values of the right type."""
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  module, workdir_default = _entry(name)
  fv = _own_flags(name)
  args = _normalize(args, fv)
  if default_config and not any(a.startswith("--config=") for a in args):
    args = [f"--config={default_config}"] + args
  default = (lambda argv: cli.WORKDIR_CONFIG) if workdir_default else None
  base = [a for a in args if a.startswith("--config=")]
  config = None
  out = []
  for a in args:
    key, eq, value = a.partition("=")
    if eq and PLACEHOLDER.match(value):
      if key.startswith("--config."):
        if config is None:
          config = cli.parse(name, module.__doc__, base, None, default).config
        node = config
        for part in key[len("--config."):].split("."):
          node = node.get(part) if hasattr(node, "get") else None
        value = _typed_dummy(node) or value
      elif key[2:] in fv:
        value = {"IntegerParser": "1", "FloatParser": "1.0"}.get(
            type(fv[key[2:]].parser).__name__, value)
      a = f"{key}={value}"
    out.append(a)
  with contextlib.redirect_stdout(io.StringIO()):
    try:
      return cli.parse(name, module.__doc__, out, module._define, default)  # pylint: disable=protected-access
    except SystemExit as e:  # --help
      if e.code not in (0, None):
        raise


def _config_of(name: str, args: list[str], default_config: str | None):
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  module, workdir_default = _entry(name)
  base = [a for a in _normalize(args, _own_flags(name)) if a.startswith("--config=")]
  if not base and default_config:
    base = [f"--config={default_config}"]
  default = (lambda argv: cli.WORKDIR_CONFIG) if workdir_default or not base else None
  return cli.parse(name, module.__doc__, base, None, default).config


def _check_names(name: str, args: list[str], default_config: str | None = None) -> None:
  """Inline spans: each flag a dapo-* command is shown with exists (config keys included)."""
  fv = _own_flags(name)
  config = None
  for a in args:
    if not a.startswith("--"):
      continue
    key = a[2:].split("=", 1)[0]
    if key.startswith("config."):
      if config is None:
        config = _config_of(name, args, default_config)
      node = config
      for part in key[len("config."):].split("."):
        if not hasattr(node, "keys") or part not in node.keys():
          raise ValueError(f"--{key}: {part!r} is not a config key")
        node = node[part]
    elif key not in fv and key not in ("config", "help", "helpfull") and not (
        key.startswith("no") and key[2:] in fv and fv[key[2:]].boolean):
      raise ValueError(f"--{key}: {name} has no such flag")


def _check_dapo(name: str, args: list[str], inline: bool, default_config=None) -> None:
  if inline:
    _check_names(name, args, default_config)
  else:
    _parse_entry(name, args, default_config)


def _literal(node):
  try:
    return ast.literal_eval(node)
  except ValueError:
    return None


def _placeholder_or(kind):
  def convert(value: str):
    return value if PLACEHOLDER.match(value) else kind(value)
  convert.__name__ = kind.__name__
  return convert


@functools.cache
def _script_parser(path: str):
  """(parser rebuilt from the script's add_argument calls or None, parse_known_args?, source).
  Flags a sibling module the script imports adds (bench/_demo_runs.py's shared ones) count."""
  source = open(os.path.join(ROOT, path), encoding="utf-8").read()
  for node in ast.walk(ast.parse(source)):
    for alias in node.names if isinstance(node, ast.Import) else []:
      sibling = os.path.join(ROOT, os.path.dirname(path), alias.name + ".py")
      if os.path.isfile(sibling):
        source += "\n" + open(sibling, encoding="utf-8").read()
  calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
           and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"]
  if not calls:
    return None, False, source
  parser = argparse.ArgumentParser(prog=path, exit_on_error=False, conflict_handler="resolve")
  for call in sorted(calls, key=lambda c: c.lineno):
    names = [_literal(a) for a in call.args]
    if not names or not all(isinstance(n, str) for n in names):
      continue
    kw = {}
    for k in call.keywords:
      if k.arg in ("nargs", "choices", "required", "dest", "const"):
        kw[k.arg] = _literal(k.value)
      elif k.arg == "action":
        if isinstance(k.value, ast.Constant):
          kw["action"] = k.value.value
        elif isinstance(k.value, ast.Attribute) and k.value.attr == "BooleanOptionalAction":
          kw["action"] = argparse.BooleanOptionalAction
      elif k.arg == "type" and isinstance(k.value, ast.Name) and k.value.id in ("int", "float"):
        kw["type"] = _placeholder_or({"int": int, "float": float}[k.value.id])
    kw = {k: v for k, v in kw.items() if v is not None}
    parser.add_argument(*names, **kw)
  return parser, "parse_known_args" in source, source


def _check_script(path: str, args: list[str], inline: bool) -> None:
  if not os.path.isfile(os.path.join(ROOT, path)):
    raise ValueError(f"{path}: no such file")
  parser, known, source = _script_parser(path)
  if parser is None:
    for a in args:
      if a.startswith("-") and a.split("=")[0] not in source:
        raise ValueError(f"{path} reads no flag {a}")
    forward = BENCH_FORWARD.get(path)
    if forward and args:
      _check_dapo(forward[0], [a for a in args if a.split("=")[0] not in source or
                               a.startswith("--config")], inline, forward[1])
    return
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      if known or path in BENCH_FORWARD:
        _, rest = parser.parse_known_args(args)
      else:
        parser.parse_args(args)
        rest = []
  except (argparse.ArgumentError, SystemExit) as e:
    if isinstance(e, SystemExit) and e.code in (0, None):
      return
    message = err.getvalue() or str(e)
    if inline and ("arguments are required" in message or "expected one argument" in message):
      return  # prose names a flag without its value
    raise ValueError(f"{path}: {message.strip().splitlines()[-1]}") from None
  if rest and path in BENCH_FORWARD:
    name, config = BENCH_FORWARD[path]
    _check_names(name, rest, config)  # a forwarded part need not be a whole command


def _case_flags(path: str) -> set[str]:
  """The options a shell script's `case` patterns accept (`--name)`, `-h|--help)`)."""
  text = open(os.path.join(ROOT, path), encoding="utf-8").read()
  flags = set()
  for pattern in re.findall(r"^\s*((?:-[\w-]+(?:=\*)?\|?)+)\)", text, re.M):
    flags.update(p.replace("=*", "") for p in pattern.split("|") if p)
  return flags


def _check_launch(path: str, args: list[str], inline: bool) -> None:
  if not os.path.isfile(os.path.join(ROOT, path)):
    raise ValueError(f"{path}: no such file")
  mode, config = LAUNCH.get(path, ("after --", None))
  if mode is None:
    return
  if mode.endswith(".py"):
    _check_script(mode, args, inline)
    return
  if mode == "positional":
    if inline and len(args) < 2:
      return
    if len(args) < 2 or args[0].startswith("-"):
      raise ValueError(f"{path} takes CONFIG WORKDIR first")
    _check_dapo("dapo-train", [f"--config={args[0]}", "--workdir=W"] + args[2:], inline)
    return
  own = _case_flags(path)
  i, rest, config_arg = 0, [], config
  while i < len(args):
    a = args[i]
    if a == "--" and mode == "after --":
      rest = args[i + 1:]
      break
    name = a.split("=", 1)[0]
    if a.startswith("-") and name in own:
      takes_value = "=" not in a and i + 1 < len(args) and not args[i + 1].startswith("-")
      if name == "--config":
        config_arg = a.split("=", 1)[1] if "=" in a else args[i + 1]
      i += 2 if takes_value else 1
    elif mode == "rest":
      rest.append(a)
      i += 1
    else:
      raise ValueError(f"{path}: no option {a} (its options: {', '.join(sorted(own))})")
  if config_arg and not os.path.isfile(os.path.join(ROOT, config_arg.split(":")[0])):
    raise ValueError(f"{path}: --config {config_arg}: no such config file")
  if rest or (config_arg and not inline):
    base = [f"--config={config_arg}"] if config_arg else []
    _check_dapo("dapo-train", base + ["--workdir=W"] + rest, inline or not config_arg)


def check(words: list[str], inline: bool) -> None:
  """Raises with a one-line reason if the command ``words`` does not parse."""
  program, args = words[0], words[1:]
  if program.startswith("dapo-"):
    if program not in _entry_points():
      raise ValueError(f"{program}: no such command in setup.py")
    if args or not inline:
      _check_dapo(program, args, inline)
    return
  if program in ("python", "python3"):
    if args[0] == "-m":
      module, args = args[1], args[2:]
      by_module = {m: n for n, m in _entry_points().items()}
      if module in by_module:
        return check([by_module[module]] + args, inline)
      if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ValueError(f"python -m {module}: no such module")
      if module == "pytest":
        return check(["pytest"] + args, inline)
      return
    return _check_script(args[0], args[1:], inline)
  if program == "pytest":
    for a in args:
      if not a.startswith("-") and (a.startswith("tests") or a.endswith(".py")):
        if not os.path.exists(os.path.join(ROOT, a.split("::")[0])):
          raise ValueError(f"{a}: no such test file")
    return
  if program in ("bash", "sh", "sbatch"):
    while args and args[0].startswith("-"):
      args = args[1:]
    program, args = args[0], args[1:]
  if program.startswith("bench/"):
    return _check_script(program, args, inline)
  return _check_launch(program, args, inline)


def _all_commands():
  return [c for rel in DOCS for c in extract(rel)]


def test_the_pages_name_commands():
  """The extractor finds the commands it must (a regression here would pass every check)."""
  found = {(c.file, " ".join(w[:2])) for c, w in _all_commands()}
  for expected in [("README.md", "bash launch/local_cpu.sh"), ("README.md", "bash launch/test.sh"),
                   ("README.md", "dapo-export --workdir"), ("bench/README.md",
                                                            "python bench/table1_cpu.py")]:
    assert expected in found, expected
  ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
  assert "bash launch/test.sh" in ci  # CI runs the README's test command


def test_bench_readme_lists_every_script():
  text = open(os.path.join(ROOT, "bench", "README.md"), encoding="utf-8").read()
  missing = [f for f in sorted(os.listdir(os.path.join(ROOT, "bench")))
             if f.endswith(".py") and not f.startswith("_") and f"`{f}`" not in text]
  assert not missing, f"bench/README.md does not list {missing}: add what each measures"


def test_every_command_in_the_docs_parses():
  failures = []
  for cmd, words in _all_commands():
    try:
      check(words, cmd.inline)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"{cmd.where()}\n    {type(e).__name__}: {' '.join(str(e).split())[:300]}")
  assert not failures, f"{len(failures)} command(s) in the docs do not parse:\n" + "\n".join(
      failures)


@pytest.mark.parametrize("words,inline", [
    (["dapo-train", "--config", "configs/tiny_cpu.py", "--workdir", "W",
      "--config.optim.lrr=1e-5"], False),  # a misspelt key
    (["dapo-eval", "--workdri", "RUN_DIR"], True),  # a misspelt flag, even in prose
    (["dapo-train", "--config", "configs/tiny_gpu.py", "--workdir", "W"], False),
    (["python", "bench/table1_cpu.py", "--max_runz", "3"], False),
    (["python", "bench/no_such_bench.py"], False),
    (["python", "-m", "pytest", "tests/test_no_such_thing.py"], True),
    (["bash", "launch/tpu_vm.sh", "--name", "x", "--config.optim.lr=1e-6"], False),
    (["sbatch", "launch/slurm_gpu.sbatch", "configs/tiny_cpu.py", "W",
      "--config.rollout.nn=4"], False),
])
def test_the_check_catches_a_broken_command(words, inline):
  with pytest.raises(Exception):
    check(words, inline)


def test_commands_are_found_in_blocks_spans_and_wrappers(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
      "Run `nice -n 19 python bench/faults.py --out\nDIR` first.\n\n"
      "```bash\nXLA_FLAGS=x dapo-plan --config configs/tiny_cpu.py \\\n    --target cpu:8"
      "   # note\npip install x\n```\n\n"
      f"{SKIP_MARK}\n```\ndapo-train --bogus\n```\n")
  got = [(c.line, c.inline, w) for c, w in extract("page.md", str(tmp_path))]
  assert got == [
      (5, False, ["dapo-plan", "--config", "configs/tiny_cpu.py", "--target", "cpu:8"]),
      (1, True, ["python", "bench/faults.py", "--out", "DIR"]),
  ]


# --- links -----------------------------------------------------------------------------------


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading."""
  text = re.sub(r"[`*_]", lambda m: "_" if m.group(0) == "_" else "", heading.strip().lower())
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


@functools.cache
def _anchors(path: str) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  fence = False
  for line in open(path, encoding="utf-8"):
    if line.lstrip().startswith("```"):
      fence = not fence
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m and not fence:
      slug = _slug(m.group(1))
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      anchors.add(slug if n == 0 else f"{slug}-{n}")
  return anchors


def test_links_between_pages_resolve():
  failures = []
  for rel in DOCS:
    text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
      target = m.group(1)
      if re.match(r"^[a-z]+:", target):
        continue
      path, _, anchor = target.partition("#")
      lineno = text.count("\n", 0, m.start()) + 1
      full = os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), path)) if path else \
          os.path.join(ROOT, rel)
      if not os.path.exists(full):
        failures.append(f"{rel}:{lineno}: ({target}): no such file")
      elif anchor and full.endswith(".md") and anchor not in _anchors(full):
        failures.append(f"{rel}:{lineno}: ({target}): no heading #{anchor} in "
                        f"{os.path.relpath(full, ROOT)}")
  assert not failures, "broken links:\n" + "\n".join(failures)
