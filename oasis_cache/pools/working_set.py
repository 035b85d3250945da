"""The device working set: the key/value blocks a layer attends to besides its recent tokens.

`kv`: `[2, B, Hkv, S, T, D]` on the compute device (0 = keys, 1 = values). Which block sits in which slot is
decided by `SlotMap` alone; bytes are written by `oasis_cache.memory.transfer`.
"""

from __future__ import annotations

import torch


class WorkingSet:
    def __init__(self, batch_size, num_kv_heads, num_slots, block_size, head_dim, dtype, device):
        self.num_slots = num_slots
        self.kv = torch.zeros(
            (2, batch_size, num_kv_heads, num_slots, block_size, head_dim), dtype=dtype, device=device
        )

    def attendable(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(keys, values)`, each `[B, Hkv, S*T, D]` (views)."""
        two, B, H, S, T, D = self.kv.shape
        return self.kv[0].view(B, H, S * T, D), self.kv[1].view(B, H, S * T, D)

    def index_batch(self, indices: torch.Tensor) -> None:
        self.kv = self.kv.index_select(1, indices.to(self.kv.device))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
