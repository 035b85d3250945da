"""What `OasisCache.fork` copies of the host pool: one layer's pool shaped like the quality suite's SmolLM2 8K cell
(24 prompts of 8,192 tokens + template, fp32, 3 KV heads, 30 layers), forked with its complete chunks shared.
The chunk being filled is copied two ways, interleaved, medians over repeats:

- `whole chunk`: the chunk cloned and pinned again (what the fork did up to 2026-12-02: two copies of C blocks);
- `used blocks`: a new chunk from the host allocator and one copy of the blocks in use (`HostKVPool._own_copy`).

    python bench/fork_copy.py                    # CPU (no pinning)
    python bench/fork_copy.py --pin              # pinned host memory (a CUDA machine)

Prints seconds per fork for the whole model (one layer's time x layers).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.pools.host_kv import SHARE_CHUNKS, HostKVPool  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=8192 + 48, help="the prompt's tokens (its complete blocks)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pin", action="store_true", help="pinned host memory (needs CUDA)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    pool = HostKVPool(args.batch, args.kv_heads, args.head_dim, 16, dtype, 256, args.pin)
    pool.num_blocks = args.tokens // 16
    pool.reserve(pool.num_blocks + 1)
    for chunk in pool.chunks:
        chunk.normal_()
    full = pool.num_blocks // pool.chunk_blocks

    def whole_chunk():
        return [chunk.clone().pin_memory() if args.pin else chunk.clone() for chunk in pool.chunks[full:]]

    def used_blocks():
        return copy.deepcopy(pool, {SHARE_CHUNKS: True}).chunks[full:]

    times = {"whole chunk": [], "used blocks": []}
    for _ in range(args.repeats):
        for name, fn in (("whole chunk", whole_chunk), ("used blocks", used_blocks)):
            started = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - started)
            del out
    copied = pool.num_blocks - full * pool.chunk_blocks
    print(f"{args.batch} x {args.tokens} tokens, {args.dtype}, {args.layers} layers, pinned {args.pin}: "
          f"{pool.num_blocks} blocks, {full} chunks shared, {copied} of {pool.chunk_blocks} blocks in use in the "
          f"last ({pool.chunk_blocks * pool.block_nbytes * args.layers / 2**30:.2f} GiB per fork)")
    for name, values in times.items():
        print(f"{name:12} {statistics.median(values) * args.layers:8.3f} s per fork (median of {args.repeats})")


if __name__ == "__main__":
    main()
