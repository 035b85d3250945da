"""The decode side's local cache of a remote tier: blocks a store holds, read one (sequence, KV head) at a time.

A layer admitted from a store (`remote/disaggregate.py`) keeps its first `published` blocks in the store, one object
per (block, sequence, KV head): `[2, T, D]`, keys and values. A decode step that selects such a block for a sequence's
KV head needs only that head's run, so that is the unit fetched and cached. The cache is an arena of `capacity` units
in host memory (pinned on CUDA, read by the same gather kernel as the host pool, `gather_blocks(per_unit=True)`):

    arena      `[capacity, 2, 1, 1, T, D]`   slot s holds one unit
    slot_of    `[B, Hkv, published]` int64   the unit's slot, -1 when not here (on the host; a copy on the device
                                             maps a step's block ids to slots without a sync)
    unit_of    `[capacity]` int64            the unit a slot holds ((b * Hkv + h) * P + block, P the blocks published
                                             at admission), -1 when free
    last_used  `[capacity]` int64            the step that last read a slot: eviction takes the least recent

`ensure` runs before a step's gather: it reads the step's selected block ids on the host (a sync: a remote-backed
cache decodes eagerly), fetches the units not here from the store (batched calls), into the free slots first and then
into the least recently used ones, and updates both maps. Blocks completed during decode are written to the layer's
host pool (which starts at block `published`) and never evicted. This cache is the one owner of its slots; a slot is
freed only by `ensure` (eviction) or with the whole cache.
"""

from __future__ import annotations

import torch


class LocalBlockCache:
    """A bounded LRU cache of one layer's store-held (block, sequence, KV head) units.

    Args:
        tier: the request's `RemoteTier`.
        layer_idx: the layer.
        published: blocks [0, published) are in the store.
        batch_size, num_kv_heads, block_size, head_dim, dtype: the layer's B, Hkv, T, D and element type.
        capacity: units the arena holds (at least one step's selection of this layer).
        pin_memory: page-locked arena (CUDA models).
        device: the compute device (where the slot map's copy lives).
    """

    def __init__(self, tier, layer_idx, published, batch_size, num_kv_heads, block_size, head_dim, dtype, capacity,
                 pin_memory, device):
        self.tier = tier
        self.layer_idx = layer_idx
        self.published = published
        self.batch_size, self.num_kv_heads = batch_size, num_kv_heads
        self.capacity = capacity
        self.arena = torch.empty((capacity, 2, 1, 1, block_size, head_dim), dtype=dtype, pin_memory=pin_memory)
        self.stride = published  # unit id = (b * Hkv + h) * stride + block
        self.slot_of = torch.full((batch_size, num_kv_heads, published), -1, dtype=torch.int64)
        self.device = torch.device(device)
        self.slot_of_device = self.slot_of if self.device.type == "cpu" else self.slot_of.to(self.device)
        self.unit_of = torch.full((capacity,), -1, dtype=torch.int64)
        self.last_used = torch.full((capacity,), -1, dtype=torch.int64)
        self.step = 0
        self.units_fetched = 0  # units got from the store so far (a unit evicted and read again counts twice)
        self.units_evicted = 0
        self.arena_table = None  # the gather's chunk-address table for the arena (built on first use, on the device)

    @property
    def unit_nbytes(self) -> int:
        return self.arena[0].numel() * self.arena.element_size()

    @property
    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def ensure(self, block_ids: torch.Tensor, fetch: torch.Tensor) -> None:
        """Make every unit a step reads here: entries `fetch` of `block_ids` (`[B, Hkv, K]`) below `published`."""
        ids, wanted = block_ids.to("cpu"), fetch.to("cpu").bool()  # a sync on CUDA: the remote path decodes eagerly
        b, h, k = wanted.nonzero(as_tuple=True)
        blocks = ids[b, h, k]
        in_store = blocks < self.published
        if not bool(in_store.any()):
            return
        units = ((b * self.num_kv_heads + h) * self.stride + blocks)[in_store].unique()
        self.step += 1
        flat = self.slot_of.view(-1)
        slots = flat[units]
        here = slots >= 0
        self.last_used[slots[here]] = self.step
        missing = units[~here]
        if not missing.numel():
            return
        if units.numel() > self.capacity:
            raise MemoryError(
                f"OasisCache: one decode step of layer {self.layer_idx} reads {units.numel()} (block, sequence, KV "
                f"head) units from the store, more than the local cache holds ({self.capacity}). Admit with a larger "
                f"local cache: admit(..., local_cache_units={units.numel() * 2}) or more.")
        order = torch.argsort(self.last_used, stable=True)  # free slots (-1) first, then the least recently used
        victims = order[: missing.numel()]
        old = self.unit_of[victims]
        flat[old[old >= 0]] = -1
        try:
            self.tier.get_units(self.layer_idx, self.triples(missing),
                                [self.arena[s].data_ptr() for s in victims.tolist()], self.unit_nbytes, self.arena)
        except BaseException:
            self.unit_of[victims] = -1  # those slots hold nothing usable now
            self.last_used[victims] = -1
            self._sync_device(old[old >= 0], None)
            raise
        self.unit_of[victims] = missing
        self.last_used[victims] = self.step
        flat[missing] = victims
        self.units_fetched += missing.numel()
        self.units_evicted += int((old >= 0).sum())
        self._sync_device(old[old >= 0], (missing, victims))

    def triples(self, units: torch.Tensor) -> list:
        """`[(block, sequence, KV head)]` of unit ids."""
        bh, block = units // self.stride, units % self.stride
        return list(zip(block.tolist(), (bh // self.num_kv_heads).tolist(), (bh % self.num_kv_heads).tolist()))

    def _sync_device(self, cleared: torch.Tensor, placed) -> None:
        if self.slot_of_device is self.slot_of:
            return
        device_flat = self.slot_of_device.view(-1)
        if cleared.numel():
            device_flat[cleared.to(self.device)] = -1
        if placed is not None:
            device_flat[placed[0].to(self.device)] = placed[1].to(self.device)

    def slots_for(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The arena slots of `block_ids` (`[B, Hkv, K]` on the device; entries not in the store give -1)."""
        index = block_ids.clamp(0, self.stride - 1)
        slots = torch.gather(self.slot_of_device, 2, index)
        return torch.where(block_ids < self.published, slots, torch.full_like(slots, -1))

    def read_all_into(self, pool) -> None:
        """Write every published block into `pool` (a local pool holding blocks from 0, its chunks reserved): units
        here are copied from the arena, the rest got from the store, one batch per chunk."""
        B, H, P = self.batch_size, self.num_kv_heads, self.published
        C = pool.chunk_blocks
        for chunk_index in range(-(-P // C)):
            lo, hi = chunk_index * C, min(P, chunk_index * C + C)
            n = hi - lo
            staging = torch.empty((n * B * H,) + tuple(self.arena.shape[1:]), dtype=self.arena.dtype)
            slots = self.slot_of[:, :, lo:hi].permute(2, 0, 1).reshape(-1)  # [n * B * H], block-major
            here = slots >= 0
            staging[here] = self.arena[slots[here]]
            rows = (~here).nonzero().flatten()
            if rows.numel():
                block = lo + rows // (B * H)
                bh = rows % (B * H)
                self.tier.get_units(self.layer_idx, list(zip(block.tolist(), (bh // H).tolist(), (bh % H).tolist())),
                                    [staging[r].data_ptr() for r in rows.tolist()], self.unit_nbytes, staging)
            # [n * B * H, 2, 1, 1, T, D] -> the pool's [n, 2, B, H, T, D]
            T, D = staging.shape[-2:]
            pool.chunks[chunk_index][:n].copy_(staging.view(n, B, H, 2, T, D).permute(0, 3, 1, 2, 4, 5))

    def truncate(self, num_blocks: int) -> None:
        """Blocks from `num_blocks` on are forgotten (crop below the published ones); their slots are freed."""
        if num_blocks >= self.published:
            return
        used = self.unit_of >= 0
        gone = used & (self.unit_of % self.stride >= num_blocks)
        self.slot_of.view(-1)[self.unit_of[gone]] = -1
        if self.slot_of_device is not self.slot_of:
            self.slot_of_device.view(-1)[self.unit_of[gone].to(self.device)] = -1
        self.unit_of[gone] = -1
        self.last_used[gone] = -1
        self.published = num_blocks
