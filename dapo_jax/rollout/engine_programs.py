"""The continuous engine's programs compiled ahead of time, the engine state in the layout the
decode chunk's compiler picks.

`slot_programs` holds the three programs as plain `jax.jit` functions, whose engine state
crosses every call in XLA's default (row-major) layout. libtpu keeps the KV cache inside the
chunk's decode loop in another layout (for the stacked cache, slots before heads), so with the
default layout at the call boundary it copied the whole cache in on every chunk call and back
out: a temporary of the whole cache (22.1 GiB per chip for the 32B v5p-64 row of docs/planning.md).
Here the chunk is compiled with the engine's layouts left to the compiler (`Layout.AUTO`, in
and out, donated), and `init` and `enqueue` are compiled to produce and take exactly the
layouts the chunk chose, so the state is created in them and never relaid out. On CPU the
compiler picks the default layouts: nothing changes there.

One `EnginePrograms` serves every stream of one shape (model graph, mesh, slots, chunk size,
queue, samples, prompt and cache length, sampling parameters, and the parameters' shapes,
dtypes and shardings): `programs_for` keeps the most recent `CACHE_SIZE` of them for the whole
process, as `jax.jit`'s own cache would, so a trainer step (or another sampler of the same
shape) compiles nothing new.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from dapo_jax.rollout import slot_programs as prog
from dapo_jax.rollout.sampling import SamplingParams

CACHE_SIZE = 32  # stream shapes whose compiled programs the process keeps
ENQUEUE_ARGS = 7  # tokens [M, P], true length, key id, seq [M], budget [M, G], entry, shard [M]


def replicated_sharding(mesh: Mesh | None, state: Any = None):
  """Where the programs' host inputs and the chunk's outputs live: replicated over `mesh`, or
  without one on the device of `state` (default: the first device)."""
  if mesh is not None:
    return NamedSharding(mesh, PartitionSpec())
  leaf = jax.tree.leaves(state)[0] if state is not None else None
  device = min(leaf.sharding.device_set, key=lambda d: d.id) if leaf is not None else (
      jax.devices()[0])
  return SingleDeviceSharding(device)


def _auto(shardings: Any) -> Any:
  return jax.tree.map(lambda s: Format(Layout.AUTO, s), shardings)


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def signature(state: nnx.State) -> tuple:
  """What of the parameters a compiled program depends on: structure, shapes, dtypes, layout."""
  leaves, treedef = jax.tree.flatten(state)
  return treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


def lower_chunk(state: Any, engine: Any, *, graphdef: nnx.GraphDef, params: SamplingParams,
                mesh: Mesh | None, chunk_steps: int, max_admit: int,
                paged: prog.PagedSpec | None = None):
  """The chunk lowered with the engine state's layouts (in = out, donated) left to the
  compiler. `state` and `engine`: arrays or ShapeDtypeStructs carrying their shardings."""
  rep = replicated_sharding(mesh, state)
  key_data = jax.random.key_data(jax.random.key(0))
  st_sh = jax.tree.map(lambda x: x.sharding, state)
  eng_sh = jax.tree.map(lambda x: x.sharding, engine)
  fn = functools.partial(prog.chunk_program.__wrapped__, graphdef=graphdef, params=params,
                         mesh=mesh, chunk_steps=chunk_steps, max_admit=max_admit, paged=paged)
  jitted = jax.jit(fn, in_shardings=(st_sh, _auto(eng_sh), rep, rep),
                   out_shardings=(_auto(eng_sh), rep), donate_argnums=(1,))
  return jitted.lower(_abstract(state, st_sh), _abstract(engine, eng_sh),
                      jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=rep),
                      jax.ShapeDtypeStruct((), bool, sharding=rep))


def lower_init(state: Any, *, out_formats: Any = None, **static):
  """`slot_programs.init_program` lowered; `out_formats` (the chunk's engine input formats)
  makes it create the state in those layouts."""
  st_sh = jax.tree.map(lambda x: x.sharding, state)
  fn = functools.partial(prog.init_program.__wrapped__, **static)
  # Without a mesh the program reads no parameter value (only shapes), so nothing would tie it
  # to the parameters' device: pinned there (rollout_devices puts them off the default one).
  kwargs = ({"out_shardings": out_formats} if out_formats is not None else
            {} if static.get("mesh") is not None else
            {"out_shardings": replicated_sharding(None, state)})
  return jax.jit(fn, in_shardings=(st_sh,), **kwargs).lower(_abstract(state, st_sh))


class EnginePrograms:
  """`init`, `enqueue` and `chunk` of one stream shape (see the module docstring)."""

  def __init__(self, state: nnx.State, *, graphdef: nnx.GraphDef, mesh: Mesh | None,
               num_slots: int, queue_size: int, num_samples: int, prompt_length: int,
               cache_length: int, params: SamplingParams, chunk_steps: int, max_admit: int,
               paged: prog.PagedSpec | None = None):
    self._graphdef, self._mesh = graphdef, mesh
    self.replicated = replicated_sharding(mesh, state)
    self._state_sh = jax.tree.map(lambda x: x.sharding, state)
    init_static = dict(graphdef=graphdef, num_slots=num_slots, queue_size=queue_size,
                       num_samples=num_samples, prompt_length=prompt_length,
                       cache_length=cache_length, mesh=mesh, paged=paged)
    # The engine's shapes and shardings, from the init program as XLA lays it out by default.
    default_init = lower_init(state, **init_static)
    default_compiled = default_init.compile()
    engine = _abstract(default_init.out_info, default_compiled.output_shardings)
    self.chunk = lower_chunk(state, engine, graphdef=graphdef, params=params, mesh=mesh,
                             chunk_steps=chunk_steps, max_admit=max_admit, paged=paged).compile()
    self.formats = self.chunk.input_formats[0][1]
    if jax.tree.leaves(self.chunk.output_formats[0]) != jax.tree.leaves(self.formats):
      raise RuntimeError("The compiled chunk returns the engine state in other layouts than it "
                         "takes; please report this with the model and mesh.")
    # Where the chunk keeps XLA's default layouts (e.g. CPU), the default init is the program:
    # lowering it again would compile (or load from the persistent cache) the same HLO twice.
    if jax.tree.leaves(default_compiled.output_formats) == jax.tree.leaves(self.formats):
      self.init = default_compiled
    else:
      self.init = lower_init(state, out_formats=self.formats, **init_static).compile()
    self._engine = engine
    self._enqueue: dict[int, Any] = {}

  def enqueue(self, state: nnx.State, engine: Any, *host_args: jax.Array) -> Any:
    """Prefills M prompts into the queue (one compile per bucket size M)."""
    m = host_args[0].shape[0]
    if m not in self._enqueue:
      rep = self.replicated
      fn = functools.partial(prog.enqueue_program.__wrapped__, graphdef=self._graphdef,
                             mesh=self._mesh)
      jitted = jax.jit(fn, in_shardings=(self._state_sh, self.formats) + (rep,) * ENQUEUE_ARGS,
                       out_shardings=self.formats, donate_argnums=(1,))
      eng_sh = jax.tree.map(lambda f: f.sharding, self.formats)
      self._enqueue[m] = jitted.lower(
          _abstract(state, self._state_sh), _abstract(self._engine, eng_sh),
          *(jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=rep) for a in host_args)
      ).compile()
    return self._enqueue[m](state, engine, *host_args)


_CACHE: collections.OrderedDict[tuple, EnginePrograms] = collections.OrderedDict()


def programs_for(state: nnx.State, **static) -> EnginePrograms:
  """The `EnginePrograms` of this shape (`EnginePrograms`' keyword arguments), compiled on first
  use and shared by every sampler of the process."""
  key = (signature(state), tuple(sorted(static.items())))
  if key in _CACHE:
    _CACHE.move_to_end(key)
  else:
    _CACHE[key] = EnginePrograms(state, **static)
    while len(_CACHE) > CACHE_SIZE:
      _CACHE.popitem(last=False)
  return _CACHE[key]
