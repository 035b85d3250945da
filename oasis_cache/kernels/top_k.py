"""The k best blocks per (sequence, KV head) in one launch: what `torch.topk(ranks, k, sorted=True)` returns, best
first, ties in block order. torch's radix select (`sbtopk::gatherTopK`) took 18.7 us a layer at 32K on the H200
(2048 blocks, k = 128; 0.67 ms of a replayed 36-layer step, thirtieth session) for what is a few thousand numbers.

One program per (sequence, KV head) holds its whole row in registers: each rank becomes a sortable 64-bit key (its
fp32 bits made monotonic in the high half, the complement of its block id in the low half, so that equal ranks keep
block order), one bitonic sort (`tl.sort`), the first k keys decoded back. The sort is unrolled, so its code and
compile time grow with the row: compiled for sm_90 on a CPU core (Triton 3.9, 2026-12-03) 1.7 s for 512 keys, 4.1 s
for 2048 (32K tokens), 9.8 s for 4096, 230 s for 16384. Rows longer than `MAX_ROW` fall back to `torch.topk`.

Shapes:
    ranks        `[B, H, W]` fp32, last dim contiguous (a strided view, e.g. one half of a split ranking, is read in
                 place); +inf forced, -inf not allowed
    ids (out)    `[B, H, k]` int64   values (out) `[B, H, k]` fp32
"""

from __future__ import annotations

import torch

from .gather import triton

MAX_ROW = 4096  # blocks of a row sorted in one program (64K tokens of 16); longer rows: torch.topk

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _top_k_kernel(ranks, ids, values, W, k, H, stride_b, stride_h, BLOCK_W: tl.constexpr):
        row = tl.program_id(0)
        b = row // H
        h = row % H
        offs = tl.arange(0, BLOCK_W)
        x = tl.load(ranks + b * stride_b + h * stride_h + offs, mask=offs < W, other=-float("inf"))
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # fp32 order as signed int32 order
        packed = (key.to(tl.int64) << 32) | (BLOCK_W - 1 - offs).to(tl.int64)  # ties: the lower block id first
        best = tl.sort(packed, descending=True)
        block = BLOCK_W - 1 - (best & 0xFFFFFFFF)
        key = (best >> 32).to(tl.int32)
        rank = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        out = row.to(tl.int64) * k + offs
        tl.store(ids + out, block, mask=offs < k)
        tl.store(values + out, rank, mask=offs < k)


def kernel_fits(ranks: torch.Tensor, k: int) -> bool:
    """Whether `top_k` runs the kernel for `ranks` (else it is `torch.topk`)."""
    return (triton is not None and ranks.dtype == torch.float32 and ranks.dim() == 3 and ranks.stride(-1) == 1
            and 0 < k <= ranks.shape[-1] <= MAX_ROW)


def top_k(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, values)` `[B, H, k]`: the k largest of `ranks` `[B, H, W]` per row, largest first, equal values in
    index order (`torch.topk(..., sorted=True)`, whose order among equal values is unspecified)."""
    if not kernel_fits(ranks, k):
        top = torch.topk(ranks, k, dim=-1, sorted=True)
        return top.indices, top.values
    B, H, W = ranks.shape
    ids = torch.empty((B, H, k), dtype=torch.int64, device=ranks.device)
    values = torch.empty((B, H, k), dtype=torch.float32, device=ranks.device)
    BLOCK_W = max(16, triton.next_power_of_2(W))
    _top_k_kernel[(B * H,)](ranks, ids, values, W, k, H, ranks.stride(0), ranks.stride(1), BLOCK_W=BLOCK_W)
    return ids, values
