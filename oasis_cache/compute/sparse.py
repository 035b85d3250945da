"""Sparse decode attention: the new queries attend to the working set — the slots selected this step and the recent
tokens, one contiguous run per KV head — under its visibility mask, causally among the new tokens. Softmax is
order-free and keys are already rotated, so slot order does not matter. Query heads are grouped by KV head (GQA) so
keys and values are read once per KV head."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sparse_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float,
    bias: torch.Tensor,
) -> torch.Tensor:
    """
    Args:
        query: `[B, Hq, Qn, D]`, the newest Qn of the recent tokens.
        keys, values: `[B, Hkv, L, D]`, the slots then the recent-token region (the whole working set: a shape
            that does not change between steps, so attention backends keep their plans).
        visible: `[B, Hkv, L]` bool: tokens of selected slots and visible recent tokens (none past the last one).
        scale: softmax scale.
        bias: `[G * Qn, L]` (`[1, L]` when Qn == 1) in the query's dtype, 0 or -inf, row `g * Qn + i`: token j may
            be seen by new query i iff j <= end - Qn + i (end: one past the last recent token); the cache builds it
            once per forward for all layers (`OasisCache.new_token_bias`).
    Returns:
        `[B, Hq, Qn, D]`.
    """
    B, Hq, Qn, D = query.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    grouped = query.reshape(B, Hkv, G * Qn, D)  # query head h*G + g uses KV head h: rows (g, i)
    # The additive mask in one operation, [B, Hkv, G * Qn or 1, L]: what a boolean mask would become inside the
    # attention call (0 where seen, -inf elsewhere), with the new tokens' causality folded in.
    mask = torch.where(visible[:, :, None, :], bias, float("-inf"))
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, Qn, D)
