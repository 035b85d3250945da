"""The recent tokens on the compute device: those not yet in a complete block (the partial block), plus, within one
forward, the tokens it adds. After the forward, complete blocks leave for the host pool and the summaries, and fewer
than T tokens remain.

`kv`: `[2, B, Hkv, n, D]` (0 = keys, 1 = values); token i is absolute token `start + i`, `start` = NB * T.
"""

from __future__ import annotations

import torch


class RecentTokens:
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device):
        self.kv = torch.empty((2, batch_size, num_kv_heads, 0, head_dim), dtype=dtype, device=device)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """`key_states`, `value_states`: `[B, Hkv, q, D]`."""
        new = torch.stack((key_states, value_states))
        self.kv = new if self.num_tokens == 0 else torch.cat((self.kv, new), dim=3)

    def take_complete_blocks(self, block_size: int) -> torch.Tensor | None:
        """Remove and return the leading complete blocks as `[2, B, Hkv, n, T, D]`, or None if there is none."""
        n = self.num_tokens // block_size
        if n == 0:
            return None
        two, B, H, _, D = self.kv.shape
        blocks = self.kv[:, :, :, : n * block_size].reshape(2, B, H, n, block_size, D)
        self.kv = self.kv[:, :, :, n * block_size :].clone()
        return blocks

    def prepend(self, kv: torch.Tensor) -> None:
        """Put tokens back in front (after `crop` reaches into complete blocks). `kv`: `[2, B, Hkv, n, D]`."""
        self.kv = torch.cat((kv.to(self.kv.device), self.kv), dim=3)

    def truncate(self, num_tokens: int) -> None:
        self.kv = self.kv[:, :, :, :num_tokens]

    def index_batch(self, indices: torch.Tensor) -> None:
        self.kv = self.kv.index_select(1, indices.to(self.kv.device))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
