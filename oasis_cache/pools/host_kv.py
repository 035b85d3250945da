"""The host pool: every complete block of one layer's keys and values, in host memory (pinned when the model runs
on CUDA), grown by fixed-size chunks and never reallocated per token.

Layout of one chunk: `[C, 2, B, Hkv, T, D]` (C = `chunk_blocks`; 0 = keys, 1 = values). Block `block_id` lives in
chunk `block_id // C` at index `block_id % C`; one (block, K or V, sequence, KV head) is one contiguous run of T*D
elements, and a range of blocks is one contiguous run (one copy per chunk when blocks are offloaded). The pool holds data and answers where a block is; bytes are moved by `oasis_cache.memory`.
"""

from __future__ import annotations

import torch


class HostKVPool:
    """Complete blocks of one attention layer, in host memory.

    Args:
        batch_size, num_kv_heads, head_dim, block_size: B, Hkv, D, T.
        dtype: element type of the model's keys and values.
        chunk_blocks: C, blocks per chunk (per allocation).
        pin_memory: allocate page-locked memory (for CUDA models).
    """

    def __init__(self, batch_size, num_kv_heads, head_dim, block_size, dtype, chunk_blocks, pin_memory):
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.chunk_blocks = chunk_blocks
        self.pin_memory = pin_memory
        self.chunks: list[torch.Tensor] = []  # each [C, 2, B, Hkv, T, D]
        self.num_blocks = 0  # NB: complete blocks stored
        self.remote = None  # `remote.disaggregate.RemoteBlocks` on a decode side: blocks still in a store

    # ----------------------------------------------------------------------------------------------------- capacity
    @property
    def capacity_blocks(self) -> int:
        return len(self.chunks) * self.chunk_blocks

    def reserve(self, num_blocks: int) -> None:
        """Make room for `num_blocks` blocks in all (allocates whole chunks)."""
        shape = (self.chunk_blocks, 2, self.batch_size, self.num_kv_heads, self.block_size, self.head_dim)
        while self.capacity_blocks < num_blocks:
            self.chunks.append(torch.empty(shape, dtype=self.dtype, device="cpu", pin_memory=self.pin_memory))

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: its `[2, B, Hkv, T, D]` run in a chunk."""
        return 2 * self.batch_size * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def bytes_to_reserve(self, num_blocks: int) -> int:
        """Host bytes `reserve(num_blocks)` would allocate."""
        missing = max(0, -(-(num_blocks - self.capacity_blocks) // self.chunk_blocks))
        return missing * self.chunk_blocks * self.block_nbytes

    def spans(self, start: int, end: int):
        """Yield `(chunk, local_start, local_end, offset)` covering blocks [start, end): blocks `local_start ..
        local_end` of `chunk` are blocks `offset + 0 ..` of the range."""
        C = self.chunk_blocks
        block = start
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
        self.num_blocks = num_blocks
        if self.remote is not None:
            self.remote.truncate(num_blocks)

    def index_batch(self, indices: torch.Tensor) -> None:
        """Keep or reorder sequences: sequence i becomes old sequence `indices[i]` (beam search, batch selection)."""
        indices = indices.to("cpu")
        self.fetch_all_remote()  # the store holds the old order
        self.chunks = [
            _pin(chunk.index_select(2, indices), self.pin_memory) for chunk in self.chunks
        ]
        self.batch_size = int(indices.numel())

    def __deepcopy__(self, memo):
        """Every chunk copied, pinned again where the pool is pinned (a gather reads it through unified addressing)."""
        self.fetch_all_remote()  # the copy owns every block (the store's keys go with the original)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.remote = None
        new.chunks = [_pin(chunk.clone(), self.pin_memory) for chunk in self.chunks]
        memo[id(self)] = new
        return new

    def fetch_all_remote(self) -> None:
        """Bring every block still in a store into the pool and drop the link (no-op for a local pool)."""
        if self.remote is not None:
            self.remote.ensure_range(self, 0, self.num_blocks)
            self.remote = None

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunk in self.chunks)


def _pin(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    return tensor.pin_memory() if pin_memory else tensor
