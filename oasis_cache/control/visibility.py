"""What one forward lets every layer see, computed once per forward from the 2D attention mask: which blocks hold
visible tokens, which blocks are always attended (sink and recent), and the per-token visibility that attention
applies inside blocks and among the recent tokens. All layers of a forward share it (same mask, same length).

A captured decode step cannot read a mask that grows every step: it is called without one. The padding lies in the
prompt, and `generate`'s decode masks extend the prompt's with ones, so the cache keeps the prompt's padding
(`Padding`, taken from the last multi-token forward's mask) and a one-token step without a mask computes its
visibility from it and from the block count on the device, in shapes that do not change from step to step
(`runtime/captured_step.py`). A step given a mask reads the mask."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch


@dataclass
class StepVisibility:
    """Shapes: B sequences, NB complete blocks, W >= NB the width blocks are ranked over (the summaries' capacity:
    blocks [NB, W) are never allowed, so the ranking's shapes stay fixed as blocks complete), T tokens per block, n
    recent tokens (the new ones included).

    allowed:      `[B, W]` bool, blocks holding at least one visible token
    forced:       `[B, W]` bool, sink blocks (from each sequence's first visible token) and the newest blocks
    block_tokens: `[B, NB, T]` bool visibility of each block's tokens (`[B, W, T]` from a `Padding`), or None when
                  every token is visible
    recent:       `[B, n]` bool visibility of the recent tokens, or None when every token is visible
    """

    num_blocks: int
    allowed: torch.Tensor
    forced: torch.Tensor
    block_tokens: torch.Tensor | None
    recent: torch.Tensor | None


@dataclass
class Padding:
    """The batch's padding, from the mask of the last multi-token forward (`Padding.of`), for the decode steps after it.

    tokens:     `[B, L]` bool, True = a real token, over the cache's first L tokens (tokens from L on are real), or None
                when no token is padding
    first:      `[B, 1]` int64, each sequence's first real token
    clear_from: the position after the last padding token of any sequence (0 without padding), on the host: a decode
                step takes its visibility from here once every padding token is in a complete block
    """

    tokens: torch.Tensor | None
    first: torch.Tensor
    clear_from: int

    @classmethod
    def of(cls, visible: torch.Tensor | None, batch_size: int, device) -> "Padding":
        """The padding of a forward's mask `visible` (`[B, N]` bool over all N tokens, or None); one host sync."""
        if visible is not None:
            padded = (~visible).any(dim=0).nonzero()
            if padded.numel():
                return cls(visible.clone(), visible.int().argmax(dim=1, keepdim=True), int(padded[-1]) + 1)
        return cls(None, torch.zeros((batch_size, 1), dtype=torch.long, device=device), 0)


def sink_blocks(padding: "Padding | None", batch_size: int, sink_tokens: int, block_size: int,
                device) -> torch.Tensor | None:
    """`[B, J]` each sequence's sink blocks (those holding its first `sink_tokens` real tokens, as `step_visibility`
    forces them), -1 past a sequence's last; None without sink tokens."""
    if sink_tokens <= 0:
        return None
    first = padding.first.to(device) if padding is not None else torch.zeros((batch_size, 1), dtype=torch.long,
                                                                          device=device)
    lo, hi = _sink_range(first, sink_tokens, block_size)
    ids = lo + torch.arange((sink_tokens - 1) // block_size + 2, device=device)
    return torch.where(ids <= hi, ids, -1)


def _sink_range(first: torch.Tensor, sink_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and last sink block of each sequence whose first real token is `first`."""
    return first // block_size, (first + sink_tokens - 1) // block_size


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
    padding: Padding | None = None,
) -> StepVisibility:
    """`visible`: `[B, N]` bool (True = a real token) over all N = NB*T + n tokens, or None (no padding). `count`:
    NB as a `[1]` int64 on the device — without a mask the masks are computed from it alone, so that a captured
    step replays them for the next block count. `padding` (with `visible` None: a decode step whose padding tokens
    are all in complete blocks): the batch's padding, read in fixed shapes — `block_tokens` is then `[B, W, T]`."""
    blocks = torch.arange(width, device=device)
    exists = blocks < count  # [W]
    if visible is None and padding is not None and padding.tokens is not None:
        tokens, cover = padding.tokens[:, : width * block_size], width * block_size
        block_tokens = torch.nn.functional.pad(tokens, (0, cover - tokens.shape[1]), value=True).view(
            batch_size, width, block_size)
        allowed = block_tokens.any(dim=-1) & exists
        first, recent = padding.first, None
    elif visible is None:
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
        sink_lo, sink_hi = _sink_range(first, sink_tokens, block_size)
        forced = forced | ((blocks >= sink_lo) & (blocks <= sink_hi))
    forced = forced.expand(batch_size, width) & allowed
    return StepVisibility(num_blocks, allowed, forced, block_tokens, recent)


def from_pattern(pattern: torch.Tensor, batch_size: int, length: int, queries: int, decodes: bool) -> torch.Tensor:
    """`[B, N]` bool, the tokens some query of a 4D mask `pattern` (`[B or 1, 1 or Hq, Qn, N]` bool, True: seen)
    sees: the padding the steps after this forward keep hidden. A forward that attends densely attends `pattern`
    as given (a multimodal prompt's image tokens see each other, Gemma 3); one that decodes sparsely attends
    causally among these tokens, so there the pattern must be exactly that (one host read), else it is refused.
    Remembered for the last mask seen on this thread: every full-attention layer of a forward gets the same mask
    tensor, so the reduction and the check run once a forward (as `dense.mask_layout` reads a 2D mask once)."""
    last = getattr(_patterns, "last", None)
    asked = (batch_size, length, queries, decodes)
    if last is not None and last[0]() is pattern and last[1] == asked:
        return last[2]
    visible = _visible_of(pattern, *asked)
    _patterns.last = (weakref.ref(pattern), asked, visible)
    return visible


_patterns = threading.local()


def _visible_of(pattern: torch.Tensor, batch_size: int, length: int, queries: int, decodes: bool) -> torch.Tensor:
    B1, _, Qn, N = pattern.shape
    if B1 not in (1, batch_size) or Qn != queries or N != length:
        raise ValueError(f"A 4D attention mask of shape {list(pattern.shape)} does not fit this forward ({batch_size} "
                         f"sequences, {queries} new tokens, {length} tokens with the past): pass [batch, 1, "
                         f"{queries}, {length}], or a 2D padding mask [batch, {length}].")
    visible = pattern.any(dim=2).any(dim=1).expand(batch_size, N)
    if decodes:
        key_pos = torch.arange(N, device=pattern.device)
        causal = key_pos[None, :] <= torch.arange(N - Qn, N, device=pattern.device)[:, None]  # [Qn, N]
        if not bool((pattern == (causal[None, None] & visible[:, None, None])).all()):
            raise NotImplementedError(
                f"A forward of {Qn} new token(s) decodes sparsely (causally, among the tokens not padding), but its "
                "4D attention mask shows them another pattern. OasisCache attends such patterns in forwards that "
                "attend densely (prefills, over max_decode_tokens new tokens); use a DynamicCache here.")
    return visible
