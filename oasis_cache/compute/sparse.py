"""Sparse decode attention: the new queries attend to the working-set slots selected this step and to the recent
tokens (causally among the new ones). Softmax is order-free and keys are already rotated, so slot order does not
matter. Query heads are grouped by KV head (GQA) so keys and values are read once per KV head."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sparse_attention(
    query: torch.Tensor,
    slot_kv: tuple[torch.Tensor, torch.Tensor],
    slot_visible: torch.Tensor,
    recent_kv: torch.Tensor,
    recent_visible: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """
    Args:
        query: `[B, Hq, Qn, D]`, the last Qn of the recent tokens.
        slot_kv: keys and values of the slots, each `[B, Hkv, S*T, D]`.
        slot_visible: `[B, Hkv, S*T]` bool, tokens of slots selected this step that are not padding.
        recent_kv: `[2, B, Hkv, n, D]`, the recent tokens (n >= Qn).
        recent_visible: `[B, n]` bool, or None when none is padding.
        scale: softmax scale.
    Returns:
        `[B, Hq, Qn, D]`.
    """
    B, Hq, Qn, D = query.shape
    Hkv, n = recent_kv.shape[2], recent_kv.shape[3]
    G = Hq // Hkv
    keys = torch.cat((slot_kv[0], recent_kv[0]), dim=2)
    values = torch.cat((slot_kv[1], recent_kv[1]), dim=2)

    # Recent token j is seen by query i iff j <= n - Qn + i.
    recent_mask = torch.ones((Qn, n), dtype=torch.bool, device=query.device).tril(n - Qn)
    recent_mask = recent_mask[None, None].expand(B, Hkv, Qn, n)
    if recent_visible is not None:
        recent_mask = recent_mask & recent_visible[:, None, None, :]
    mask = torch.cat((slot_visible[:, :, None, :].expand(B, Hkv, Qn, -1), recent_mask), dim=-1)  # [B, Hkv, Qn, L]

    # Query head h*G + g uses KV head h: rows (g, i) of KV head h.
    grouped = query.reshape(B, Hkv, G * Qn, D)
    if Qn > 1:
        mask = mask[:, :, None].expand(B, Hkv, G, Qn, mask.shape[-1]).reshape(B, Hkv, G * Qn, -1)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, Qn, D)
