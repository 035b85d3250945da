"""The transfer engine: the only code that moves K/V bytes between host and device.

- `offload`: complete blocks, device -> host pool (asynchronous into pinned memory on CUDA, stream-ordered; with the
  Triton backend one block is written at a block number read on the device, `kernels/host_store.py`).
- `load_range`: a contiguous range of host blocks -> device (dense attention over the past, `crop`).
- `fetch`: selected blocks -> working-set slots. Backends:
    "triton": one kernel reads pinned host memory through unified addressing (CUDA only; no staging, no sync);
    "torch":  indexing ops; on CUDA it stages through host memory and waits for the stream (a fallback).
All work is issued on the current stream, so ordering against compute is the stream's; the memory-plane issue
moves `fetch` to a side stream with per-layer events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import os

import torch

if TYPE_CHECKING:  # (annotations only: the pools are above the transfers)
    from ..pools import HostKVPool, WorkingSet

from ..kernels.gather import gather_blocks, triton_available
from ..kernels.host_store import store_block
from .host_memory import check_host_room


def resolve_backend(requested: str, device: torch.device) -> str:
    """"triton" (CUDA kernels) or "torch" (plain tensor ops; the CPU path and the reference)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if requested == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter runs on CPU tensors
            raise ValueError("backend='triton' needs a CUDA model; use backend='torch' or 'auto' on this device.")
        if not triton_available():
            raise ImportError("backend='triton' needs the `triton` package (pip install triton).")
    return requested


def side_stream_programs(device: torch.device) -> int:
    """Gather programs (per K/V) for a prefetch on the side stream: the largest power of two <= a sixteenth of the
    device's SMs, at least 4 (8 on an H200's 132 SMs), each of `SIDE_WARPS` warps copying `SIDE_ENTRIES` blocks at
    once. A prefetch only has to land within the step it overlaps; its programs mostly wait on PCIe, and the SMs
    they sit on run the step's kernels slower (a layer's matmuls 1.20x their time alone beside 32 programs of 4
    warps, 1.14x beside 8 of 16 warps, same gather rate; compiled 32K x 1 steps 8.57 -> 8.28 ms, 128K x 1 9.53 ->
    9.25: docs/performance.md; one program per block took 27% more than 32 of 4)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(4, 1 << (max(1, sms // 16).bit_length() - 1))


SIDE_WARPS, SIDE_ENTRIES = 16, 4  # the side stream's gather shape (`side_stream_programs`)


def narrow_factor(representation) -> int:
    """How many times fewer bytes a unit of `representation` is than the model's own, as a power of two (1, 2 for
    fp8 of bf16, 4 for int4): the side stream's few programs copy that many more units a round, else their bytes in
    flight, which bound a latency-bound gather, would shrink with the unit."""
    wide = representation.block_size * representation.head_dim * representation.dtype.itemsize
    return max(1, 1 << round(math.log2(wide / representation.unit_nbytes)))


ROTATED_SIDE_PROGRAMS = 4  # times the side stream's programs for rotated int4 units (`side_programs_for`)


def side_programs_for(programs: int, representation) -> int:
    """The side stream's programs for a gather of `representation`'s units: rotated int4's widening (a tensor-core
    product a unit) bounds few programs before the link does, so it gets 4x the programs (32K x 4 on the H100: 1, 4,
    16 times took 34.4, 20.1, 25.2 ms a step; docs/performance.md); other units the same programs."""
    return programs * (ROTATED_SIDE_PROGRAMS if getattr(representation, "rotates", False) else 1)


def launch_shape(shape: dict, representation) -> dict:
    """A gather's launch shape (`num_warps`, `entries`: units a warp copies a round) for units of `representation`:
    `shape`'s, its entries times `narrow_factor` (a narrow unit is fewer bytes: as many more a round keep the bytes
    a program has in flight)."""
    return dict(shape, entries=shape["entries"] * narrow_factor(representation))


class TransferEngine:
    def __init__(self, backend: str, device: torch.device, streams=None, gather_programs: int | None = None):
        self.backend = resolve_backend(backend, device)
        self.gather_programs = gather_programs  # None: chosen per stream (`_programs`); 0: one per block
        chosen = gather_programs is None  # the side stream's shape, unless the programs are the caller's
        self.gather_shape = dict(num_warps=SIDE_WARPS if chosen else 4,
                                 entries=SIDE_ENTRIES if chosen else 1)  # where programs are few
        self.side_programs = side_stream_programs(device) if self.backend == "triton" and device.type == "cuda" \
            else None
        self.device = device
        self.streams = streams  # PrefetchStreams: offloads run on its side stream
        self._offloaded: dict[int, object] = {}  # id(pool) -> side-stream event after its last offload
        self._chunk_addrs: dict[int, tuple[tuple, torch.Tensor]] = {}  # id(pool) -> (chunk pointers, on device)
        self._retired: list[torch.Tensor] = []  # replaced address tables: queued kernels may still read them

    # --------------------------------------------------------------------------------------------- device -> host
    def offload(self, pool: HostKVPool, blocks: torch.Tensor, number: torch.Tensor | None = None) -> None:
        """Append `blocks` (`[2, B, Hkv, n, T, D]`, compute device) to the pool. `number`: `[1]` int64 on the device,
        the pool's block count (`BlockSummaries.count`): with the Triton backend a single block is written there by
        a kernel, with no host address in the launch (a captured step that completes a block replays for the next).
        Narrowed to the pool's representation on the compute device, before the bytes cross the link."""
        n = blocks.shape[3]
        narrow = pool.representation.narrow
        start = pool.num_blocks
        self.reserve(pool, start + n)
        if n == 1 and number is not None and self.backend == "triton":
            table = self._addresses(pool)
            at = number - pool.first_block if pool.first_block else number.clone()  # (the count moves on after)
            block = narrow(blocks[:, :, :, 0]).contiguous()  # [2, B, Hkv, *U]

            def copy():
                store_block(table, pool.chunk_blocks, at, block)
            keep = (block, at)
        else:
            if pool.read_only:
                raise RuntimeError("a dry step's copy of a host pool would write the original's chunks: only its "
                                   "kernels' launches (compiled, not run) may write (runtime/ahead.py)")
            non_blocking = pool.pin_memory and blocks.device.type == "cuda"
            block_major = narrow(blocks.permute(3, 0, 1, 2, 4, 5)).contiguous()  # the pool's [n, 2, B, Hkv, *U]
            spans = list(pool.spans(start, start + n))

            def copy():
                for chunk, lo, hi, offset in spans:
                    chunk[lo:hi].copy_(block_major[offset : offset + hi - lo], non_blocking=non_blocking)
            keep = (block_major,)

        if self.streams is not None:
            self.streams.run_after_compute(copy, *keep)  # overlaps the next layer's compute on CUDA
            # (inside a capture no event is kept: the graph joins its side work, so compute is ordered after it)
            self._offloaded[id(pool)] = None if self.streams.capturing() else self.streams.side_event()
        else:
            copy()
        pool.num_blocks = start + n

    def forget_offload(self, pool: HostKVPool) -> None:
        """After a replayed step offloaded into `pool`: its graph joined the side stream, so compute is ordered after
        the offload (no event to wait on)."""
        self._offloaded[id(pool)] = None

    def reserve(self, pool: HostKVPool, num_blocks: int) -> None:
        """Grow `pool` to hold `num_blocks` blocks; the gather's address table follows at once (a captured gather
        may read a new chunk before any eager fetch would have rebuilt it)."""
        chunks = len(pool.chunks)
        nbytes = pool.bytes_to_reserve(num_blocks)
        if nbytes:  # MemoryError, before anything is allocated, where the host cannot hold it
            check_host_room(nbytes, f"growing a layer's host pool to {num_blocks} blocks")
        pool.reserve(num_blocks)
        if self.backend == "triton" and len(pool.chunks) != chunks:
            self._addresses(pool)

    def refresh_addresses(self, pool: HostKVPool) -> None:
        """After `pool` replaced a chunk (a fork's crop, `HostKVPool.truncate`): its address table now, before any
        captured step could read the old one (a new table changes the captured steps' signature)."""
        if self.backend == "triton":
            self._addresses(pool)

    def prepare_capture(self, pools) -> None:
        """Before a decode step is captured (the compute stream has joined the side stream): every offload has
        landed, and each pool's chunk-address table is current — built now, not inside the graph (its host staging
        buffer would not outlive the capture)."""
        self._offloaded.clear()
        if self.backend == "triton":
            for pool in pools:
                self._addresses(pool)

    def address_tables(self) -> tuple:
        """Device addresses of the pools' chunk-address tables (what a captured gather reads)."""
        return tuple(table.data_ptr() for _, table in self._chunk_addrs.values())

    def _wait_offloads(self, pool: HostKVPool) -> None:
        """Compute-stream readers of `pool` wait for its offloads (a no-op on the side stream, which is ordered)."""
        if self.streams is not None:
            self.streams.compute_waits(self._offloaded.get(id(pool)))

    # --------------------------------------------------------------------------------------------- host -> device
    def load_range(self, pool: HostKVPool, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks [start, end) of the pool on the compute device, `[2, B, Hkv, end-start, T, D]`. `out`: a device
        tensor of that shape (e.g. a view of a `[2, B, Hkv, L, D]` buffer's first tokens) written and returned — one
        host chunk's transfer at a time beside it instead of the whole range twice (its chunks, then them joined).
        Narrow units cross the link as they are and are widened on the device."""
        widen = pool.representation.widen
        self._wait_offloads(pool)
        if pool.remote is not None and start < pool.first_block:  # a dense read of blocks in a store: all of them
            self.wait_host_reads()  # come local (`crop` into them, a dense step over the past: not the sparse path)
            pool.fetch_all_remote()
        if out is not None:
            for chunk, lo, hi, offset in pool.spans(start, end):
                part = widen(chunk[lo:hi].to(self.device, non_blocking=pool.pin_memory))  # [n, 2, B, Hkv, T, D]
                out[:, :, :, offset : offset + hi - lo].copy_(part.permute(1, 2, 3, 0, 4, 5))
            return out
        parts = [widen(chunk[lo:hi].to(self.device, non_blocking=pool.pin_memory))
                 for chunk, lo, hi, _ in pool.spans(start, end)]
        if not parts:
            shape = (0, 2, pool.batch_size, pool.num_kv_heads, pool.block_size, pool.head_dim)
            parts = [torch.empty(shape, dtype=pool.dtype, device=self.device)]
        block_major = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return block_major.permute(1, 2, 3, 0, 4, 5)

    def fetch(self, pool: HostKVPool, working_set: WorkingSet, block_ids, dest, fetch, prefetch: bool = False) -> None:
        """Copy host blocks `block_ids[fetch]` into slots `dest[fetch]`. `block_ids`, `dest`, `fetch`: `[B, Hkv, K]`.
        `prefetch`: for the next step (a remote tier's deferred cache may then leave its misses to after the step)."""
        self._wait_offloads(pool)
        timing = self.streams.time_on_compute() if self.streams is not None else None
        if pool.remote is not None:  # a decode side: blocks below `first_block` are in a store
            cache = pool.remote
            in_store = block_ids < pool.first_block
            if prefetch and cache.deferred:  # what is here now; the rest after the step (`repair_after_step`)
                slots = cache.slots_for(block_ids)
                self._gather(cache, working_set, slots, dest, fetch & in_store & (slots >= 0))
                cache.defer(working_set, block_ids, dest, fetch & in_store)
            else:
                cache.ensure(block_ids, fetch)  # the selected units come to the local cache first (a host sync)
                self._gather(cache, working_set, cache.slots_for(block_ids), dest, fetch & in_store)
            fetch = fetch & ~in_store
            block_ids = (block_ids - pool.first_block).clamp(min=0)
        if pool.num_blocks > pool.first_block or pool.remote is None:
            self._gather(pool, working_set, block_ids, dest, fetch)
        if timing is not None:
            timing.record(torch.cuda.current_stream(self.device))

    def gather_units(self, cache, working_set, slots, dest, fetch) -> None:
        """`fetch` entries of a remote tier's local cache (arena `slots`) into working-set slots `dest`, on the
        current stream (after a step: `remote.repair.repair_after_step`)."""
        self._gather(cache, working_set, slots, dest, fetch)

    def _gather(self, source, working_set, block_ids, dest, fetch) -> None:
        """`fetch` entries of `block_ids` (ids in `source`: a pool's local blocks, or slots of a remote tier's local
        cache) into slots `dest` of the working set."""
        per_unit = hasattr(source, "arena_table")  # (a remote tier's local cache: per-unit slots)
        if self.backend == "triton":
            if per_unit:
                table, C = source.arena_table, source.capacity
            else:
                table, C = self._addresses(source), source.chunk_blocks
            programs = self._programs(source.representation)
            shape = launch_shape(self.gather_shape, source.representation) if programs else {}
            gather_blocks(table, C, block_ids, dest, fetch, working_set.kv, working_set.block_size, programs,
                          per_unit=per_unit, representation=source.representation, **shape)
        elif per_unit:
            self._fetch_units_torch(source, working_set, block_ids, dest, fetch)
        else:
            self._fetch_torch(source, working_set, block_ids, dest, fetch)

    def _programs(self, representation=None) -> int | None:
        """The gather's programs per K/V for a launch on the current stream (None: one per block) of
        `representation`'s units (None: the model's dtype)."""
        if self.gather_programs is not None:
            return self.gather_programs or None
        on_side = self.streams is not None and self.streams.cuda and \
            torch.cuda.current_stream(self.device) == self.streams.side
        return side_programs_for(self.side_programs, representation) if on_side and self.side_programs else None

    def _fetch_units_torch(self, cache, working_set, slots, dest, fetch) -> None:
        """The torch path of a gather from a remote tier's local cache (its arena of (sequence, KV head) units)."""
        b, h, k = fetch.nonzero(as_tuple=True)
        if not b.numel():
            return
        source, target = slots[b, h, k], dest[b, h, k]
        data = cache.arena[source.to("cpu")][:, :, 0, 0]  # [n, 2, *U]
        if working_set.kv.device.type == "cuda":
            data = data.pin_memory().to(working_set.kv.device, non_blocking=True)
        working_set.slots[:, b, h, target] = cache.representation.widen(data, heads=h.to(data.device)).transpose(0, 1)

    def _fetch_torch(self, pool, working_set, block_ids, dest, fetch) -> None:
        on_cuda = working_set.kv.device.type == "cuda"
        if on_cuda:  # the host pool is read by the CPU below: the offload copies must have landed (fallback only)
            self.wait_host_reads()
        slots_view = working_set.slots
        b, h, k = fetch.nonzero(as_tuple=True)
        blocks, slots = block_ids[b, h, k], dest[b, h, k]
        if on_cuda:
            b, h, blocks, slots = b.cpu(), h.cpu(), blocks.cpu(), slots.cpu()
        chunk_of, local = blocks // pool.chunk_blocks, blocks % pool.chunk_blocks
        for c, chunk in enumerate(pool.chunks):
            m = chunk_of == c
            if not bool(m.any()):
                continue
            data = chunk[local[m], :, b[m], h[m]]  # [n, 2, *U]
            if on_cuda:
                dev = working_set.kv.device
                data = pool.representation.widen(data.pin_memory().to(dev, non_blocking=True), heads=h[m].to(dev))
                slots_view[:, b[m].to(dev), h[m].to(dev), slots[m].to(dev)] = data.transpose(0, 1)
            else:
                slots_view[:, b[m], h[m], slots[m]] = pool.representation.widen(data, heads=h[m]).transpose(0, 1)

    def wait_host_reads(self) -> None:
        """Before host buffers are replaced or read by the CPU: let queued transfers that use them finish."""
        if self.streams is not None:
            self.streams.settle()  # prefetches a host worker holds are queued (or, on CPU, done)
        if self.device.type == "cuda":
            if self.streams is not None:
                self.streams.side.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def _addresses(self, pool: HostKVPool) -> torch.Tensor:
        """Device int64 table of the pool's chunk base addresses. It has room for more chunks than the pool holds:
        new chunks' addresses are written in place (a captured gather keeps reading the same table); only when the
        room runs out is a table twice as large made."""
        cached = self._chunk_addrs.get(id(pool))
        key = tuple(chunk.data_ptr() for chunk in pool.chunks)
        if cached is not None and cached[0] == key:
            return cached[1]
        table = cached[1] if cached is not None else None
        if table is not None and (len(key) > table.shape[0] or key[: len(cached[0])] != cached[0]):
            self._retired.append(table)  # a few bytes per growth; never reused under a running kernel
            table = None
        if table is None:
            table = torch.zeros(max(16, 2 * len(key)), dtype=torch.int64, device=self.device)
        staged = torch.tensor(key, dtype=torch.int64)
        if self.device.type == "cuda":  # no synchronous copy: staged through pinned memory
            staged = staged.pin_memory()
        table[: len(key)].copy_(staged, non_blocking=True)
        self._chunk_addrs[id(pool)] = (key, table)
        return table
