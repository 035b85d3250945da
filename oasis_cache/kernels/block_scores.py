"""Block scores in one launch, maximised over a KV head's query rows, with forced blocks at +inf and blocks without a
visible token at -inf (what `control.selection` computes in several ops). Two scorers (see `control.selection`):

    bound  relu(q) . kmax + min(q, 0) . kmin, fp32 accumulation (exact products for bf16/fp16 keys)
    bits   max over the block's tokens t of q . where(bit(t), high, low): one matrix product per token position,
           on TF32 tensor cores for bf16/fp16 keys and queries (their values are exact in TF32, so are the products;
           fp32 accumulation), IEEE fp32 for fp32 keys

Shapes and strides (contiguous unless said; element type E = keys' dtype, scores fp32):
    query        `[B, Hq, Qn, D]`, any strides  row r = g * Qn + i of KV head h is query head h * G + g, token i
    levels       `[2, BH, NBcap, D]`           bound: 0 = kmin, 1 = kmax; bits: the two levels; blocks [0, NB) used
    codes        `[BH, NBcap, ceil(T/8), D]`   uint8, bits scorer only (bit t % 8 of byte t // 8: token t)
    scales       `[BH, NBcap]` fp32            fp8 levels only: level = fp8 value * scale (a power of two)
    channels     `[BH, D']` int64              summaries on D' of the query's channels only: the query's channels
                                               read (the gather `BlockSummaries.query_channels` would launch)
    forced       `[B, NB]` int8                allowed `[B, NB]` int8
    scores (out) `[BH, NB]` fp32, or `[BH, 2, NB]` with `split_last`: 0 = the rows of tokens [0, Qn - 1) (the real
                 tokens beside a riding draft), 1 = the rows of token Qn - 1 (the draft) — two rankings from one
                 read of the summaries
Program (bh, tile): blocks [tile*BLOCK_N, tile*BLOCK_N + BLOCK_N) of one (sequence, KV head).
"""

from __future__ import annotations

import torch

from .fitting import launch_fitting
from .gather import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def precise_dot(a, b, IEEE: tl.constexpr):
        """`a` `[M, K]` . `b` `[K, N]` in fp32: IEEE products for fp32 inputs, else TF32 (exact for bf16/fp16
        values). Shared with `decode_attention.py`."""
        if IEEE:
            product = tl.dot(a, b, input_precision="ieee")
        else:
            product = tl.dot(a, b, input_precision="tf32")
        return product

    @triton.jit
    def _ranked(score, rows_used, is_forced, is_allowed):
        """The best of `score` `[R_POW2, BLOCK_N]` over the rows where `rows_used` `[R_POW2]`, per block: +inf where
        forced, -inf where not allowed."""
        best = tl.max(tl.where(rows_used[:, None], score, -float("inf")), axis=0)  # [BLOCK_N]
        return tl.where(is_allowed, tl.where(is_forced, float("inf"), best), -float("inf"))

    @triton.jit
    def _block_scores_kernel(
        query,
        levels,
        codes,
        scales,
        channels,
        forced,
        allowed,
        scores,
        H,
        G,
        QN,
        stride_b,
        stride_h,
        stride_q,
        stride_d,
        D,
        NB,
        NBcap,
        BH,
        R_POW2: tl.constexpr,
        D_POW2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TOKENS: tl.constexpr,  # 0: the bound scorer; else the bits scorer over blocks of TOKENS tokens
        IEEE: tl.constexpr,  # fp32 keys: IEEE fp32 products in the bits scorer (else TF32, exact for bf16/fp16)
        SCALED: tl.constexpr,  # fp8 levels with a scale per block
        SPLIT_LAST: tl.constexpr,  # two outputs: the rows of tokens [0, QN - 1), and those of token QN - 1
        GATHER: tl.constexpr,  # the query's channels read through `channels` (summaries on D' channels)
    ):
        bh = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        b = bh // H
        R = G * QN
        rows = tl.arange(0, R_POW2)
        dims = tl.arange(0, D_POW2)
        blocks = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_blocks = blocks < NB
        q_mask = (rows[:, None] < R) & (dims[None, :] < D)
        heads = (bh % H) * G + rows // QN
        if GATHER:
            read = tl.load(channels + bh * D + dims, mask=dims < D, other=0)
        else:
            read = dims
        q = tl.load(query + b * stride_b + heads[:, None] * stride_h + (rows % QN)[:, None] * stride_q
                    + read[None, :] * stride_d, mask=q_mask, other=0.0).to(tl.float32)
        kv_mask = in_blocks[:, None] & (dims[None, :] < D)
        low = tl.load(levels + (bh * NBcap + blocks[:, None]) * D + dims[None, :], mask=kv_mask, other=0.0)
        high = tl.load(levels + ((BH + bh) * NBcap + blocks[:, None]) * D + dims[None, :], mask=kv_mask, other=0.0)
        low, high = low.to(tl.float32), high.to(tl.float32)
        if SCALED:
            scale = tl.load(scales + bh * NBcap + blocks, mask=in_blocks, other=1.0)[:, None]
            low, high = low * scale, high * scale
        if TOKENS == 0:
            score = tl.dot(tl.maximum(q, 0.0), tl.trans(high), input_precision="ieee")
            score += tl.dot(tl.minimum(q, 0.0), tl.trans(low), input_precision="ieee")
        else:  # one tensor-core product per token position
            BYTES: tl.constexpr = (TOKENS + 7) // 8
            score = tl.full((R_POW2, BLOCK_N), -float("inf"), tl.float32)
            for byte in tl.static_range(BYTES):
                code = tl.load(codes + ((bh * NBcap + blocks[:, None]) * BYTES + byte) * D + dims[None, :],
                               mask=kv_mask, other=0)
                for bit in tl.static_range(8):
                    if byte * 8 + bit < TOKENS:
                        coarse = tl.where(((code >> bit) & 1) != 0, high, low)  # [BLOCK_N, D_POW2]
                        score = tl.maximum(score, precise_dot(q, tl.trans(coarse), IEEE))
        is_forced = tl.load(forced + b * NB + blocks, mask=in_blocks, other=0) != 0
        is_allowed = tl.load(allowed + b * NB + blocks, mask=in_blocks, other=0) != 0
        if SPLIT_LAST:
            last = (rows % QN) == QN - 1
            real = _ranked(score, (rows < R) & (last == 0), is_forced, is_allowed)
            tl.store(scores + (2 * bh) * NB + blocks, real, mask=in_blocks)
            draft = _ranked(score, (rows < R) & last, is_forced, is_allowed)
            tl.store(scores + (2 * bh + 1) * NB + blocks, draft, mask=in_blocks)
        else:
            tl.store(scores + bh * NB + blocks, _ranked(score, rows < R, is_forced, is_allowed), mask=in_blocks)


def _as_int8(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask read as int8 (same bytes: no copy, no launch, when contiguous)."""
    return mask.contiguous().view(torch.int8)


def default_blocks_per_program(batch: int, bits: bool) -> int:
    """Blocks a program scores: 32 for the bits scorer on one sequence, else 64 (H200, 4 warps, a micro-benchmark
    graphed as in a captured step. Bits, one sequence, 8 rows, 64 kept channels, 2,176 / 8,704 blocks: 32 a program
    8.6 / 23.7 us, 64 11.6 / 27.6. An earlier form of the kernel: bits, four
    sequences, 2,048 blocks, 64 94 us, 32 125; the bound scorer 64 faster at one sequence too, 143 against 198)."""
    return 32 if bits and batch == 1 else 64


def block_scores(query: torch.Tensor, levels: torch.Tensor, num_blocks: int, forced: torch.Tensor,
                 allowed: torch.Tensor, codes: torch.Tensor | None = None, block_size: int = 16,
                 blocks_per_program: int | None = None, num_warps: int = 4,
                 scales: torch.Tensor | None = None, split_last: bool = False,
                 channels: torch.Tensor | None = None) -> torch.Tensor:
    """`query` `[B, Hq, Qn, D]` (a strided slice is read in place), `levels` `[2, B, Hkv, NBcap, D]`,
    `forced`/`allowed` `[B, NB]` bool, `codes` `[B, Hkv, NBcap, ceil(T/8), D]` uint8 or None (None: the bound
    scorer), `scales` `[B, Hkv, NBcap]` fp32 with fp8 levels, else None -> `[B, Hkv, NB]` fp32 ranked scores (+inf
    forced, -inf not allowed); with `split_last` (Qn >= 2) `[B, Hkv, 2, NB]`: the first Qn - 1 tokens' ranking, then
    the last token's. `channels` `[B, Hkv, D']` int64: the summaries cover these channels of the query only (the
    query passed whole, its channels read in the kernel). `blocks_per_program` (a power of two >= 16; None:
    `default_blocks_per_program`) and `num_warps` are tuning knobs (a micro-benchmark)."""
    B, Hq, Qn, D = query.shape
    if channels is not None:
        D = channels.shape[-1]  # D': the channels the summaries (levels, codes) hold
    H, NBcap = levels.shape[2], levels.shape[3]
    R = Hq // H * Qn
    if split_last and Qn < 2:
        raise ValueError("split_last ranks the last query token apart from the others: it needs Qn >= 2")
    shape = (B, H, 2, num_blocks) if split_last else (B, H, num_blocks)
    scores = torch.empty(shape, dtype=torch.float32, device=query.device)
    bits = codes is not None
    rows = triton.next_power_of_2(R)
    D_POW2 = max(16, triton.next_power_of_2(D))
    ieee = torch.float32 in (levels.dtype, query.dtype)

    def launch(BLOCK_N: int) -> None:
        _block_scores_kernel[(B * H, triton.cdiv(num_blocks, BLOCK_N))](
            query, levels, codes if bits else levels, scales if scales is not None else scores,
            channels.contiguous() if channels is not None else levels, _as_int8(forced),
            _as_int8(allowed), scores,
            H, Hq // H, Qn, *query.stride(), D, num_blocks, NBcap, B * H,
            R_POW2=max(16, rows),  # tensor-core products need 16 rows
            D_POW2=D_POW2, BLOCK_N=BLOCK_N,
            TOKENS=block_size if bits else 0, IEEE=ieee,
            SCALED=scales is not None, SPLIT_LAST=split_last, GATHER=channels is not None, num_warps=num_warps,
        )

    # (wide float32 summaries may not fit the tile in a small card's shared memory: fewer, `kernels/fitting.py`)
    launch_fitting((query.device, query.dtype, levels.dtype, rows, D_POW2, bits, block_size, num_warps),
                   blocks_per_program or default_blocks_per_program(B, bits), launch)
    return scores
