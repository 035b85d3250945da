"""The selection's kernels after the block scores, at a decode step's shape: the top-k (the package's select kernel,
and `torch.topk` + the sort into block order it replaced), then the slot assignment on a stream of selections.
(earlier variants lost and were dropped: four bits a round in the select, an eviction order
by pairwise comparisons in the assignment.) Each is
captured as a CUDA graph of `--calls` calls (no launch overhead: a replayed decode step's conditions), replayed
`--repeats` times; medians.

    python bench/select_kernels.py                   # Qwen3-8B: Hkv 8, k 128; rows of 2048, 3072, 8192 blocks
    python bench/select_kernels.py --warps 4 8 16    # the select kernel's warps
    python bench/select_kernels.py --rows 2176 8704 --segments 1 4 8 16 0   # one stage against two (0: default)
    python bench/select_kernels.py --rows 2176 8704 --segments 1 4 0 --beside-gather 32   # as in a step
    TRITON_INTERPRET=1 python bench/select_kernels.py --rows 64 --k 8 --repeats 1 --calls 1   # CPU smoke (host clock)

Prints one line per (shape, method): microseconds per call (per decode step multiply by the layers, e.g. 36).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import beside_gather  # noqa: E402
from attention_kernel import graphed  # noqa: E402
from score_kernel import time_us  # noqa: E402

from oasis_cache.kernels.slot_assign import slot_assign  # noqa: E402
from oasis_cache.kernels.top_k import top_k  # noqa: E402
from oasis_cache.pools import SlotMap  # noqa: E402


def torch_top_k(ranks: torch.Tensor, k: int):
    top = torch.topk(ranks, k, dim=-1, sorted=False)
    ids, order = top.indices.sort(dim=-1)
    return ids, top.values.gather(-1, order)


METHODS = {"select": top_k, "torch.topk+sort": torch_top_k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 3072, 8192], help="blocks per row")
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warps", type=int, nargs="+", default=[0],
                        help="the select kernel's warps (0: the package's choice); several: a row per value")
    parser.add_argument("--segments", type=int, nargs="+", default=[0],
                        help="the select's segments (1: one stage; 0: the package's choice); several: a row per value")
    parser.add_argument("--slots", type=int, nargs="+", default=[128, 256], help="slot assignment: slots (K = 128)")
    beside_gather.add_option(parser)
    args = parser.parse_args()
    load = beside_gather.load_from(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for W in args.rows:
        ranks = torch.randn(args.batch, args.kv_heads, W, device=device)
        reference = torch_top_k(ranks, args.k)
        methods = dict(METHODS)
        if args.warps != [0]:
            del methods["select"]
            methods.update({f"select/{w or 'auto'}w": functools.partial(top_k, num_warps=w or None)
                            for w in args.warps})
        if args.segments != [0]:
            methods.pop("select", None)
            methods.update({f"select/{n or 'auto'}seg": functools.partial(top_k, segments=n or None)
                            for n in args.segments if not n or W // n >= args.k})
        for name, method in methods.items():
            ids, values = method(ranks, args.k)
            same = torch.equal(ids, reference[0]) and torch.equal(values, reference[1])
            us = time_us(graphed(lambda: method(ranks, args.k), args.calls), args.repeats, load) / args.calls
            print(f"rows {W:5d} x {args.batch * args.kv_heads:3d}, k {args.k}: {name:16s} {us:7.2f} us/call"
                  f"{'' if same else '  (differs from torch.topk)'}", flush=True)
    for S in args.slots:  # a steady state: every call a new selection of k of 2048 blocks, ~k/16 of them resident
        B, H, NB, k = args.batch, args.kv_heads, 2048, args.k
        slot_map = SlotMap(B, H, S, device, use_kernel=True)
        slot_map.reserve(NB)
        draws = [torch.stack([torch.randperm(NB, device=device)[:k] for _ in range(B * H)]).view(B, H, k)
                 for _ in range(8)]  # (a graph's calls cycle through them: ~k/16 blocks stay resident a call)
        ranks = torch.rand(B, H, k, device=device)
        visible = torch.zeros(B, H, S * 16, dtype=torch.bool, device=device)
        counters = torch.zeros(4, dtype=torch.int64, device=device)
        step = torch.ones(1, dtype=torch.int64, device=device)
        calls = iter(range(10**9))

        def assign():
            slot_assign(draws[next(calls) % len(draws)], ranks, slot_map.block_slot, slot_map.slot_block,
                        slot_map.last_used, step, visible, counters, 16, k)

        us = time_us(graphed(assign, args.calls), args.repeats, load) / args.calls
        print(f"assign {B * H:3d} rows, k {k}, slots {S}: {us:7.2f} us/call", flush=True)


if __name__ == "__main__":
    main()
