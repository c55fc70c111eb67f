"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single or sharded).

Loading reads one tensor at a time (memory-mapped by safetensors), converts it to our layout and
places it straight into its target sharding, so the host never holds more than one full tensor.
Only safetensors are read: no pickle (``pytorch_model.bin``) is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from dapo_jax import sharding as shd
from dapo_jax.models.config import Qwen2Config
from dapo_jax.models.init import abstract_model
from dapo_jax.models.qwen2 import Qwen2ForCausalLM

_log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "char_tokenizer.json")
# Input dims of each projection's kernel: o_proj contracts over (heads, head_dim).
_N_IN = {"o_proj": 2}


class CheckpointError(ValueError):
  """A Hugging Face checkpoint that cannot be loaded as asked; the message names the cause."""


def hf_name(path: tuple[Any, ...]) -> str:
  """Our parameter path -> the HF tensor name (``('layers', 0, 'mlp', 'up_proj', 'kernel')``)."""
  if path == ("embed_tokens",):
    return "model.embed_tokens.weight"
  if path == ("lm_head",):
    return "lm_head.weight"
  parts = [str(p) for p in path]
  leaf = parts[-1]
  parts[-1] = "bias" if leaf == "bias" else "weight"
  return "model." + ".".join(parts)


def _to_ours(path: tuple[Any, ...], w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """HF ``nn.Linear`` weights are [out, in]; our kernels are [*in, *out]."""
  leaf = path[-1]
  if path == ("lm_head",):
    w = w.T
  elif leaf == "kernel":
    w = w.T.reshape(shape)
  elif leaf == "bias":
    w = w.reshape(shape)
  return w


def _to_hf(path: tuple[Any, ...], w: np.ndarray) -> np.ndarray:
  leaf = path[-1]
  if path == ("lm_head",):
    return np.ascontiguousarray(w.T)
  if leaf == "kernel":
    n_in = _N_IN.get(str(path[-2]), 1)
    return np.ascontiguousarray(
        w.reshape(math.prod(w.shape[:n_in]), math.prod(w.shape[n_in:])).T)
  if leaf == "bias":
    return w.reshape(-1)
  return w


def _weight_map(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      mapping = json.load(f)["weight_map"]
    missing = sorted({v for v in mapping.values() if not os.path.exists(os.path.join(path, v))})
    if missing:
      raise CheckpointError(f"{index} lists shard files that are missing: {missing}.")
    return {k: os.path.join(path, v) for k, v in mapping.items()}
  single = os.path.join(path, SINGLE_FILE)
  if os.path.exists(single):
    with safe_open(single, framework="numpy") as f:
      return {k: single for k in f.keys()}
  present = sorted(os.listdir(path))
  hint = (" Only safetensors are loaded (pickle files are never read); convert with "
          "`transformers` save_pretrained(safe_serialization=True)."
          if any(p.endswith((".bin", ".pt", ".pth")) for p in present) else "")
  raise CheckpointError(f"No {SINGLE_FILE} or {INDEX_FILE} in {path} (found {present}).{hint}")


class _Reader:
  """Opens each safetensors file once and reads tensors by name."""

  def __init__(self, weight_map: dict[str, str]):
    self.weight_map = weight_map
    self._handles: dict[str, Any] = {}

  def get(self, name: str) -> np.ndarray:
    file = self.weight_map[name]
    if file not in self._handles:
      self._handles[file] = safe_open(file, framework="numpy")
    return self._handles[file].get_tensor(name)

  def close(self):
    self._handles.clear()


def load_pretrained(path: str | os.PathLike, dtype: str | None = None, mesh: Mesh | None = None,
                    rules: shd.Rules = shd.TRAIN_RULES, **config_overrides) -> Qwen2ForCausalLM:
  """Loads a HF Qwen2 / Qwen2.5 checkpoint directory as a ``Qwen2ForCausalLM``.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or sharded files plus
      ``model.safetensors.index.json``).
    dtype: parameter (and compute) dtype, e.g. "float32" or "bfloat16"; default float32.
    mesh: when given, each tensor is placed straight into its sharded layout under ``rules``.
    rules: logical-axis rules (``dapo_jax.sharding.TRAIN_RULES`` or ``SAMPLE_RULES``).
    **config_overrides: run-time fields of ``Qwen2Config`` (``remat``, ``attention_impl``, ...).
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Checkpoint directory {path} does not exist.")
  overrides = dict(config_overrides)
  if dtype is not None:
    overrides.setdefault("param_dtype", dtype)
    overrides.setdefault("dtype", dtype)
  config = Qwen2Config.from_hf(path, **overrides)
  graphdef, abstract_state = nnx.split(abstract_model(config))
  shardings = (shd.state_shardings(abstract_state, mesh, rules) if mesh is not None else None)
  reader = _Reader(_weight_map(path))
  flat = nnx.to_flat_state(abstract_state)
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  loaded = []
  try:
    for p, var in flat:
      name = hf_name(p)
      if name not in reader.weight_map:
        raise CheckpointError(f"Tensor {name!r} (parameter {'/'.join(map(str, p))}) is missing "
                              f"from the checkpoint at {path}.")
      shape = tuple(var.value.shape)
      raw = reader.get(name)
      w = _to_ours(p, raw, shape) if raw.size == math.prod(shape) else raw
      if tuple(w.shape) != shape:
        raise CheckpointError(f"Tensor {name!r} has shape {tuple(raw.shape)} but config.json "
                              f"implies {shape} (after layout conversion) for "
                              f"{'/'.join(map(str, p))}.")
      w = w.astype(var.value.dtype)
      if mesh is not None:
        sharding: NamedSharding = flat_shardings[p].value
        arr = jax.make_array_from_callback(shape, sharding, lambda idx, w=w: w[idx])
      else:
        arr = jnp.asarray(w)
      loaded.append((p, var.replace(arr)))
      del raw, w
  finally:
    reader.close()
  unused = set(reader.weight_map) - {hf_name(p) for p, _ in flat}
  unused = {n for n in unused if "rotary_emb" not in n and n != "lm_head.weight"}
  if unused:
    _log.warning("Ignored %d checkpoint tensors not used by Qwen2ForCausalLM: %s", len(unused),
                 sorted(unused)[:8])
  return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _host_array(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def iter_hf_tensors(model: Qwen2ForCausalLM, dtype: str | None = None
                    ) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, host array) pairs, one tensor gathered at a time."""
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    w = _host_array(var.value)
    if dtype is not None:
      w = w.astype(jnp.dtype(dtype))
    yield hf_name(p), _to_hf(p, w)


def save_pretrained(model: Qwen2ForCausalLM, out_dir: str | os.PathLike, *,
                    dtype: str | None = None, max_shard_bytes: int = 2 << 30,
                    tokenizer_dir: str | os.PathLike | None = None) -> str:
  """Exports ``model`` as a HF checkpoint that ``transformers`` (and vLLM, SGLang...) load.

  Tensors are gathered one at a time and written in shards of at most ``max_shard_bytes``; only
  process 0 writes. Tokenizer files found in ``tokenizer_dir`` are copied alongside.
  """
  out_dir = os.fspath(out_dir)
  write = jax.process_index() == 0
  if write:
    os.makedirs(out_dir, exist_ok=True)
  config = model.config
  out_dtype = dtype or config.param_dtype
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  files: list[str] = []

  def flush():
    nonlocal size
    if shards[-1]:
      files.append(f"part-{len(files):05d}")
      if write:
        save_file(shards[-1], os.path.join(out_dir, files[-1] + ".tmp"),
                  metadata={"format": "pt"})
      shards[-1] = {}
      size = 0

  weight_map = {}
  total = 0
  for name, w in iter_hf_tensors(model, out_dtype):
    total += w.nbytes
    if size and size + w.nbytes > max_shard_bytes:
      flush()
    shards[-1][name] = w
    weight_map[name] = len(files)
    size += w.nbytes
  flush()
  if write:
    n = len(files)
    names = ([SINGLE_FILE] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    for tmp, final in zip(files, names):
      os.replace(os.path.join(out_dir, tmp + ".tmp"), os.path.join(out_dir, final))
    if n > 1:
      index = {"metadata": {"total_size": total},
               "weight_map": {k: names[v] for k, v in weight_map.items()}}
      with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
      json.dump(config.to_hf(out_dtype), f, indent=2)
    if tokenizer_dir is not None:
      for fname in TOKENIZER_FILES:
        src = os.path.join(os.fspath(tokenizer_dir), fname)
        if os.path.exists(src):
          shutil.copy(src, os.path.join(out_dir, fname))
  return out_dir
