"""The device working set: the selected blocks a layer attends to, and its recent tokens, in ONE tensor so that
decode attention reads a single contiguous run of keys and values per KV head (no per-step concatenation).

    kv       `[2, B, Hkv, S*T + R, D]`   0 = keys, 1 = values
             [0, S*T)        S slots of T tokens: blocks placed by `SlotMap`, bytes written by `memory.transfer`
             [S*T, S*T + R)  the recent-token region (`RecentTokens`): the partial block and the new tokens
    visible  `[B, Hkv, S*T + R]` bool, the attention mask of the current step (slots: written by the slot
             assignment; recent region: written per forward)
"""

from __future__ import annotations

import torch

from .stamped import Stamped


class WorkingSet(Stamped):
    def __init__(self, batch_size, num_kv_heads, num_slots, block_size, recent_capacity, head_dim, dtype, device):
        self.num_slots = num_slots
        self.block_size = block_size
        self.slot_tokens = num_slots * block_size
        length = self.slot_tokens + recent_capacity
        self.kv = torch.zeros((2, batch_size, num_kv_heads, length, head_dim), dtype=dtype, device=device)
        self.visible = torch.zeros((batch_size, num_kv_heads, length), dtype=torch.bool, device=device)

    @property
    def slots(self) -> torch.Tensor:
        """`[2, B, Hkv, S, T, D]` view of the slots."""
        return self.kv[:, :, :, : self.slot_tokens].unflatten(3, (self.num_slots, self.block_size))

    @property
    def recent_region(self) -> torch.Tensor:
        """`[2, B, Hkv, R, D]` view of the recent-token region."""
        return self.kv[:, :, :, self.slot_tokens :]

    @property
    def recent_capacity(self) -> int:
        return self.visible.shape[-1] - self.slot_tokens

    def set_recent_visible(self, mask: torch.Tensor) -> None:
        """Mask of the recent region, `[B or 1, 1, R]` bool (`ForwardContext.recent_visibility`: the same for every
        layer of a forward)."""
        self.visible[:, :, self.slot_tokens :].copy_(mask)  # broadcast over sequences and KV heads

    def _slot_index(self, slots: torch.Tensor) -> torch.Tensor:
        """`slots` `[B, Hkv, n]` as an index into `self.slots` along its slot dim: `[2, B, Hkv, n, T, D]`."""
        return slots[None, :, :, :, None, None].expand(2, -1, -1, -1, self.block_size, self.kv.shape[-1])

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """What slots `slots` (`[B, Hkv, n]`, each >= 0) hold: `[2, B, Hkv, n, T, D]`."""
        return self.slots.gather(3, self._slot_index(slots))

    def write_slots(self, slots: torch.Tensor, placed: torch.Tensor, blocks: torch.Tensor) -> None:
        """`blocks` (`[2, B, Hkv, n, T, D]`) into slots `slots` (`[B, Hkv, n]`, distinct per row) where `placed`; the
        other slots named keep what they hold (tensor ops: no host sync)."""
        at, view = self._slot_index(slots), self.slots
        made = blocks.to(view.dtype)
        view.scatter_(3, at, torch.where(placed[None, :, :, :, None, None], made, view.gather(3, at)))

    def attendable(self):
        """`(keys, values, visible)` over the whole working set, `[B, Hkv, L, D]` twice and `[B, Hkv, L]`."""
        return self.kv[0], self.kv[1], self.visible

    def grown(self, num_slots: int) -> "WorkingSet":
        """A working set of `num_slots` slots holding this one's slots in its first ones (their masks too); the
        recent region is left empty (`OasisLayer.reserve_slots` moves the recent tokens)."""
        B, H, _, D = self.kv.shape[1:]
        new = WorkingSet(B, H, num_slots, self.block_size, self.recent_capacity, D, self.kv.dtype, self.kv.device)
        new.kv[:, :, :, : self.slot_tokens] = self.kv[:, :, :, : self.slot_tokens]
        new.visible[..., : self.slot_tokens] = self.visible[..., : self.slot_tokens]
        return new

    def index_batch(self, indices: torch.Tensor) -> None:
        self.kv = self.kv.index_select(1, indices.to(self.kv.device))
        self.visible = self.visible.index_select(0, indices.to(self.kv.device))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.visible.numel()
