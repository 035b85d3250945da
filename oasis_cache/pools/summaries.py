"""The summary pool: per complete block, what selection ranks it by, kept on the compute device. Keys are as cached
(after RoPE).

`minmax`: `[2, B, Hkv, NBcap, D]` (0 = min, 1 = max), the elementwise min and max of the block's keys; they bound
    q.k over the block from above (the "bound" scorer, `control.selection`).
`codes`: `[B, Hkv, NBcap, ceil(T/8), D]` uint8, only with `key_bits=True` (the "bits" scorer): one bit per token and
    key channel, set when the key is nearer the block's max than its min in that channel (2k > kmin + kmax). Bit
    `t % 8` of byte `t // 8` is token t. Snapping every channel to its block's min or max gives a coarse copy of each
    key, so a block can be ranked by the best q.(coarse key) of its tokens instead of a bound over all of them.
    T*D/8 bytes per block and KV head: half of `minmax` in bf16.

Blocks [0, num_blocks) are valid. Capacity grows by a quarter (at least 64 blocks) when full: the pool costs about
2/T of the keys' size (1/16 of K+V at T=16; 3/32 with codes at bf16), with at most 25% slack, and is reallocated
O(log N) times over a sequence.
"""

from __future__ import annotations

import torch


def pack_key_bits(key_blocks: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """`key_blocks` `[..., T, D]`, `kmin`/`kmax` `[..., D]` -> codes `[..., ceil(T/8), D]` uint8 (see module doc)."""
    *lead, T, D = key_blocks.shape
    nearer_max = 2 * key_blocks.float() > (kmin.float() + kmax.float()).unsqueeze(-2)  # [..., T, D]
    padded = torch.zeros((*lead, -(-T // 8) * 8, D), dtype=torch.uint8, device=key_blocks.device)
    padded[..., :T, :] = nearer_max
    weights = (1 << torch.arange(8, device=key_blocks.device)).to(torch.uint8)[:, None]  # [8, 1]
    return (padded.view(*lead, -1, 8, D) * weights).sum(dim=-2, dtype=torch.uint8)


def unpack_key_bits(codes: torch.Tensor, block_size: int) -> torch.Tensor:
    """codes `[..., ceil(T/8), D]` uint8 -> `[..., T, D]` bool (token t's channels nearer the block's max)."""
    shifts = torch.arange(8, device=codes.device, dtype=torch.uint8)[:, None]  # [8, 1]
    bits = (codes.unsqueeze(-2) >> shifts) & 1  # [..., ceil(T/8), 8, D]
    return bits.flatten(-3, -2)[..., :block_size, :].bool()


class BlockSummaries:
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device, block_size: int, key_bits: bool):
        self.minmax = torch.empty((2, batch_size, num_kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.codes = (
            torch.empty((batch_size, num_kv_heads, 0, -(-block_size // 8), head_dim), dtype=torch.uint8, device=device)
            if key_bits else None
        )
        self.num_blocks = 0

    @property
    def capacity_blocks(self) -> int:
        return self.minmax.shape[3]

    def append(self, key_blocks: torch.Tensor) -> None:
        """Summarize and append new complete blocks. `key_blocks`: `[B, Hkv, n, T, D]` on the compute device."""
        n = key_blocks.shape[2]
        end = self.num_blocks + n
        if end > self.capacity_blocks:
            capacity = max(end, self.capacity_blocks * 5 // 4, self.capacity_blocks + 64)
            self.minmax = self._grown(self.minmax, 3, capacity)
            if self.codes is not None:
                self.codes = self._grown(self.codes, 2, capacity)
        kmin, kmax = key_blocks.amin(dim=3), key_blocks.amax(dim=3)  # [B, Hkv, n, D]
        self.minmax[0, :, :, self.num_blocks : end] = kmin
        self.minmax[1, :, :, self.num_blocks : end] = kmax
        if self.codes is not None:
            self.codes[:, :, self.num_blocks : end] = pack_key_bits(key_blocks, kmin, kmax)
        self.num_blocks = end

    def _grown(self, pool: torch.Tensor, block_dim: int, capacity: int) -> torch.Tensor:
        shape = list(pool.shape)
        shape[block_dim] = capacity
        grown = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        grown.narrow(block_dim, 0, self.num_blocks).copy_(pool.narrow(block_dim, 0, self.num_blocks))
        return grown

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(kmin, kmax)`, each `[B, Hkv, NB, D]`."""
        return self.minmax[0, :, :, : self.num_blocks], self.minmax[1, :, :, : self.num_blocks]

    def truncate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def index_batch(self, indices: torch.Tensor) -> None:
        self.minmax = self.minmax.index_select(1, indices.to(self.minmax.device))
        if self.codes is not None:
            self.codes = self.codes.index_select(0, indices.to(self.codes.device))

    @property
    def nbytes(self) -> int:
        codes = 0 if self.codes is None else self.codes.numel()
        return self.minmax.numel() * self.minmax.element_size() + codes
