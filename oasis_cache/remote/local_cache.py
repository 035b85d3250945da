"""The decode side's local cache of a remote tier: blocks a store holds, read one (sequence, KV head) at a time.

A layer admitted from a store (`remote/admission.py`) keeps its first `published` blocks in the store, one object
per (block, sequence, KV head): `[2, *U]`, keys and values as the host pool holds them. A decode step that selects
such a block for a sequence's KV head needs only that head's run, so that is the unit fetched and cached. The cache is
an arena of `capacity` units in host memory (pinned on CUDA, read by the same gather kernel as the host pool,
`gather_blocks(per_unit=True)`):

    arena      `[capacity, 2, 1, 1, *U]`     slot s holds one unit
    slot_of    `[B, Hkv, published]` int64   the unit's slot, -1 when not here (on the host; a copy on the device
                                             maps a step's block ids to slots without a sync)
    unit_of    `[capacity]` int64            the unit a slot holds ((b * Hkv + h) * P + block, P the blocks published
                                             at admission), -1 when free
    last_used  `[capacity]` int64            the step that last read a slot: eviction takes the least recent

`ensure` reads a step's selected block ids on the host, fetches the units not here from the store (batched calls),
into the free slots first and then into the least recently used ones, and updates both maps. It runs at one of two
times:
- before the gather, inside the step (`deferred` False: a fetch on the critical path — lookahead "none" or `exact`
  — and every prefetch of such a cache, on the host worker): a host sync inside the step, so these steps run eagerly;
- after the step (`deferred` True: the prefetches of lookahead "previous" / "eagle3" without `exact`). The step's
  prefetch gathers only the units already here (the device copy of `slot_of` maps the others to -1, masked out) and
  records the step's ids, destinations and wanted entries in fixed device buffers (`defer`); after the forward,
  `remote.repair.repair_after_step` reads them (one sync per step, as `generate` makes anyway), does `ensure`'s
  work for every layer (`repair_plan`, one series of store reads for all layers) and gathers the units it fetched
  into their slots (`repair_gather`) — before the next step reads them. No host work inside the step: such steps
  replay as captured CUDA graphs, and the working set before each step is what the immediate path leaves (the same
  tokens).
Blocks completed during decode are written to the layer's host pool (which starts at block `published`) and never
evicted. This cache is the one owner of its slots; a slot is freed only by `ensure` (eviction) or with the whole
cache.
"""

from __future__ import annotations

import torch


def arena_slots(slot_map: torch.Tensor, ids: torch.Tensor, bound) -> torch.Tensor:
    """The arena slots of block `ids` along the last dim of `slot_map` (`[..., P]`, a device copy of the slot map):
    -1 where an id is not mapped, or not below `bound` (not in the store)."""
    slots = torch.gather(slot_map, -1, ids.clamp(0, slot_map.shape[-1] - 1))
    return torch.where(ids < bound, slots, torch.full_like(slots, -1))


def least_recent(last_used: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` slots to evict first along the last dim of `last_used` (`[..., capacity]` steps, -1 = free): free
    slots first, then the least recently used, ties by slot index — the first `k` of a stable argsort, found by a
    `topk` over step * capacity + slot (one key per slot) instead of sorting every slot."""
    capacity = last_used.shape[-1]
    keys = last_used * capacity + torch.arange(capacity, dtype=last_used.dtype)
    return torch.topk(keys, k, dim=-1, largest=False, sorted=True).indices


class LocalBlockCache:
    """A bounded LRU cache of one layer's store-held (block, sequence, KV head) units.

    Args:
        tier: the request's `RemoteTier`.
        layer_idx: the layer.
        published: blocks [0, published) are in the store.
        batch_size, num_kv_heads: the layer's B, Hkv.
        representation: how its host pool holds a unit (`memory/representation.py`): the arena holds units so.
        capacity: units the arena holds (at least one step's selection of this layer).
        pin_memory: page-locked arena (CUDA models).
        device: the compute device (where the slot map's copy lives).
    """

    def __init__(self, tier, layer_idx, published, batch_size, num_kv_heads, representation, capacity, pin_memory,
                 device):
        self.tier = tier
        self.layer_idx = layer_idx
        self.published = published
        self.batch_size, self.num_kv_heads = batch_size, num_kv_heads
        self.capacity = capacity
        self.representation = representation
        self.arena = torch.empty((capacity, 2, 1, 1, *representation.unit_shape), dtype=representation.storage_dtype,
                                 pin_memory=pin_memory)
        self.stride = published  # unit id = (b * Hkv + h) * stride + block
        self.slot_of = torch.full((batch_size, num_kv_heads, published), -1, dtype=torch.int64)
        self.device = torch.device(device)
        self.slot_of_device = self.slot_of if self.device.type == "cpu" else self.slot_of.to(self.device)
        self.unit_of = torch.full((capacity,), -1, dtype=torch.int64)
        self.last_used = torch.full((capacity,), -1, dtype=torch.int64)
        self.step = 0
        self.units_fetched = 0  # units got from the store so far (a unit evicted and read again counts twice)
        self.units_evicted = 0
        # the Triton gather's chunk-address table for the arena, on the device (built now: a captured gather reads it)
        self.arena_table = torch.tensor([self.arena.data_ptr()], dtype=torch.int64).to(self.device)
        self.deferred = False  # prefetches leave their misses to `repair_after_step` (see the module's docstring)
        self.pending = None  # (working set, ids, dest, wanted) of the step's deferred prefetch: fixed device buffers
        self.overlap = False  # the records are read while the step runs (`remote.repair.start_repair`)
        self.ready = None  # CUDA: an event after this layer's record in each step (external: host threads wait on it)
        self.group, self.group_index = None, 0  # the `LocalCacheGroup` this layer belongs to, if any, and its row

    @property
    def unit_nbytes(self) -> int:
        return self.arena[0].numel() * self.arena.element_size()

    @property
    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def ensure(self, block_ids: torch.Tensor, fetch: torch.Tensor) -> None:
        """Make every unit a step reads here: entries `fetch` of `block_ids` (`[B, Hkv, K]`) below `published`."""
        plan = self.plan(block_ids, fetch)
        if plan is None:
            return
        try:
            self.tier.get_units_of_layers([self.reads(plan)], self.unit_nbytes)
        except BaseException:
            self.failed(plan)
            raise
        self.placed(plan)

    def plan(self, block_ids: torch.Tensor, fetch: torch.Tensor):
        """`ensure`'s host work before its store read: the units of the entries `fetch` of `block_ids` that are here
        are marked used; slots are chosen for the others (free ones first, then the least recently used), their old
        units unmapped. Returns `(missing units, their slots, the slots' old units)`, or None when all are here."""
        ids, wanted = block_ids.to("cpu"), fetch.to("cpu").bool()  # a sync on CUDA (inside a step: an eager one)
        wanted = wanted & (ids < self.published)
        if not bool(wanted.any()):
            return None
        found = torch.gather(self.slot_of, 2, ids.clamp(0, self.stride - 1))[wanted]
        if bool((found >= 0).all()):  # all here (most layers of a warm step): marked used in a few operations
            self.step += 1
            self.last_used[found] = self.step
            return None
        b, h, k = wanted.nonzero(as_tuple=True)
        units = ((b * self.num_kv_heads + h) * self.stride + ids[b, h, k]).unique()
        self.step += 1
        flat = self.slot_of.view(-1)
        slots = flat[units]
        here = slots >= 0
        self.last_used[slots[here]] = self.step
        missing = units[~here]  # (at least one: all here returned above)
        if units.numel() > self.capacity:
            raise MemoryError(
                f"OasisCache: one decode step of layer {self.layer_idx} reads {units.numel()} (block, sequence, KV "
                f"head) units from the store, more than the local cache holds ({self.capacity}). Admit with a larger "
                f"local cache: admit(..., local_cache_units={units.numel() * 2}) or more.")
        victims = least_recent(self.last_used, missing.numel())
        old = self.unit_of[victims]
        flat[old[old >= 0]] = -1
        return missing, victims, old

    def reads(self, plan) -> tuple:
        """`(layer, units, addresses, arena)`: the store read of a plan (`RemoteTier.get_units_of_layers`)."""
        missing, victims, _ = plan
        return self.layer_idx, self.triples(missing), [self.arena[s].data_ptr() for s in victims.tolist()], self.arena

    def placed(self, plan) -> None:
        """The plan's units have landed in their slots: both maps and the counters follow."""
        missing, victims, old = plan
        self.unit_of[victims] = missing
        self.last_used[victims] = self.step
        self.slot_of.view(-1)[missing] = victims
        self.units_fetched += missing.numel()
        self.units_evicted += int((old >= 0).sum())
        self._sync_device(old[old >= 0], (missing, victims))

    def failed(self, plan) -> None:
        """The plan's store read failed: its slots hold nothing usable now."""
        _, victims, old = plan
        self.unit_of[victims] = -1
        self.last_used[victims] = -1
        self._sync_device(old[old >= 0], None)

    def defer(self, working_set, block_ids: torch.Tensor, dest: torch.Tensor, wanted: torch.Tensor) -> None:
        """A deferred prefetch (device work only, capturable): remember the step's selected `block_ids`, their slots
        `dest` and the `wanted` entries (`[B, Hkv, K]`: to fetch, in the store) in buffers of `[B, Hkv, slots]` made
        at the first (eager) call, for `remote.repair.repair_after_step`."""
        K, width = block_ids.shape[-1], working_set.num_slots
        if self.pending is None or self.pending[0] is not working_set or self.pending[1].shape[-1] < K:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a deferred remote prefetch met new buffer shapes inside a graph capture")
            shape = (self.batch_size, self.num_kv_heads, max(K, width))
            if self.group is not None:  # rows of the group's stacked records: the repair reads them all at once
                self.pending = (working_set, *self.group.record_rows(self.group_index, shape, block_ids.dtype,
                                                                     dest.dtype, block_ids.device))
            else:
                self.pending = (working_set, torch.zeros(shape, dtype=block_ids.dtype, device=block_ids.device),
                                torch.zeros(shape, dtype=dest.dtype, device=dest.device),
                                torch.zeros(shape, dtype=torch.bool, device=block_ids.device))
        _, ids, slots, flags = self.pending
        ids[..., :K].copy_(block_ids)
        slots[..., :K].copy_(dest)
        flags[..., :K].copy_(wanted)
        flags[..., K:].fill_(False)
        if self.overlap and ids.is_cuda:  # the record is complete here: a host thread may read it while the step runs
            if self.ready is None:
                self.ready = torch.cuda.Event(external=True)  # (made at the first, eager, call: an event record node
            self.ready.record()  # when captured, re-recorded at each replay)

    def repair_plan(self, ids: torch.Tensor, wanted: torch.Tensor):
        """After a step, on the host: `ids` and `wanted` are this layer's deferred record read back (`[B, Hkv, W]`).
        The units it wanted are marked used and slots chosen for those not here (`plan`, as the immediate path's
        `ensure` would have done inside the step). Returns `(plan or None, the entries to gather once it landed)`."""
        plan = self.plan(ids, wanted)
        if plan is None:
            return None, None
        # the entries whose units are not mapped yet: the plan's missing ones (it unmapped only slots older than
        # every unit this step wanted, which it marked used first)
        return plan, wanted & (torch.gather(self.slot_of, 2, ids.clamp(0, self.stride - 1)) < 0)

    def repair_gather(self, transfer, missing: torch.Tensor | None, on_device: torch.Tensor | None = None,
                      slots: torch.Tensor | None = None, clear: bool = True) -> None:
        """Gather the record's entries `missing` (host; now here) into the slots the step assigned them, on the
        current stream (before the next step reads them); clear the record (`clear=False`: the caller clears the
        group's at once). `on_device`: `missing` already copied; `slots`: the record's arena slots, looked up."""
        working_set, ids_device, dest_device, wanted_device = self.pending
        if missing is not None and bool(missing.any()):
            transfer.gather_units(self, working_set, slots if slots is not None else self.slots_for(ids_device),
                                  dest_device, on_device if on_device is not None else missing.to(ids_device.device))
        if clear:
            wanted_device.fill_(False)

    def pending_tensors(self) -> list[torch.Tensor]:
        """The device tensors a captured deferred prefetch writes or reads (their addresses: replay signature)."""
        made = list(self.pending[1:]) if self.pending is not None else []
        return made + [self.slot_of_device, self.arena_table]

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
        return arena_slots(self.slot_of_device, block_ids, self.published)

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
            # [n * B * H, 2, 1, 1, *U] -> the pool's [n, 2, B, H, *U]
            unit = staging.shape[4:]
            pool.chunks[chunk_index][:n].copy_(staging.view(n, B, H, 2, *unit).permute(0, 3, 1, 2,
                                                                                          *range(4, 4 + len(unit))))

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


class LocalCacheGroup:
    """The local caches of every layer of one admitted cache, their maps stacked so that the after-step repair
    (`remote.repair.repair_after_step`) plans all layers in a few operations instead of a dozen per layer:

        slot_of    `[L, B, Hkv, P]` int64   (each layer's `slot_of` is row l, a view; so is the device copy)
        unit_of    `[L, capacity]` int64
        last_used  `[L, capacity]` int64

    Only for layers of one shape (B, Hkv, P, capacity, unit size, device: what `admit` makes for a model's layers);
    `LocalCacheGroup.fits` says. Each layer keeps its own arena, step counter and counters, and every per-layer path
    (`ensure`, `defer`, `truncate`, `read_all_into`) works on the views unchanged. `plan` / `placed` / `failed` make
    the decisions the per-layer ones make, layer by layer (same slots, same evictions)."""

    def __init__(self, links: list[LocalBlockCache]):
        self.links = links
        self.slot_of = torch.stack([link.slot_of for link in links])
        self.unit_of = torch.stack([link.unit_of for link in links])
        self.last_used = torch.stack([link.last_used for link in links])
        first = links[0]
        self.device = first.device
        self.slot_of_device = self.slot_of if self.device.type == "cpu" else self.slot_of.to(self.device)
        for i, link in enumerate(links):
            link.slot_of, link.unit_of, link.last_used = self.slot_of[i], self.unit_of[i], self.last_used[i]
            link.slot_of_device = link.slot_of if self.device.type == "cpu" else self.slot_of_device[i]
        self.arena_base = torch.tensor([link.arena.data_ptr() for link in links], dtype=torch.int64)
        self.unit_nbytes = first.unit_nbytes
        self.records = None  # (ids, dest, wanted) `[L, B, Hkv, W]`: every layer's deferred record, stacked
        for i, link in enumerate(links):
            link.group, link.group_index = self, i

    def record_rows(self, i: int, shape, ids_dtype, dest_dtype, device) -> tuple:
        """Layer `i`'s rows of the stacked deferred records (`LocalBlockCache.defer`), made anew (zeros) when the
        shape or types change: layers whose working sets have not grown yet keep their rows of the old ones, and the
        repair then takes the per-layer path until every layer's record is a row of the new ones."""
        r = self.records
        if r is None or tuple(r[0].shape[1:]) != tuple(shape) or r[0].dtype != ids_dtype or r[1].dtype != dest_dtype \
                or r[0].device != torch.device(device):
            L = len(self.links)
            self.records = r = (torch.zeros((L, *shape), dtype=ids_dtype, device=device),
                                torch.zeros((L, *shape), dtype=dest_dtype, device=device),
                                torch.zeros((L, *shape), dtype=torch.bool, device=device))
        return r[0][i], r[1][i], r[2][i]

    def stacked(self, links: list[LocalBlockCache]) -> bool:
        """Whether `links` are this group's layers and every one's record is its row of the current stacked ones."""
        r = self.records
        return r is not None and self.holds(links) and all(
            link.pending is not None and link.pending[1].data_ptr() == r[0][i].data_ptr()
            and link.pending[1].shape == r[0].shape[1:] for i, link in enumerate(links))

    def record_slots(self) -> torch.Tensor:
        """`[L, B, Hkv, W]`: the arena slots of every layer's recorded ids (-1: not here, or not in the store; ids
        past a layer's published blocks map to -1 once `truncate` has cleared them)."""
        return arena_slots(self.slot_of_device, self.records[0], self.slot_of.shape[-1])

    def holds(self, links: list[LocalBlockCache]) -> bool:
        """Whether `links` are this group's layers, in its order."""
        return len(links) == len(self.links) and all(a is b for a, b in zip(links, self.links))

    @staticmethod
    def fits(links: list[LocalBlockCache]) -> bool:
        if not links:
            return False
        first = links[0]
        shape = (first.batch_size, first.num_kv_heads, first.stride, first.capacity, first.unit_nbytes, first.device)
        return all((link.batch_size, link.num_kv_heads, link.stride, link.capacity, link.unit_nbytes, link.device)
                   == shape for link in links)

    def plan(self, ids: torch.Tensor, wanted: torch.Tensor):
        """`LocalBlockCache.repair_plan` for every layer at once: `ids`, `wanted` are the layers' deferred records
        read back (`[L, B, Hkv, W]`, host). Returns None when nothing is missing, else `(plan, missing entries
        [L, B, Hkv, W])`; the plan is `(layer of each missing unit, the units, their slots, the slots' old units)`."""
        L, B, H, P = self.slot_of.shape
        cap, per_layer = self.unit_of.shape[1], B * H * P
        published = torch.tensor([link.published for link in self.links], dtype=torch.int64).view(L, 1, 1, 1)
        wanted = wanted & (ids < published)
        active = wanted.flatten(1).any(1)
        if not bool(active.any()):
            return None
        index = ids.clamp(0, P - 1)
        found = torch.gather(self.slot_of, 3, index)
        layer = torch.arange(L).view(L, 1, 1, 1).expand_as(ids)
        keys = ((layer * B + torch.arange(B).view(1, B, 1, 1)) * H + torch.arange(H).view(1, 1, H, 1)) * P + index
        counts = torch.bincount(keys[wanted].unique() // per_layer, minlength=L)
        if bool((counts > cap).any()):
            i = int(torch.nonzero(counts > cap)[0])
            raise MemoryError(
                f"OasisCache: one decode step of layer {self.links[i].layer_idx} reads {int(counts[i])} (block, "
                f"sequence, KV head) units from the store, more than the local cache holds ({cap}). Admit with a "
                f"larger local cache: admit(..., local_cache_units={int(counts[i]) * 2}) or more.")
        steps = torch.tensor([link.step for link in self.links], dtype=torch.int64) + active.long()
        for link, step in zip(self.links, steps.tolist()):
            link.step = step
        here = wanted & (found >= 0)
        self.last_used[layer[here], found[here]] = steps[layer[here]]  # the units this step reads are the newest
        missing_entries = wanted & (found < 0)
        if not bool(missing_entries.any()):
            return None
        units = keys[missing_entries].unique()  # by layer, then unit: the per-layer plans' order
        unit_layer, units = units // per_layer, units % per_layer
        needed = torch.bincount(unit_layer, minlength=L)
        k = int(needed.max())
        order = least_recent(self.last_used, k)  # [L, k]: each layer's k first victims
        victims = order[torch.arange(k).view(1, k) < needed.view(L, 1)]  # layer by layer, as `unit_layer`
        old = self.unit_of[unit_layer, victims]
        gone = old >= 0
        self.slot_of.view(L, -1)[unit_layer[gone], old[gone]] = -1
        return (unit_layer, units, victims, old), missing_entries

    def reads(self, plan) -> list:
        """The store reads of a plan: `[(layer, units, addresses, arena)]` for `RemoteTier.get_units_of_layers`."""
        unit_layer, units, victims, _ = plan
        first = self.links[0]
        P, H = first.stride, first.num_kv_heads
        blocks, bh = (units % P).tolist(), (units // P)
        triples = list(zip(blocks, (bh // H).tolist(), (bh % H).tolist()))
        addresses = (self.arena_base[unit_layer] + victims * self.unit_nbytes).tolist()
        out, at = [], 0
        for i, n in enumerate(torch.bincount(unit_layer, minlength=len(self.links)).tolist()):
            if n:
                link = self.links[i]
                out.append((link.layer_idx, triples[at: at + n], addresses[at: at + n], link.arena))
            at += n
        return out

    def placed(self, plan) -> None:
        """The plan's units have landed: every layer's maps and counters follow (one copy to the device)."""
        unit_layer, units, victims, old = plan
        L = len(self.links)
        steps = torch.tensor([link.step for link in self.links], dtype=torch.int64)
        self.unit_of[unit_layer, victims] = units
        self.last_used[unit_layer, victims] = steps[unit_layer]
        self.slot_of.view(L, -1)[unit_layer, units] = victims
        gone = old >= 0
        fetched = torch.bincount(unit_layer, minlength=L).tolist()
        evicted = torch.bincount(unit_layer[gone], minlength=L).tolist()
        for link, f, e in zip(self.links, fetched, evicted):
            link.units_fetched += f
            link.units_evicted += e
        self._sync_device(unit_layer[gone], old[gone], (unit_layer, units, victims))

    def failed(self, plan) -> None:
        """The plan's store read failed: its slots hold nothing usable now."""
        unit_layer, _, victims, old = plan
        self.unit_of[unit_layer, victims] = -1
        self.last_used[unit_layer, victims] = -1
        gone = old >= 0
        self._sync_device(unit_layer[gone], old[gone], None)

    def _sync_device(self, cleared_layer, cleared, placed) -> None:
        if self.slot_of_device is self.slot_of:
            return
        per_layer = self.slot_of[0].numel()
        parts = [cleared_layer * per_layer + cleared]
        if placed is not None:
            unit_layer, units, victims = placed
            parts += [unit_layer * per_layer + units, victims]
        payload = torch.cat(parts).pin_memory().to(self.device, non_blocking=True)  # one copy for every layer
        flat, n = self.slot_of_device.view(-1), cleared.numel()
        flat[payload[:n]] = -1
        if placed is not None:
            m = placed[1].numel()
            flat[payload[n: n + m]] = payload[n + m:]
