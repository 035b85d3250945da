"""What one forward lets every layer see, computed once per forward from the 2D attention mask: which blocks hold
visible tokens, which blocks are always attended (sink and recent), and the per-token visibility that attention
applies inside blocks and among the recent tokens. All layers of a forward share it (same mask, same length)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepVisibility:
    """Shapes: B sequences, NB complete blocks, W >= NB the width blocks are ranked over (the summaries' capacity:
    blocks [NB, W) are never allowed, so the ranking's shapes stay fixed as blocks complete), T tokens per block, n
    recent tokens (the new ones included).

    allowed:      `[B, W]` bool, blocks holding at least one visible token
    forced:       `[B, W]` bool, sink blocks (from each sequence's first visible token) and the newest blocks
    block_tokens: `[B, NB, T]` bool visibility of each block's tokens, or None when every token is visible
    recent:       `[B, n]` bool visibility of the recent tokens, or None when every token is visible
    """

    num_blocks: int
    allowed: torch.Tensor
    forced: torch.Tensor
    block_tokens: torch.Tensor | None
    recent: torch.Tensor | None


def step_visibility(
    visible: torch.Tensor | None,
    batch_size: int,
    num_blocks: int,
    count: torch.Tensor,
    width: int,
    block_size: int,
    sink_tokens: int,
    num_recent_blocks: int,
    device: torch.device,
) -> StepVisibility:
    """`visible`: `[B, N]` bool (True = a real token) over all N = NB*T + n tokens, or None (no padding). `count`:
    NB as a `[1]` int64 on the device — without padding the masks are computed from it alone, so that a captured
    step replays them for the next block count."""
    blocks = torch.arange(width, device=device)
    exists = blocks < count  # [W]
    if visible is None:
        allowed = exists.expand(batch_size, width).contiguous()  # (once per forward: the kernel reads it as int8)
        first = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        block_tokens = recent = None
    else:
        cut = num_blocks * block_size
        block_tokens = visible[:, :cut].reshape(batch_size, num_blocks, block_size)
        recent = visible[:, cut:]
        allowed = torch.nn.functional.pad(block_tokens.any(dim=-1), (0, width - num_blocks), value=False)
        first = visible.int().argmax(dim=1, keepdim=True)  # first visible token of each sequence
    forced = blocks >= count - num_recent_blocks
    if sink_tokens > 0:
        sink_lo, sink_hi = first // block_size, (first + sink_tokens - 1) // block_size
        forced = forced | ((blocks >= sink_lo) & (blocks <= sink_hi))
    forced = forced.expand(batch_size, width) & allowed
    return StepVisibility(num_blocks, allowed, forced, block_tokens, recent)
