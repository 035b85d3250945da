"""Decode attention over the working set in two launches (split over the keys, then combined), without a
materialized mask and without copying the query or the output.

What it computes is `compute/sparse.py`'s `sparse_attention`: each new query row attends to the working set's visible
tokens, and new token i (of Qn) sees working-set token j iff j <= slot_tokens + count - Qn + i (count: the recent
tokens, `[1]` int64 read on the device, so a captured step replays with its new value). With `sinks` (`[Hq]`, a
learned logit per query head: gpt-oss), each head's sink joins its softmax's sum where the splits are combined.

Shapes and strides:
    query          `[B, Hq, Qn, D]`, any strides with D contiguous (transformers hands a transposed view of
                   `[B, Qn, Hq, D]`); query head h*G + g uses KV head h
    keys, values   `[B, Hkv, L, D]`, D contiguous (the working set's two halves)
    visible        `[B, Hkv, L]` bool, L contiguous
    recent_visible optional `[B or 1, 1, L - slot_tokens]` bool, contiguous: the recent region's mask, the same for
                   every KV head (and sequence, with a first dim of 1), read in place of `visible`'s recent part (which
                   is then not read: no per-layer copy of a per-forward mask)
    output         `[B, Qn, Hq, D]` contiguous in the query's dtype, returned as its `[B, Hq, Qn, D]` view (what the
                   attention function transposes back without a copy)
Program (bh, split) of the first kernel: the G*Qn rows of one KV head over keys [split*P, (split+1)*P), an online
softmax in fp32, its partial output, running max and sum into fp32 scratch `[B*Hkv, SPLITS, ROWS, D]` and
`[B*Hkv, SPLITS, 2, ROWS]` (the G*Qn real rows only). The second kernel's program (bh, chunk) rescales and sums
the splits for CHUNK (row, dim) pairs at once: one read of a `[SPLITS, CHUNK]` tile, no loop over the splits (a
program per KV head looping over them took 9.2 us a layer on the H200, a dependent load per split).

With `tickets` (`[>= B*Hkv]` int32, zero, owned by the caller) it is one launch: each split program, its partials
stored, takes a ticket of its KV head (an atomic add, after a barrier: its stores are released with it); the program
that takes the last one combines that KV head's splits as the second kernel would (reading the partials from L2) and
sets the counter back to 0. Research, not what the package runs: it was to save the second launch and the gap before
it (7.0 us a layer inside a compiled H200 step), but on the H200 (a micro-benchmark)
it took 62.7 us a call against 14.6 for two launches at the Qwen3-8B shape (B 1, Qn 1, 33 splits; equal at 8
splits, 2x at 16) and a compiled 32K x 1 step 10.5 ms against 8.6 — the one combining program per KV head walks
every split's partials itself, no spills (233 registers), cause not yet found.
"""

from __future__ import annotations

import torch

from .fitting import launch_fitting
from .gather import triton

BLOCK_N = 64  # keys per tile
COMBINE_TILE = 4096  # partial results a combine program reads at once (splits x (row, dim) pairs)


if triton is not None:
    import triton.language as tl

    from .block_scores import precise_dot

    @triton.jit
    def _split_kernel(
        query, keys, values, visible, recent_visible, count, part_acc, part_stats, tickets, sinks, out,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl,
        stride_sb, stride_sh, stride_rb,
        H, L, D, slot_tokens, scale, keys_per_split, splits,
        G: tl.constexpr, QN: tl.constexpr, ROWS: tl.constexpr, D_POW2: tl.constexpr, BLOCK: tl.constexpr,
        IEEE: tl.constexpr, RECENT_APART: tl.constexpr, FUSED: tl.constexpr, SPLITS_POW2: tl.constexpr,
        CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b, h = bh // H, bh % H
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, D_POW2)
        row_ok = rows < G * QN
        token = rows % QN
        q = tl.load(query + b * stride_qb + (h * G + rows // QN)[:, None] * stride_qh + token[:, None] * stride_qn
                    + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
        q = q * scale
        last_seen = slot_tokens + tl.load(count) - QN + token  # [ROWS]: the last working-set token row i sees
        m = tl.full((ROWS,), -float("inf"), tl.float32)
        s_sum = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, D_POW2), tl.float32)
        start = split * keys_per_split
        stop = tl.minimum(start + keys_per_split, L)
        for first in range(start, stop, BLOCK):
            n = first + tl.arange(0, BLOCK)
            n_ok = n < stop
            if RECENT_APART:  # the slots' mask per KV head, the recent region's per sequence (or batch)
                in_slots = n < slot_tokens
                seen_key = ((tl.load(visible + b * stride_sb + h * stride_sh + n, mask=n_ok & in_slots, other=0) != 0)
                            | (tl.load(recent_visible + b * stride_rb + (n - slot_tokens), mask=n_ok & ~in_slots,
                                       other=0) != 0)) & n_ok
            else:
                seen_key = (tl.load(visible + b * stride_sb + h * stride_sh + n, mask=n_ok, other=0) != 0) & n_ok
            kv_mask = seen_key[:, None] & (dims[None, :] < D)
            k = tl.load(keys + b * stride_kb + h * stride_kh + n[:, None] * stride_kl + dims[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            s = precise_dot(q, tl.trans(k), IEEE)
            seen = seen_key[None, :] & (n[None, :].to(tl.int64) <= last_seen[:, None])
            s = tl.where(seen, s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            base = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that saw nothing yet stay at 0
            p = tl.exp(s - base[:, None])
            alpha = tl.exp(m - base)
            v = tl.load(values + b * stride_vb + h * stride_vh + n[:, None] * stride_vl + dims[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + precise_dot(p, v, IEEE)
            s_sum = s_sum * alpha + tl.sum(p, 1)
            m = m_new
        part = bh * splits + split
        tl.store(part_acc + (part * ROWS + rows[:, None]) * D_POW2 + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats + (part * 2) * ROWS + rows, m, mask=row_ok)
        tl.store(part_stats + (part * 2 + 1) * ROWS + rows, s_sum, mask=row_ok)
        if FUSED:  # the last of this KV head's splits to finish combines them
            tl.debug_barrier()  # (every thread's stores before the release)
            ticket = tl.atomic_add(tickets + bh, 1, sem="acq_rel")
            if ticket == splits - 1:
                for first in range(0, G * QN * D_POW2, CHUNK):
                    _combine_chunk(part_acc, part_stats, sinks, out, bh, H, D, splits, first + tl.arange(0, CHUNK), G,
                                   QN, ROWS, D_POW2, SPLITS_POW2, HAS_SINKS)
                tl.store(tickets + bh, 0)  # (ready for the next launch)

    @triton.jit
    def _combine_chunk(part_acc, part_stats, sinks, out, bh, H, D, splits, flat, G: tl.constexpr, QN: tl.constexpr,
                       ROWS: tl.constexpr, D_POW2: tl.constexpr, SPLITS_POW2: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Output of KV head `bh`'s (row, dim) pairs `flat` `[CHUNK]` from its splits' partials (read from L2:
        written by other programs of the same launch where fused); with `HAS_SINKS`, the query head's learned sink
        logit joins the softmax's sum (a score without a value: `compute/sinks.py`)."""
        b, h = bh // H, bh % H
        row, dim = flat // D_POW2, flat % D_POW2
        ok = (row < G * QN) & (dim < D)
        split = tl.arange(0, SPLITS_POW2)
        part = bh * splits + split
        both = (split < splits)[:, None] & ok[None, :]
        m_all = tl.load(part_stats + (part[:, None] * 2) * ROWS + row[None, :], mask=both, other=-float("inf"),
                        cache_modifier=".cg")
        m = tl.max(m_all, 0)
        token, head = row % QN, h * G + row // QN
        if HAS_SINKS:
            sink = tl.load(sinks + head, mask=ok, other=0.0).to(tl.float32)
            m = tl.maximum(m, sink)
        base = tl.where(m == -float("inf"), 0.0, m)
        weight = tl.exp(m_all - base[None, :])  # [SPLITS_POW2, CHUNK]; 0 where a split saw nothing (or is none)
        total = tl.sum(weight * tl.load(part_stats + (part[:, None] * 2 + 1) * ROWS + row[None, :], mask=both,
                                        other=0.0, cache_modifier=".cg"), 0)
        if HAS_SINKS:
            total += tl.exp(sink - base)
        acc = tl.sum(weight * tl.load(part_acc + (part[:, None] * ROWS + row[None, :]) * D_POW2 + dim[None, :],
                                      mask=both, other=0.0, cache_modifier=".cg"), 0)
        result = acc / tl.where(total > 0, total, 1.0)  # a row that sees nothing gets 0
        tl.store(out + ((b * QN + token) * (H * G) + head) * D + dim, result.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_kernel(
        part_acc, part_stats, sinks, out, H, D, splits,
        G: tl.constexpr, QN: tl.constexpr, ROWS: tl.constexpr, D_POW2: tl.constexpr, SPLITS_POW2: tl.constexpr,
        CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        flat = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)  # (row, dim) pairs of the real rows
        _combine_chunk(part_acc, part_stats, sinks, out, bh, H, D, splits, flat, G, QN, ROWS, D_POW2, SPLITS_POW2,
                       HAS_SINKS)


def _programs_wanted(device: torch.device) -> int:
    """About two programs per SM (the interpreter: a few); `decode_attention` also keeps two tiles per program. H200,
    Qwen3-8B shape (a micro-benchmark): the fastest split counts were 16 at batch 1 (two tiles each; 14.7 us
    per call, 22 at one tile) and 8 at batch 4 (two programs per SM; 20.6 us, 22.6 at one)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     count: torch.Tensor, slot_tokens: int, scale: float, splits: int | None = None,
                     recent_visible: torch.Tensor | None = None, tickets: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`query` `[B, Hq, Qn, D]`, `keys`/`values` `[B, Hkv, L, D]`, `visible` `[B, Hkv, L]` bool, `count` `[1]` int64
    (the recent tokens, the new ones included) -> `[B, Hq, Qn, D]` (a view of a contiguous `[B, Qn, Hq, D]`).
    `splits`: key ranges per KV head (None: about two programs per SM, at least two tiles of keys each).
    `recent_visible` `[B or 1, 1, L - slot_tokens]` bool: the recent region's mask, read instead of `visible`'s.
    `tickets` `[>= B*Hkv]` int32, all 0 (the caller's, not used by another launch at the same time; left at 0): one
    launch, the last split of each KV head combining (module docstring); None: two launches. `sinks` `[Hq]`: learned
    sink logits (gpt-oss), one more term of each query head's softmax sum, or None."""
    B, Hq, Qn, D = query.shape
    H, L = keys.shape[1], keys.shape[2]
    G = Hq // H
    for name, t in (("query", query), ("keys", keys), ("values", values)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention needs the last dimension of {name} contiguous")
    if visible.dtype != torch.bool or visible.stride(-1) != 1 or visible.stride(1) != L:
        raise ValueError("decode_attention needs `visible` as a bool [B, Hkv, L] with L contiguous rows")
    apart = recent_visible is not None
    if apart and (recent_visible.dtype != torch.bool or not recent_visible.is_contiguous()
                  or recent_visible.shape[0] not in (1, B) or recent_visible.shape[-1] != L - slot_tokens):
        raise ValueError(f"decode_attention needs `recent_visible` as a contiguous bool [B or 1, 1, "
                         f"{L - slot_tokens}], got {tuple(recent_visible.shape)} {recent_visible.dtype}")
    if tickets is not None and (tickets.dtype != torch.int32 or tickets.numel() < B * H or not tickets.is_contiguous()):
        raise ValueError(f"decode_attention needs `tickets` as a contiguous int32 tensor of at least {B * H} zeros, "
                         f"got {tuple(tickets.shape)} {tickets.dtype}")
    ROWS = max(16, triton.next_power_of_2(G * Qn))  # tensor-core products need 16 rows
    D_POW2 = max(16, triton.next_power_of_2(D))
    ieee = torch.float32 in (query.dtype, keys.dtype)  # TF32 products are exact for bf16 / fp16 inputs only
    out = torch.empty((B, Qn, Hq, D), dtype=query.dtype, device=query.device)
    fused = tickets is not None
    has_sinks = sinks is not None
    if has_sinks and (sinks.shape != (Hq,) or not sinks.is_contiguous()):
        raise ValueError(f"decode_attention needs `sinks` as a contiguous [{Hq}] tensor, got {tuple(sinks.shape)}")
    wanted = splits

    def launch(block: int):
        """The split launch with `block` keys a tile; its splits and fp32 scratch."""
        splits = wanted or max(1, min(triton.cdiv(L, 2 * block), _programs_wanted(query.device) // (B * H)))
        keys_per_split = block * triton.cdiv(triton.cdiv(L, splits), block)
        splits = triton.cdiv(L, keys_per_split)
        part_acc = torch.empty((B * H, splits, ROWS, D_POW2), dtype=torch.float32, device=query.device)
        part_stats = torch.empty((B * H, splits, 2, ROWS), dtype=torch.float32, device=query.device)
        SPLITS_POW2 = triton.next_power_of_2(splits)
        CHUNK = min(triton.next_power_of_2(G * Qn * D_POW2), max(16, COMBINE_TILE // SPLITS_POW2))
        _split_kernel[(B * H, splits)](
            query, keys, values, visible.view(torch.int8),
            recent_visible.view(torch.int8) if apart else visible.view(torch.int8), count, part_acc, part_stats,
            tickets if fused else count, sinks if has_sinks else count, out,
            query.stride(0), query.stride(1), query.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            visible.stride(0), visible.stride(1),
            recent_visible.stride(0) if apart and recent_visible.shape[0] > 1 else 0,
            H, L, D, slot_tokens, scale, keys_per_split, splits,
            G=G, QN=Qn, ROWS=ROWS, D_POW2=D_POW2, BLOCK=block, IEEE=ieee, RECENT_APART=apart, FUSED=fused,
            SPLITS_POW2=SPLITS_POW2, CHUNK=CHUNK, HAS_SINKS=has_sinks,
        )
        return part_acc, part_stats, splits, SPLITS_POW2, CHUNK

    # (a wide head in float32 may not fit 64 keys a tile in shared memory: fewer, `kernels/fitting.py`)
    part_acc, part_stats, splits, SPLITS_POW2, CHUNK = launch_fitting(
        (query.device, query.dtype, keys.dtype, D_POW2, ROWS, apart, fused), BLOCK_N, launch)
    if fused:
        return out.transpose(1, 2)
    _combine_kernel[(B * H, triton.cdiv(G * Qn * D_POW2, CHUNK))](
        part_acc, part_stats, sinks if has_sinks else count, out, H, D, splits, G=G, QN=Qn, ROWS=ROWS, D_POW2=D_POW2,
        SPLITS_POW2=SPLITS_POW2, CHUNK=CHUNK, HAS_SINKS=has_sinks)
    return out.transpose(1, 2)
