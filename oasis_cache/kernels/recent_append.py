"""A decode step's new keys and values appended to the recent region in one launch, at the count read on the device,
which the launch then advances: what `RecentTokens.append` does in four operators (the positions, two index copies,
the count's add), ~3 launches fewer per layer and step.

Programs split the rows (sequence, KV head, new token); each reads the count before writing and then takes a ticket
(`done`, an atomic add): the program with the last ticket — every other program has read the count by then —
advances the count and resets the tickets for the next launch.

Shapes:
    key, value  `[B, Hkv, q, D]`, any strides, the region's dtype (`RecentTokens` casts others in torch)
    region      `[2, B, Hkv, R, D]`, any strides (the working set's recent region, a view)
    count       `[1]` int64: tokens in the region (read, then advanced by q)
    done        `[1]` int32: 0 between launches
"""

from __future__ import annotations

import torch

from .gather import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _recent_append_kernel(key, value, region, count, done,
                              skb, skh, skq, skd, svb, svh, svq, svd, r_kv, r_b, r_h, r_r, r_d,
                              H, Q, D, ROWS, PROGRAMS, BLOCK_ROWS: tl.constexpr, D_POW2: tl.constexpr):
        at = tl.load(count)
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        b = (rows // (H * Q)).to(tl.int64)
        h = ((rows // Q) % H).to(tl.int64)
        i = (rows % Q).to(tl.int64)
        dims = tl.arange(0, D_POW2)
        mask = (rows < ROWS)[:, None] & (dims < D)[None, :]
        k = tl.load(key + (b * skb + h * skh + i * skq)[:, None] + dims[None, :] * skd, mask=mask)
        v = tl.load(value + (b * svb + h * svh + i * svq)[:, None] + dims[None, :] * svd, mask=mask)
        to = region + (b * r_b + h * r_h + (at + i) * r_r)[:, None] + dims[None, :] * r_d
        tl.store(to, k, mask=mask)
        tl.store(to + r_kv, v, mask=mask)
        ticket = tl.atomic_add(done, 1)  # (after this program's read of the count)
        if ticket == PROGRAMS - 1:
            tl.store(count, at + Q)
            tl.store(done, 0)


def recent_append(key: torch.Tensor, value: torch.Tensor, region: torch.Tensor, count: torch.Tensor,
                  done: torch.Tensor) -> None:
    """Write `key`, `value` `[B, Hkv, q, D]` at positions `count .. count + q` of `region` `[2, B, Hkv, R, D]` and
    advance `count` by q, in one launch (the caller checks that they fit)."""
    B, H, Q, D = key.shape
    rows = B * H * Q
    D_POW2 = triton.next_power_of_2(D)
    BLOCK_ROWS = min(triton.next_power_of_2(rows), max(1, 4096 // D_POW2))
    programs = triton.cdiv(rows, BLOCK_ROWS)
    _recent_append_kernel[(programs,)](key, value, region, count, done, *key.stride(), *value.stride(),
                                       *region.stride(), H, Q, D, rows, programs, BLOCK_ROWS=BLOCK_ROWS,
                                       D_POW2=D_POW2)
