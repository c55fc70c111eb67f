"""The one override syntax of every command: ``--config path[:arg] --config.x=y`` (as dapo-train).

``dapo-eval``, ``dapo-serve``, ``dapo-export`` and ``dapo-plan`` parse their flags here, each
into a fresh ``absl.flags.FlagValues`` (so tests call ``main(argv)`` in one process). Without
``--config``, the config is this file's ``get_config``: a training workdir's saved
``config.json`` (``--workdir``), else the schema defaults in float32.

This file is also loaded by path as a config file (``config_flags`` runs its ``get_config``),
so it imports only light modules and defines no flags at import.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import sys
from typing import Callable, Iterator, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from dapo_jax.infra import run_files
from dapo_jax.spec import run_config

WORKDIR_CONFIG = os.path.abspath(__file__)


class MeshParser(flags.ArgumentParser):
  """``--config.mesh=fsdp=-1,tensor=8`` or a Python literal ``[("fsdp", -1), ("tensor", 8)]``.

  Registered for list-typed config fields (``mesh``, ``rollout_mesh``), which config_flags
  cannot override on its own.
  """

  def parse(self, argument):
    if not isinstance(argument, str):
      return list(argument)
    text = argument.strip()
    if not text or text[0] in "[(":
      value = ast.literal_eval(text or "[]")
      return [tuple(v) if isinstance(v, list) else v for v in value]
    out = []
    for part in filter(None, text.split(",")):
      name, sep, size = part.partition("=")
      if not sep:
        raise ValueError(f"{argument!r}: write axis=size pairs, e.g. fsdp=-1,tensor=8.")
      out.append((name.strip(), int(size)))
    return out

  def flag_type(self):
    return "mesh"


config_flags.register_flag_parser_for_type(list, MeshParser())
_CONFIG_DICT_FILE = os.path.abspath(ml_collections.ConfigDict.__getattr__.__code__.co_filename)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """A dapo-train workdir's saved config (``arg`` = the workdir), else the schema defaults.

  The defaults run in float32 (the paper config's bfloat16 is one override away:
  ``--config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16``).
  """
  from dapo_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  if not arg:
    c = config_lib.default_config()
    c.model.param_dtype = c.model.dtype = "float32"
    c.model.remat = "none"
    return c
  path = run_files.resolve(arg) / run_files.CONFIG_FILE
  # A storage outage is waited out (one warning), as dapo-train's launch waits, for the default
  # checkpoint.storage_wait_s (the run's own setting is in the file being read).
  text = run_files.retry_transient(
      lambda: path.read_text() if path.exists() else None, what=f"--workdir {arg}",
      timeout_s=config_lib.default_config().checkpoint.storage_wait_s)
  if text is None:
    if run_files.is_remote(path):
      run_config.check_bucket(path.parent)  # "no such bucket" rather than "not a workdir"
    raise FileNotFoundError(f"{path} not found: is {arg} a dapo-train workdir? Pass --config "
                            "with the config file the run used.")
  return ml_collections.ConfigDict(json.loads(text))


def expand_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Expands "~" in every path leaf of ``config`` (in place; also returned)."""
  for field in run_config.PATH_FIELDS:
    *parents, leaf = field.split(".")
    node = config
    for name in parents:
      node = node.get(name) if node is not None else None
    if node is not None and isinstance(node.get(leaf), str):
      node[leaf] = os.path.expanduser(node[leaf])
  return config


def expand(path: str | None) -> str | None:
  """A path flag as the commands use it (``run_files.resolve``: ``~`` expanded, local made
  absolute, ``gs://`` kept)."""
  return None if path is None else os.fspath(run_files.resolve(path))


def _has_config(argv: Sequence[str]) -> bool:
  return any(a in ("--config", "-config") or a.startswith(("--config=", "-config="))
             for a in argv)


def parse(prog: str, doc: str, argv: Sequence[str],
          define: Callable[[flags.FlagValues], None] | None = None,
          default_config: Callable[[list[str]], str] | None = None) -> flags.FlagValues:
  """Parses ``argv`` (without the program name) into fresh flags; ``--help`` prints the usage.

  ``define(fv)`` adds the command's own flags; ``default_config(argv)`` gives the ``--config``
  value used when none is passed (None: ``--config`` is required).
  """
  argv = [prog] + list(argv)
  fv = flags.FlagValues()
  if define is not None:
    define(fv)
  if not _has_config(argv) and default_config is not None:
    argv.insert(1, f"--config={default_config(argv)}")
  config_flags.DEFINE_config_file(
      "config", None, "Config file, path[:arg] (as dapo-train); override leaves with "
      "--config.x=y, e.g. --config.model.dtype=bfloat16 --config.mesh=data=-1,tensor=8.",
      flag_values=fv, lock_config=True, sys_argv=argv)
  if any(a in ("--help", "-h", "--helpfull", "-help") for a in argv[1:]):
    print(usage(doc, fv))
    raise SystemExit(0)
  if not _has_config(argv):
    raise flags.Error("--config is required, e.g. --config configs/dapo_qwen2_5_32b.py.")
  rest = _parse_flags(fv, argv)
  if len(rest) > 1:
    raise flags.Error(f"unexpected arguments {rest[1:]}; flags are written --name=value.")
  try:
    expand_paths(fv.config)
  except OSError as e:  # config_flags defers a get_config failure to first use; raise its cause
    raise (e.__cause__ or e) from None
  return fv


def _config_value(argv: Sequence[str]) -> str:
  """The ``--config`` argument (``path[:arg]``) as written on the command line."""
  for i, a in enumerate(argv):
    if a.startswith(("--config=", "-config=")):
      return a.split("=", 1)[1]
    if a in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def _raised_in(e: BaseException, filename: str) -> bool:
  """Whether a frame of ``e``'s traceback (or of an exception it was raised from) ran code of
  ``filename``."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if getattr(e, "filename", None) and os.path.abspath(e.filename) == filename:  # SyntaxError
      return True
    tb = e.__traceback__
    while tb is not None:
      if os.path.abspath(tb.tb_frame.f_code.co_filename) == filename:
        return True
      tb = tb.tb_next
    e = e.__cause__ or e.__context__
  return False


def _root(e: BaseException) -> BaseException:
  """The first exception of the chain: config_flags re-raises a get_config error as a new one
  whose message is the whole formatted traceback."""
  seen = set()
  while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return e


def _unknown_key(e: LookupError | AttributeError, argv: Sequence[str]) -> flags.Error:
  """ml_collections' KeyError for an override of a missing field, as one readable line.

  Its message is ``"'key'\\nDid you mean \"other\" instead of \"key\"?"``, wrapped in an
  AttributeError, so the str() a user sees is an escaped repr.
  """
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  first, _, rest = str(e.args[0] if e.args else e).partition("\n")
  key = first.strip("'\" ")
  close = re.search(r'Did you mean "([^"]+)"', rest)
  for a in argv:
    name = a.split("=", 1)[0].lstrip("-")
    parts = name.split(".")
    if parts[0] == "config" and key in parts[1:]:
      hint = ""
      if close:
        fixed = parts[:parts.index(key, 1)] + [close.group(1)]
        hint = f" Did you mean --{'.'.join(fixed)}?"
      return flags.Error(f"--{name}: unknown config key {key!r}.{hint} dapo_jax/config.py "
                         "lists every key.")
  hint = f" Did you mean {close.group(1)!r}?" if close else ""
  return flags.Error(f"unknown config key {key!r}.{hint}")


def _parse_flags(fv: flags.FlagValues, argv: list[str]) -> list[str]:
  """``fv(argv)`` with the user mistakes config_flags lets through raised as one-line
  `flags.Error`s: a missing config file, a config file that fails to load, an override of a
  key the config lacks. Anything else propagates unchanged."""
  value = _config_value(argv)
  path = os.path.abspath(os.path.expanduser(value.split(":", 1)[0]))
  if value and not os.path.isfile(path):
    raise flags.Error(f"--config={value}: no such config file {path} (the configs are in "
                      "configs/, e.g. configs/tiny_cpu.py).")
  try:
    return fv(argv)
  except flags.Error as e:
    if "Error whilst parsing config file" not in str(e):
      raise
    root = _root(e)
    raise flags.Error(f"--config={value}: the config file failed: {type(root).__name__}: "
                      f"{root}") from e
  except Exception as e:  # pylint: disable=broad-except
    if not _raised_in(e, path):
      if isinstance(e, (AttributeError, KeyError)) and _raised_in(e, _CONFIG_DICT_FILE):
        raise _unknown_key(e, argv) from e  # an override of a key the config lacks
      raise
    raise flags.Error(f"--config={value}: the config file failed: {type(e).__name__}: "
                      f"{e}") from e


def define_verbose(fv: flags.FlagValues) -> None:
  """``--verbose``: what `console_log.configure_logging` keeps off a user's terminal."""
  flags.DEFINE_bool("verbose", False, "Show third-party INFO lines and the warnings hidden as "
                    "noise (Orbax's read-only note, its waits for the previous save), e.g. to "
                    "report a bug.", flag_values=fv)


def usage(doc: str, fv: flags.FlagValues) -> str:
  return f"{doc.strip()}\n\nflags:\n{fv.get_help(include_special_flags=False)}"


def workdir_default(argv: Sequence[str]) -> str:
  """The ``--config`` a command without one reads: ``--workdir``'s config.json, or defaults."""
  for i, a in enumerate(argv):
    if a.startswith("--workdir="):
      return f"{WORKDIR_CONFIG}:{a.split('=', 1)[1]}"
    if a == "--workdir" and i + 1 < len(argv):
      return f"{WORKDIR_CONFIG}:{argv[i + 1]}"
  return WORKDIR_CONFIG


_KEEP_TRACEBACK = "_dapo_keep_traceback"


@contextlib.contextmanager
def tracebacks_except(*user_errors: type[BaseException]) -> Iterator[None]:
  """Inside, only ``user_errors`` are a user's mistake: `exit_on_error` lets any other error
  out with its traceback (a ValueError deep in a training step is a bug to report, not a
  one-line answer)."""
  try:
    yield
  except user_errors:
    raise
  except BaseException as e:
    try:
      setattr(e, _KEEP_TRACEBACK, True)
    except AttributeError:  # an exception type without a __dict__ is not caught below anyway
      pass
    raise


def exit_on_error(prog: str, main: Callable[[list[str]], object],
                  argv: Sequence[str] | None = None) -> None:
  """Console entry point: a bad flag, config value or path (or an error whose class sets
  ``one_line``, e.g. the other process of a split gone) prints one line and exits with 2
  (argparse's code for a usage error), not a trace. ``argv`` defaults to ``sys.argv[1:]``; then
  this is the process's command and it ends with `exit_process` (tests pass ``argv`` and get
  ``SystemExit``)."""
  leave = sys.exit if argv is not None else exit_process
  try:
    out = main(list(sys.argv[1:] if argv is None else argv))
  except Exception as e:  # pylint: disable=broad-except  (re-raised unless a user's answer)
    one_line = (isinstance(e, (flags.Error, ValueError, OSError, NotImplementedError))
                or getattr(e, "one_line", False))  # e.g. the other process of a split gone
    if not one_line or getattr(e, _KEEP_TRACEBACK, False):
      raise
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    leave(2)
  leave(out if isinstance(out, int) else 0)


def exit_process(code: int) -> None:
  """Ends a single-process command that has finished (its files written and closed) without
  the interpreter's teardown: JAX's atexit hook frees every compiled program and client, about
  2 s after a short CPU run (issue 41), for nothing the process still needs. Logs and standard
  streams are flushed first. A multi-process job exits normally (``jax.distributed``'s shutdown
  is a barrier the other processes wait on)."""
  jax = sys.modules.get("jax")
  if jax is not None and jax.distributed.is_initialized():
    sys.exit(code)
  import logging  # pylint: disable=g-import-not-at-top
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed pipe
      pass
  os._exit(code)  # pylint: disable=protected-access
