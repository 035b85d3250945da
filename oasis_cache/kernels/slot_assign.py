"""Slot assignment in one launch: what `SlotMap.assign` does in ~25 tensor ops, one program per (sequence, KV head).
Resident selected blocks keep their slot; each missing block takes a free slot, else the least recently selected slot
holding no selected block (ties: lowest slot). Also writes the attention mask of the slots and the step's counters.

Shapes (contiguous, per (sequence, KV head) = bh, BH of them):
    block_ids     `[BH, K]` int64     candidates; entry k is selected iff `ranks[bh, k] > -inf` (and, if it is not
                                      resident, it is among the first `max_fetch` such entries)
    ranks         `[BH, K]` fp32
    block_slot    `[BH, NBcap+1]` int64   slot_block / last_used `[BH, S+1]` int64   (the SlotMap's state)
    dest (out)    `[BH, K]` int64     slot of each selected block (S for unselected entries)
    fetch (out)   `[BH, K]` int8      1 = copy host block -> dest
    visible (out) rows of stride `visible_stride`, first S*T entries: 1 for the tokens of selected slots
    scratch       `[BH, 2, S_POW2]` int64 (program-private staging for scatters within a program)
    counters      `[4]` int64 += (selected, hits, fetched, tokens in selected slots)
    step          `[1]` int64         the LRU clock (read on the device: a captured launch sees its new value)
"""

from __future__ import annotations

import torch

from .gather import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _slot_assign_kernel(block_ids, ranks, block_slot, slot_block, last_used, dest, fetch, visible, scratch,
                            counters, step, max_fetch, K, S, NBcap1, visible_stride,
                            T: tl.constexpr, K_POW2: tl.constexpr, S_POW2: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_POW2)
        s = tl.arange(0, S_POW2)
        in_k = k < K
        in_s = s < S
        ids = tl.load(block_ids + bh * K + k, mask=in_k, other=0)
        selected = in_k & (tl.load(ranks + bh * K + k, mask=in_k, other=-float("inf")) > -float("inf"))
        resident = tl.load(block_slot + bh * NBcap1 + ids, mask=selected, other=-1)
        hit = selected & (resident >= 0)
        miss = selected & (resident < 0)
        over_cap = miss & (tl.cumsum(miss.to(tl.int32), axis=0) > max_fetch)
        miss = miss & ~over_cap
        selected = selected & ~over_cap

        # keep[s] = slot s holds a selected block (scatter through program-private scratch).
        keep_row = scratch + (bh * 2) * S_POW2
        tl.store(keep_row + s, tl.zeros([S_POW2], dtype=tl.int64))
        tl.debug_barrier()
        tl.store(keep_row + resident, tl.full([K_POW2], 1, tl.int64), mask=hit)
        tl.debug_barrier()
        keep = tl.load(keep_row + s) != 0

        # Eviction order: free slots (last_used = -1) first, then least recently selected; kept slots last.
        used = tl.load(last_used + bh * (S + 1) + s, mask=in_s, other=0)
        last = tl.full([S_POW2], 1 << 40, tl.int64)  # kept slots sort last (the clock stays far below 2**40)
        order_key = tl.where(keep | (s >= S), last * S_POW2 + s, (used + 1) * S_POW2 + s)
        order = tl.sort(order_key) % S_POW2  # slot ids, eviction order first (a rank by S^2 pairwise comparisons
        order_row = scratch + (bh * 2 + 1) * S_POW2  # was slower on the H200: 8.8 vs 6.3 us at S = 128)
        tl.store(order_row + s, order)
        tl.debug_barrier()
        rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        new_slot = tl.load(order_row + rank, mask=miss, other=0)
        slot = tl.where(hit, resident, tl.where(miss, new_slot, S))
        tl.store(dest + bh * K + k, slot, mask=in_k)
        tl.store(fetch + bh * K + k, miss.to(tl.int8), mask=in_k)

        # Evict what the fetched blocks replace, then record the new owners and the LRU clock.
        evicted = tl.load(slot_block + bh * (S + 1) + new_slot, mask=miss, other=-1)
        tl.debug_barrier()
        tl.store(block_slot + bh * NBcap1 + evicted, tl.full([K_POW2], -1, tl.int64), mask=miss & (evicted >= 0))
        tl.debug_barrier()
        tl.store(block_slot + bh * NBcap1 + ids, new_slot, mask=miss)
        tl.store(slot_block + bh * (S + 1) + new_slot, ids, mask=miss)
        tl.store(last_used + bh * (S + 1) + slot, tl.full([K_POW2], 0, tl.int64) + tl.load(step), mask=selected)

        # Attention mask of the slots: the T tokens of every slot holding a selected block.
        tl.store(keep_row + s, tl.zeros([S_POW2], dtype=tl.int64))
        tl.debug_barrier()
        tl.store(keep_row + slot, tl.full([K_POW2], 1, tl.int64), mask=selected)
        tl.debug_barrier()
        attended = tl.load(keep_row + s) != 0
        t = tl.arange(0, T)
        tl.store(visible + bh * visible_stride + s[:, None] * T + t[None, :],
                 (attended[:, None] & (t[None, :] >= 0)).to(tl.int8), mask=in_s[:, None] & (t[None, :] >= 0))

        n_selected = tl.sum(selected.to(tl.int64), axis=0)
        tl.atomic_add(counters + 0, n_selected)
        tl.atomic_add(counters + 1, tl.sum(hit.to(tl.int64), axis=0))
        tl.atomic_add(counters + 2, tl.sum(miss.to(tl.int64), axis=0))
        tl.atomic_add(counters + 3, n_selected * T)


def slot_assign(block_ids, ranks, block_slot, slot_block, last_used, step, visible, counters, block_size, max_fetch):
    """Launch the kernel; returns `(dest, fetch)` (`[B, Hkv, K]` int64, int8). `visible`: `[B, Hkv, L]` bool whose
    first S*T entries per row receive the slots' mask; `counters`: `[4]` int64 (accumulated); `step`: `[1]` int64."""
    B, H, K = block_ids.shape
    S = slot_block.shape[-1] - 1
    S_POW2 = triton.next_power_of_2(S)
    dest = torch.empty((B, H, K), dtype=torch.int64, device=block_ids.device)
    fetch = torch.empty((B, H, K), dtype=torch.int8, device=block_ids.device)
    scratch = torch.empty((B * H, 2, S_POW2), dtype=torch.int64, device=block_ids.device)
    _slot_assign_kernel[(B * H,)](
        block_ids.contiguous(), ranks.contiguous(), block_slot, slot_block, last_used, dest, fetch,
        visible.view(torch.int8), scratch, counters, step, max_fetch, K, S, block_slot.shape[-1], visible.shape[-1],
        T=block_size, K_POW2=max(16, triton.next_power_of_2(K)), S_POW2=S_POW2,
    )
    return dest, fetch
