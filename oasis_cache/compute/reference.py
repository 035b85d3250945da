"""Plain-PyTorch references, written independently of the fast paths they check (no grouping tricks, full masks):
used by the tests to show that sparse decode is exactly dense attention restricted to the selected blocks."""

from __future__ import annotations

import torch


def block_masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    selected_blocks: torch.Tensor,
    visible: torch.Tensor | None,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Dense attention in float64 over all N cached tokens, where complete blocks not selected are masked out.

    Args:
        query: `[B, Hq, Qn, D]`, positions N-Qn .. N-1.
        keys, values: `[B, Hkv, N, D]`, all tokens (complete blocks, then the recent ones).
        selected_blocks: `[B, Hkv, NB]` bool, NB = complete blocks before this forward.
        visible: `[B, N]` bool or None.
    Returns:
        `[B, Hq, Qn, D]` in the query's dtype.
    """
    B, Hq, Qn, D = query.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    NB = selected_blocks.shape[-1]
    token_block = torch.arange(N, device=keys.device) // block_size
    in_block = token_block < NB
    block_sel = selected_blocks.gather(-1, token_block.clamp(max=max(NB - 1, 0)).expand(B, Hkv, N)) if NB else None
    token_ok = torch.ones((B, Hkv, N), dtype=torch.bool, device=keys.device)
    if block_sel is not None:
        token_ok = torch.where(in_block, block_sel, token_ok)
    if visible is not None:
        token_ok = token_ok & visible[:, None, :]
    q_pos = torch.arange(N - Qn, N, device=keys.device)
    causal = torch.arange(N, device=keys.device)[None, :] <= q_pos[:, None]  # [Qn, N]
    mask = token_ok[:, :, None, :] & causal  # [B, Hkv, Qn, N]
    mask = mask.repeat_interleave(G, dim=1)  # [B, Hq, Qn, N]
    k = keys.double().repeat_interleave(G, dim=1)
    v = values.double().repeat_interleave(G, dim=1)
    logits = torch.matmul(query.double(), k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, -torch.inf)
    return torch.matmul(torch.softmax(logits, dim=-1), v).to(query.dtype)
