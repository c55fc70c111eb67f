"""`dapo-serve`: a Qwen2.5 checkpoint behind JetStream's own orchestrator and gRPC server.

    dapo-serve --checkpoint /ckpt/Qwen2.5-Math-1.5B --port 9000 --max_concurrent_decodes 16

Query it with JetStream's `Orchestrator.Decode` RPC (`jetstream.core.proto.jetstream_pb2_grpc`).
It binds to 127.0.0.1 unless `--host` says otherwise. The engine is `QwenEngine`
(`dapo_jax.rollout.jetstream_engine`); tokenizer files come from the checkpoint directory (or
`--tokenizer`). A trainer's Orbax checkpoint is served with `--model_config` naming the model.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from typing import Any, Sequence

import jax
from flax import nnx

from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.rollout.sampling import SamplingParams

# server_lib reads its bind address from a module global when a server is built; the lock keeps
# two servers started from different threads from seeing each other's host.
_HOST_LOCK = threading.Lock()


def _jetstream():
  """Imports JetStream's server modules (slow: they pull in TensorFlow via seqio)."""
  root_level = logging.getLogger().level
  from jetstream.core import config_lib, orchestrator, server_lib  # pylint: disable=g-import-not-at-top
  # The orchestrator sets the root logger to DEBUG at import, which floods every JAX compile
  # and generate step into stdout; keep the level the application chose.
  logging.getLogger().setLevel(root_level)
  # JetStream 0.2.2 frees each inserted prefix with `jax.tree_map`, which jax>=0.6 removed; the
  # thread that hits it kills the whole process (SIGKILL). Same behaviour, current API.
  orchestrator.delete_pytree = _delete_pytree
  return config_lib, server_lib


def _delete_pytree(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


def load_model(checkpoint: str, *, fmt: str = "auto", dtype: str | None = None,
               model_config: str | None = None, step: int | None = None) -> Qwen2ForCausalLM:
  """The policy in `checkpoint`: a HF directory, or a trainer's Orbax checkpoint directory.

  Orbax train checkpoints hold parameters only, so `model_config` names the architecture: a
  directory with a HF config.json (e.g. the checkpoint the run started from) or a preset name.
  """
  if not os.path.isdir(checkpoint):
    raise FileNotFoundError(f"--checkpoint {checkpoint} is not a directory.")
  if fmt == "auto":
    fmt = "hf" if os.path.exists(os.path.join(checkpoint, "config.json")) else "orbax"
  overrides = {} if dtype is None else dict(param_dtype=dtype, dtype=dtype)
  if fmt == "hf":
    from dapo_jax.checkpoints.hf import load_pretrained  # pylint: disable=g-import-not-at-top
    return load_pretrained(checkpoint, **overrides)
  if model_config is None:
    raise ValueError(f"{checkpoint} is an Orbax train checkpoint (no config.json), which stores "
                     "parameters only: pass --model_config with a HF checkpoint directory (its "
                     "config.json) or a preset name such as qwen2.5-math-1.5b.")
  from dapo_jax.checkpoints import orbax as orbax_ckpt  # pylint: disable=g-import-not-at-top
  from dapo_jax.models import Qwen2Config, abstract_model, get_preset  # pylint: disable=g-import-not-at-top
  cfg = (Qwen2Config.from_hf(model_config, **overrides) if os.path.isdir(model_config)
         else get_preset(model_config, **overrides))
  # The trainer saves `nnx.split(model, nnx.Param, ...)`'s params (train_step.init_train_state).
  graphdef, abstract_params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError("The model has non-parameter state that Orbax train checkpoints lack.")
  params = orbax_ckpt.load_params_only(checkpoint, step, abstract_params=abstract_params)
  return nnx.merge(graphdef, params, rest)


def build_engine(args: argparse.Namespace):
  """The `QwenEngine` the flags describe."""
  from dapo_jax.rollout.jetstream_engine import QwenEngine  # pylint: disable=g-import-not-at-top
  from dapo_jax.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
  model = load_model(args.checkpoint, fmt=args.format, dtype=args.dtype,
                     model_config=args.model_config, step=args.step)
  tokenizer_path = args.tokenizer or args.checkpoint
  sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens)
  return QwenEngine(model, load_tokenizer(tokenizer_path),
                    max_concurrent_decodes=args.max_concurrent_decodes,
                    max_prefill_length=args.max_prefill_length, sampling=sampling,
                    seed=args.seed, tokenizer_path=tokenizer_path)


def _check_port_free(host: str, port: int) -> None:
  """Fails early: server_lib.run starts the driver's non-daemon threads before it binds, so a
  bind error there leaves a process that never exits (and gRPC's SO_REUSEPORT would even let two
  servers share a port silently)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may follow TIME_WAIT
    try:
      s.bind((host.strip("[]"), port))
    except OSError as e:
      raise OSError(f"Cannot serve on {host}:{port} ({e.strerror}); pick another --port.") from e


def start_server(engine: Any, *, port: int, host: str = "127.0.0.1", threads: int | None = None):
  """Starts JetStream's orchestrator + gRPC server with `engine`; returns the running server.

  Stop it with `server.stop()` (or block with `server.wait_for_termination()`).
  """
  _check_port_free(host, port)
  config_lib, server_lib = _jetstream()
  devices = list(engine.mesh.devices.flat)
  config = config_lib.ServerConfig(
      interleaved_slices=(f"{devices[0].platform}={len(devices)}",),
      interleaved_engine_create_fns=(lambda unused_devices: engine,))
  bind = f"[{host}]" if ":" in host and not host.startswith("[") else host
  with _HOST_LOCK:
    default_host = server_lib._HOST  # pylint: disable=protected-access
    server_lib._HOST = bind  # pylint: disable=protected-access
    try:
      return server_lib.run(port=port, config=config, devices=devices, threads=threads)
    finally:
      server_lib._HOST = default_host  # pylint: disable=protected-access


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="dapo-serve", description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", required=True,
                 help="HF checkpoint directory, or a trainer's Orbax checkpoints directory.")
  p.add_argument("--format", choices=("auto", "hf", "orbax"), default="auto",
                 help="Checkpoint format (auto: hf when config.json exists, else orbax).")
  p.add_argument("--model_config", default=None,
                 help="Orbax only: HF checkpoint dir (config.json) or preset name.")
  p.add_argument("--step", type=int, default=None, help="Orbax only: step (default: newest).")
  p.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: checkpoint).")
  p.add_argument("--port", type=int, default=9000)
  p.add_argument("--host", default="127.0.0.1", help="Bind address (default: localhost only).")
  p.add_argument("--max_concurrent_decodes", type=int, default=8)
  p.add_argument("--max_prefill_length", type=int, default=1024,
                 help="Longest prompt: 16, 32, 64, ... (JetStream's prefill buckets).")
  p.add_argument("--max_new_tokens", type=int, default=1024,
                 help="Decode capacity per request (the KV cache holds prompt + this).")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--top_k", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32).")
  p.add_argument("--threads", type=int, default=None, help="gRPC worker threads.")
  p.add_argument("--log_level", default="WARNING",
                 help="Python logging level (INFO logs every JetStream generate step).")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, block: bool = True):
  """Serves until interrupted; with `block=False`, returns the running server instead."""
  args = parse_args(argv)
  logging.getLogger().setLevel(args.log_level.upper())
  engine = build_engine(args)
  server = start_server(engine, port=args.port, host=args.host, threads=args.threads)
  print(f"dapo-serve: {args.checkpoint} on {args.host}:{args.port} "
        f"({args.max_concurrent_decodes} slots)", flush=True)
  if not block:
    return server
  server.wait_for_termination()  # stops the driver and the gRPC server on exit
  return 0


def run() -> None:
  """Console entry point `dapo-serve`: a bad flag or checkpoint prints one line, not a trace."""
  try:
    sys.exit(main(sys.argv[1:]))
  except (ValueError, OSError, NotImplementedError) as e:
    sys.exit(f"dapo-serve: error: {e}")
