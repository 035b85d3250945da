"""Learned attention sinks (gpt-oss, Granite SWA, Flint, ...: the attention module's `sinks`, passed to the attention
function as `s_aux`): one logit per query head joins every softmax's denominator and attends no value, so a query
may give part of its weight to nothing:

    out = sum_j exp(s_j - Z) v_j,   Z = log(exp(sink_h) + sum_j exp(s_j))

The torch way here computes the scores explicitly (float32), in bounded chunks of queries: the dense attention of a
prefill or an extend (`dense_causal_attention(..., sinks=)`), the sparse one of a decode step
(`sparse_attention(..., sinks=)`) and the layers transformers keeps (sliding windows: `oasis_attention_eager`'s
fallback). Equal to transformers' eager attention of these models within float rounding. The package's Triton
decode kernel and cuDNN's split prefill do not take sinks: a model with sinks decodes through these.
"""

from __future__ import annotations

import torch

_SCORE_ELEMENTS = 1 << 25  # largest float32 score block computed at once (128 MiB)


def check_sinks(sinks, query: torch.Tensor, module) -> torch.Tensor:
    """`sinks` as given to the attention (`s_aux`): one logit per query head, `[Hq]`; anything else is refused."""
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise NotImplementedError(
            f"{type(module).__name__} passes attention sinks of shape {shape}; OasisCache computes one learned sink "
            f"logit per query head ([{query.shape[1]}]). Use a DynamicCache."
        )
    return sinks


def attention_with_sinks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                         sinks: torch.Tensor, visible: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `query` `[B, Hq, Qn, D]` (the last Qn of L positions) over `keys`, `values` `[B, Hkv, L, D]`
    with one sink logit per query head (`sinks` `[Hq]`). What each query sees: `mask`, bool `[B or 1, Hq or 1, Qn,
    L]` (True: seen) where given; else causally (aligned to the bottom right) among the tokens `visible` `[B, L]`
    shows (None: all), a hidden query seeing itself (its row is meaningless, not empty). Returns `[B, Hq, Qn, D]` in
    `query`'s dtype."""
    B, Hq, Qn, D = query.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    k = keys.float()[:, :, None]  # [B, Hkv, 1, L, D]
    v = values.float()[:, :, None]
    sink = sinks.float().view(1, Hkv, G, 1, 1)
    rows = max(1, min(Qn, _SCORE_ELEMENTS // max(1, B * Hq * L)))
    key_pos = torch.arange(L, device=query.device)
    out = torch.empty_like(query)
    for lo in range(0, Qn, rows):
        hi = min(Qn, lo + rows)
        q = query[:, :, lo:hi].float().view(B, Hkv, G, hi - lo, D)
        scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hkv, G, r, L]
        if mask is not None:
            seen = mask[:, :, lo:hi]
            seen = seen.view(seen.shape[0], Hkv, G, hi - lo, L) if seen.shape[1] == Hq else seen[:, :, None]
        else:
            q_pos = torch.arange(L - Qn + lo, L - Qn + hi, device=query.device)
            seen = key_pos[None, :] <= q_pos[:, None]  # [r, L]
            if visible is not None:
                seen = (seen[None] & visible[:, None, :]) | (key_pos[None, None, :] == q_pos[None, :, None])
            seen = seen[:, None, None] if seen.dim() == 3 else seen
        scores = scores.masked_fill(~seen, float("-inf"))
        total = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)  # the sink joins the sum
        out[:, :, lo:hi] = (torch.exp(scores - total) @ v).view(B, Hq, hi - lo, D).to(query.dtype)
    return out


def grouped_sinks(sinks: torch.Tensor, num_kv_heads: int, num_queries: int) -> torch.Tensor:
    """`[Hkv, G * Qn]`: each row of a KV head's grouped queries (`sparse_attention`'s rows `g * Qn + i`) with its
    query head's sink logit (float32)."""
    return sinks.float().view(num_kv_heads, -1).repeat_interleave(num_queries, dim=1)
