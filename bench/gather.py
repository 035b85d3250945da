"""Gather bandwidth: selected 4 KiB blocks (T=16 x D=128, bf16, K and V) from pinned host memory into the working
set, through the Triton kernel (unified addressing), for several program counts; against a plain pinned->device
copy of the same bytes (contiguous, the PCIe ceiling). Medians over repeats, CUDA events.

    python bench/gather.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.kernels.gather import gather_blocks  # noqa: E402


def timed(fn, repeats=20):
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def main():
    B, H, T, D, S = 4, 8, 16, 128, 127
    NB, C = 8192, 1024  # 128K tokens per sequence, chunks of 1024 blocks
    chunks = [torch.randn(C, 2, B, H, T, D).to(torch.bfloat16).pin_memory() for _ in range(NB // C)]
    addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device="cuda")
    out = torch.empty(2, B, H, S * T + 32, D, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(NB, generator=g)[:S] for _ in range(B * H)]).view(B, H, S).cuda()
    dest = torch.arange(S).expand(B, H, S).contiguous().cuda()
    fetch = torch.ones(B, H, S, dtype=torch.int8, device="cuda")
    nbytes = 2 * B * H * S * T * D * 2
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = timed(lambda: dev.copy_(host, non_blocking=True))
    print(f"{nbytes / 2**20:.1f} MiB per gather ({B * H * S} blocks x 2 x {T * D * 2} B)")
    print(f"contiguous pinned->device copy: {nbytes / ms / 1e6:6.1f} GB/s")
    for programs in (None, 1024, 256, 132, 64, 32):
        ms = timed(lambda: gather_blocks(addrs, C, ids, dest, fetch, out, T, programs))
        print(f"gather kernel, programs {str(programs or 'one per block'):>14}: {nbytes / ms / 1e6:6.1f} GB/s "
              f"({ms:.3f} ms)")


if __name__ == "__main__":
    main()
