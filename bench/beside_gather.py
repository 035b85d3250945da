"""A side stream kept busy by the package's gather kernel, as a decode step's prefetch runs beside its kernels.

Kernels time differently inside a step than alone: on the H200 (thirty-eighth session, compiled Qwen3-8B steps) the
top-k took 22.5 us a call at 2,176 blocks inside a 32K step against 11.0 alone, the grouped projections 48.6
against 33.5, cuBLAS's gate/up 31.3 against 28.5 — beside the gather's 32 long-lived programs (a layer's prefetch,
~150 us). Tiles and program counts tuned alone can lose in the step. `GatherLoad` recreates that neighbour for the
kernel benches (`--beside-gather`: `select_kernels.py`, `score_kernel.py`, `matmul.py`):

    load = GatherLoad(programs=32)      # a layer's prefetch at 32K x 1: 8 KV heads x 127 blocks of 16 x 128, bf16
    us = time_us(fn, repeats, load)      # score_kernel.time_us: each timed call with gathers queued beside it

A bench takes the option with `add_option(parser)` and its load (or None) with `load_from(args)`.

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
    blocks into a working set, on a stream of their own, `programs` programs each (the package's side-stream count)."""

    def __init__(self, programs: int = 32, heads: int = 8, blocks: int = 127, pool_blocks: int = 4096,
                 chunk_blocks: int = 512, T: int = 16, D: int = 128):
        if not torch.cuda.is_available():
            raise RuntimeError("--beside-gather needs a CUDA device (the gather reads pinned host memory)")
        self.programs, self.T = programs, T
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
                          self.out, self.T, self.programs)

    def cover(self, us: float) -> None:
        """Queue gathers for at least `us` microseconds (call right before the timed work: it starts beside them)."""
        for _ in range(max(1, math.ceil(us / self.gather_us))):
            self.gather()

    def drain(self) -> None:
        self.stream.synchronize()

    def __str__(self) -> str:
        return f"beside the gather ({self.programs} programs, {self.gather_us:.0f} us a call)"


def add_option(parser) -> None:
    """`--beside-gather PROGRAMS` on a bench's argument parser."""
    parser.add_argument("--beside-gather", type=int, default=None, metavar="PROGRAMS",
                        help="time each call beside the package's gather on a side stream, on PROGRAMS programs "
                             "(32: the package's; bench/beside_gather.py), as inside a decode step")


def load_from(args) -> GatherLoad | None:
    """The `GatherLoad` that `--beside-gather` asks for (announced), else None."""
    if args.beside_gather is None:
        return None
    load = GatherLoad(args.beside_gather)
    print(load, flush=True)
    return load
