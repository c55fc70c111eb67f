"""Our Qwen2 against ``transformers`` on tiny random checkpoints (fp32, max |diff| < 1e-4)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dapo_jax  # pylint: disable=g-import-not-at-top
from dapo_jax.checkpoints import hf as hf_io  # pylint: disable=g-import-not-at-top
from dapo_jax.models import default_positions  # pylint: disable=g-import-not-at-top
from tests import hf_fixtures  # pylint: disable=g-import-not-at-top

TOL = 1e-4


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(request, tmp_path_factory):
  d = str(tmp_path_factory.mktemp("qwen2") / ("tied" if request.param else "untied"))
  return hf_fixtures.write_tiny_qwen2(d, tie=request.param, seed=int(request.param))


# Both decoder layouts: a Python loop over layers, and one stacked layer under jax.lax.scan.
layouts = pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])


def _ids(b, t, seed=0, vocab=128):
  return np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)


@layouts
def test_full_forward_matches_transformers(ckpt, scan):
  model = dapo_jax.load_pretrained(ckpt, scan_layers=scan)
  ids = _ids(3, 17)
  ours = np.asarray(model(jnp.asarray(ids)))
  ref = hf_fixtures.hf_logits(ckpt, ids)
  assert ours.shape == ref.shape == (3, 17, 128)
  assert np.abs(ours - ref).max() < TOL
  assert model.config.tie_word_embeddings == (os.path.basename(ckpt) == "tied")


def test_left_padded_batch_matches_transformers(ckpt):
  model = dapo_jax.load_pretrained(ckpt)
  ids = _ids(3, 12, seed=1)
  mask = np.ones_like(ids)
  mask[0, :5] = 0  # left padding of different lengths
  mask[1, :2] = 0
  ids = np.where(mask == 1, ids, 0)
  ours = np.asarray(model(jnp.asarray(ids), attention_mask_BxT=jnp.asarray(mask)))
  pos = np.asarray(default_positions(jnp.asarray(mask)))
  ref = hf_fixtures.hf_logits(ckpt, ids, attention_mask=mask, positions=pos)
  real = mask.astype(bool)
  assert np.abs(ours[real] - ref[real]).max() < TOL
  # Each padded row equals the same prompt run alone without padding.
  alone = np.asarray(model(jnp.asarray(ids[:1, 5:])))
  assert np.abs(alone[0] - ours[0, 5:]).max() < TOL


def _decode(model, cache, ids_NxT, pos_NxT, same_slot):
  """`model.decode_step` (the one every sampler uses) over T columns, compiled once."""
  step = jax.jit(lambda m, c, tok, pos: m.decode_step(tok, pos, c, same_slot=same_slot))
  got = []
  for t in range(ids_NxT.shape[1]):
    logits_NxV, cache = step(model, cache, jnp.asarray(ids_NxT[:, t]), jnp.asarray(pos_NxT[:, t]))
    got.append(np.asarray(logits_NxV))
  return np.stack(got, axis=1), cache


@layouts
def test_prefill_then_kv_cache_decode_matches_transformers(ckpt, scan):
  """A left-padded batch at one shared slot (the static sampler's write: one
  dynamic_update_slice per layer) and a right-padded one whose rows sit at different slots
  (JetStream's decode slots: a per-row scatter) both reproduce the full HF forward; the scanned
  model's cache is one stacked [L, ...] array per k and v."""
  model = dapo_jax.load_pretrained(ckpt, scan_layers=scan)
  ids = _ids(2, 14, seed=2)
  mask = np.ones_like(ids)
  mask[1, :3] = 0
  ids = np.where(mask == 1, ids, 0)
  pos = np.asarray(default_positions(jnp.asarray(mask)))
  ref = hf_fixtures.hf_logits(ckpt, ids, attention_mask=mask, positions=pos)
  prompt_len, real = 6, mask.astype(bool)

  h, cache = model.prefill(jnp.asarray(ids[:, :prompt_len]), jnp.asarray(pos[:, :prompt_len]),
                           jnp.asarray(mask[:, :prompt_len]))
  assert cache.k[0].shape == (2, 2, 16, prompt_len)  # [N, K, E, S]
  assert cache.v[0].shape == (2, 2, prompt_len, 16)  # [N, K, S, E]
  assert cache.stacked == scan
  got, cache = _decode(model, cache.grow(14 - prompt_len), ids[:, prompt_len:],
                       pos[:, prompt_len:], same_slot=True)
  got = np.concatenate([np.asarray(model.logits_from_hidden(h)), got], axis=1)
  assert np.abs(got[real] - ref[real]).max() < TOL
  assert cache.index.tolist() == [14, 14] and bool(cache.valid[1, 3:].all())

  # Row 1 again, right-padded: prompt = its 3 real tokens, then its slots run 3 behind row 0.
  right_ids = ids.copy()
  right_ids[1, :3], right_ids[1, 3:prompt_len] = ids[1, 3:prompt_len], 0
  right_mask = np.ones_like(mask)
  right_mask[1, 3:prompt_len] = 0
  h, cache = model.prefill(jnp.asarray(right_ids[:, :prompt_len]),
                           jnp.asarray(default_positions(jnp.asarray(right_mask))[:, :prompt_len]),
                           jnp.asarray(right_mask[:, :prompt_len]))
  cache = cache.replace(index=jnp.asarray([prompt_len, 3], jnp.int32))
  got, cache = _decode(model, cache.grow(14 - prompt_len), ids[:, prompt_len:],
                       pos[:, prompt_len:], same_slot=False)
  prefill_logits = np.asarray(model.logits_from_hidden(h))
  assert np.abs(prefill_logits[0] - ref[0, :prompt_len]).max() < TOL
  assert np.abs(prefill_logits[1, :3] - ref[1, 3:prompt_len]).max() < TOL
  assert np.abs(got - ref[:, prompt_len:]).max() < TOL
  assert cache.index.tolist() == [14, 11]
  assert cache.valid[1].tolist() == [True] * 11 + [False] * 3  # decode overwrote the padding


def test_export_reload_with_transformers(ckpt, tmp_path):
  model = dapo_jax.load_pretrained(ckpt)
  out = hf_io.save_pretrained(model, tmp_path / "export", max_shard_bytes=20_000)
  assert os.path.exists(os.path.join(out, hf_io.INDEX_FILE))  # forced into several shards
  ids = _ids(2, 9, seed=3)
  ref = hf_fixtures.hf_logits(ckpt, ids)
  exported = hf_fixtures.hf_logits(out, ids)
  assert np.abs(exported - ref).max() < TOL
  # And our own loader reads the sharded export back.
  again = dapo_jax.load_pretrained(out)
  assert np.abs(np.asarray(again(jnp.asarray(ids))) - ref).max() < TOL


def test_scanned_model_exports_the_same_safetensors(ckpt, tmp_path):
  """The stacked layout is ours only: its HF export is byte for byte the unscanned one's, and
  each layout reads the other's export."""
  loop = dapo_jax.load_pretrained(ckpt)
  scanned = dapo_jax.load_pretrained(ckpt, scan_layers=True)
  a = hf_io.save_pretrained(loop, tmp_path / "loop")
  b = hf_io.save_pretrained(scanned, tmp_path / "scan")
  names = sorted(os.listdir(a))
  assert names == sorted(os.listdir(b))
  for name in names:
    with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
      assert fa.read() == fb.read(), name
  ids = jnp.asarray(_ids(2, 9, seed=6))
  np.testing.assert_array_equal(np.asarray(dapo_jax.load_pretrained(b)(ids)),
                                np.asarray(loop(ids)))


def test_bf16_load_runs_close_to_fp32(ckpt):
  model = dapo_jax.load_pretrained(ckpt, dtype="bfloat16")
  ids = _ids(2, 8, seed=4)
  assert model.embed_tokens.value.dtype == jnp.bfloat16
  ours = np.asarray(model(jnp.asarray(ids)))
  ref = hf_fixtures.hf_logits(ckpt, ids)
  assert ours.dtype == np.float32
  assert np.abs(ours - ref).max() < 0.1  # bf16 rounding, not a layout error


# --- clear errors ---------------------------------------------------------------------------


def test_missing_directory_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    dapo_jax.load_pretrained(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="config.json"):
    dapo_jax.load_pretrained(tmp_path / "empty")


def test_pickle_only_checkpoint_is_refused(ckpt, tmp_path):
  d = tmp_path / "bin"
  d.mkdir()
  (d / "config.json").write_text(open(os.path.join(ckpt, "config.json")).read())
  (d / "pytorch_model.bin").write_bytes(b"not unpickled")
  with pytest.raises(hf_io.CheckpointError, match="pickle"):
    dapo_jax.load_pretrained(d)


def test_unknown_architecture(ckpt, tmp_path):
  d = tmp_path / "llama"
  d.mkdir()
  cfg = json.load(open(os.path.join(ckpt, "config.json")))
  cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="LlamaForCausalLM"):
    dapo_jax.load_pretrained(d)


def _copy_with_tensors(ckpt, d, edit):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  d.mkdir()
  (d / "config.json").write_text(open(os.path.join(ckpt, "config.json")).read())
  tensors = load_file(os.path.join(ckpt, "model.safetensors"))
  edit(tensors)
  save_file(tensors, str(d / "model.safetensors"))


def test_missing_tensor_is_named(ckpt, tmp_path):
  name = "model.layers.1.mlp.up_proj.weight"
  _copy_with_tensors(ckpt, tmp_path / "m", lambda t: t.pop(name))
  with pytest.raises(hf_io.CheckpointError, match=name.replace(".", r"\.")):
    dapo_jax.load_pretrained(tmp_path / "m")


def test_misshaped_tensor_is_named(ckpt, tmp_path):
  name = "model.layers.0.self_attn.k_proj.weight"
  _copy_with_tensors(ckpt, tmp_path / "s", lambda t: t.update({name: t[name][:-1]}))
  with pytest.raises(hf_io.CheckpointError, match=r"k_proj\.weight.*shape"):
    dapo_jax.load_pretrained(tmp_path / "s")


@layouts
def test_load_straight_into_sharded_layout(ckpt, scan):
  from dapo_jax.infra import sharding as shd  # pylint: disable=g-import-not-at-top
  mesh = shd.make_mesh([("data", 1), ("fsdp", 4), ("tensor", 2)])
  model = dapo_jax.load_pretrained(ckpt, mesh=mesh, scan_layers=scan)
  if scan:  # [2 layers, 64, 96]: the layer axis unsharded
    up = model.layers.mlp.up_proj.kernel.value
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (2, 16, 48)
  else:  # [64, 96]: fsdp x tensor
    up = model.layers[0].mlp.up_proj.kernel.value
    assert up.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (16, 48)
  ids = _ids(2, 9, seed=5)
  ref = hf_fixtures.hf_logits(ckpt, ids)
  assert np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max() < TOL


@layouts
def test_load_holds_at_most_one_full_tensor_on_host(ckpt, scan, monkeypatch):
  """Each tensor read from disk is released before the next one is read."""
  import weakref  # pylint: disable=g-import-not-at-top
  alive, peak = [0], [0]
  original = hf_io._Reader.get

  def tracked(self, name):
    arr = original(self, name)
    alive[0] += 1
    peak[0] = max(peak[0], alive[0])
    weakref.finalize(arr, lambda: alive.__setitem__(0, alive[0] - 1))
    return arr

  monkeypatch.setattr(hf_io._Reader, "get", tracked)
  dapo_jax.load_pretrained(ckpt, scan_layers=scan)
  assert peak[0] == 1
