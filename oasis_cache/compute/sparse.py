"""Sparse decode attention: the new queries attend to the working set — the slots selected this step and the recent
tokens, one contiguous run per KV head — under its visibility mask, causally among the new tokens. Softmax is
order-free and keys are already rotated, so slot order does not matter. Query heads are grouped by KV head (GQA) so
keys and values are read once per KV head.

Two implementations of the same function: `sparse_attention` (torch: SDPA with an additive mask, any device) and the
Triton kernel `kernels/decode_attention.py` (the Triton backend: no mask tensor, no query or output copy), which the
layer calls instead when its cache runs Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def new_token_bias(num_queries: int, group: int, length: int, slot_tokens: int, count: torch.Tensor,
                   dtype: torch.dtype, device) -> torch.Tensor:
    """`[G * Qn, L]` (`[1, L]` when Qn == 1) additive attention bias in `dtype`, 0 or -inf: row `g * Qn + i` (query
    head g of a KV head's group, new token i) may see working-set token j iff j <= end - Qn + i, end = `slot_tokens`
    + the recent-token count `count` (`[1]` int64 on the device: a captured step replays with its new value)."""
    if num_queries == 1:  # one new token sees every visible token: the visibility alone decides
        return torch.zeros((1, length), dtype=dtype, device=device)
    offset = torch.arange(length, device=device) - torch.arange(num_queries, device=device)[:, None]
    seen = (offset <= count + (slot_tokens - num_queries)).repeat(group, 1)  # [G * Qn, L]
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def sparse_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float,
    bias: torch.Tensor, sinks: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """
    Args:
        query: `[B, Hq, Qn, D]`, the newest Qn of the recent tokens.
        keys, values: `[B, Hkv, L, D]`, the slots then the recent-token region (the whole working set: a shape
            that does not change between steps, so attention backends keep their plans).
        visible: `[B, Hkv, L]` bool: tokens of selected slots and visible recent tokens (none past the last one).
        scale: softmax scale.
        bias: `new_token_bias(...)`, `[G * Qn, L]` or `[1, L]`: the new tokens' causality (the cache builds it once
            per forward for all layers: `ForwardContext.new_token_bias`).
        sinks: `[Hq]` learned sink logits (`compute/sinks.py`) or None.
        softcap: attention logit soft-capping (scores `softcap * tanh(s / softcap)`), or None.
    Returns:
        `[B, Hq, Qn, D]`.
    """
    B, Hq, Qn, D = query.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    grouped = query.reshape(B, Hkv, G * Qn, D)  # query head h*G + g uses KV head h: rows (g, i)
    # The additive mask in one operation, [B, Hkv, G * Qn or 1, L]: what a boolean mask would become inside the
    # attention call (0 where seen, -inf elsewhere), with the new tokens' causality folded in.
    mask = torch.where(visible[:, :, None, :], bias, float("-inf"))
    if sinks is not None or softcap is not None:  # the scores explicitly, sinks in the softmax's sum (float32)
        from .sinks import grouped_sinks, softmax_with_sinks

        scores = (grouped.float() @ keys.float().transpose(-1, -2)) * scale  # [B, Hkv, G * Qn, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        sink = None if sinks is None else grouped_sinks(sinks, Hkv, Qn)[None, :, :, None]
        out = softmax_with_sinks(scores + mask.float(), sink, values.float())
        return out.to(query.dtype).reshape(B, Hq, Qn, D)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, Qn, D)
