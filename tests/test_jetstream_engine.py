"""QwenEngine (JetStream Engine API) and dapo-serve: greedy parity, no retrace, gRPC."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import grpc  # pylint: disable=g-import-not-at-top,g-bad-import-order
import portpicker  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # pylint: disable=g-import-not-at-top

import dapo_jax  # pylint: disable=g-import-not-at-top
from dapo_jax.commands import serve  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout import jetstream_engine as je  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout.jetstream_api import token_utils  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout.sampler import generate  # pylint: disable=g-import-not-at-top
from dapo_jax.rollout.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
from dapo_jax.tokenizers import load_tokenizer  # pylint: disable=g-import-not-at-top
from tests import rollout_fixtures  # pylint: disable=g-import-not-at-top

R = 12  # decode capacity of the test engines
PROMPT = [17, 5, 40, 22, 9, 31, 12]
NEIGHBOUR = [8, 8, 50, 3, 27, 14, 60, 2, 33, 19, 7]


@pytest.fixture(scope="module")
def ckpt():
  return rollout_fixtures.tiny_checkpoint()


@pytest.fixture(scope="module")
def model(ckpt):
  return dapo_jax.load_pretrained(ckpt)


def _engine(model, **kw):
  return je.QwenEngine(model, max_concurrent_decodes=3, max_prefill_length=16,
                       sampling=SamplingParams(temperature=0.0, max_new_tokens=R), **kw)


def _jetstream_pad(ids):
  """What the orchestrator does to a token request: BOS (our sentinel) + right padding."""
  return token_utils.pad_tokens(np.asarray(ids), je.NO_TOKEN, 0, max_prefill_length=16)


def _greedy_ref(model, ids, max_new_tokens, eos_ids=()):
  batch = generate(model, jnp.asarray([ids]), jnp.ones((1, len(ids)), bool), jax.random.key(0),
                   SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                  eos_ids=eos_ids))
  n = int(batch.lengths[0])
  return np.asarray(batch.response_ids[0, :n]), np.asarray(batch.logprobs[0, :n])


def test_greedy_matches_static_sampler_and_full_forward(model):
  engine = _engine(model)
  params, state = engine.load_params(), engine.init_decode_state()
  # A neighbour decoding in slot 0 sits at another cache index; rows must not interact.
  padded, n = _jetstream_pad(NEIGHBOUR)
  state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n), state,
                        slot=0)
  for _ in range(3):
    state, _ = engine.generate(params, state)
  padded, n = _jetstream_pad(PROMPT)
  assert padded[0] == je.NO_TOKEN and n == len(PROMPT) + 1
  state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n), state,
                        slot=2)
  results = []
  for _ in range(engine.cache_length):  # past capacity, to see tokens turn invalid
    state, res = engine.generate(params, state)
    results.append(res)
  tokens, logprobs = je.response_tokens(results, 2)
  # The slot holds n prompt slots of a 16 + R cache: one valid token per slot left, plus one.
  assert len(tokens) == engine.cache_length - n + 1
  assert [int(r.convert_to_numpy().get_result_at_slot(2).lengths[0]) for r in results[:3]] == [
      1, 2, 3]

  ref_tokens, ref_logprobs = _greedy_ref(model, PROMPT, R)
  np.testing.assert_array_equal(tokens[:R], ref_tokens)
  np.testing.assert_allclose(logprobs[:R], ref_logprobs, atol=1e-5)
  # Teacher-forced full forward: each token is the argmax after the ones before it.
  seq = np.array(PROMPT + tokens[:-1])
  logits = np.asarray(model(jnp.asarray(seq[None])))[0, len(PROMPT) - 1:]
  np.testing.assert_array_equal(logits.argmax(-1), tokens)
  full_lp = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(len(tokens)), tokens]
  np.testing.assert_allclose(logprobs, full_lp, atol=1e-4)


def test_no_retrace_across_calls_and_engines(model):
  engine = _engine(model)
  params, state = engine.load_params(), engine.init_decode_state()
  padded, n = _jetstream_pad(PROMPT)
  state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n), state,
                        slot=1)
  state, _ = engine.generate(params, state)
  before = je.TRACES.snapshot()
  other = _engine(dapo_jax.load_pretrained(rollout_fixtures.tiny_checkpoint()))
  state2 = other.init_decode_state()
  for slot, prompt in enumerate([NEIGHBOUR, PROMPT[:3], [5] * 15]):  # one bucket: 16
    padded, n = _jetstream_pad(prompt)
    state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n),
                          state, slot=slot)
    state2 = other.insert(other.prefill(params=other.load_params(), padded_tokens=padded,
                                        true_length=n), state2, slot=slot)
    for _ in range(2):
      state, _ = engine.generate(params, state)
      state2, _ = other.generate(other.load_params(), state2)
  assert je.TRACES.snapshot() == before


def _decode(stub, request):
  text, ids = "", []
  for response in stub.Decode(request):
    sample = response.stream_content.samples[0]
    text += sample.text
    ids += list(sample.token_ids)
  return text, ids


def test_served_by_jetstream_orchestrator_over_grpc(ckpt, model):
  tokenizer = load_tokenizer(ckpt)
  port = portpicker.pick_unused_port()
  # Served sharded: params split over tensor=2 (SAMPLE_RULES), slots over data=4; the paged KV
  # cache (the default off CPU and for long slots), 2 slots of ceil(32 / 4) pages.
  server = serve.main([f"--config.model.checkpoint={ckpt}", "--config.mesh=data=4,tensor=2",
                       "--config.rollout.kv_cache=paged", "--config.rollout.page_size=4",
                       "--port", str(port), "--max_concurrent_decodes", "2",
                       "--max_prefill_length", "16", "--max_new_tokens", "16"], block=False)
  assert server._driver._generate_engines[0].paged.num_pages == 2 * 8  # pylint: disable=protected-access
  prompts = ["what is 2+3?", "compute 7*8=", "solve x-1=4"]  # 3 requests on 2 slots
  try:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
      grpc.channel_ready_future(channel).result(timeout=60)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      text_req = lambda p: jetstream_pb2.DecodeRequest(
          max_tokens=10, text_content=jetstream_pb2.DecodeRequest.TextContent(text=p))
      with concurrent.futures.ThreadPoolExecutor(3) as pool:
        served = list(pool.map(lambda p: _decode(stub, text_req(p)), prompts))
      token_req = jetstream_pb2.DecodeRequest(
          max_tokens=10, token_content=jetstream_pb2.DecodeRequest.TokenContent(
              token_ids=tokenizer.encode(prompts[0])))
      token_served = _decode(stub, token_req)
  finally:
    server.stop()
  assert not any(t.is_alive() for t in server._driver._all_threads)  # pylint: disable=protected-access

  for prompt, (text, ids) in zip(prompts, served):
    ref, _ = _greedy_ref(model, tokenizer.encode(prompt), 10, tokenizer.eos_ids)
    if ref[-1] in tokenizer.eos_ids:  # JetStream does not stream the stop token
      ref = ref[:-1]
    assert ids == ref.tolist(), prompt
    assert text == tokenizer.decode(ref)
  assert token_served == ("", served[0][1])  # token requests get ids back, no text


def test_serve_loads_trainer_orbax_checkpoint(ckpt, model, tmp_path):
  from dapo_jax.spec import cli  # pylint: disable=g-import-not-at-top
  from dapo_jax.checkpoints.orbax import TrainCheckpointer  # pylint: disable=g-import-not-at-top
  _, params, _ = nnx.split(model, nnx.Param, ...)
  workdir = tmp_path / "run"
  with TrainCheckpointer(workdir / "checkpoints") as saver:
    saver.save(7, params, {"mu": jnp.zeros(3)})
  with pytest.raises(FileNotFoundError, match="config.json"):
    serve.parse_args([f"--workdir={workdir}"])
  run_config = cli.get_config()
  run_config.model.checkpoint = ckpt  # the architecture (config.json) the run started from
  run_config.model.scan_layers = False  # the layout `model` (and so the saved step) has
  (workdir / "config.json").write_text(run_config.to_json_best_effort())
  fv = serve.parse_args([f"--workdir={workdir}", "--config.mesh=data=4,tensor=2"])
  from dapo_jax.trainer import policy  # pylint: disable=g-import-not-at-top
  from dapo_jax.spec.run_spec import RunSpec  # pylint: disable=g-import-not-at-top
  spec = RunSpec.read(fv.config)  # as dapo-serve reads it
  mesh = policy.sampling_mesh(spec.mesh, spec.rollout_mesh, spec.dcn_mesh)
  restored, _ = serve.load_model(spec, workdir=fv.workdir, mesh=mesh)
  q = restored.layers[0].self_attn.q_proj.kernel.value
  assert q.addressable_shards[0].data.nbytes * 2 == q.nbytes  # restored tensor-split
  ids = jnp.asarray([PROMPT])
  np.testing.assert_allclose(np.asarray(restored(ids)), np.asarray(model(ids)), atol=1e-5)


def test_engine_rejects_bad_settings(model):
  with pytest.raises(ValueError, match="prefill buckets"):
    je.QwenEngine(model, max_prefill_length=100)
  engine = _engine(model)
  with pytest.raises(NotImplementedError):
    engine.prefill(params=engine.load_params(), existing_prefix=object(),
                   padded_tokens=np.zeros(16, np.int32), true_length=3)


def _requests(engine, script):
  """Runs `script` (("insert", slot, prompt) or ("generate", steps)) on a fresh decode state;
  returns each inserted request's valid (tokens, log-probs) and the final state."""
  params, state = engine.load_params(), engine.init_decode_state()
  out, in_slot = [], {}
  for op, *args in script:
    if op == "insert":
      slot, prompt = args
      padded, n = _jetstream_pad(prompt)
      state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n),
                            state, slot=slot)
      in_slot[slot] = len(out)
      out.append(([], []))
      continue
    for _ in range(args[0]):
      state, res = engine.generate(params, state)
      res = res.convert_to_numpy()
      for slot, r in in_slot.items():
        if res.get_result_at_slot(slot).valid[0, 0]:
          out[r][0].append(int(res.get_result_at_slot(slot).tokens[0, 0]))
          out[r][1].append(float(res.get_logprobs_at_slot(slot)[0, 0]))
  return out, state


def test_paged_engine_matches_dense_and_frees_pages(model):
  """Sampled (temperature 1) tokens and log-probs of the paged engine equal the dense engine's,
  with slots reused after a finished request (its pages freed) and while one runs; every page
  is back in the pool at the end, and nothing retraces after the first calls."""
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R)
  dense, paged = (je.QwenEngine(model, max_concurrent_decodes=3, max_prefill_length=16,
                                sampling=sampling, seed=3, kv_cache=kv, page_size=4)
                  for kv in ("dense", "paged"))
  assert dense.paged is None and paged.paged.num_pages == 3 * 7  # 3 slots x ceil(28 / 4)
  script = [("insert", 0, NEIGHBOUR), ("generate", 3), ("insert", 2, PROMPT), ("generate", 4),
            ("insert", 1, [5] * 15), ("generate", 6),  # the first request ends (R tokens)
            ("insert", 0, PROMPT[:3]),  # into the finished slot
            ("insert", 2, [9, 1]),  # over a running request
            ("generate", R + 1)]
  want, _ = _requests(dense, script)
  got, state = _requests(paged, script)
  assert [len(t) for t, _ in got] == [R, 10, R, R, R]  # the second was replaced
  for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
    assert tokens == ref_tokens[:len(tokens)]
    np.testing.assert_allclose(logprobs, ref_logprobs[:len(tokens)], atol=1e-6)
  assert not np.asarray(state.active).any() and int(state.lost) == 0
  assert int(state.decode.cache.free_pages()) == paged.paged.num_pages
  assert (np.asarray(state.decode.cache.table) == -1).all()
  before = je.TRACES.snapshot()
  again, _ = _requests(paged, script)  # a fresh decode state of the same engine
  assert je.TRACES.snapshot() == before
  assert [t for t, _ in again] != [t for t, _ in got]  # the prefill counter moved the keys on


def test_paged_engine_pool_too_small_is_an_error(model):
  kw = dict(max_concurrent_decodes=2, max_prefill_length=16, kv_cache="paged", page_size=4,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=R))
  with pytest.raises(ValueError, match=r"rollout.kv_pages=6 .* use at least 7"):
    je.QwenEngine(model, kv_pages=6, **kw)
  engine = je.QwenEngine(model, kv_pages=7, **kw)  # one full-length request
  params, state = engine.load_params(), engine.init_decode_state()
  padded, n = _jetstream_pad(PROMPT)
  prefix = lambda: engine.prefill(params=params, padded_tokens=padded, true_length=n)
  state = engine.insert(prefix(), state, slot=0)
  second = prefix()
  with pytest.raises(RuntimeError, match=r"rollout.kv_pages=7 .* cannot take a request into "
                                         r"slot 1.* hold 7"):
    engine.insert(second, state, slot=1)
  for _ in range(R):  # the first request ends and gives its pages back
    state, _ = engine.generate(params, state)
  state = engine.insert(second, state, slot=1)
  state, res = engine.generate(params, state)
  assert res.convert_to_numpy().get_result_at_slot(1).valid[0, 0] and int(state.lost) == 0
