"""Block scores in one launch: the min/max upper bound of q.k, maximised over a KV head's query rows, with forced
blocks at +inf and blocks without a visible token at -inf (what `control.selection` computes in five ops).

Shapes and strides (contiguous unless said; element type E = keys' dtype, scores fp32):
    query        `[BH, R, D]`          R = G * Qn query rows of each (sequence, KV head)
    minmax       `[2, BH, NBcap, D]`   0 = kmin, 1 = kmax; blocks [0, NB) used
    forced       `[B, NB]` int8        allowed `[B, NB]` int8
    scores (out) `[BH, NB]` fp32
Program (bh, tile): blocks [tile*BLOCK_N, tile*BLOCK_N + BLOCK_N) of one (sequence, KV head).
bound = relu(q) . kmax + min(q, 0) . kmin, computed with fp32 accumulation (exact products for bf16/fp16 keys).
"""

from __future__ import annotations

import torch

from .gather import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_scores_kernel(
        query,
        minmax,
        forced,
        allowed,
        scores,
        H,
        R,
        D,
        NB,
        NBcap,
        BH,
        R_POW2: tl.constexpr,
        D_POW2: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        b = bh // H
        rows = tl.arange(0, R_POW2)
        dims = tl.arange(0, D_POW2)
        blocks = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_blocks = blocks < NB
        q = tl.load(query + (bh * R + rows[:, None]) * D + dims[None, :],
                    mask=(rows[:, None] < R) & (dims[None, :] < D), other=0.0).to(tl.float32)
        kv_mask = in_blocks[:, None] & (dims[None, :] < D)
        kmin = tl.load(minmax + (bh * NBcap + blocks[:, None]) * D + dims[None, :], mask=kv_mask, other=0.0)
        kmax = tl.load(minmax + ((BH + bh) * NBcap + blocks[:, None]) * D + dims[None, :], mask=kv_mask, other=0.0)
        bound = tl.dot(tl.maximum(q, 0.0), tl.trans(kmax.to(tl.float32)), input_precision="ieee")
        bound += tl.dot(tl.minimum(q, 0.0), tl.trans(kmin.to(tl.float32)), input_precision="ieee")
        bound = tl.where(rows[:, None] < R, bound, -float("inf"))
        best = tl.max(bound, axis=0)  # [BLOCK_N]
        is_forced = tl.load(forced + b * NB + blocks, mask=in_blocks, other=0) != 0
        is_allowed = tl.load(allowed + b * NB + blocks, mask=in_blocks, other=0) != 0
        best = tl.where(is_forced, float("inf"), best)
        best = tl.where(is_allowed, best, -float("inf"))
        tl.store(scores + bh * NB + blocks, best, mask=in_blocks)


def _as_int8(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask read as int8 (same bytes: no copy, no launch, when contiguous)."""
    return mask.contiguous().view(torch.int8)


def block_scores(query: torch.Tensor, minmax: torch.Tensor, num_blocks: int, forced: torch.Tensor,
                 allowed: torch.Tensor) -> torch.Tensor:
    """`query` `[B, Hkv, R, D]`, `minmax` `[2, B, Hkv, NBcap, D]`, `forced`/`allowed` `[B, NB]` bool ->
    `[B, Hkv, NB]` fp32 ranked scores (+inf forced, -inf not allowed)."""
    B, H, R, D = query.shape
    NBcap = minmax.shape[3]
    scores = torch.empty((B, H, num_blocks), dtype=torch.float32, device=query.device)
    BLOCK_N = 64
    grid = (B * H, triton.cdiv(num_blocks, BLOCK_N))
    _block_scores_kernel[grid](
        query.contiguous(), minmax, _as_int8(forced), _as_int8(allowed), scores,
        H, R, D, num_blocks, NBcap, B * H,
        R_POW2=max(16, triton.next_power_of_2(R)), D_POW2=max(16, triton.next_power_of_2(D)), BLOCK_N=BLOCK_N,
    )
    return scores
