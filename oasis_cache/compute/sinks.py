"""Learned attention sinks (gpt-oss, Granite SWA, Flint, ...: the attention module's `sinks`, passed to the attention
function as `s_aux`): one logit per query head joins every softmax's denominator and attends no value, so a query
may give part of its weight to nothing:

    out = sum_j exp(s_j - Z) v_j,   Z = log(exp(sink_h) + sum_j exp(s_j))

A kernel that returns its log-sum-exp gives the same by scaling its output: `out * sigmoid(lse - sink)`. The dense
attention of a prefill or an extend (`dense_causal_attention(..., sinks=)`) takes that way where it can — cuDNN's
attention on CUDA (bf16 / fp16, as `dense._past_then_chunk` calls it: the past and the chunk's own tokens, merged),
the flash kernel for CPU — for prompts without padding or left-padded (one call per sequence, as it lays out any
prompt). A decode step's sparse attention on the Triton backend adds the sink to each query head's sum where
the kernel combines its splits (`kernels/decode_attention.py`). Elsewhere the scores are explicit (float32, in
bounded chunks of queries): other masks, the torch backend's sparse step (`sparse_attention(..., sinks=)`) and the
layers transformers keeps (sliding windows: `oasis_attention_eager`'s fallback). Equal to transformers' eager
attention of these models within float rounding.

The explicit scores serve attention logit soft-capping too (Gemma 2, VaultGemma: `softcap`, each score s becomes
`softcap * tanh(s / softcap)` before the softmax), with or without sinks: no kernel here takes it. Block selection
is unchanged by either (a sink adds the same term to every block; the cap keeps the scores' order).
"""

from __future__ import annotations

import torch

from . import dense
from .dense import causal_rows, dense_causal_attention

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


def check_softcap(softcap, module) -> float | None:
    """`softcap` as given to the attention (Gemma 2's `attn_logit_softcapping`): a positive number, or None."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise NotImplementedError(f"{type(module).__name__} passes softcap={softcap!r}; OasisCache caps attention "
                                  "scores at one positive number. Use a DynamicCache.")
    return float(softcap)


_KERNEL = {"refused": False}  # cuDNN refused a call (a RuntimeError other than memory): explicit scores from then on


def _with_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """`(out [B, H, Qn, D], lse [B, H, Qn, 1] float32)` of `query` (the last Qn of L positions) over `keys`,
    `values` `[B, Hkv, L, D]`, causal from the bottom right, by a kernel that returns its log-sum-exp: cuDNN's on
    CUDA (where `dense._cudnn_applies`), the flash kernel for CPU; the past and the queries' own tokens separately,
    merged. None where neither applies."""
    if query.is_cuda:
        if _KERNEL["refused"] or not dense._cudnn_applies(query):
            return None
        kernel = None  # (cuDNN's)
    elif query.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        def kernel(q, k, v, causal):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    else:
        return None
    D, Dv = keys.shape[-1], values.shape[-1]
    if Dv > D:
        return None
    if Dv < D:  # (values narrower than keys, MiMo-V2-Flash: these kernels take one head size; padded, cut after)
        values = torch.nn.functional.pad(values, (0, D - Dv))
    keys, values = dense._expand_kv_heads(query, keys, values)
    try:
        out, lse = dense.past_then_chunk_with_lse(query, keys, values, scale, kernel)
        return out[..., :Dv], lse
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        if not query.is_cuda:
            raise
        _KERNEL["refused"] = True
        return None


def _scaled(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`out` `[B, Hq, Qn, D]` of a softmax whose log-sum-exp is `lse` `[B, Hq, Qn, 1]`, with each head's sink logit
    joining the sum."""
    return (out.float() * torch.sigmoid(lse - sinks.float().view(1, -1, 1, 1))).to(out.dtype)


def causal_with_sinks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      sinks: torch.Tensor) -> torch.Tensor:
    """`dense_causal_attention`'s unpadded call with sinks: through a kernel's log-sum-exp (`_with_lse`) where one
    applies, else the explicit scores."""
    done = _with_lse(query, keys, values, scale)
    return _explicit(query, keys, values, scale, sinks, None, None) if done is None else _scaled(*done, sinks)


def attention_with_sinks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                         sinks: torch.Tensor | None, visible: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """Attention of `query` `[B, Hq, Qn, D]` (the last Qn of L positions) over `keys`, `values` `[B, Hkv, L, D]`
    with one sink logit per query head (`sinks` `[Hq]`). What each query sees: `mask`, bool `[B or 1, Hq or 1, Qn,
    L]` (True: seen) where given (explicit scores; with `window`, a sliding window's mask: query i sees no key
    `window` or more positions before it, so only those keys are scored); else causally (aligned to the bottom
    right) among the tokens `visible` `[B, L]` shows (None: all), as `dense_causal_attention` lays out a mask
    (padding rows meaningless). `sinks` None: none; `softcap`: the scores capped (explicit scores). Returns
    `[B, Hq, Qn, D]` in `query`'s dtype."""
    if mask is not None or softcap is not None:
        return _explicit(query, keys, values, scale, sinks, visible if mask is None else None, mask, window, softcap)
    if sinks is None:
        return dense_causal_attention(query, keys, values, visible, scale)
    return dense_causal_attention(
        query, keys, values, visible, scale,
        causal=lambda q, k, v, s: causal_with_sinks(q, k, v, s, sinks),
        explicit=lambda q, k, v, seen, s: _explicit(q, k, v, s, sinks, seen, None))


def causal_attention(query, keys, values, visible, scale, sinks=None, pattern=None, softcap=None) -> torch.Tensor:
    """`dense_causal_attention` with learned `sinks` and a `softcap` where the model has them."""
    if sinks is None and softcap is None:
        return dense_causal_attention(query, keys, values, visible, scale, pattern)
    return attention_with_sinks(query, keys, values, scale, sinks, visible=visible, mask=pattern, softcap=softcap)


def _explicit(query, keys, values, scale, sinks, visible, mask, window=None, softcap=None) -> torch.Tensor:
    """Attention with sinks (or None), its scores computed (float32, in chunks of at most `_SCORE_ELEMENTS`; capped at
    `softcap` where given): what a query sees as `attention_with_sinks` says, a row that sees
    nothing giving zeros. With `mask` and `window`, the keys of a chunk of queries are those within `window` positions of one of
    them (the mask hides the others)."""
    B, Hq, Qn, D = query.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    windowed = mask is not None and window is not None and window < L
    k = keys.float()[:, :, None]  # [B, Hkv, 1, L, D]
    v = values.float()[:, :, None]
    sink = None if sinks is None else sinks.float().view(1, Hkv, G, 1, 1)
    per_row = B * Hq
    if windowed:  # r rows score r + window - 1 keys: the most rows within the budget
        rows = int(((window - 1) ** 2 + 4 * _SCORE_ELEMENTS / per_row) ** 0.5 - (window - 1)) // 2
    else:
        rows = _SCORE_ELEMENTS // max(1, per_row * L)
    rows = max(1, min(Qn, rows))
    out = query.new_empty(query.shape[:3] + values.shape[3:])
    for lo in range(0, Qn, rows):
        hi = min(Qn, lo + rows)
        first, last = 0, L  # the keys these rows may see
        if windowed:  # (row r is position L - Qn + r; it sees keys after r's position - window)
            first = max(0, L - Qn + lo - window + 1)
            last = L - Qn + hi
        q = query[:, :, lo:hi].float().view(B, Hkv, G, hi - lo, D)
        scores = (q @ k[..., first:last, :].transpose(-1, -2)) * scale  # [B, Hkv, G, r, L']
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            seen = mask[:, :, lo:hi, first:last]
            seen = (seen.view(seen.shape[0], Hkv, G, hi - lo, last - first) if seen.shape[1] == Hq
                    else seen[:, :, None])
        else:
            seen = causal_rows(L, Qn, lo, hi, visible, query.device)  # [r, L] or [B, r, L]
            seen = seen[:, None, None] if seen.dim() == 3 else seen
        out[:, :, lo:hi] = softmax_with_sinks(scores.masked_fill(~seen, float("-inf")), sink,
                                              v[..., first:last, :]).view(B, Hq, hi - lo, -1).to(query.dtype)
    return out


def softmax_with_sinks(scores: torch.Tensor, sink: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`softmax(scores) @ values` with `sink` (broadcast to `scores[..., :1]`; None: no sink) joining the softmax's
    sum; float32 `scores` `[..., r, L]`, masked with -inf (a row masked whole gives zeros)."""
    total = torch.logsumexp(scores, dim=-1, keepdim=True)
    if sink is not None:
        total = torch.logaddexp(total, sink)
    else:  # (a row that sees nothing, a padding query in transformers' window mask: zeros, not NaN)
        total = total.clamp(min=torch.finfo(total.dtype).min)
    return torch.exp(scores - total) @ values


def grouped_sinks(sinks: torch.Tensor, num_kv_heads: int, num_queries: int) -> torch.Tensor:
    """`[Hkv, G * Qn]`: each row of a KV head's grouped queries (`sparse_attention`'s rows `g * Qn + i`) with its
    query head's sink logit (float32)."""
    return sinks.float().view(num_kv_heads, -1).repeat_interleave(num_queries, dim=1)
