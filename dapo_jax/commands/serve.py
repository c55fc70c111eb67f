"""`dapo-serve`: a Qwen2.5 checkpoint behind JetStream's own orchestrator and gRPC server.

    dapo-serve --config.model.checkpoint=~/ckpt/Qwen2.5-Math-1.5B --port 9000 \
        --max_concurrent_decodes 16
    dapo-serve --workdir gs://bucket/run --step 200 --config.mesh=data=1,tensor=8

Query it with JetStream's `Orchestrator.Decode` RPC (`jetstream.core.proto.jetstream_pb2_grpc`).
It binds to 127.0.0.1 unless `--host` says otherwise. The engine is `QwenEngine`
(`dapo_jax.rollout.jetstream_engine`), its params loaded straight into the sampling layout
(`sharding.SAMPLE_RULES`) on `config.rollout_mesh` (else `config.mesh`) over every device. The
weights are a HF directory (`--config.model.checkpoint`; tokenizer files from there or
`--config.tokenizer.path`) or a training workdir's Orbax checkpoint (`--workdir`, whose
config.json names the model). Settings are the trainer's, with one override syntax (`--config
path --config.x=y`); without `--config` the config is the workdir's, else the float32 defaults
(`--config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16` for bf16). The KV cache is
`--config.rollout.kv_cache` (auto: paged on TPU/GPU and for long slots on CPU; page_size,
kv_pages, attention_impl as for rollout). The default pool holds every slot at full length:
JetStream cannot pause a request, so with a smaller `kv_pages` a request the pool cannot hold
stops the server (JetStream ends the process on a driver thread's error) naming the setting.

Requests are checked before JetStream sees them (`RequestLimits`): an exception in one of its
driver threads kills the whole server, and a prompt over its prefill length would be silently
cut. A request without content, with `max_tokens` outside [1, --max_new_tokens], with a prompt
over the prefill length or with token ids outside the vocabulary gets INVALID_ARGUMENT naming the
limit; more than --max_pending requests in flight get RESOURCE_EXHAUSTED; a message over
--max_request_bytes is refused by gRPC itself (RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import socket
import sys
import threading
from concurrent import futures
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import jax
from absl import flags

from dapo_jax.spec import cli
from dapo_jax.infra import compile_cache
from dapo_jax.infra import libtpu_flags

from dapo_jax.models.qwen2 import Qwen2ForCausalLM
from dapo_jax.rollout.sampling import SamplingParams

if TYPE_CHECKING:
  from dapo_jax.spec.run_spec import RunSpec

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# A prompt longer than this many characters per prefill token is refused before tokenizing.
_MAX_CHARS_PER_TOKEN = 32


def _jetstream():
  """Imports JetStream's server modules (its engine API first, without seqio: jetstream_api)."""
  from dapo_jax.rollout import jetstream_api  # noqa: F401  pylint: disable=g-import-not-at-top
  root_level = logging.getLogger().level
  # pylint: disable-next=g-import-not-at-top
  from jetstream.core import orchestrator
  from jetstream.core.proto import jetstream_pb2  # pylint: disable=g-import-not-at-top
  # The orchestrator sets the root logger to DEBUG at import, which floods every JAX compile
  # and generate step into stdout; keep the level the application chose.
  logging.getLogger().setLevel(root_level)
  # JetStream 0.2.2 frees each inserted prefix with `jax.tree_map`, which jax>=0.6 removed; the
  # thread that hits it kills the whole process (SIGKILL). Same behaviour, current API.
  orchestrator.delete_pytree = _delete_pytree
  return orchestrator, jetstream_pb2


def _delete_pytree(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


def load_model(spec: RunSpec, *, workdir: str | None = None, step: int | None = None,
               mesh=None) -> tuple[Qwen2ForCausalLM, Any]:
  """(model, tokenizer): `workdir`'s Orbax checkpoint, else the HF `spec.model.checkpoint`,
  params in the sampling layout on `mesh`."""
  from dapo_jax.trainer import policy as policy_lib  # pylint: disable=g-import-not-at-top
  policy = policy_lib.load_policy(spec, workdir=workdir, step=step, mesh=mesh)
  return policy.model, policy.tokenizer


def build_engine(fv):
  """The `QwenEngine` the flags describe, sharded over every device by the config's mesh."""
  from dapo_jax.trainer import policy as policy_lib  # pylint: disable=g-import-not-at-top
  from dapo_jax.trainer import run_setup  # pylint: disable=g-import-not-at-top
  from dapo_jax.rollout.jetstream_engine import QwenEngine  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec import run_spec  # pylint: disable=g-import-not-at-top
  libtpu_flags.apply(fv.config.get("tpu_windowed_einsum", False))
  spec = run_spec.RunSpec.read(fv.config)  # a workdir's saved config is not judged again
  workdir = cli.expand(fv.workdir)
  compile_cache.setup(spec.compilation_cache_dir, workdir)
  mesh = policy_lib.sampling_mesh(spec.mesh, spec.rollout_mesh, spec.dcn_mesh)
  model, tokenizer = load_model(spec, workdir=workdir, step=fv.step, mesh=mesh)
  tokenizer_path = spec.tokenizer.path or spec.model.checkpoint
  sampling = SamplingParams(temperature=fv.temperature, top_p=fv.top_p, top_k=fv.top_k,
                            max_new_tokens=fv.max_new_tokens)
  kv = run_setup.kv_cache_args(spec.rollout)
  del kv["kv_hbm_fraction"]  # the pool holds every slot at full length (QwenEngine, kv_pages)
  model = run_setup.for_rollout(model, spec.rollout)  # its caches as rollout.kv_cache_dtype
  return QwenEngine(model, tokenizer, max_concurrent_decodes=fv.max_concurrent_decodes,
                    max_prefill_length=fv.max_prefill_length, sampling=sampling,
                    seed=fv.seed, mesh=mesh, tokenizer_path=tokenizer_path, **kv)


def _check_port_free(host: str, port: int) -> None:
  """Fails early, with the port in the message, before the driver starts its threads."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may follow TIME_WAIT
    try:
      s.bind((host.strip("[]"), port))
    except OSError as e:
      raise OSError(f"Cannot serve on {host}:{port} ({e.strerror}); pick another --port.") from e


@dataclasses.dataclass(frozen=True)
class RequestLimits:
  """What one Decode request may ask of the engine."""
  max_prompt_tokens: int  # the prefill length minus the slot of JetStream's start marker
  max_new_tokens: int
  vocab_size: int
  max_prompt_chars: int

  @classmethod
  def for_engine(cls, engine: Any) -> RequestLimits:
    return cls(max_prompt_tokens=engine.max_prefill_length - 1,
               max_new_tokens=engine.sampling.max_new_tokens,
               vocab_size=engine.config.vocab_size,
               max_prompt_chars=_MAX_CHARS_PER_TOKEN * engine.max_prefill_length)

  def problem(self, request: Any, encode: Callable[[str], Sequence[int]]) -> str | None:
    """Why `request` (a `DecodeRequest`) cannot be served, or None."""
    which = request.WhichOneof("content")
    if which is None:
      return "the request has neither text_content nor token_content"
    if not 1 <= request.max_tokens <= self.max_new_tokens:
      return (f"max_tokens={request.max_tokens} is outside [1, {self.max_new_tokens}] "
              "(the server's --max_new_tokens)")
    if which == "text_content":
      text = request.text_content.text
      if len(text) > self.max_prompt_chars:
        return (f"the prompt has {len(text)} characters; this server reads at most "
                f"{self.max_prompt_chars}")
      try:
        num_tokens = len(encode(text))
      except Exception as e:  # pylint: disable=broad-except
        return f"the prompt cannot be tokenized ({type(e).__name__})"
    else:
      ids = request.token_content.token_ids
      num_tokens = len(ids)
      if num_tokens <= self.max_prompt_tokens:  # (a huge list is refused by its length)
        outside = [t for t in ids if not 0 <= t < self.vocab_size]
        if outside:
          return f"token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
    if num_tokens == 0:
      return "the prompt is empty"
    if num_tokens > self.max_prompt_tokens:
      return (f"the prompt has {num_tokens} tokens; this server takes at most "
              f"{self.max_prompt_tokens} (--max_prefill_length minus one start marker)")
    return None


class _Undecodable(NamedTuple):
  """Stands for request bytes that are not a message (gRPC would answer a bare UNKNOWN)."""
  error: str


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
  def deserialize(data: bytes) -> Any:
    try:
      return parse(data)
    except Exception as e:  # pylint: disable=broad-except
      return _Undecodable(type(e).__name__)
  return deserialize


class _CheckedOrchestrator:
  """JetStream's `LLMOrchestrator` behind request checks and a cap on requests in flight."""

  def __init__(self, inner: Any, limits: RequestLimits, encode: Callable[[str], Sequence[int]],
               max_pending: int):
    self._inner, self._limits, self._encode = inner, limits, encode
    self._max_pending = max_pending
    self._pending = 0  # touched only on the server's event loop thread

  async def Decode(self, request, context=None):  # pylint: disable=invalid-name
    import grpc  # pylint: disable=g-import-not-at-top
    problem = (f"the request is not a DecodeRequest message ({request.error})"
               if isinstance(request, _Undecodable) else
               self._limits.problem(request, self._encode))
    if problem is not None:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dapo-serve: {problem}.")
    if self._pending >= self._max_pending:
      await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"dapo-serve: {self._pending} requests in flight (--max_pending); "
                          "retry later.")
    self._pending += 1
    try:
      async for response in self._inner.Decode(request, context):
        yield response
    finally:
      self._pending -= 1

  async def HealthCheck(self, request, context=None):  # pylint: disable=invalid-name
    return await self._inner.HealthCheck(request, context)

  def handler(self, pb: Any) -> Any:
    """The gRPC service `add_OrchestratorServicer_to_server` registers, lenient in parsing."""
    import grpc  # pylint: disable=g-import-not-at-top
    return grpc.method_handlers_generic_handler("jetstream_proto.Orchestrator", {
        "Decode": grpc.unary_stream_rpc_method_handler(
            self.Decode, request_deserializer=_lenient(pb.DecodeRequest.FromString),
            response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            self.HealthCheck, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString)})


class Server:
  """The running gRPC server and JetStream driver (`server_lib.JetStreamServer`, with our bind
  address, message size limit and request checks)."""

  def __init__(self, driver: Any, handler: Any, address: str, threads: int,
               max_request_bytes: int):
    import grpc  # pylint: disable=g-import-not-at-top
    self._driver = driver
    self._executor = futures.ThreadPoolExecutor(max_workers=threads)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._thread = threading.Thread(target=self._loop.run_forever, name="dapo-serve-grpc",
                                    daemon=True)
    self._thread.start()

    async def build():
      server = grpc.aio.server(self._executor, options=[
          ("grpc.max_receive_message_length", max_request_bytes),
          ("grpc.so_reuseport", 0)])  # a second server must fail to bind, not share the port
      server.add_generic_rpc_handlers((handler,))
      if not server.add_insecure_port(address):
        raise OSError(f"Cannot bind {address}.")
      await server.start()
      return server

    try:
      self._grpc = self._run(build())
    except BaseException:
      driver.stop()
      self._loop.call_soon_threadsafe(self._loop.stop)
      raise

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  def stop(self) -> None:
    self._driver.stop()
    self._run(self._grpc.stop(grace=10))
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()
    self._executor.shutdown(wait=False)

  def wait_for_termination(self) -> None:
    try:
      self._run(self._grpc.wait_for_termination())
    finally:
      self.stop()


def start_server(engine: Any, *, port: int, host: str = "127.0.0.1", threads: int | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_pending: int | None = None) -> Server:
  """Starts JetStream's orchestrator + a gRPC server with `engine`; returns the running server.

  Stop it with `server.stop()` (or block with `server.wait_for_termination()`).
  """
  _check_port_free(host, port)
  orchestrator, pb = _jetstream()
  params = engine.load_params()
  driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  tokenizer = engine.build_tokenizer(engine.get_tokenizer()).tokenizer
  slots = engine.max_concurrent_decodes
  servicer = _CheckedOrchestrator(orchestrator.LLMOrchestrator(driver=driver),
                                  RequestLimits.for_engine(engine), tokenizer.encode,
                                  max_pending or 8 * slots)
  bind = f"[{host}]" if ":" in host and not host.startswith("[") else host
  return Server(driver, servicer.handler(pb), f"{bind}:{port}", threads or max(slots, 64),
                max_request_bytes)


def _define(fv) -> None:
  """dapo-serve's own flags; model, dtype and mesh are `--config.x=y` (as dapo-train)."""
  string, integer, real = (functools.partial(f, flag_values=fv) for f in (
      flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float))
  string("workdir", None, "A dapo-train workdir: serve its Orbax checkpoint (its config.json "
         "names the model); default: the HF directory --config.model.checkpoint.")
  integer("step", None, "Orbax step (default: the newest).")
  integer("port", 9000, "gRPC port.")
  string("host", "127.0.0.1", "Bind address (default: localhost only).")
  integer("max_concurrent_decodes", 8, "Decode slots.")
  integer("max_prefill_length", 1024,
          "Longest prompt: 16, 32, 64, ... (JetStream's prefill buckets).")
  integer("max_new_tokens", 1024,
          "Decode capacity per request (the KV cache holds prompt + this).")
  real("temperature", 0.0, "0 = greedy.")
  real("top_p", 1.0, "Nucleus sampling mass.")
  integer("top_k", 0, "Top-k sampling (0: off).")
  integer("seed", 0, "Sampling seed.")
  integer("threads", None, "gRPC worker threads.")
  integer("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES, "Largest request message gRPC accepts.")
  integer("max_pending", None, "Requests in flight before new ones get RESOURCE_EXHAUSTED "
          "(default: 8 x --max_concurrent_decodes).")
  string("log_level", "WARNING",
         "Python logging level (INFO logs every JetStream generate step).")
  cli.define_verbose(fv)


def parse_args(argv: Sequence[str] | None):
  """The flags (`fv.config` is the run config, `fv.port` ...), parsed into fresh FlagValues."""
  return cli.parse("dapo-serve", __doc__,
                   sys.argv[1:] if argv is None else argv, _define, cli.workdir_default)


def main(argv: Sequence[str] | None = None, *, block: bool = True):
  """Serves until interrupted; with `block=False`, returns the running server instead."""
  fv = parse_args(argv)
  from dapo_jax.infra import console_log  # pylint: disable=g-import-not-at-top
  console_log.configure_logging(stderr=True, verbose=fv.verbose)  # as every command
  logging.getLogger().setLevel(fv.log_level.upper())
  engine = build_engine(fv)
  server = start_server(engine, port=fv.port, host=fv.host, threads=fv.threads,
                        max_request_bytes=fv.max_request_bytes, max_pending=fv.max_pending)
  source = fv.workdir or fv.config.model.checkpoint
  cache = (f"{engine.paged.num_pages} KV pages of {engine.paged.page_size}" if engine.paged
           else "dense KV cache")
  print(f"dapo-serve: {source} on {fv.host}:{fv.port} ({fv.max_concurrent_decodes} slots, "
        f"{cache}, {jax.device_count()} devices)", flush=True)
  if not block:
    return server
  server.wait_for_termination()  # stops the driver and the gRPC server on exit
  return 0


def run() -> None:
  """Console entry point `dapo-serve`: a bad flag or checkpoint prints one line, not a trace."""
  cli.exit_on_error("dapo-serve", main)
