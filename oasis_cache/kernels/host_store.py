"""Write one completed block per (sequence, KV head) into the pinned host pool at a block index read on the device
(the reverse of `gather.py`): the offload of a decode step that completes a block, with no host-side address, so
that the step can be captured as a CUDA graph and replayed for every later block.

Shapes (contiguous, element type E = the pool's: the model's K/V dtype, or bytes of narrowed units):
    block        `[2, B, Hkv, *U]`              the completed block's keys (0) and values (1), on the device, already
                                                in the pool's representation (U: `[T, D]`, or a unit's bytes)
    host chunk c `[C, 2, B, Hkv, *U]`           base address `chunk_addrs[c]` (pinned; written through unified
                                                addressing, the stores cross PCIe)
    index        `[1]` int64                    the block's number in the pool (its chunk: index // C)
Program (bh, kv): copies the T*D elements of (kv, bh).
"""

from __future__ import annotations

import torch

from .gather import triton_available

if triton_available():
    import triton
    import triton.language as tl

    from .gather import host_block

    @triton.jit
    def _store_block_kernel(chunk_addrs, index, block, BH, C, BLOCK_ELEMS: tl.constexpr, BLOCK_POW2: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        kv = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, BLOCK_POW2)
        mask = offs < BLOCK_ELEMS
        dst = host_block(chunk_addrs, tl.load(index), C, kv, BH, bh, block, BLOCK_ELEMS)
        src = block + (kv * BH + bh) * BLOCK_ELEMS
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def store_block(chunk_addrs: torch.Tensor, chunk_blocks: int, index: torch.Tensor, block: torch.Tensor) -> None:
    """Copy `block` `[2, B, Hkv, *U]` to block `index` `[1]` of the host pool whose chunks start at `chunk_addrs`."""
    two, B, H = block.shape[:3]
    unit = block[0, 0, 0].numel()
    _store_block_kernel[(B * H, 2)](
        chunk_addrs, index, block.contiguous(), B * H, chunk_blocks,
        BLOCK_ELEMS=unit, BLOCK_POW2=triton.next_power_of_2(unit),
    )
