"""Dense causal attention for prefill and long extends: the new queries are the last Qn of L positions (aligned to
the bottom right), padding respected, and no `[B, Qn, L]` mask is built for the common cases:

- no padding: SDPA's own causal (`is_causal`, or `causal_lower_right` when there is a past);
- a mask that hides nothing (generate's all-ones): as without one;
- left padding (what `generate` produces): one SDPA call per sequence on its unpadded tokens;
- any other mask: explicit boolean masks for bounded chunks of queries.

The left-padding test reads the mask on the host (one sync per prefill forward, remembered across its layers;
never in decode).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_MASK_ELEMENTS = 1 << 26  # largest explicit mask built at once (64 Mi booleans)


def _expand_kv_heads(query, keys, values):
    """GQA by repeating K/V heads (one layer, transiently): SDPA's `enable_gqa` sends fp32 and masked calls to the
    math kernel, which materializes `[B, Hq, Qn, L]` scores (128 GiB at 32K)."""
    G = query.shape[1] // keys.shape[1]
    if G == 1:
        return keys, values
    return keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)


def _sdpa_causal(query, keys, values, scale):
    Qn, L = query.shape[2], keys.shape[2]
    keys, values = _expand_kv_heads(query, keys, values)
    if Qn == L:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(Qn, L), scale=scale)


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of the last Qn positions over all L.

    Args:
        query: `[B, Hq, Qn, D]`, positions L-Qn .. L-1.
        keys, values: `[B, Hkv, L, D]`.
        visible: `[B, L]` bool (False = padding), or None.
        scale: softmax scale.
    Returns:
        `[B, Hq, Qn, D]`; rows of padding queries are finite but meaningless.
    """
    if visible is None:
        return _sdpa_causal(query, keys, values, scale)
    B, Hq, Qn, D = query.shape
    L = keys.shape[2]
    left, padded, firsts = mask_layout(visible)
    if left and not padded:  # nothing hidden (generate's all-ones mask): one batched call
        return _sdpa_causal(query, keys, values, scale)
    if left:
        out = torch.zeros_like(query)
        for b, start in enumerate(firsts):
            q_start = max(0, start - (L - Qn))
            if q_start < Qn:
                out[b : b + 1, :, q_start:] = _sdpa_causal(
                    query[b : b + 1, :, q_start:], keys[b : b + 1, :, start:], values[b : b + 1, :, start:], scale
                )
        return out
    return _explicit_mask_attention(query, keys, values, visible, scale)


def mask_layout(visible: torch.Tensor) -> tuple[bool, bool, list[int]]:
    """`(left-padded or unpadded, any padding, each sequence's first visible token)` of a `[B, L]` mask, in one host
    read, remembered for the last mask seen on this thread: every layer of a forward gets the same mask tensor, so
    a prefill chunk reads it once, not once per layer (each read waits for the device)."""
    last = getattr(_layouts, "last", None)
    if last is not None and last[0]() is visible:
        return last[1]
    L = visible.shape[-1]
    first = visible.int().argmax(dim=1)  # first visible token (0 for an all-padding row)
    left_padded = visible == (torch.arange(L, device=visible.device) >= first[:, None])
    read = torch.cat([torch.stack([left_padded.all(), (first > 0).any()]).long(), first.long()]).tolist()
    layout = (bool(read[0]), bool(read[1]), read[2:])
    _layouts.last = (weakref.ref(visible), layout)
    return layout


_layouts = threading.local()


def _explicit_mask_attention(query, keys, values, visible, scale):
    B, Hq, Qn, D = query.shape
    L = keys.shape[2]
    keys, values = _expand_kv_heads(query, keys, values)
    rows = max(1, min(Qn, _MASK_ELEMENTS // max(1, B * L)))
    key_pos = torch.arange(L, device=query.device)
    out = torch.empty_like(query)
    for lo in range(0, Qn, rows):
        hi = min(Qn, lo + rows)
        q_pos = torch.arange(L - Qn + lo, L - Qn + hi, device=query.device)
        causal = key_pos[None, :] <= q_pos[:, None]  # [rows, L]
        mask = causal[None] & visible[:, None, :]  # [B, rows, L]
        mask |= key_pos[None, None, :] == q_pos[None, :, None]  # a padding query sees itself: no empty softmax row
        out[:, :, lo:hi] = F.scaled_dot_product_attention(
            query[:, :, lo:hi], keys, values, attn_mask=mask[:, None], scale=scale
        )
    return out
