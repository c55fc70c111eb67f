r"""Queued prompts' pages on a mesh: how many pages the paged engine's pools hold for the queue.

    python bench/paged_queue_shards.py --out bench/results/paged_queue_shards.json

The mesh case of tests/test_paged_engine.py (8 simulated CPU devices as data 2 x fsdp 2 x
tensor 2: 4 data shards, each with its pool of `--kv_pages` pages of 4 tokens and N/4 slots;
5 prompts of 3 to 9 tokens, G = 3 samples, responses up to 24 tokens). Reports the pages in use
in each shard's pool right after the first enqueue (only queued prompts hold pages then), and
the counters of the whole `generate` (its tokens are checked against the dense engine's). Run it
on two commits to compare engines (it only uses the sampler's public arguments and the
stream's `_enqueue` step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dapo_jax.infra import sharding as shd  # noqa: E402
from dapo_jax.models import create_model, get_preset  # noqa: E402
from dapo_jax.rollout import continuous  # noqa: E402
from tests import test_paged_engine as case  # noqa: E402

COUNTERS = ("decode_steps", "chunks", "enqueues", "preemptions", "preempted_tokens",
            "stalled_slot_steps", "busy_slot_steps", "min_free_pages", "peak_live_slots")


def _cpu() -> str:
  with open("/proc/cpuinfo") as f:
    names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
  return names[0] if names else platform.machine()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--kv_pages", type=int, default=16)
  ap.add_argument("--num_slots", type=int, default=8)
  ap.add_argument("--label", default="")
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  graphdef, state = nnx.split(create_model(get_preset("test"), seed=0))
  mesh = shd.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  kw = dict(num_slots=args.num_slots, mesh=mesh, kv_cache="paged", page_size=4,
            kv_pages=args.kv_pages)
  sampler = continuous.ContinuousSampler(graphdef, chunk_steps=6, max_prefill_length=16,
                                         attention_impl="xla", **kw)
  ids, mask = case._prompts()  # pylint: disable=protected-access
  stream = sampler.open_stream(state, params=case.PARAMS, num_samples=case.G,
                               key=jax.random.key(7), prompt_length=9)
  for i in range(len(ids)):
    stream.admit(ids[i][mask[i]], prompt_index=i)
  stream._enqueue()  # pylint: disable=protected-access
  refcount = np.asarray(jax.device_get(stream._engine.slots.decode.cache.refcount))  # pylint: disable=protected-access
  queued = stream.last_stats.prompts_prefilled
  stream.close()
  out, stats = case._generate(graphdef, state, **kw)  # pylint: disable=protected-access
  dense, _ = case._generate(graphdef, state, kv_cache="dense")  # pylint: disable=protected-access
  same = bool(np.array_equal(out.response_ids, dense.response_ids))
  result = {
      "label": args.label, "kv_pages_per_shard": args.kv_pages, "num_slots": args.num_slots,
      "data_shards": 4, "page_size": 4, "prompt_pages": [-(-int(m.sum()) // 4) for m in mask],
      "after_first_enqueue": {"prompts_enqueued": queued,
                              "pages_in_use_per_shard": (refcount > 0).sum(1).tolist(),
                              "pages_in_use": int((refcount > 0).sum())},
      "generate": {k: getattr(stats, k) for k in COUNTERS}, "tokens_equal_dense": same,
      "machine": _cpu()}
  print(json.dumps(result, indent=1))
  if args.out:
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    rows = [r for r in rows if r.get("label") != args.label] + [result]
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
