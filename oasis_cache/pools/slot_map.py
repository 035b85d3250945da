"""The head-wise map between host blocks and device slots — the ONLY code that changes which block sits in which
slot. Everything runs as tensor ops on the compute device: no host sync, fixed shapes whatever the hit rate.

State, per (sequence, KV head); each tensor has one extra trailing "scratch" entry that absorbs masked writes:
    slot_block  `[B, Hkv, S+1]`     block_id held by each slot, -1 when empty
    block_slot  `[B, Hkv, NBcap+1]` slot holding each block, -1 when not resident
    last_used   `[B, Hkv, S+1]`     step at which each slot was last selected, -1 never (the eviction order: LRU)

Example (the article's): block size 16, slot 7 maps to block 31, so token 31*16+8 is slot 7, offset 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .stamped import Stamped


@dataclass
class Assignment:
    """Where this step's selected blocks are, and what must move. Shapes `[B, Hkv, K]`.

    dest:   slot of each selected block (S for entries that are not selected)
    fetch:  selected blocks that are not resident: copy host block -> `dest` (bool, or int8 from the kernel)
    """

    dest: torch.Tensor
    fetch: torch.Tensor


class SlotMap(Stamped):
    def __init__(self, batch_size, num_kv_heads, num_slots, device, use_kernel: bool = False):
        self.num_slots = num_slots
        self.use_kernel = use_kernel
        shape = (batch_size, num_kv_heads)
        self.slot_block = torch.full((*shape, num_slots + 1), -1, dtype=torch.long, device=device)
        self.last_used = torch.full((*shape, num_slots + 1), -1, dtype=torch.long, device=device)
        self.block_slot = torch.full((*shape, 1), -1, dtype=torch.long, device=device)

    @property
    def capacity_blocks(self) -> int:
        return self.block_slot.shape[-1] - 1

    def reserve(self, num_blocks: int) -> None:
        """Make the block -> slot table cover `num_blocks` blocks (grows by half, at least 64 blocks)."""
        if num_blocks <= self.capacity_blocks:
            return
        capacity = max(num_blocks, self.capacity_blocks * 3 // 2, self.capacity_blocks + 64)
        grown = torch.full((*self.block_slot.shape[:2], capacity + 1), -1, dtype=torch.long, device=self.block_slot.device)
        grown[..., : self.capacity_blocks] = self.block_slot[..., : self.capacity_blocks]
        self.block_slot = grown

    def grow_slots(self, num_slots: int) -> None:
        """Make room for `num_slots` slots (more than now): the new ones are empty; blocks stay in their slots."""
        S = self.num_slots
        for name in ("slot_block", "last_used"):
            old = getattr(self, name)
            grown = torch.full((*old.shape[:2], num_slots + 1), -1, dtype=old.dtype, device=old.device)
            grown[..., :S] = old[..., :S]
            setattr(self, name, grown)
        self.num_slots = num_slots

    def assign(self, block_ids: torch.Tensor, ranks: torch.Tensor, step: int | torch.Tensor, visible: torch.Tensor,
               counters: torch.Tensor, block_size: int, max_fetch: int | None = None) -> Assignment:
        """Place this step's selection. Resident blocks stay where they are; each missing block takes a free slot,
        else the least recently selected slot that holds no selected block (ties: the lowest slot). At most
        `max_fetch` missing blocks per (sequence, KV head) are placed, in entry order; later ones are dropped.

        Args:
            block_ids: `[B, Hkv, K]` distinct block ids, best first when `max_fetch` may drop some.
            ranks: `[B, Hkv, K]` their ranking scores; an entry is selected iff its rank > -inf.
            step: a counter that grows with each call (the LRU clock): `[1]` int64 on the device (read there, so
                that a captured step replays with the clock's new value), or an int.
            visible: `[B, Hkv, L]` bool; its first S*T entries receive the attention mask of the slots (the T tokens
                of every slot that holds a selected block).
            counters: `[4]` int64, += (selected, already resident, fetched, tokens in selected slots).
        """
        max_fetch = block_ids.shape[-1] if max_fetch is None else max_fetch
        if not isinstance(step, torch.Tensor):
            step = torch.full((1,), step, dtype=torch.long, device=self.slot_block.device)
        if self.use_kernel:
            from ..kernels.slot_assign import slot_assign

            dest, fetch = slot_assign(block_ids, ranks, self.block_slot, self.slot_block, self.last_used, step,
                                      visible, counters, block_size, max_fetch)
            return Assignment(dest=dest, fetch=fetch)
        return self._assign_reference(block_ids, ranks, step, visible, counters, block_size, max_fetch)

    def _assign_reference(self, block_ids, ranks, step, visible, counters, block_size, max_fetch) -> Assignment:
        """The plain-PyTorch implementation (CPU, and the kernel's reference)."""
        S, NBcap = self.num_slots, self.capacity_blocks
        selected = ranks > -torch.inf
        block_ids = torch.where(selected, block_ids, NBcap)  # (unselected ids may lie past the table)
        resident = self.block_slot.gather(-1, block_ids)
        hit = selected & (resident >= 0)
        fetch = selected & ~hit
        over_cap = fetch & (torch.cumsum(fetch, dim=-1) > max_fetch)
        selected, fetch = selected & ~over_cap, fetch & ~over_cap

        # Slots that hold a block selected this step are kept; the others are candidates, free ones first, then LRU.
        keep = torch.zeros_like(self.slot_block, dtype=torch.bool)
        keep.scatter_(-1, torch.where(hit, resident, S), True)
        age = torch.where(keep, torch.iinfo(torch.long).max, self.last_used)[..., :S]
        order = torch.sort(age, dim=-1, stable=True).indices  # [B, Hkv, S]
        rank = (torch.cumsum(fetch, dim=-1) - 1).clamp_(min=0)
        dest = torch.where(hit, resident, torch.where(fetch, order.gather(-1, rank), S))

        # Evict what the fetched blocks replace, then record the new owners.
        evicted = self.slot_block.gather(-1, dest)
        self.block_slot.scatter_(-1, torch.where(fetch & (evicted >= 0), evicted, NBcap), -1)
        self.block_slot.scatter_(-1, torch.where(fetch, block_ids, NBcap), torch.where(fetch, dest, -1))
        self.slot_block.scatter_(-1, torch.where(fetch, dest, S), torch.where(fetch, block_ids, -1))
        self.last_used.scatter_(-1, torch.where(selected, dest, S), step.expand(dest.shape))

        attended = torch.zeros_like(self.slot_block, dtype=torch.bool)
        attended.scatter_(-1, torch.where(selected, dest, S), True)
        B, H = attended.shape[:2]
        visible[..., : S * block_size] = attended[..., :S, None].expand(B, H, S, block_size).reshape(B, H, -1)
        n_selected = selected.sum()
        counters += torch.stack((n_selected, hit.sum(), fetch.sum(), n_selected * block_size))
        return Assignment(dest=dest, fetch=fetch)

    def hold_newest(self, working_set, blocks: torch.Tensor, count: torch.Tensor, newest: int,
                    step: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        """With a narrow host pool (`host_dtype`), decode steps attend each sequence's sink blocks and the newest
        `recent_tokens` complete blocks as the model made them: each takes a slot as it completes (written from the
        device's copy, `WorkingSet.write_slots`) — forced every step, it keeps it — and a newest block gives it up
        when it leaves them (read from the pool, widened, after that); dense forwards read every complete block from
        the pool. Here: `blocks` (`[2, B, Hkv, completed, T, D]`) just completed, the last before the device count
        `count` (`[1]`); `sinks` (`[B, J]`, -1 past a sequence's last, `held_ids`) its sink blocks. The blocks that
        leave the newest `newest` with them lose their slots unless sinks, and the completed ones among the newest
        (up to `newest`) and the sinks take free slots, stamped at `step`, and are written there. Tensor ops only (a
        captured step replays them at the next count)."""
        J = 0 if sinks is None else sinks.shape[-1]
        if newest == 0 and J == 0:
            return
        S, NBcap, completed = self.num_slots, self.capacity_blocks, blocks.shape[3]
        B, H = self.slot_block.shape[:2]
        device = self.slot_block.device
        leaving = (count - newest - completed + torch.arange(completed, device=device)).expand(B, completed)
        if J:
            leaving = torch.where((leaving[..., None] == sinks[:, None]).any(-1), -1, leaving)
        leaving = torch.where(leaving >= 0, leaving, NBcap)[:, None].expand(B, H, completed)
        held = self.block_slot.gather(-1, leaving)
        held = torch.where(held >= 0, held, S)
        self.slot_block.scatter_(-1, held, -1)
        self.last_used.scatter_(-1, held, -1)
        self.block_slot.scatter_(-1, leaving, -1)
        n = min(completed, newest)
        new = (count - n + torch.arange(n, device=device)).expand(B, n)
        if J:  # (a sink block among the newest is placed once, as one of them)
            young = (sinks >= count - completed) & (sinks < count - n)
            new = torch.cat([torch.where(young, sinks, -1), new], -1)
        new = new.gather(-1, torch.sort((new < 0).to(torch.int8), dim=-1, stable=True).indices)  # blocks first
        m = min(new.shape[-1], S)
        new = new[:, None, :m].expand(B, H, m)
        free = self.slot_block[..., :S] < 0
        slots = torch.sort((~free).to(torch.int8), dim=-1, stable=True).indices[..., :m]  # free ones first
        placed = free.gather(-1, slots) & (new >= 0)
        self.block_slot.scatter_(-1, torch.where(placed, new, NBcap), torch.where(placed, slots, -1))
        self.slot_block.scatter_(-1, torch.where(placed, slots, S), torch.where(placed, new, -1))
        self.last_used.scatter_(-1, torch.where(placed, slots, S), step.expand(B, H, m))
        at = (new - (count - completed)).clamp(0, completed - 1)  # (a block that found no free slot is read from the
        working_set.write_slots(slots, placed, blocks.gather(3, at[None, ..., None, None].expand(  # pool)
            2, B, H, m, *blocks.shape[4:])))

    def held_ids(self, count: torch.Tensor, newest: int, sinks: torch.Tensor | None) -> torch.Tensor:
        """`[B, Hkv, J + newest]` the blocks `hold_newest` holds at the device count `count`: the sinks (`[B, J]`),
        then the newest; -1 where none."""
        B, H = self.slot_block.shape[:2]
        ids = (count - newest + torch.arange(newest, device=count.device)).expand(B, newest)
        ids = torch.cat([sinks, ids], -1) if sinks is not None else ids
        return torch.where(ids >= 0, ids, -1)[:, None].expand(B, H, ids.shape[-1])

    def forget_blocks_from(self, num_blocks: int) -> None:
        """Blocks >= `num_blocks` no longer exist (after `crop`): free their slots."""
        gone = self.slot_block >= num_blocks
        self.slot_block.masked_fill_(gone, -1)
        self.last_used.masked_fill_(gone, -1)
        self.block_slot[..., num_blocks : self.capacity_blocks] = -1

    def index_batch(self, indices: torch.Tensor) -> None:
        indices = indices.to(self.slot_block.device)
        self.slot_block = self.slot_block.index_select(0, indices)
        self.last_used = self.last_used.index_select(0, indices)
        self.block_slot = self.block_slot.index_select(0, indices)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.slot_block, self.last_used, self.block_slot))
