"""The k best blocks per (sequence, KV head) in one launch, in block order: the set `torch.topk(ranks, k)` returns
(ties: the lower block ids), listed by block id instead of best first. torch's radix select (`sbtopk::gatherTopK`,
2 bits a pass) and the sort of its k results took ~28 us a layer at 48K on the H200 (3072 blocks, k = 128; ~1 ms of a
replayed 36-layer step, thirty-first session) for what is a few thousand numbers.

One program per (sequence, KV head) holds its whole row in registers, each rank as an unsigned 32-bit key (its fp32
bits made monotonic; held in 64 bits, -1 past the row). The k-th largest key T is found from the top bit down, two bits a round: a round counts the
keys at or above three candidate thresholds (one sum over the registers, the three counts packed in 64 bits) and
keeps the highest candidate that still leaves k keys at or above it; 16 rounds fix all 32 bits. Every key above T
is chosen, and the first (in block order) of the keys equal to T until k are; a prefix sum gives each its place in
the output.

Four bits a round (8 rounds, 15 candidates' counts as four packed sums in one reduction) was slower on the H200:
24.8 against 8.4 us for 8 rows of 2048 (`bench/results/select-kernels-h200-2026-12-03-session32.txt`).

The thirtieth session's kernel sorted each row instead (a bitonic `tl.sort` of 64-bit keys): 87 us a layer at 32K,
130 at 48K on the H200 — ~66 dependent exchange stages of the whole row for one program; here 16 sums.

Shapes:
    ranks        `[B, H, W]` fp32, last dim contiguous (a strided view, e.g. one half of a split ranking, is read in
                 place); +inf forced, -inf not allowed
    ids (out)    `[B, H, k]` int64, increasing   values (out) `[B, H, k]` fp32
"""

from __future__ import annotations

import torch

from .gather import triton

MAX_ROW = 8192  # blocks of a row held by one program (128K tokens of 16); longer rows: torch.topk

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _top_k_kernel(ranks, ids, values, W, k, H, stride_b, stride_h, BLOCK_W: tl.constexpr):
        row = tl.program_id(0)
        b = row // H
        h = row % H
        offs = tl.arange(0, BLOCK_W)
        inside = offs < W
        x = tl.load(ranks + b * stride_b + h * stride_h + offs, mask=inside, other=-float("inf")) + 0.0  # (-0 -> +0)
        bits = x.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # fp32 order as 0 .. 2^32 - 1
        key = tl.where(inside, key, -1)  # (past the row: below every rank)
        threshold = tl.full((), 0, tl.int64)  # count(key >= threshold) >= k throughout
        for r in tl.static_range(16):  # two bits a round, the highest first
            step = 1 << (30 - 2 * r)  # (an int32 constant: the candidates are made by int64 additions)
            t1 = threshold + step
            t2 = t1 + step
            t3 = t2 + step
            packed = ((key >= t1).to(tl.int64) + ((key >= t2).to(tl.int64) << 21)
                      + ((key >= t3).to(tl.int64) << 42))
            counts = tl.sum(packed, axis=0)  # three counts < 2^21 in one reduction
            n1 = counts & 0x1FFFFF
            n2 = (counts >> 21) & 0x1FFFFF
            n3 = counts >> 42
            threshold = tl.where(n3 >= k, t3, tl.where(n2 >= k, t2, tl.where(n1 >= k, t1, threshold)))
        above = key > threshold
        equal = key == threshold
        room = k - tl.sum(above.to(tl.int32), axis=0)  # the equal keys taken, lowest block ids first
        chosen = above | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) <= room))
        place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        out = row.to(tl.int64) * k + place
        tl.store(ids + out, offs.to(tl.int64), mask=chosen)
        tl.store(values + out, x, mask=chosen)


def kernel_fits(ranks: torch.Tensor, k: int) -> bool:
    """Whether `top_k` runs the kernel for `ranks` (else it is `torch.topk`)."""
    return (triton is not None and ranks.dtype == torch.float32 and ranks.dim() == 3 and ranks.stride(-1) == 1
            and 0 < k <= ranks.shape[-1] <= MAX_ROW)


def top_k(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, values)` `[B, H, k]`: the k largest of `ranks` `[B, H, W]` per row (equal values: the lower indices),
    in index order. Rows the kernel does not take (`kernel_fits`) go through `torch.topk` and are put in index
    order too (which of equal values it keeps is its own choice)."""
    if not kernel_fits(ranks, k):
        top = torch.topk(ranks, k, dim=-1, sorted=False)
        ids, order = top.indices.sort(dim=-1)
        return ids, top.values.gather(-1, order)
    B, H, W = ranks.shape
    ids = torch.empty((B, H, k), dtype=torch.int64, device=ranks.device)
    values = torch.empty((B, H, k), dtype=torch.float32, device=ranks.device)
    BLOCK_W = max(16, triton.next_power_of_2(W))
    warps = 4 if BLOCK_W <= 2048 else 8
    _top_k_kernel[(B * H,)](ranks, ids, values, W, k, H, ranks.stride(0), ranks.stride(1), BLOCK_W=BLOCK_W,
                            num_warps=warps)
    return ids, values
