"""What the bench scripts record about the host they ran on."""

import platform


def cpu_name() -> str:
  """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor()
