"""A side stream kept busy by the package's gather kernel, as a decode step's prefetch runs beside its kernels.

Kernels time differently inside a step than alone: on the H200 (, compiled Qwen3-8B steps) the
top-k took 22.5 us a call at 2,176 blocks inside a 32K step against 11.0 alone, the grouped projections 48.6
against 33.5, cuBLAS's gate/up 31.3 against 28.5 — beside the gather's 32 long-lived programs (a layer's prefetch,
~150 us). Tiles and program counts tuned alone can lose in the step. `GatherLoad` recreates that neighbour for the
kernel benches (`--beside-gather`: `select_kernels.py`, `score_kernel.py`, `matmul.py`):

    load = GatherLoad()                 # a layer's prefetch at 32K x 1: 8 KV heads x 127 blocks of 16 x 128, bf16
    us = time_us(fn, repeats, load)      # score_kernel.time_us: each timed call with gathers queued beside it

A bench takes the option with `add_option(parser)` and its load (or None) with `load_from(args)`; the option's
value is the gather's shape, `P` or `PxWxE` (P programs per K/V of W warps, each copying E blocks at once).

Run as a script, it compares gather shapes by what they cost their neighbours: for each shape, the gather's own time
(a layer's prefetch, alone) and a Qwen3-8B layer's seven weight matmuls timed beside it (cuBLAS at M = 1: ~63% of a
compiled 32K x 1 step), against the matmuls alone:

    python bench/beside_gather.py --shapes 32x4x1 16x4x2 16x8x2 8x8x4 8x16x4

CUDA only (pinned host memory read through unified addressing).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.kernels.gather import gather_blocks  # noqa: E402


class GatherLoad:
    """Gathers of `heads` x `blocks` random blocks (`[T, D]` bf16 each, K and V) from a pinned pool of `pool_blocks`
    blocks into a working set, on a stream of their own: `programs` programs per K/V of `warps` warps, each copying
    `entries` blocks at once (defaults: the package's side-stream shape on an H200, `memory.transfer`)."""

    def __init__(self, programs: int = 8, heads: int = 8, blocks: int = 127, pool_blocks: int = 4096,
                 chunk_blocks: int = 512, T: int = 16, D: int = 128, warps: int = 16, entries: int = 4):
        if not torch.cuda.is_available():
            raise RuntimeError("--beside-gather needs a CUDA device (the gather reads pinned host memory)")
        self.programs, self.T, self.warps, self.entries = programs, T, warps, entries
        self.chunks = [torch.randn(chunk_blocks, 2, 1, heads, T, D).to(torch.bfloat16).pin_memory()
                       for _ in range(pool_blocks // chunk_blocks)]
        self.addrs = torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64, device="cuda")
        self.chunk_blocks = chunk_blocks
        self.out = torch.empty(2, 1, heads, blocks * T + 32, D, dtype=torch.bfloat16, device="cuda")
        g = torch.Generator().manual_seed(0)
        self.ids = [torch.stack([torch.randperm(pool_blocks, generator=g)[:blocks] for _ in range(heads)])
                    .view(1, heads, blocks).cuda() for _ in range(4)]  # (calls cycle through them)
        self.dest = torch.arange(blocks).expand(1, heads, blocks).contiguous().cuda()
        self.fetch = torch.ones(1, heads, blocks, dtype=torch.int8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.turn = 0
        self.gather()  # (compiles the kernel)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        for _ in range(8):
            self.gather()
        end.record(self.stream)
        end.synchronize()
        self.gather_us = start.elapsed_time(end) * 1000 / 8

    def gather(self) -> None:
        """One gather, queued on the side stream."""
        self.turn += 1
        with torch.cuda.stream(self.stream):
            gather_blocks(self.addrs, self.chunk_blocks, self.ids[self.turn % len(self.ids)], self.dest, self.fetch,
                          self.out, self.T, self.programs, num_warps=self.warps, entries=self.entries)

    def cover(self, us: float) -> None:
        """Queue gathers for at least `us` microseconds (call right before the timed work: it starts beside them)."""
        for _ in range(max(1, math.ceil(us / self.gather_us))):
            self.gather()

    def drain(self) -> None:
        self.stream.synchronize()

    def __str__(self) -> str:
        return (f"beside the gather ({self.programs} programs of {self.warps} warps, {self.entries} block(s) at once; "
                f"{self.gather_us:.0f} us a call)")


def parse_shape(spec: str) -> dict:
    """`P` (4 warps, one block at once: the shape) or `PxWxE` -> GatherLoad's
    programs, warps, entries."""
    parts = [int(x) for x in spec.lower().split("x")]
    if len(parts) not in (1, 3) or min(parts) < 1:
        raise ValueError(f"a gather shape is P or PxWxE (programs, warps, blocks at once), got {spec!r}")
    return dict(zip(("programs", "warps", "entries"), parts + [4, 1] if len(parts) == 1 else parts))


def add_option(parser) -> None:
    """`--beside-gather P[xWxE]` on a bench's argument parser."""
    parser.add_argument("--beside-gather", default=None, metavar="P[xWxE]",
                        help="time each call beside the package's gather on a side stream, on P programs per K/V "
                             "of W warps copying E blocks at once (8x16x4: the package's on an H200; P alone: 4 "
                             "warps, one block at once) (bench/beside_gather.py), as inside a decode step")


def load_from(args) -> GatherLoad | None:
    """The `GatherLoad` that `--beside-gather` asks for (announced), else None."""
    if args.beside_gather is None:
        return None
    load = GatherLoad(**parse_shape(args.beside_gather))
    print(load, flush=True)
    return load


def main() -> None:
    import argparse

    import torch.nn.functional as F

    from attention_kernel import graphed
    from score_kernel import time_us

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["32x4x1", "16x4x2", "16x8x2", "8x8x4", "8x16x4"])
    parser.add_argument("--calls", type=int, default=4, help="distinct weight sets per graph (more than L2 holds)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    h, i, q, kv = 4096, 12288, 4096, 1024  # Qwen3-8B
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in shapes]
            for _ in range(args.calls)]
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (h, i)}
    turn = iter(range(10**9))

    def layer():
        for w in sets[next(turn) % args.calls]:
            F.linear(xs[w.shape[1]], w)

    calls = graphed(layer, args.calls)
    alone = time_us(calls, args.repeats) / args.calls
    print(f"a layer's seven matmuls alone: {alone:.1f} us", flush=True)
    for spec in args.shapes:
        load = GatherLoad(**parse_shape(spec))
        nbytes = load.out[:, :, :, : load.ids[0].shape[-1] * load.T].numel() * load.out.element_size()
        beside = time_us(calls, args.repeats, load) / args.calls
        print(f"gather {spec:>8s}: {load.gather_us:6.1f} us a call ({nbytes / load.gather_us / 1e3:5.1f} GB/s); "
              f"the layer beside it {beside:6.1f} us ({beside / alone:.2f}x alone)", flush=True)
        del load


if __name__ == "__main__":
    main()
