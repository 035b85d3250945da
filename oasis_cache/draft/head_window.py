"""The draft head's keys/values: the rows its next call may attend to.

A head trained with an attention window W (`Eagle3Config.attention_window`) lets a row see itself and the W - 1 rows
before it, so W - 1 rows are all that is kept, in a ring `[B, Hkv, W - 1, Dh]`: rotary is applied before a key is
stored, so attention does not depend on where in the ring it sits (a head of L layers: `[L, B, Hkv, W - 1, Dh]`,
every layer's rows in the same slots). `valid` `[1, W]` marks the filled slots, then the
new row itself (always visible). A one-row call (a decode step) reads the whole ring, with that mask until the ring
is full, so once full its shapes and its path never change (what a CUDA graph of the head's call needs). Calls of
several rows (a prompt, a long extend) get the rows in their order (`past`) and hand back all of them (`store`).

Without a window (published heads attend to every row) the keys/values grow by concatenation.
"""

from __future__ import annotations

import torch


class HeadKV:
    def __init__(self, window: int | None):
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.k = self.v = None  # window: the ring [L, B, Hkv, W - 1, Dh]; else every row so far [L, B, Hkv, rows, Dh]
        self.valid = None  # window: [1, W] bool
        self.filled = 0  # window: ring slots holding a row
        self.slot = 0  # window: where the next row goes (the oldest row once the ring is full)

    @property
    def has_ring(self) -> bool:
        return self.window is not None and self.k is not None

    def past(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept rows in their order, `(k, v)` each `[L, B, Hkv, rows, Dh]`, or None before the first row."""
        if self.k is None:
            return None
        if self.window is None:
            return self.k, self.v
        if self.filled < self.k.shape[-2]:
            return self.k[..., : self.filled, :], self.v[..., : self.filled, :]
        return self.k.roll(-self.slot, -2), self.v.roll(-self.slot, -2)  # oldest (at `slot`) first

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """After a call over `past()`: keep the past rows and this call's `k`, `v` (`[L, B, Hkv, n, Dh]`, in
        order)."""
        past = self.past()
        if past is not None:
            k, v = torch.cat((past[0], k), -2), torch.cat((past[1], v), -2)
        if self.window is None:
            self.k, self.v = k, v
            return
        rows = self.window - 1
        n = k.shape[-2]
        if self.k is None or self.k.shape[:-2] != k.shape[:-2]:  # first rows, or another batch
            self.k = k.new_zeros((*k.shape[:-2], rows, k.shape[-1]))
            self.v = v.new_zeros((*v.shape[:-2], rows, v.shape[-1]))
            self.valid = torch.zeros((1, rows + 1), dtype=torch.bool, device=k.device)
            self.valid[0, rows] = True  # the row being computed sees itself
        kept = min(rows, n)
        self.k[..., :kept, :] = k[..., n - kept :, :]
        self.v[..., :kept, :] = v[..., n - kept :, :]
        self.valid[0, :rows] = False
        self.valid[0, :kept] = True
        self.filled, self.slot = kept, kept % rows if rows else 0

    @property
    def full(self) -> bool:
        """A ring of at least one row, every slot filled: a one-row call's shapes and path no longer change."""
        return self.has_ring and self.k.shape[-2] > 0 and self.filled == self.k.shape[-2]

    def advance(self) -> None:
        """The host's copy of the slot after a full ring's row was written on the device (`head_step.py`)."""
        self.slot = (self.slot + 1) % self.k.shape[-2]

    def ring(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For a one-row call: `(k, v, valid)`, the whole ring and its `[1, W]` visibility (the row itself last), None
        once every slot is filled (the call then needs no mask)."""
        return self.k, self.v, (self.valid if self.filled < self.k.shape[-2] else None)

    def write_one(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """After a one-row call over `ring()`: its `k`, `v` (`[L, B, Hkv, 1, Dh]`) take the oldest slot."""
        rows = self.window - 1
        if rows == 0:
            return
        self.k[..., self.slot, :] = k[..., 0, :]
        self.v[..., self.slot, :] = v[..., 0, :]
        if self.filled < rows:
            self.valid[0, self.slot] = True
            self.filled += 1
        self.slot = (self.slot + 1) % rows

    def index_batch(self, indices: torch.Tensor) -> None:
        """Sequence i becomes old sequence `indices[i]` (beam search); the ring keeps its storage."""
        if self.k is None:
            return
        indices = indices.to(self.k.device)
        k, v = self.k.index_select(-4, indices), self.v.index_select(-4, indices)  # the batch dimension
        if self.window is None or k.shape != self.k.shape:
            self.k, self.v = k, v
        else:
            self.k.copy_(k)
            self.v.copy_(v)
