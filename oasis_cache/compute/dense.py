"""Dense causal attention for prefill and long extends: the new queries are the last Qn of L positions (aligned to
the bottom right), padding respected, and no `[B, Qn, L]` mask is built for the common cases:

- no padding: SDPA's own causal (`is_causal`; after a past, on CUDA, the past without a mask and the new queries'
  own tokens causally, merged by log-sum-exp: `_past_then_chunk`; else `causal_lower_right`);
- a mask that hides nothing (generate's all-ones): as without one;
- left padding (what `generate` produces): one SDPA call per sequence on its unpadded tokens;
- any other mask: explicit boolean masks for bounded chunks of queries.

The left-padding test reads the mask on the host (one sync per prefill forward, remembered across its layers;
never in decode).
"""

from __future__ import annotations

import contextlib
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


# Largest keys and values expanded for grouped query heads at once (`_sdpa_causal`): a prefill's chunk over a long
# past attends in slices of KV heads past it. Qwen3-8B at 32K x 8 under a 24 GiB cap ran out of memory expanding 1 GiB
# of keys (4.3 GB of K and V a layer at 16K x 8); at 32K x 1 (67 MB a KV head) nothing changes.
EXPAND_BYTES = 1 << 29


def _sdpa_causal(query, keys, values, scale):
    B, Hkv, L, D = keys.shape
    G = query.shape[1] // Hkv
    if query.shape[2] == L:
        if (getattr(_chunks_follow, "on", False) and SPLIT_PAST and SPLIT_WARM_QUERIES and _cudnn_applies(query)
                and not torch.compiler.is_dynamo_compiling()):
            warm_split_past(query, keys, scale)
    elif G > 1 and _split_gqa(query):
        out = _split_unless_refused(query, keys, values, scale, "gqa_failed")  # (cuDNN reads the grouped heads)
        if out is not None:
            return out
    per_head = 2 * B * G * L * D * keys.element_size()  # one KV head's keys and values, expanded
    heads = max(1, EXPAND_BYTES // per_head) if G > 1 else Hkv
    if heads >= Hkv:
        return _sdpa_causal_heads(query, keys, values, scale)
    out = query.new_empty(query.shape[:3] + values.shape[3:])  # (values may be narrower than keys: MLA, Gemma 4)
    for h in range(0, Hkv, heads):
        e = min(h + heads, Hkv)
        out[:, h * G : e * G] = _sdpa_causal_heads(query[:, h * G : e * G], keys[:, h:e], values[:, h:e], scale)
    return out


def _sdpa_causal_heads(query, keys, values, scale):
    Qn, L = query.shape[2], keys.shape[2]
    keys, values = _expand_kv_heads(query, keys, values)
    if Qn == L:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
    if SPLIT_PAST and _cudnn_applies(query):
        out = _split_unless_refused(query, keys, values, scale, "failed")
        if out is not None:
            return out
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(Qn, L), scale=scale)


def _split_unless_refused(query, keys, values, scale, flag: str):
    """`_past_then_chunk`, or None where cuDNN refuses it (a RuntimeError other than running out of memory): then
    `_CUDNN[flag]` is set and the process takes the other way from now on."""
    try:
        return _past_then_chunk(query, keys, values, scale)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        _CUDNN[flag] = True
        return None


# Queries after a past (a chunk of a prompt prefilled in chunks, an extend): SDPA's lower-right causal mask runs its
# flash kernel (sm80 code on an H200), while `is_causal` over a square runs cuDNN's, 1.8x faster per query-key pair
# (Qwen3-8B, 32K x 1 in chunks of 8192: 917 ms in 108 lower-right calls against 550 ms for the whole prompt in 36
# square ones; docs/performance.md). With SPLIT_PAST the queries attend the past without a mask and
# their own chunk causally, both by cuDNN with log-sum-exps, merged (`_past_then_chunk`).
SPLIT_PAST = True
_CUDNN = {"failed": False, "gqa_failed": False}
# The split's cuDNN calls on the unexpanded keys and values (PyTorch's cuDNN attention takes fewer KV heads than query
# heads): no `[B, Hq, L, D]` copies; a refusal turns it off for the process. H200, a chunk of 8,192 over 8-123K past
# tokens: bit-equal to the split on expanded heads and 3-7% faster (a micro-benchmark's `gqa` way;
# docs/performance.md).
SPLIT_GQA = True
SPLIT_MIN_QUERIES = 128  # fewer new queries (a short extend, a step before the first block): one masked call


def _cudnn_applies(query) -> bool:
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 128
            and query.shape[2] >= SPLIT_MIN_QUERIES and not _CUDNN["failed"]
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.backends.cuda.cudnn_sdp_enabled())


def _split_gqa(query) -> bool:
    """Whether a chunk after its past hands the split its keys and values with their own (fewer) heads."""
    return SPLIT_GQA and SPLIT_PAST and _cudnn_applies(query) and not _CUDNN["gqa_failed"]


def _past_then_chunk(query, keys, values, scale):
    """`past_then_chunk_with_lse`'s attention, by cuDNN's kernels."""
    return past_then_chunk_with_lse(query, keys, values, scale)[0]


def past_then_chunk_with_lse(query, keys, values, scale, kernel=None):
    """`(out [B, H, Qn, D], lse [B, H, Qn, 1] float32)`: attention of `query` (the last Qn of L positions) over
    `keys`/`values` `[B, Hk, L, D]` (Hk = H, heads expanded, or the KV heads with `SPLIT_GQA`), over the last Qn
    positions causally and over the L - Qn past ones without a mask, each by `kernel(q, k, v, causal) -> (out, lse)`
    (None: cuDNN's), merged as one softmax over all L would weigh them (`compute/sinks.py` scales it by the lse)."""
    if kernel is None:
        def kernel(q, k, v, causal):
            return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)[:2]
    shape = (*query.shape[:3], 1)
    P = keys.shape[2] - query.shape[2]
    own, own_lse = kernel(query, keys[:, :, P:], values[:, :, P:], True)
    if P == 0:
        return own, own_lse.float().view(shape)
    past, past_lse = kernel(query, keys[:, :, :P], values[:, :, :P], False)
    lse = torch.logaddexp(past_lse.float().view(shape), own_lse.float().view(shape))
    return merge_partial(past, past_lse, own, own_lse), lse


# A prompt's first chunk starts cuDNN's kernels of the chunks after it in a thread (`warm_split_past`): on a machine
# whose driver has not yet compiled them (its JIT cache, ~/.nv/ComputeCache), the first chunk after a past paid
# ~1 s for them (H200, a new machine's first process: chunk 2 of a 32K prompt 1.32 s against 0.36 later; docs/performance.md).
# Queries of the warm-up call (0: none).
SPLIT_WARM_QUERIES = 1024
_chunks_follow = threading.local()  # `.on` while a prompt is prefilled in chunks (`chunks_follow`)
_WARM_THREADS: dict = {}  # what was warmed in this process -> its thread (`warm_split_past`)
WARM_FAILED: dict = {}  # what was warmed -> the error its thread met (`warm_split_past`; tests and benches read it)


class chunks_follow:
    """While a prompt is prefilled in chunks (`runtime/routing.py`): a first chunk's square attention starts the
    later chunks' cuDNN kernels in a thread (`warm_split_past`); on leaving, the threads it started are joined, so
    none is inside a CUDA call when a decode step is captured."""

    def __enter__(self):
        self.before = getattr(_chunks_follow, "on", False)
        _chunks_follow.on = True
        return self

    def __exit__(self, *exc):
        _chunks_follow.on = self.before
        if not self.before:
            join_warm_threads()
        return False


def join_warm_threads() -> None:
    for thread in list(_WARM_THREADS.values()):
        thread.join()


def _order(tensor: torch.Tensor) -> tuple[int, ...]:
    """`tensor`'s dimensions from outermost to innermost in memory."""
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d)))


def _laid_out(shape: list[int], order: tuple[int, ...], dtype, device) -> torch.Tensor:
    """Zeros of `shape` whose dimensions lie in memory in `order` (outermost first)."""
    laid = torch.zeros([shape[d] for d in order], dtype=dtype, device=device)
    return laid.permute([order.index(d) for d in range(len(shape))])


def warm_split_past(query: torch.Tensor, keys: torch.Tensor, scale: float) -> None:
    """`_past_then_chunk` once in a daemon thread, on its own stream, with `SPLIT_WARM_QUERIES` queries over twice as
    many keys, as the later chunks will call it: queries laid out in memory as `query` `[B, Hq, Qn, D]`, keys as
    `keys` `[B, Hkv, Qn, D]` with their own heads (`SPLIT_GQA`) or expanded to Hq (contiguous, as
    `_expand_kv_heads` makes them). The driver compiles cuDNN's two kernels there while the first chunk runs, instead
    of in the second chunk. Once a process per dtype, device, heads, head size and layouts; a failure is left to the
    real call (which falls back to expanded heads, or to the masked way)."""
    H, D, dtype, device = query.shape[1], query.shape[3], query.dtype, query.device
    grouped = keys.shape[1] != H and _split_gqa(query)
    Hk = keys.shape[1] if grouped else H
    q_order, k_order = _order(query), _order(keys) if grouped or keys.shape[1] == H else tuple(range(keys.dim()))
    what = (dtype, device, H, Hk, D, q_order, k_order)
    if what in _WARM_THREADS:
        return
    n = SPLIT_WARM_QUERIES

    def run():
        try:
            with torch.no_grad(), contextlib.ExitStack() as on:
                if device.type == "cuda":  # (this thread's current device and stream: the query's device, its own)
                    on.enter_context(torch.cuda.device(device))
                    on.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
                q = _laid_out([1, H, n, D], q_order, dtype, device)
                k, v = (_laid_out([1, Hk, 2 * n, D], k_order, dtype, device) for _ in range(2))
                _past_then_chunk(q, k, v, scale)
        except Exception as error:  # noqa: BLE001 - (a warm-up: the real call compiles, or falls back, itself)
            WARM_FAILED[what] = repr(error)

    thread = threading.Thread(target=run, name="oasis-warm-cudnn", daemon=True)
    _WARM_THREADS[what] = thread
    thread.start()


def merge_partial(first, first_lse, second, second_lse):
    """Attention over two disjoint sets of keys merged into attention over both: `first`, `second` `[B, H, Qn, D]`,
    their log-sum-exps `[B, H, Qn]` or `[B, H, Qn, 1]` (float32); in `first`'s dtype."""
    shape = (*first.shape[:3], 1)
    weight = torch.sigmoid(first_lse.view(shape) - second_lse.view(shape))  # first's share of the softmax's mass
    merged = second.to(torch.float32, copy=True)  # (a copy in float32 too: the caller's tensor stays as it was)
    return merged.lerp_(first.float(), weight).to(first.dtype)


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None, scale: float,
    pattern: torch.Tensor | None = None, causal=None, explicit=None,
) -> torch.Tensor:
    """Attention of the last Qn positions over all L.

    Args:
        query: `[B, Hq, Qn, D]`, positions L-Qn .. L-1.
        keys, values: `[B, Hkv, L, D]`.
        visible: `[B, L]` bool (False = padding), or None.
        scale: softmax scale.
        pattern: what each query sees, `[B or 1, 1 or Hq, Qn, L]` bool, or None (causal among `visible`): as
            transformers' SDPA attends it (a multimodal prompt's image tokens see each other).
        causal, explicit: the unpadded causal call `(q, k, v, scale)` and the explicit-mask one `(q, k, v, visible,
            scale)`; None: SDPA's (`compute/sinks.py` passes its own, which add learned sinks).
    Returns:
        `[B, Hq, Qn, D]`; rows of padding queries are finite but meaningless.
    """
    if pattern is not None:
        return _pattern_attention(query, keys, values, pattern, scale)
    causal = causal or _sdpa_causal  # (unpadded, causal from the bottom right)
    if visible is None:
        return causal(query, keys, values, scale)
    B, Hq, Qn, D = query.shape
    L = keys.shape[2]
    left, padded, firsts = mask_layout(visible)
    if left and not padded:  # nothing hidden (generate's all-ones mask): one batched call
        return causal(query, keys, values, scale)
    if left:
        out = query.new_zeros(query.shape[:3] + values.shape[3:])
        for b, start in enumerate(firsts):
            q_start = max(0, start - (L - Qn))
            if q_start < Qn:
                out[b : b + 1, :, q_start:] = causal(
                    query[b : b + 1, :, q_start:], keys[b : b + 1, :, start:], values[b : b + 1, :, start:], scale
                )
        return out
    return (explicit or _explicit_mask_attention)(query, keys, values, visible, scale)


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


def _pattern_attention(query, keys, values, pattern, scale):
    """`dense_causal_attention` with a 4D `pattern`: SDPA given it as transformers' SDPA attention gives it (KV heads
    repeated), in slices of queries past `_MASK_ELEMENTS` scores a head."""
    keys, values = _expand_kv_heads(query, keys, values)
    B, Qn, L = query.shape[0], query.shape[2], keys.shape[2]
    rows = max(1, min(Qn, _MASK_ELEMENTS // max(1, B * L)))
    if rows == Qn:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=pattern, scale=scale)
    out = query.new_empty(query.shape[:3] + values.shape[3:])
    for lo in range(0, Qn, rows):
        hi = min(Qn, lo + rows)
        out[:, :, lo:hi] = F.scaled_dot_product_attention(query[:, :, lo:hi], keys, values,
                                                          attn_mask=pattern[:, :, lo:hi], scale=scale)
    return out


def causal_rows(length: int, num_queries: int, lo: int, hi: int, visible: torch.Tensor | None = None,
                device=None) -> torch.Tensor:
    """Rows `lo:hi` of the causal mask from the bottom right (the `num_queries` queries are the last positions of
    `length` keys): bool `[hi - lo, length]`; with `visible` (`[B, length]` bool, False at padding) `[B, hi - lo,
    length]`, padding keys hidden — a padding query's own key too, as transformers' SDPA mask hides it: a row that
    sees nothing attends to nothing (zeros, as SDPA gives)."""
    key_pos = torch.arange(length, device=device)
    q_pos = torch.arange(length - num_queries + lo, length - num_queries + hi, device=device)
    seen = key_pos[None, :] <= q_pos[:, None]
    if visible is None:
        return seen
    return seen[None] & visible[:, None, :]


def _explicit_mask_attention(query, keys, values, visible, scale):
    B, Hq, Qn, D = query.shape
    L = keys.shape[2]
    keys, values = _expand_kv_heads(query, keys, values)
    rows = max(1, min(Qn, _MASK_ELEMENTS // max(1, B * L)))
    out = query.new_empty(query.shape[:3] + values.shape[3:])
    for lo in range(0, Qn, rows):
        hi = min(Qn, lo + rows)
        mask = causal_rows(L, Qn, lo, hi, visible, query.device)  # [B, rows, L]
        out[:, :, lo:hi] = F.scaled_dot_product_attention(
            query[:, :, lo:hi], keys, values, attn_mask=mask[:, None], scale=scale
        )
    return out
