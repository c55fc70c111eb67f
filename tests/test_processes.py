"""tests/processes.py: the multi-process tests' waits end on events (an exit, a stall), not on a
total time, and their coordinator ports cannot be taken by an outgoing connection."""

import os
import subprocess
import sys

import pytest

from tests import processes


def _start(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def test_the_first_process_to_fail_ends_the_wait_with_its_output():
  """A peer left waiting (as in a collective) is stopped at once, not waited for."""
  procs = [_start("import time; time.sleep(120)"),
           _start("import sys; print('rank 1 broke', flush=True); sys.exit(3)")]
  with pytest.raises(pytest.fail.Exception, match=r"(?s)a rank 1 exited with 3.*rank 1 broke"):
    processes.wait_all(procs, 100, "a rank")
  assert procs[0].returncode is not None and procs[0].returncode < 0  # killed, not waited for


def test_a_slow_run_that_writes_files_is_not_a_hang(tmp_path):
  """Silent for longer than the limit, but writing (a compilation cache filling up): waited for."""
  code = (f"import os, time\nfor i in range(8):\n  time.sleep(0.5)\n"
          f"  open(os.path.join({str(tmp_path)!r}, str(i)), 'w').close()\nprint('done')")
  outs = processes.wait_all([_start(code), _start("print('quick')")], 2, "a rank",
                            watch=[str(tmp_path)])
  assert outs == ["done\n", "quick\n"]


def test_a_stall_fails_with_each_process_stack():
  procs = [_start("import time\ndef waiting_for_a_peer():\n  time.sleep(120)\n"
                  "waiting_for_a_peer()")]
  with pytest.raises(pytest.fail.Exception, match=r"(?s)hung: no output.*waiting_for_a_peer"):
    processes.wait_all(procs, 2, "a rank")


def test_free_port_is_below_the_ephemeral_range():
  low, _ = processes._ephemeral_ports()  # pylint: disable=protected-access
  for _ in range(20):
    assert processes.free_port() < low
