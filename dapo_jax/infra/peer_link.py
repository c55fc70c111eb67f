"""Two JAX processes joined (``dapo-train --role``, trainer/rollout_process.py): a control
channel for host objects and a transfer server for arrays.

- **Arrays, device to device** (`jax.experimental.transfer`): one side offers a tree under a
  key (``await_pull``), the other pulls it by that key onto its own devices, naming shapes,
  dtypes and layouts. A pull names what it wants, so the two sides need not issue transfers in
  the same order, and neither takes part in the other's programs or collectives (the two are
  not one ``jax.distributed`` job). Shards keep their shapes: the sides need the same device
  count and the same layout axes.
- **Host objects** (`multiprocessing.connection`): messages ``(kind, key, payload)``; `wait`
  returns the one asked for and keeps the others for later. They are pickled, as
  multiprocessing's own are (the verifier's worker processes too), so only a process holding
  the channel's key may connect (HMAC challenge): ``DAPO_PEER_KEY`` when set, else a random key
  the training process writes to ``<workdir>/rollout_peer.key`` (mode 0600 on a local disk) at
  each launch. Whoever can read the run's workdir can connect, as whoever can write it can
  change its checkpoints.

A side may be several processes (each side its own ``jax.distributed`` job, of the same process
count): process i of one side is joined to process i of the other, one link each (``--peer``
lists one HOST:PORT per training process; ``rollout_peer.<i>.key``). Both processes of a pair
hold the same shards of every array (the same meshes over the same local device counts), so a
pull moves only the shards of that pair.

``--peer=auto`` is for launches that cannot know the training hosts in advance (a SLURM job,
`launch/slurm_gpu.sbatch`): each training process listens on a free port of its own address
and writes HOST:PORT to ``<workdir>/rollout_peer.addr`` (``rollout_peer.<i>.addr``) beside its
key; each rollout process reads it there, and retries until a training process of this launch
answers. The address is ``DAPO_PEER_HOST`` when set, else the interface that reaches the
training side's ``jax.distributed`` coordinator (JAX_COORDINATOR_ADDRESS), else the host name's.

One piece: `Link` is one connection's state (the handshake, the inbox, the heartbeat, the pulls
and how the connection ends, told to `side_exit` on a side of several processes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import secrets
import socket
import threading
import time
from multiprocessing import connection
from typing import Any

import jax

from dapo_jax.infra import run_files
from dapo_jax.infra import side_exit

CONNECT_TIMEOUT_S = 600.0  # the other process may still be compiling or loading a checkpoint
# Each end says it is alive every HEARTBEAT_S (from a thread of its own); no word for SILENCE_S
# (a host down, a network cut: no closed connection reports them), or weights pulled but not
# arrived in PULL_TIMEOUT_S, is the other process gone.
HEARTBEAT_S, SILENCE_S, PULL_TIMEOUT_S = 10.0, 300.0, 600.0


class PeerError(RuntimeError):
  """The other process could not be reached, or ended (not a bug: printed in one line)."""
  one_line = True  # `spec.cli.exit_on_error`


class PeerGone(PeerError):
  """The link ended (the other process exited, was killed, went silent or lost its link)."""


class PeerAddressError(ValueError):
  """A ``--peer`` that is not HOST:PORT."""


KEY_FILE = "rollout_peer.key"  # in the workdir: this launch's channel key (module docstring)
AUTO = "auto"  # --peer=auto: the training processes write where they listen (module docstring)


def key_file() -> str:
  """This process's key file: `KEY_FILE`, or ``rollout_peer.<i>.key`` on process i of a side of
  several."""
  return _pair_file("key")


def address_file() -> str:
  """Where this pair's training process writes its HOST:PORT under ``--peer=auto``."""
  return _pair_file("addr")


def _pair_file(suffix: str) -> str:
  if jax.process_count() == 1:
    return f"rollout_peer.{suffix}"
  return f"rollout_peer.{jax.process_index()}.{suffix}"


def _new_key(workdir: str) -> bytes:
  """The training process's key for this launch (written for the rollout process to read)."""
  if os.environ.get("DAPO_PEER_KEY"):
    return os.environ["DAPO_PEER_KEY"].encode()
  key = secrets.token_hex(32).encode()
  _write_private(workdir, key_file(), key)
  return key


def _read_key(workdir: str) -> bytes | None:
  """The rollout process's key: the training process's of this launch (None: not written
  yet)."""
  if os.environ.get("DAPO_PEER_KEY"):
    return os.environ["DAPO_PEER_KEY"].encode()
  return _read_file(workdir, key_file())


def parse_peer(peer: str) -> tuple[str, int]:
  host, sep, port = peer.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise PeerAddressError(f"--peer={peer!r}: give the training process's HOST:PORT")
  return host, int(port)


def process_peer(peer: str) -> str:
  """This process's item of ``--peer``: HOST:PORT, or one comma-separated HOST:PORT per
  training process (in process order) on a side of several processes; `AUTO` as it is."""
  if peer == AUTO:
    return peer
  items = peer.split(",")
  n = jax.process_count()
  if len(items) != n:
    raise PeerAddressError(
        f"--peer={peer!r} names {len(items)} address(es) for {n} process(es) a side: give one "
        "HOST:PORT per training process, comma-separated in process order (process i of each "
        "side pairs with process i of the other)")
  for item in items:
    parse_peer(item)
  return items[jax.process_index()]


def _local_address(peer_host: str) -> str:
  """This host's address on the interface that reaches ``peer_host``."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((socket.gethostbyname(peer_host), 9))  # no packet is sent
    return s.getsockname()[0]


def _advertised_host() -> str:
  """Where a training process listens under ``--peer=auto`` (module docstring)."""
  if os.environ.get("DAPO_PEER_HOST"):
    return os.environ["DAPO_PEER_HOST"]
  coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS", "").rpartition(":")[0]
  try:
    if coordinator:
      return _local_address(coordinator)
    return socket.gethostbyname(socket.gethostname())
  except OSError:
    return "127.0.0.1"


def _write_private(workdir: str, name: str, data: bytes) -> None:
  """``<workdir>/name``, replaced whole, readable by its owner alone on a local disk."""
  path = run_files.resolve(workdir) / name
  if run_files.is_remote(path):
    run_files.write_bytes_atomic(path, data)
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = f"{path}.{secrets.token_hex(6)}.tmp"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def _read_file(workdir: str, name: str) -> bytes | None:
  try:
    return (run_files.resolve(workdir) / name).read_bytes()
  except (FileNotFoundError, OSError):
    return None


class Link:
  """One end of the two channels. ``Link.listen`` on the training process, ``Link.connect`` on
  the rollout process; each then knows the other's device count and transfer address."""

  def __init__(self, conn: connection.Connection, host: str, other: str = "the other process",
               agree: dict[str, str] | None = None):
    from jax.experimental import transfer  # pylint: disable=g-import-not-at-top
    self._conn, self._send_lock = conn, threading.Lock()
    self.other = other  # "the rollout process" / "the training process": which side went
    self._inbox: list[tuple] = []
    self.signalled: int | None = None  # a signal the other process was sent (`signal`)
    self._closed = threading.Event()  # (ends the heartbeat)
    self.watch: side_exit.SideWatch | None = None  # set after the handshake (below)
    client = jax.local_devices()[0].client
    self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
    self.send(("hello", {"devices": jax.local_device_count(), "transfer": self.server.address(),
                         "platform": jax.default_backend(), "agree": agree or {},
                         "process": [jax.process_index(), jax.process_count()]}))
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
    _check_agree(agree or {}, hello.get("agree", {}))
    if hello["process"] != [jax.process_index(), jax.process_count()]:
      raise PeerError(
          f"process {jax.process_index()} of {jax.process_count()} reached process "
          f"{hello['process'][0]} of {hello['process'][1]} of the other side: each side needs "
          "the same process count, and --peer's addresses in process order")
    # A side of several processes: this link gone ends the whole side in bounded time.
    self.watch = (side_exit.SideWatch("training" if other == "the rollout process" else
                                      "rollout") if jax.process_count() > 1 else None)
    threading.Thread(target=self._heartbeat, name="dapo-peer-heartbeat", daemon=True).start()

  @classmethod
  def listen(cls, peer: str, workdir: str, timeout_s: float = CONNECT_TIMEOUT_S,
             agree: dict[str, str] | None = None) -> Link:
    """The training process: waits for the rollout process to connect to ``peer`` (this
    process's item, `process_peer`; `AUTO`: a free port, written to the workdir). ``agree``:
    settings both must share (what decides the batches), checked at the handshake."""
    peer = process_peer(peer)
    if peer == AUTO:
      host, port = _advertised_host(), 0
    else:
      host, port = parse_peer(peer)
    listener = connection.Listener((host, port), authkey=_new_key(workdir))
    hint = peer
    if peer == AUTO:
      peer = f"{host}:{listener.address[1]}"
      _write_private(workdir, address_file(), peer.encode())
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(_accept(listener)), daemon=True)
    t.start()
    t.join(timeout_s)
    listener.close()
    if not got:
      raise PeerError(f"no rollout process connected to {peer} within {timeout_s:.0f} s (start "
                      f"dapo-train --role=rollout --peer={hint} with the same --config and "
                      "--workdir)")
    if isinstance(got[0], BaseException):
      raise PeerError(f"the rollout process's connection to {peer} failed: {got[0]}")
    return cls(got[0], host, "the rollout process", agree)

  @classmethod
  def connect(cls, peer: str, workdir: str, timeout_s: float = CONNECT_TIMEOUT_S,
              agree: dict[str, str] | None = None) -> Link:
    """The rollout process: connects to the training process at ``peer`` (retried until it
    listens; ``peer``, ``agree``: as `listen`'s)."""
    peer = item = process_peer(peer)
    deadline = time.monotonic() + timeout_s
    while True:  # until it listens with the key it wrote for this launch
      try:
        if item == AUTO:  # where it listens this launch (an earlier launch's: refused, retried)
          written = _read_file(workdir, address_file())
          if written is None:
            raise FileNotFoundError(f"no {address_file()} in {workdir} yet")
          peer = written.decode()
        host, port = parse_peer(peer)
        key = _read_key(workdir)
        if key is None:
          raise FileNotFoundError(f"no {key_file()} in {workdir} yet")
        conn = connection.Client((host, port), authkey=key)
        break
      except (OSError, multiprocessing.AuthenticationError) as e:
        if time.monotonic() > deadline:
          where = peer if item != AUTO else f"{peer} ({address_file()} in {workdir})"
          raise PeerError(f"the training process at {where} did not answer within "
                          f"{timeout_s:.0f} s ({e})") from e
        time.sleep(1.0)
    return cls(conn, _local_address(host), "the training process", agree)

  def send(self, msg: tuple) -> int:
    """Sends ``msg``; its size in bytes, pickled."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if msg[0] == "stop":  # the run's end: the other process closes its end next
      self._finished()
    with self._send_lock:
      try:
        self._conn.send_bytes(data)  # what Connection.send sends: `recv` reads it
      except (OSError, EOFError) as e:
        raise self._gone(e) from e
    return len(data)

  def recv(self) -> tuple:
    """The next message (a "signal" message is noted in ``signalled``, a heartbeat dropped);
    `PeerGone` after SILENCE_S without a word."""
    while (msg := self._recv()) is None:
      pass
    return msg

  def _recv(self) -> tuple | None:
    try:
      if not self._conn.poll(SILENCE_S):
        raise self._noted(PeerGone(
            f"{self.other} has gone (no word from it for {SILENCE_S:.0f} s, where it says it "
            f"is alive every {HEARTBEAT_S:.0f} s: its host down or the network cut?)"))
      msg = self._conn.recv()
    except (OSError, EOFError) as e:
      raise self._gone(e) from e
    if msg[0] == "signal":
      self.signalled = msg[2]
    elif msg[0] == "stop":
      self._finished()
    return None if msg[0] in ("signal", "heartbeat") else msg

  def _heartbeat(self) -> None:
    while not self._closed.wait(HEARTBEAT_S) and self._try_send(("heartbeat", None, None)):
      pass

  def _try_send(self, msg: tuple) -> bool:
    try:
      self.send(msg)
    except PeerError:
      return False
    return True

  def signal(self, signum: int) -> None:
    """Tells the other process that this one was sent ``signum`` (its ``signalled``); never
    raises or waits (a signal handler calls it, maybe while this thread holds the send lock)."""
    threading.Thread(target=self._try_send, args=(("signal", None, signum),), daemon=True).start()

  def poll_signal(self) -> int | None:
    """The other process's signal, once its message came (others read meanwhile: kept)."""
    while self.signalled is None and self._conn.poll(0):
      msg = self._recv()
      if msg is not None:
        self._inbox.append(msg)
    return self.signalled

  def _gone(self, e: BaseException) -> PeerGone:
    return self._noted(PeerGone(f"{self.other} has gone ({str(e) or type(e).__name__})"))

  def _noted(self, e: PeerGone) -> PeerGone:
    """``e``, told to the side's watch first (whichever thread met it: the heartbeat's too)."""
    if self.watch is not None and not self._closed.is_set():
      self.watch.link_gone(str(e))
    return e

  def _finished(self) -> None:
    if self.watch is not None:
      self.watch.finished()

  def wait(self, kind: str, key: Any) -> tuple:
    """The first message ``(kind, key, payload)``; others that come first are kept for later."""
    i = 0
    while True:
      if i == len(self._inbox):
        self._inbox.append(self.recv())
      msg = self._inbox[i]
      if msg[0] == "error":  # (kept: every later wait raises it too)
        raise PeerError(f"{self.other} stopped: {msg[2]}")
      if msg[:2] == (kind, key):
        return self._inbox.pop(i)
      i += 1

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
    deadline = time.monotonic() + PULL_TIMEOUT_S  # (the pull's own timeout never fired here)
    while not all(x.is_ready() for x in leaves):
      if time.monotonic() > deadline:
        raise PeerGone(f"the weights {self.other} offered (key {offer['key']}) did not arrive "
                       f"within {PULL_TIMEOUT_S:.0f} s")
      time.sleep(0.002)
    nbytes = sum(int(x.nbytes) for x in leaves)
    return jax.tree.unflatten(offer["treedef"], leaves), nbytes

  def close(self) -> None:
    self._closed.set()
    self._finished()
    with contextlib.suppress(OSError):
      self._conn.close()


def _check_agree(here: dict[str, str], there: dict[str, str]) -> None:
  """`Link`'s ``agree`` settings against the other process's (one line naming a difference)."""
  differ = sorted(k for k in set(here) | set(there) if here.get(k) != there.get(k))
  if not differ:
    return
  shown = "; ".join(f"{k}={here.get(k, '(unset)')} here, {there.get(k, '(unset)')} there"
                    for k in differ[:3])
  more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
  raise PeerError(
      f"the training and rollout processes run different configs: {shown}{more}. Start both "
      "with the same --config and overrides (the settings that decide the batches: seed, "
      "data, model, tokenizer, rollout, reward, algorithm, eval, optim.train_batch_size)")


def _accept(listener: connection.Listener):
  """The first connection that proves the key (a rollout process holding an earlier launch's
  key retries with the new one)."""
  while True:
    try:
      return listener.accept()
    except multiprocessing.AuthenticationError:
      continue
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
