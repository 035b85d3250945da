"""The host pool: every complete block of one layer's keys and values, in host memory (pinned when the model runs
on CUDA), grown by fixed-size chunks and never reallocated per token.

Layout of one chunk: `[C, 2, B, Hkv, *U]` (C = `chunk_blocks`; 0 = keys, 1 = values; U = the representation's unit
shape: `[T, D]` of the model's dtype, or a run of bytes with `host_dtype`, `memory/representation.py`). Block
`block_id` lives in chunk `block_id // C` at index `block_id % C`; one (block, K or V, sequence, KV head) — a unit —
is one contiguous run, and a range of blocks is one contiguous run (one copy per chunk when blocks are offloaded).
The pool holds data and answers where a block is; bytes are moved (narrowed, widened) by `oasis_cache.memory`.

A decode side admitted from a store (`remote/admission.py`) holds only the blocks completed after admission:
`first_block` = the blocks published, which `remote` (a `remote.local_cache.LocalBlockCache`) reads from the store;
block `first_block + i` is the pool's local block i.
"""

from __future__ import annotations

import copy

import torch

from ..memory.representation import SCORE_NOISE_LIMIT, representation_for, score_noise

# A `copy.deepcopy` memo key: the copy shares the pool's complete chunks instead of copying them (`OasisCache.fork`).
SHARE_CHUNKS = "oasis_cache.pools.host_kv.share_chunks"
READ_ONLY_COPY = "oasis_cache.pools.host_kv.read_only_copy"  # (a dry step's copy: `runtime/ahead.py`)


def fitted_chunk_blocks(chunk_blocks: int, block_nbytes: int, pin_memory: bool) -> int:
    """Blocks per chunk: `chunk_blocks`, and for pinned chunks as many more as fit the allocation torch makes for
    it — its caching host allocator rounds every pinned request up to a power of two (a chunk of 256 blocks of
    SmolLM2 in fp32 at a batch of 24 asks 144 MiB and pins 256 MiB; the 112 MiB past it would sit unused)."""
    if not pin_memory:
        return chunk_blocks
    pinned = 1 << (chunk_blocks * block_nbytes - 1).bit_length()
    return max(chunk_blocks, pinned // block_nbytes)


class HostKVPool:
    """Complete blocks of one attention layer, in host memory.

    Args:
        batch_size, num_kv_heads, head_dim, block_size: B, Hkv, D, T.
        dtype: element type of the model's keys and values (what a read of the pool gives).
        chunk_blocks: blocks per chunk (per allocation), at least; pinned chunks hold as many blocks as fill the
            allocation torch makes for them (`fitted_chunk_blocks`): C = `self.chunk_blocks`.
        pin_memory: allocate page-locked memory (for CUDA models).
        host_dtype: None (units in `dtype`), "fp8" or "int4" (`memory/representation.py`).
    """

    def __init__(self, batch_size, num_kv_heads, head_dim, block_size, dtype, chunk_blocks, pin_memory,
                 host_dtype=None):
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.representation = representation_for(host_dtype, dtype, block_size, head_dim)
        self.pin_memory = pin_memory
        self.chunk_blocks = fitted_chunk_blocks(chunk_blocks, self.block_nbytes, pin_memory)
        self.chunks: list[torch.Tensor] = []  # each [C, 2, B, Hkv, *U]
        self.num_blocks = 0  # NB: complete blocks of the layer (those below `first_block` are not in this pool)
        self.first_block = 0  # blocks [0, first_block) live in a store, behind `remote`
        self.remote = None  # `remote.local_cache.LocalBlockCache` on a decode side
        # chunks another pool holds too (`OasisCache.fork`): full of complete blocks, so never written (blocks are
        # appended past `num_blocks`); `truncate` gives this pool its own copy before a crop could write one
        self.shared: set[int] = set()
        self.read_only = False  # a dry step's copy (`READ_ONLY_COPY`): its writes would land in the original's chunks

    @property
    def host_dtype(self) -> str | None:
        """None (units in the model's dtype), "fp8" or "int4"."""
        return self.representation.name

    # ----------------------------------------------------------------------------------------------------- capacity
    @property
    def capacity_blocks(self) -> int:
        """The block count the pool has room for (blocks below `first_block` included: they are elsewhere)."""
        return self.first_block + len(self.chunks) * self.chunk_blocks

    def reserve(self, num_blocks: int) -> None:
        """Make room for `num_blocks` blocks in all (allocates whole chunks)."""
        shape = (self.chunk_blocks, 2, self.batch_size, self.num_kv_heads, *self.representation.unit_shape)
        while self.capacity_blocks < num_blocks:
            self.chunks.append(self._empty(shape))

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: its `[2, B, Hkv, *U]` run in a chunk."""
        return 2 * self.batch_size * self.num_kv_heads * self.representation.unit_nbytes

    def bytes_to_reserve(self, num_blocks: int) -> int:
        """Host bytes `reserve(num_blocks)` would allocate."""
        missing = max(0, -(-(num_blocks - self.capacity_blocks) // self.chunk_blocks))
        return missing * self.chunk_blocks * self.block_nbytes

    def spans(self, start: int, end: int):
        """Yield `(chunk, local_start, local_end, offset)` covering blocks [start, end) (all at or past
        `first_block`): blocks `local_start .. local_end` of `chunk` are blocks `offset + 0 ..` of the range."""
        if start < self.first_block:
            raise IndexError(f"blocks below {self.first_block} are in a store, not in this pool (asked from {start})")
        C = self.chunk_blocks
        block = start - self.first_block
        start, end = block, end - self.first_block
        while block < end:
            chunk_idx, local = divmod(block, C)
            n = min(C - local, end - block)
            yield self.chunks[chunk_idx], local, local + n, block - start
            block += n

    # ------------------------------------------------------------------------------------------------ bookkeeping
    def truncate(self, num_blocks: int) -> None:
        """Forget blocks from `num_blocks` on (used by `crop`); their chunks stay allocated for reuse."""
        if not 0 <= num_blocks <= self.num_blocks:
            raise ValueError(f"cannot truncate a pool of {self.num_blocks} blocks to {num_blocks}")
        if num_blocks < self.first_block:  # into the published blocks: the decode-side blocks go, the store's stay
            self.remote.truncate(num_blocks)
            self.first_block = num_blocks
        self.num_blocks = num_blocks
        for index in sorted(i for i in self.shared if i >= (num_blocks - self.first_block) // self.chunk_blocks):
            self.chunks[index] = self._own_copy(index, num_blocks)  # (blocks past the end: rewritten)
            self.shared.discard(index)

    def index_batch(self, indices: torch.Tensor) -> None:
        """Keep or reorder sequences: sequence i becomes old sequence `indices[i]` (beam search, batch selection)."""
        indices = indices.to("cpu")
        self.fetch_all_remote()  # the store holds the old order
        chunks = []
        for chunk in self.chunks:  # (selected straight into new, pinned chunks: one copy)
            shape = (*chunk.shape[:2], indices.numel(), *chunk.shape[3:])
            chunks.append(torch.index_select(chunk, 2, indices, out=self._empty(shape)))
        self.chunks = chunks
        self.shared = set()
        self.batch_size = int(indices.numel())

    def __deepcopy__(self, memo):
        """Every chunk copied, pinned again where the pool is pinned (a gather reads it through unified addressing).
        With `memo[SHARE_CHUNKS]` (`OasisCache.fork`) the chunks full of complete blocks are shared with the copy
        instead (both pools mark them `shared`); of the one being filled only its blocks in use are copied
        (`_own_copy`), the empty ones are made anew. With `memo[READ_ONLY_COPY]` (a dry step's copy, whose kernels
        compile instead of running: `runtime/ahead.py`) every chunk is shared and neither pool marks it."""
        self.fetch_all_remote()  # the copy owns every block (the store's keys go with the original)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.representation = copy.copy(self.representation)  # (int4's key center, fixed on its own from then on)
        new.remote = None
        full = self.num_blocks // self.chunk_blocks if memo.get(SHARE_CHUNKS) else 0
        if memo.get(READ_ONLY_COPY):  # every chunk shared, none marked: the copy must never write them
            new.chunks, new.shared, new.read_only = list(self.chunks), set(self.shared), True
            memo[id(self)] = new
            return new
        new.chunks = self.chunks[:full] + [self._own_copy(index, self.num_blocks)
                                           for index in range(full, len(self.chunks))]
        self.shared |= set(range(full))
        new.shared = set(range(full))
        memo[id(self)] = new
        return new

    def fetch_all_remote(self) -> None:
        """Make this a local pool holding every block from 0: the blocks in a store are read into new chunks (what
        the local cache holds is copied, the rest fetched) and the link is dropped (no-op for a local pool)."""
        if self.remote is None:
            return
        remote, first, local = self.remote, self.first_block, self.chunks
        self.chunks, self.first_block = [], 0
        self.reserve(self.num_blocks)
        remote.read_all_into(self)
        if self.num_blocks > first:  # the blocks completed here: local block i is block first + i
            completed = torch.cat(local)[: self.num_blocks - first]  # [n, 2, B, Hkv, *U]
            for chunk, lo, hi, offset in self.spans(first, self.num_blocks):
                chunk[lo:hi].copy_(completed[offset : offset + hi - lo])
        self.remote = None
        self.shared = set()

    def _empty(self, shape) -> torch.Tensor:
        """A new chunk, pinned where the pool is (torch's caching host allocator)."""
        return torch.empty(shape, dtype=self.representation.storage_dtype, device="cpu", pin_memory=self.pin_memory)

    def _own_copy(self, index: int, num_blocks: int) -> torch.Tensor:
        """A new chunk (pinned where the pool is) holding chunk `index`'s blocks below `num_blocks` (local blocks
        `[0, num_blocks - first_block)`), the rest left unwritten: blocks past the end are rewritten before they are
        read. One copy of the blocks in use only — a fork of a prompt just past a chunk's start copies a few blocks,
        not the chunk (`[C, 2, B, Hkv, *U]`, ~150 MB per layer for SmolLM2 in fp32 at a batch of 24)."""
        chunk = self.chunks[index]
        used = min(max(num_blocks - self.first_block - index * self.chunk_blocks, 0), self.chunk_blocks)
        new = self._empty(chunk.shape)
        if used:
            new[:used].copy_(chunk[:used])
        return new

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in self.chunks)


def measured_pool(pool: HostKVPool, blocks: torch.Tensor, query: torch.Tensor, scale: float,
                  chunk_blocks: int) -> tuple[HostKVPool, float | None]:
    """Before a narrow pool's first blocks (`blocks`, `[2, B, Hkv, n, T, D]`): `(pool, noise)`, or, where narrowing
    its layer's keys would move the forward's attention scores (`query`, `scale`) by more than `SCORE_NOISE_LIMIT`
    (`representation.score_noise`), an empty pool of the same shape in the model's dtype: that layer's keys and
    values stay as made."""
    noise = score_noise(pool.representation, blocks, query, scale)
    if noise is None or noise <= SCORE_NOISE_LIMIT:
        return pool, noise
    return HostKVPool(pool.batch_size, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype, chunk_blocks,
                      pool.pin_memory), noise
