"""colabs/: the notebooks are committed stripped, match their source, and run headless.

The execution test runs each notebook top to bottom in a fresh `python3` kernel (this
interpreter) with DAPO_COLAB_SMOKE=1, which the notebooks' parameters cells read to shrink every
run to about a minute on 2 CPU cores. A failing cell fails the test with its traceback.
"""

import importlib.util
import os
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, "colabs")
NAMES = ("dapo_objective", "train_tiny_dapo", "restore_and_sample")
INSTALL = 'pip install -q "dapo_jax{EXTRA} @ git+https://github.com/dapo-jax/dapo_jax"'


def _module(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(COLABS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _read(name):
  return nbformat.read(os.path.join(COLABS, f"{name}.ipynb"), as_version=4)


def test_every_notebook_is_listed():
  on_disk = sorted(os.path.basename(p)[:-len(".ipynb")] for p in os.listdir(COLABS)
                   if p.endswith(".ipynb"))
  assert on_disk == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_stripped_with_badge_and_install(name):
  nb = _read(name)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [], f"cell {i} has outputs: run python colabs/strip_outputs.py"
      assert cell.execution_count is None, f"cell {i} has an execution count"
  assert _module("strip_outputs").is_stripped(os.path.join(COLABS, f"{name}.ipynb"))
  badge, install = nb.cells[0], nb.cells[1]
  url = f"https://colab.research.google.com/github/dapo-jax/dapo_jax/blob/main/colabs/{name}.ipynb"
  assert badge.cell_type == "markdown" and badge.source.startswith("[![Open In Colab]")
  assert f"]({url})" in badge.source
  assert install.cell_type == "code"
  assert f"!{INSTALL}" in install.source and '"google.colab" in sys.modules' in install.source
  assert "EXTRA = accelerator_extra()" in install.source
  assert "Where it runs:" in badge.source  # what runs where, in every notebook
  code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  assert re.search(r"^(from dapo_jax[\w.]* import|import dapo_jax)", code, re.M)
  assert nb.metadata.kernelspec.name == "python3"


def _install_cell_namespace():
  """The install cell's code outside Colab: defines accelerator_extra, installs nothing."""
  source = _read("train_tiny_dapo").cells[1].source
  code = "\n".join(line for line in source.splitlines() if not line.strip().startswith("!"))
  namespace = {}
  exec(compile(code, "install_cell", "exec"), namespace)  # pylint: disable=exec-used
  return namespace


# (environment, device files present, expected extra): what each Colab runtime shows.
_RUNTIMES = [
    ({}, (), ""),  # CPU runtime
    ({"COLAB_GPU": "0"}, (), ""),  # CPU runtime that names "no GPU"
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, (), "[tpu]"),  # legacy TPU Node
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, ("/dev/vfio/[0-9]*",), "[tpu]"),  # TPU VM, v5e
    ({}, ("/dev/accel*",), "[tpu]"),  # TPU VM, v2-v4 chips, no env
    ({"COLAB_GPU": "1"}, ("/dev/nvidia[0-9]*",), "[cuda]"),  # GPU runtime
    ({}, ("/dev/nvidia[0-9]*",), "[cuda]"),  # a GPU without Colab's variable
]


@pytest.mark.parametrize("environ,devices,expected", _RUNTIMES)
def test_install_cell_picks_the_extra_of_the_runtime(environ, devices, expected):
  pick = _install_cell_namespace()["accelerator_extra"]
  assert pick(environ=environ, exists=lambda pattern: pattern in devices) == expected


def test_notebooks_match_their_source():
  build = _module("build_notebooks")
  for name in NAMES:
    with open(build.path_of(name), encoding="utf-8") as f:
      assert f.read() == build.render(name), (
          f"colabs/{name}.ipynb differs from colabs/cells/{name}.py: edit the source and run "
          f"python colabs/build_notebooks.py")


def test_strip_outputs_removes_what_an_execution_adds():
  strip = _module("strip_outputs").strip
  clean = _read("dapo_objective")
  run = _read("dapo_objective")
  run.metadata["widgets"] = {"state": {}}
  run.metadata["language_info"] = {"name": "python", "version": "3.11.9"}
  for i, cell in enumerate(run.cells):
    cell.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    if cell.cell_type == "code":
      cell.execution_count = i
      cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="x\n")]
  assert nbformat.writes(strip(run)) == nbformat.writes(clean)


@pytest.fixture(scope="module")
def python3_kernel(tmp_path_factory):
  """JUPYTER_PATH with a `python3` kernelspec that runs THIS interpreter (sys.executable).

  A kernelspec found elsewhere (~/.local, /usr/share) could start another Python without
  dapo_jax; this one comes first on the search path.
  """
  from ipykernel import kernelspec as ipk  # pylint: disable=g-import-not-at-top
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
  prefix = tmp_path_factory.mktemp("jupyter")
  ipk.install(prefix=str(prefix), kernel_name="python3")
  path = os.path.join(str(prefix), "share", "jupyter")
  old = os.environ.get("JUPYTER_PATH")
  os.environ["JUPYTER_PATH"] = path
  spec = KernelSpecManager().get_kernel_spec("python3")
  assert spec.argv[0] == sys.executable, spec.argv
  yield path
  if old is None:
    del os.environ["JUPYTER_PATH"]
  else:
    os.environ["JUPYTER_PATH"] = old


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_headless(name, tmp_path, python3_kernel):
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top
  nb = _read(name)
  env = dict(os.environ, DAPO_COLAB_SMOKE="1", DAPO_COLAB_WORKDIR=str(tmp_path / "run"),
             JUPYTER_PATH=python3_kernel, JAX_PLATFORMS="cpu",
             XLA_FLAGS="",  # one CPU device, as a user's machine: not the suite's 8 simulated
             MPLBACKEND="module://matplotlib_inline.backend_inline")
  client = NotebookClient(nb, kernel_name="python3", timeout=600, startup_timeout=120,
                          resources={"metadata": {"path": ROOT}})
  client.execute(env=env)  # raises CellExecutionError, with the traceback, on any failing cell
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  if name != "restore_and_sample":  # the two plotting notebooks draw figures inline
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was displayed"
