"""The summary pool: per complete block, the elementwise min and max of its keys (as cached, i.e. after RoPE), kept
on the compute device. They bound q.k over a block from above (see `control.selection`).

`minmax`: `[2, B, Hkv, NBcap, D]` (0 = min, 1 = max); blocks [0, num_blocks) are valid. Capacity grows by a quarter
(at least 64 blocks) when full: the pool costs about 2/T of the keys' size (1/16 of K+V at T=16), with at most 25%
slack, and is reallocated O(log N) times over a sequence.
"""

from __future__ import annotations

import torch


class BlockSummaries:
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device):
        self.minmax = torch.empty((2, batch_size, num_kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.num_blocks = 0

    @property
    def capacity_blocks(self) -> int:
        return self.minmax.shape[3]

    def append(self, key_blocks: torch.Tensor) -> None:
        """Summarize and append new complete blocks. `key_blocks`: `[B, Hkv, n, T, D]` on the compute device."""
        n = key_blocks.shape[2]
        end = self.num_blocks + n
        if end > self.capacity_blocks:
            grown = torch.empty(
                (*self.minmax.shape[:3], max(end, self.capacity_blocks * 5 // 4, self.capacity_blocks + 64),
                 self.minmax.shape[4]),
                dtype=self.minmax.dtype,
                device=self.minmax.device,
            )
            grown[:, :, :, : self.num_blocks] = self.minmax[:, :, :, : self.num_blocks]
            self.minmax = grown
        self.minmax[0, :, :, self.num_blocks : end] = key_blocks.amin(dim=3)
        self.minmax[1, :, :, self.num_blocks : end] = key_blocks.amax(dim=3)
        self.num_blocks = end

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(kmin, kmax)`, each `[B, Hkv, NB, D]`."""
        return self.minmax[0, :, :, : self.num_blocks], self.minmax[1, :, :, : self.num_blocks]

    def truncate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def index_batch(self, indices: torch.Tensor) -> None:
        self.minmax = self.minmax.index_select(1, indices.to(self.minmax.device))

    @property
    def nbytes(self) -> int:
        return self.minmax.numel() * self.minmax.element_size()
