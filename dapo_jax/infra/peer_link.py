"""Two JAX processes joined (``dapo-train --role``, trainer/rollout_process.py): a control
channel for host objects and a transfer server for arrays.

- **Arrays, device to device** (`jax.experimental.transfer`): one side offers a tree under a
  key (``await_pull``), the other pulls it by that key onto its own devices, naming shapes,
  dtypes and layouts. A pull names what it wants, so the two sides need not issue transfers in
  the same order, and neither takes part in the other's programs or collectives (the two are
  not one ``jax.distributed`` job). Shards keep their shapes: the sides need the same device
  count and the same layout axes.
- **Host objects** (`multiprocessing.connection`, pickled, authenticated with a key from
  ``DAPO_PEER_KEY`` or else from the run's workdir): messages ``(kind, key, payload)``; `wait`
  returns the one asked for and keeps the others for later.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import socket
import threading
import time
from multiprocessing import connection
from typing import Any

import jax

CONNECT_TIMEOUT_S = 600.0  # the other process may still be compiling or loading a checkpoint


class PeerError(RuntimeError):
  """The other process could not be reached, or ended."""


class PeerAddressError(ValueError):
  """A ``--peer`` that is not HOST:PORT."""


def _authkey(workdir: str) -> bytes:
  """The control channel's key: ``DAPO_PEER_KEY`` when set (set it on a shared network), else
  one derived from the run's workdir, which both processes are given."""
  key = os.environ.get("DAPO_PEER_KEY")
  return (key.encode() if key else
          hashlib.sha256(f"dapo_jax:{workdir}".encode()).digest())


def parse_peer(peer: str) -> tuple[str, int]:
  host, sep, port = peer.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise PeerAddressError(f"--peer={peer!r}: give the training process's HOST:PORT")
  return host, int(port)


def _local_address(peer_host: str) -> str:
  """This host's address on the interface that reaches ``peer_host``."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((socket.gethostbyname(peer_host), 9))  # no packet is sent
    return s.getsockname()[0]


class Link:
  """One end of the two channels. ``Link.listen`` on the training process, ``Link.connect`` on
  the rollout process; each then knows the other's device count and transfer address."""

  def __init__(self, conn: connection.Connection, host: str):
    from jax.experimental import transfer  # pylint: disable=g-import-not-at-top
    self._conn, self._send_lock = conn, threading.Lock()
    client = jax.local_devices()[0].client
    self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
    self.send(("hello", {"devices": jax.local_device_count(), "transfer": self.server.address(),
                         "platform": jax.default_backend()}))
    kind, hello = self.recv()
    if kind != "hello":
      raise PeerError(f"expected the other process's hello, got {kind!r}")
    self.peer = hello
    self._pulls = None
    if hello["devices"] != jax.local_device_count() or hello["platform"] != jax.default_backend():
      raise PeerError(
          f"the training and rollout processes need the same device count and platform (the "
          f"weights keep their shard shapes): this one has {jax.local_device_count()} "
          f"{jax.default_backend()} devices, the other {hello['devices']} {hello['platform']}")
    self._inbox: list[tuple] = []
    self.last_nbytes = 0

  @classmethod
  def listen(cls, peer: str, workdir: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Link:
    """The training process: waits for the rollout process to connect to ``peer``."""
    host, port = parse_peer(peer)
    listener = connection.Listener((host, port), authkey=_authkey(workdir))
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(_accept(listener)), daemon=True)
    t.start()
    t.join(timeout_s)
    listener.close()
    if not got:
      raise PeerError(f"no rollout process connected to {peer} within {timeout_s:.0f} s (start "
                      f"dapo-train --role=rollout --peer={peer} with the same --config and "
                      "--workdir)")
    if isinstance(got[0], BaseException):
      raise PeerError(f"the rollout process's connection to {peer} failed: {got[0]}")
    return cls(got[0], host)

  @classmethod
  def connect(cls, peer: str, workdir: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Link:
    """The rollout process: connects to the training process at ``peer`` (retried until it
    listens)."""
    host, port = parse_peer(peer)
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        conn = connection.Client((host, port), authkey=_authkey(workdir))
        break
      except (ConnectionRefusedError, OSError) as e:
        if time.monotonic() > deadline:
          raise PeerError(f"the training process at {peer} did not answer within "
                          f"{timeout_s:.0f} s ({e})") from e
        time.sleep(1.0)
    return cls(conn, _local_address(host))

  def send(self, msg: tuple) -> int:
    """Sends ``msg``; its size in bytes."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with self._send_lock:
      try:
        self._conn.send_bytes(data)
      except (OSError, EOFError) as e:
        raise PeerError(f"the other process has gone ({e})") from e
    return len(data)

  def recv(self) -> tuple:
    """The next message (``last_nbytes``: its size)."""
    try:
      data = self._conn.recv_bytes()
    except (OSError, EOFError) as e:
      raise PeerError(f"the other process has gone ({e})") from e
    msg = pickle.loads(data)
    self.last_nbytes = len(data)
    return msg

  def wait(self, kind: str, key: Any) -> tuple:
    """The first message ``(kind, key, payload)``; others that come first are kept for later.
    ``last_nbytes``: its size."""
    for i, msg in enumerate(self._inbox):
      if msg[:2] == (kind, key):
        self.last_nbytes = msg[3]
        return self._inbox.pop(i)[:3]
    while True:
      msg = self.recv()
      if msg[0] == "error":
        raise PeerError(f"the rollout process stopped: {msg[2]}")
      if msg[:2] == (kind, key):
        return msg
      self._inbox.append((*msg, self.last_nbytes))

  def offer(self, key: int, tree: Any) -> dict[str, Any]:
    """Offers ``tree`` (arrays on this process's devices) for one pull under ``key``; what the
    puller needs to name it."""
    leaves, treedef = jax.tree.flatten(tree)
    self.server.await_pull(key, leaves)
    return {"key": key, "treedef": treedef,
            "leaves": [(x.shape, x.dtype, _spec(x.sharding)) for x in leaves]}

  def pull(self, offer: dict[str, Any], mesh) -> tuple[Any, int]:
    """The offered tree on this process's devices (``mesh``: the rollout mesh, None on one
    device), and its bytes."""
    if self._pulls is None:
      self._pulls = self.server.connect(self.peer["transfer"])
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=_sharding(spec, mesh))
             for shape, dtype, spec in offer["leaves"]]
    leaves = self._pulls.pull(offer["key"], specs)
    nbytes = sum(int(x.nbytes) for x in leaves)
    return jax.tree.unflatten(offer["treedef"], leaves), nbytes

  def close(self) -> None:
    with contextlib.suppress(OSError):
      self._conn.close()


def _accept(listener: connection.Listener):
  try:
    return listener.accept()
  except BaseException as e:  # pylint: disable=broad-except  (reported by `listen`)
    return e


def _spec(sharding) -> Any:
  """A leaf's layout as the other process can rebuild it: a PartitionSpec, or None (one
  device)."""
  return getattr(sharding, "spec", None)


def _sharding(spec, mesh):
  if mesh is None or spec is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.sharding.NamedSharding(mesh, spec)
