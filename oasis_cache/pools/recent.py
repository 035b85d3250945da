"""The recent tokens: those not yet in a complete block (the partial block), plus, within one forward, the tokens
it adds. They live in the working set's recent region; a forward that adds more than the region holds (prefill, a
long extend) uses a temporary tensor until its complete blocks leave. After every forward fewer than T remain.

Token i is absolute token `start + i`, `start` = NB * T. `kv`: `[2, B, Hkv, n, D]`. The count lives on the host
(`num_tokens`) and on the device (`count`, `[1]` int64): a decode step writes its tokens at the device count and
advances it by an add, so that a captured step replays correctly; steps that move blocks set it from the host.
"""

from __future__ import annotations

import torch

from .stamped import Stamped


class RecentTokens(Stamped):
    def __init__(self, region: torch.Tensor, use_kernel: bool = False):
        self.region = region  # [2, B, Hkv, R, D], a view into the working set
        self.num_tokens = 0
        self.count = torch.zeros(1, dtype=torch.long, device=region.device)  # num_tokens, on the device
        self.use_kernel = use_kernel  # a decode step's append in one launch (`kernels/recent_append.py`)
        self._tickets = torch.zeros(1, dtype=torch.int32, device=region.device)  # (the kernel's, 0 between launches)
        self._offsets = torch.arange(region.shape[3], device=region.device)  # [R]
        self._overflow: torch.Tensor | None = None  # [2, B, Hkv, n, D] when n > R

    @property
    def capacity(self) -> int:
        return self.region.shape[3]

    @property
    def kv(self) -> torch.Tensor:
        if self._overflow is not None:
            return self._overflow
        return self.region[:, :, :, : self.num_tokens]

    @property
    def in_region(self) -> bool:
        return self._overflow is None

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """`key_states`, `value_states`: `[B, Hkv, q, D]`."""
        n, q = self.num_tokens, key_states.shape[2]
        if self._overflow is None and n + q <= self.capacity:  # at the device count: the same operators every step
            if self.use_kernel and key_states.dtype == value_states.dtype == self.region.dtype:
                from ..kernels.recent_append import recent_append

                recent_append(key_states, value_states, self.region, self.count, self._tickets)
            else:
                where = self._offsets[:q] + self.count  # [q]
                self.region[0].index_copy_(2, where, key_states.to(self.region.dtype))  # (as a slice write casts)
                self.region[1].index_copy_(2, where, value_states.to(self.region.dtype))
                self.count.add_(q)
        else:
            self._overflow = torch.cat((self.kv, torch.stack((key_states, value_states))), dim=3)
            self.count.fill_(n + q)
        self.num_tokens = n + q

    def take_complete_blocks(self, block_size: int) -> torch.Tensor | None:
        """Remove the leading complete blocks and return them as `[2, B, Hkv, n, T, D]`, or None if there is none."""
        n = self.num_tokens // block_size
        if n == 0:
            return None
        kv = self.kv
        blocks = kv[:, :, :, : n * block_size].unflatten(3, (n, block_size))
        if self._overflow is None:
            blocks = blocks.clone()  # the leftover is moved to the front of the region below
        self._set(kv[:, :, :, n * block_size :])  # fewer than T tokens from offset >= T: no overlap
        return blocks

    def prepend(self, kv: torch.Tensor) -> None:
        """Put tokens back in front (after `crop` reaches into complete blocks). `kv`: `[2, B, Hkv, n, D]`."""
        self._set(torch.cat((kv.to(self.region.device), self.kv), dim=3))

    def truncate(self, num_tokens: int) -> None:
        if self._overflow is None:  # the first tokens of the region stay where they are
            removed = self.num_tokens - min(num_tokens, self.num_tokens)
            if removed:  # (a riding draft row: 1 each step)
                self.count.sub_(removed)
            self.num_tokens -= removed
            return
        self._set(self.kv[:, :, :, :num_tokens])

    def _set(self, kv: torch.Tensor) -> None:
        """Make `kv` the recent tokens, in the region when they fit."""
        n = kv.shape[3]
        if n <= self.capacity:
            self.region[:, :, :, :n] = kv
            self._overflow = None
        else:
            self._overflow = kv.clone()
        self.num_tokens = n
        self.count.fill_(n)
