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
import struct
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save, save_file

from dapo_jax.infra import run_files
from dapo_jax.infra import sharding as shd
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


class MissingCheckpointError(FileNotFoundError):
  """``config.model.checkpoint`` names no directory: a user's mistake, answered in one line."""


def check_checkpoint_dir(path: str) -> None:
  """Raises `MissingCheckpointError` when ``path`` (``config.model.checkpoint``, local or
  ``gs://``; "" = none) is not a directory. The commands call it before they build or write
  anything, so a typo is one line, not a traceback after minutes of start-up."""
  if not path:
    return
  resolved = run_files.resolve(path)
  try:
    found = resolved.is_dir()
  except FileNotFoundError:  # gcsfs: no such bucket
    found = False
  if not found:
    raise MissingCheckpointError(
        f"config.model.checkpoint={path!r}: no such directory {resolved} (expected a Hugging "
        "Face checkpoint directory, config.json and *.safetensors, local or gs://).")


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


def layer_paths(path: tuple[Any, ...], var: nnx.Variable, config: Qwen2Config
                ) -> list[tuple[tuple[Any, ...], int | None]]:
  """The per-layer parameter paths (as the unscanned model names them) a parameter holds, each
  with its index on the stacked axis: a scanned model's ``('layers', 'mlp', ...)`` [L, ...] is
  ``('layers', l, 'mlp', ...)`` for each l; any other parameter is itself (index None)."""
  if config.scan_layers and path[0] == "layers":
    return [(("layers", i) + tuple(path[1:]), i) for i in range(var.shape[0])]
  return [(path, None)]


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


# safetensors dtype names -> numpy (little-endian, as the format stores them).
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4",
              "U16": "<u2", "U8": "u1", "BOOL": "?"}


class _RemoteSafetensors:
  """A safetensors file on ``gs://`` (any epath URL), read with ranged reads: the header once,
  then each tensor's bytes on request, so the host holds one tensor at a time, as with the
  memory map `safe_open` uses for local files."""

  def __init__(self, path: epath.Path):
    self._file = path.open("rb")
    (n,) = struct.unpack("<Q", self._file.read(8))
    self._header = json.loads(self._file.read(n))
    self._header.pop("__metadata__", None)
    self._base = 8 + n

  def keys(self) -> list[str]:
    return list(self._header)

  def get_tensor(self, name: str) -> np.ndarray:
    info = self._header[name]
    start, end = info["data_offsets"]
    self._file.seek(self._base + start)
    data = self._file.read(end - start)
    return np.frombuffer(data, dtype=_ST_DTYPES[info["dtype"]]).reshape(info["shape"])

  def close(self) -> None:
    self._file.close()


def _open_safetensors(file: epath.Path) -> Any:
  if run_files.is_remote(file):
    return _RemoteSafetensors(file)
  return safe_open(os.fspath(file), framework="numpy")


def _weight_map(path: epath.Path) -> dict[str, epath.Path]:
  """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
  index = path / INDEX_FILE
  if index.exists():
    mapping = json.loads(index.read_text())["weight_map"]
    missing = sorted({v for v in mapping.values() if not (path / v).exists()})
    if missing:
      raise CheckpointError(f"{index} lists shard files that are missing: {missing}.")
    return {k: path / v for k, v in mapping.items()}
  single = path / SINGLE_FILE
  if single.exists():
    handle = _open_safetensors(single)
    keys = list(handle.keys())
    if isinstance(handle, _RemoteSafetensors):
      handle.close()
    return {k: single for k in keys}
  present = sorted(p.name for p in path.iterdir())
  hint = (" Only safetensors are loaded (pickle files are never read); convert with "
          "`transformers` save_pretrained(safe_serialization=True)."
          if any(p.endswith((".bin", ".pt", ".pth")) for p in present) else "")
  raise CheckpointError(f"No {SINGLE_FILE} or {INDEX_FILE} in {path} (found {present}).{hint}")


class _Reader:
  """Opens each safetensors file once and reads tensors by name."""

  def __init__(self, weight_map: dict[str, epath.Path]):
    self.weight_map = weight_map
    self._handles: dict[epath.Path, Any] = {}

  def get(self, name: str) -> np.ndarray:
    file = self.weight_map[name]
    if file not in self._handles:
      self._handles[file] = _open_safetensors(file)
    return self._handles[file].get_tensor(name)

  def close(self):
    for handle in self._handles.values():
      if isinstance(handle, _RemoteSafetensors):
        handle.close()
    self._handles.clear()


def read_hf_config(path: epath.PathLike) -> dict[str, Any]:
  """A checkpoint directory's ``config.json`` (local or ``gs://``) as a dict."""
  file = run_files.resolve(path) / "config.json"
  if not file.exists():
    raise FileNotFoundError(f"No config.json at {file}: is this a Hugging Face checkpoint?")
  return json.loads(file.read_text())


def load_pretrained(path: str | os.PathLike, dtype: str | None = None, mesh: Mesh | None = None,
                    rules: shd.Rules = shd.TRAIN_RULES, **config_overrides) -> Qwen2ForCausalLM:
  """Loads a HF Qwen2 / Qwen2.5 / Qwen3 (dense) checkpoint directory as a ``Qwen2ForCausalLM``
  (Qwen3's ``q_norm`` / ``k_norm`` weights are the attention's norm scales; `hf_name`).

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or sharded files plus
      ``model.safetensors.index.json``); a local path or a URL (``gs://bucket/model``).
    dtype: parameter (and compute) dtype, e.g. "float32" or "bfloat16"; default float32.
    mesh: when given, each tensor is placed straight into its sharded layout under ``rules``.
    rules: logical-axis rules (``dapo_jax.infra.sharding.TRAIN_RULES`` or ``SAMPLE_RULES``).
    **config_overrides: run-time fields of ``Qwen2Config`` (``remat``, ``attention_impl``, ...).
  """
  path = run_files.resolve(path)
  if not path.is_dir():
    raise FileNotFoundError(f"Checkpoint directory {path} does not exist.")
  overrides = dict(config_overrides)
  if dtype is not None:
    overrides.setdefault("param_dtype", dtype)
    overrides.setdefault("dtype", dtype)
  config = Qwen2Config.from_hf(read_hf_config(path), **overrides)
  graphdef, abstract_state = nnx.split(abstract_model(config))
  shardings = (shd.state_shardings(abstract_state, mesh, rules) if mesh is not None else None)
  reader = _Reader(_weight_map(path))
  flat = nnx.to_flat_state(abstract_state)
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  loaded, names = [], set()

  def read(p, shape, dtype, sharding):
    """One HF tensor as parameter `p` of `shape`, placed in `sharding` (None: default device)."""
    name = hf_name(p)
    if name not in reader.weight_map:
      raise CheckpointError(f"Tensor {name!r} (parameter {'/'.join(map(str, p))}) is missing "
                            f"from the checkpoint at {path}.")
    names.add(name)
    raw = reader.get(name)
    w = _to_ours(p, raw, shape) if raw.size == math.prod(shape) else raw
    if tuple(w.shape) != shape:
      raise CheckpointError(f"Tensor {name!r} has shape {tuple(raw.shape)} but config.json "
                            f"implies {shape} (after layout conversion) for "
                            f"{'/'.join(map(str, p))}.")
    w = w.astype(dtype)
    if sharding is None:
      return jnp.asarray(w)
    return jax.make_array_from_callback(shape, sharding, lambda idx: w[idx])

  try:
    for p, var in flat:
      shape, dtype = tuple(var.value.shape), var.value.dtype
      sharding: NamedSharding | None = flat_shardings[p].value if mesh is not None else None
      per_layer = layer_paths(p, var, config)
      if per_layer[0][1] is None:
        arr = read(p, shape, dtype, sharding)
      else:  # a stacked parameter: each layer in its own layout, then stacked on the devices
        layer_sharding = (None if sharding is None else
                          NamedSharding(mesh, PartitionSpec(*sharding.spec[1:])))
        layers = [read(lp, shape[1:], dtype, layer_sharding) for lp, _ in per_layer]
        arr = (jnp.stack(layers) if sharding is None else
               jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*layers))
        del layers
      loaded.append((p, var.replace(arr)))
  finally:
    reader.close()
  unused = set(reader.weight_map) - names
  unused = {n for n in unused if "rotary_emb" not in n and n != "lm_head.weight"}
  if unused:
    _log.warning("Ignored %d checkpoint tensors not used by the %s decoder: %s", len(unused),
                 config.model_type, sorted(unused)[:8])
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
    for lp, i in layer_paths(p, var, model.config):
      w = _host_array(var.value if i is None else var.value[i])
      if dtype is not None:
        w = w.astype(jnp.dtype(dtype))
      yield hf_name(lp), _to_hf(lp, w)


def _new_file_mode() -> int:
  """The mode ``open()`` gives a new file: 0666 less the process umask."""
  umask = os.umask(0)  # the only portable way to read it
  os.umask(umask)
  return 0o666 & ~umask


def save_pretrained(model: Qwen2ForCausalLM, out_dir: epath.PathLike, *,
                    dtype: str | None = None, max_shard_bytes: int = 2 << 30,
                    tokenizer_dir: epath.PathLike | None = None) -> epath.Path:
  """Exports ``model`` as a HF checkpoint that ``transformers`` (and vLLM, SGLang...) load.

  Tensors are gathered one at a time and written in shards of at most ``max_shard_bytes``; only
  process 0 writes. Tokenizer files found in ``tokenizer_dir`` are copied alongside. Either
  directory may be a local path or a URL (``gs://``).
  """
  out_dir = run_files.resolve(out_dir)
  write = jax.process_index() == 0
  if write:
    out_dir.mkdir(parents=True, exist_ok=True)
  config = model.config
  out_dtype = dtype or config.param_dtype
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  files: list[str] = []

  def flush():
    nonlocal size
    if shards[-1]:
      files.append(f"part-{len(files):05d}")
      if write:  # Written now, named once the number of shards is known.
        tmp = out_dir / (files[-1] + ".tmp")
        if run_files.is_remote(tmp):
          tmp.write_bytes(save(shards[-1], metadata={"format": "pt"}))
        else:
          save_file(shards[-1], os.fspath(tmp), metadata={"format": "pt"})
          os.chmod(tmp, _new_file_mode())  # save_file writes through a tempfile: mode 0600
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
      (out_dir / (tmp + ".tmp")).replace(out_dir / final)
    if n > 1:
      index = {"metadata": {"total_size": total},
               "weight_map": {k: names[v] for k, v in weight_map.items()}}
      run_files.write_text_atomic(out_dir / INDEX_FILE, json.dumps(index, indent=2))
    run_files.write_text_atomic(out_dir / "config.json",
                                json.dumps(config.to_hf(out_dtype), indent=2))
    if tokenizer_dir is not None:
      for fname in TOKENIZER_FILES:
        src = run_files.resolve(tokenizer_dir) / fname
        if src.exists():
          run_files.write_bytes_atomic(out_dir / fname, src.read_bytes())
  return out_dir
