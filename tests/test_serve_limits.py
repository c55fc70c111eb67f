"""The served policy under bad requests (issue #8, item 5).

`dapo-serve` binds to localhost by default, answers each malformed or oversized request with a
gRPC status that names the limit, and still serves a valid request after a burst of them.
"""

import collections
import concurrent.futures
import os

import pytest

pytest.importorskip("jetstream")

import grpc  # pylint: disable=g-import-not-at-top,g-bad-import-order
import portpicker  # pylint: disable=g-import-not-at-top
from jetstream.core.proto import jetstream_pb2 as pb  # pylint: disable=g-import-not-at-top
from jetstream.core.proto import jetstream_pb2_grpc  # pylint: disable=g-import-not-at-top

from dapo_jax.commands import serve  # pylint: disable=g-import-not-at-top
from tests import fault_report  # pylint: disable=g-import-not-at-top
from tests import rollout_fixtures  # pylint: disable=g-import-not-at-top

PREFILL, NEW_TOKENS, MAX_BYTES, VOCAB = 16, 8, 4096, 128  # the tiny checkpoint has vocab 128
BURST_ROUNDS = 12
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
DECODE = "/jetstream_proto.Orchestrator/Decode"


@pytest.fixture(scope="module")
def server():
  port = portpicker.pick_unused_port()
  srv = serve.main([f"--config.model.checkpoint={rollout_fixtures.tiny_checkpoint()}",
                    "--port", str(port),
                    "--max_concurrent_decodes", "2", "--max_prefill_length", str(PREFILL),
                    "--max_new_tokens", str(NEW_TOKENS), "--max_request_bytes", str(MAX_BYTES)],
                   block=False)
  try:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
      grpc.channel_ready_future(channel).result(timeout=60)
      yield port, channel
  finally:
    srv.stop()


def _text(text, max_tokens=4):
  return pb.DecodeRequest(max_tokens=max_tokens,
                          text_content=pb.DecodeRequest.TextContent(text=text))


def _tokens(ids, max_tokens=4):
  return pb.DecodeRequest(max_tokens=max_tokens,
                          token_content=pb.DecodeRequest.TokenContent(token_ids=ids))


def _varint(n):
  out = b""
  while True:
    out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
    n >>= 7
    if not n:
      return out


# (name, request or raw bytes, expected status, text in its details)
BAD_REQUESTS = [
    ("no content", pb.DecodeRequest(max_tokens=4), INVALID, "neither text_content"),
    ("max_tokens 0", _text("2+3=", 0), INVALID, "max_tokens=0 is outside [1, 8]"),
    ("max_tokens huge", _text("2+3=", 10**6), INVALID, "max_tokens=1000000 is outside"),
    ("text over the prefill length", _text("7" * 40), INVALID,
     "the prompt has 40 tokens; this server takes at most 15"),
    ("text over the character limit", _text("7" * 600), INVALID, "600 characters"),
    ("empty text", _text(""), INVALID, "the prompt is empty"),
    ("token id above the vocabulary", _tokens([5, 500]), INVALID,
     "token id 500 is outside the vocabulary [0, 128)"),
    ("negative token id", _tokens([-3, 5]), INVALID, "token id -3 is outside"),
    ("token prompt over the prefill length", _tokens([5] * 100), INVALID,
     "the prompt has 100 tokens"),
    ("message over --max_request_bytes", _text("7" * (2 * MAX_BYTES)), EXHAUSTED, ""),
    ("not a protobuf", b"\xff\x00garbage\x13" * 9, INVALID, "not a DecodeRequest message"),
    # text_content.text holding invalid UTF-8, which proto3 strings forbid.
    ("invalid UTF-8", b"\x2a" + _varint(4) + b"\x0a\x02\xff\xfe" + b"\x20\x04", INVALID,
     "not a DecodeRequest message"),
]


def _call(channel, request):
  """The status code and details of one Decode stream (OK if it completes)."""
  raw = isinstance(request, bytes)
  stub = channel.unary_stream(DECODE, request_serializer=None if raw else
                              pb.DecodeRequest.SerializeToString,
                              response_deserializer=pb.DecodeResponse.FromString)
  try:
    ids = [t for r in stub(request, timeout=60) for s in r.stream_content.samples
           for t in s.token_ids]
    return grpc.StatusCode.OK, "", ids
  except grpc.RpcError as e:
    return e.code(), e.details() or "", []


def test_binds_to_localhost_by_default(server):
  port, _ = server
  assert serve.parse_args(["--config.model.checkpoint=x"]).host == "127.0.0.1"
  if not os.path.exists("/proc/net/tcp"):
    pytest.skip("needs /proc/net/tcp")
  listening = []
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    if os.path.exists(table):
      for line in open(table).readlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
          listening.append(address)
  # 127.0.0.1, as IPv4 or IPv4-mapped IPv6 (or ::1); never 0.0.0.0 or ::.
  loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
  assert listening and set(listening) <= loopback, listening


def test_burst_of_bad_requests_then_a_valid_one_is_served(server):
  _, channel = server
  burst = [r for _ in range(BURST_ROUNDS) for r in BAD_REQUESTS]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    answers = list(pool.map(lambda r: _call(channel, r[1]), burst))
    # Clients that give up mid-stream: cancelled while the engine works on them.
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    for _ in range(4):
      stub.Decode(_text("1+1="), timeout=60).cancel()
  codes = collections.Counter()
  for (name, _, expected, fragment), (code, details, _) in zip(burst, answers):
    codes[code.name] += 1
    assert code == expected and fragment in details, (name, code, details)
  # Still alive and still right: a valid request streams its tokens.
  for request in (_text("2+3="), _tokens([5, 17, 9])):
    code, details, ids = _call(channel, request)
    assert code == grpc.StatusCode.OK and 1 <= len(ids) <= 4, (code, details)
  health = jetstream_pb2_grpc.OrchestratorStub(channel).HealthCheck(pb.HealthCheckRequest())
  assert health.is_live
  fault_report.record("serve_limits", {"bad_requests": len(burst), "cancelled_streams": 4,
                                       "status_codes": dict(codes), "valid_after_burst": True})


def test_requests_over_max_pending_get_resource_exhausted():
  import asyncio  # pylint: disable=g-import-not-at-top

  class Inner:
    async def Decode(self, request, context):  # pylint: disable=invalid-name
      del request, context
      await asyncio.sleep(0.2)
      yield "token"

  class Context:
    async def abort(self, code, details):
      raise RuntimeError((code, details))

  limits = serve.RequestLimits(max_prompt_tokens=15, max_new_tokens=8, vocab_size=VOCAB,
                               max_prompt_chars=512)
  servicer = serve._CheckedOrchestrator(  # pylint: disable=protected-access
      Inner(), limits, lambda t: [1] * len(t), max_pending=2)

  async def one():
    try:
      return [r async for r in servicer.Decode(_text("2+3="), Context())]
    except RuntimeError as e:
      return e.args[0]

  async def burst():
    return await asyncio.gather(*(one() for _ in range(3)))

  answers = asyncio.run(burst())
  assert answers[:2] == [["token"], ["token"]]
  assert answers[2][0] == EXHAUSTED and "2 requests in flight (--max_pending)" in answers[2][1]
  assert asyncio.run(one()) == ["token"]  # the count went back down
