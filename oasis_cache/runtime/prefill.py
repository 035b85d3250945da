"""Chunked prefill, arranged by the cache: a long prompt's forward runs as several forwards of at most
`OasisConfig.prefill_chunk_tokens` tokens (over the batch), so that its activations (the MLP's intermediate states,
the logits) stay bounded whatever the prompt's length — a small card runs a long prompt without `prefill_chunk_size`.

The model's forward is routed through the cache (`compute/routing.CapturedForward`); a call is split only when
the split cannot change what the caller gets back: it writes the cache (`use_cache` not False), asks for the logits
of its last `logits_to_keep` positions only (`generate` asks for 1), and carries nothing else that runs along the
sequence (hidden states, attentions, token types, ...). Each chunk sees the mask, positions and cache positions of
its tokens, exactly as `generate(..., prefill_chunk_size=C)` slices them; the last chunk's output is returned.
"""

from __future__ import annotations

import torch

# Arguments a split forward accepts (any other set to a value runs the forward whole).
_SPLITTABLE = {"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position", "past_key_values",
               "cache", "use_cache", "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states"}


def prefill_chunks(kwargs: dict, chunk_tokens: int, block_size: int, shortest: int = 0) -> list[tuple[int, int]] | None:
    """`[(start, end), ...]` over the call's new tokens when it should run in chunks, else None. A last chunk of at
    most `shortest` tokens joins the one before (it would decode sparsely: a prefill's tail stays dense, and its mask
    is the padding record decode steps read, `control.Padding`)."""
    if not chunk_tokens:
        return None
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None or tokens.dim() < 2:
        return None
    B, N = tokens.shape[:2]
    if B * N <= chunk_tokens or kwargs.get("use_cache") is False:
        return None
    if any(value is not None and value is not False and key not in _SPLITTABLE for key, value in kwargs.items()):
        return None
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        return None  # (a 4D mask would need cutting along both of its last dims)
    keep = kwargs.get("logits_to_keep")
    spans = spans_from(0, N, max(least_span(block_size, shortest), chunk_tokens // B // block_size * block_size),
                       shortest)
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= spans[-1][1] - spans[-1][0]:
        return None  # all logits (0 or None), or indices: the whole forward
    return spans


def least_span(block_size: int, shortest: int) -> int:
    """The fewest tokens a chunk holds: whole blocks, more than `shortest` (`max_decode_tokens`). A chunk of at most
    that many would decode sparsely instead of running as a prefill's chunk: it would not write the prompt's keys
    and values kept on the device (`OasisLayer.resident_kv`), and the next chunk read those positions unwritten
    (a batch of 3 in chunks of 64 tokens: 16 a sequence, garbage logits)."""
    return (shortest // block_size + 1) * block_size


def spans_from(start: int, end: int, length: int, shortest: int = 0) -> list[tuple[int, int]]:
    """`[(start, start + length), ...]` up to `end`; a last span of at most `shortest` tokens joins the one before."""
    spans = [(at, min(end, at + length)) for at in range(start, end, length)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] <= shortest:
        spans[-2:] = [(spans[-2][0], end)]
    return spans


def run_chunks(forward, kwargs: dict, spans: list[tuple[int, int]], past: int, progress: bool = False,
               before_chunk=None):
    """Call `forward(**chunk_kwargs)` per span (`past`: tokens the cache held before the call); returns the last
    output. The mask `[B, past + N]` is cut at each chunk's end; positions `[B, N]` and cache positions `[N]` are
    the chunk's. `progress`: a tqdm bar over the prompt's tokens (from the first span's start). `before_chunk`:
    called with each span before its forward."""
    out = None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=spans[-1][1], initial=spans[0][0], unit="tok", desc="prefill")
    for i, (start, end) in enumerate(spans):
        chunk = dict(kwargs)
        for key in ("input_ids", "inputs_embeds"):
            if isinstance(kwargs.get(key), torch.Tensor):
                chunk[key] = kwargs[key][:, start:end]
        if isinstance(kwargs.get("position_ids"), torch.Tensor):  # `[B, N]`, or `[3, B, N]` (multimodal rotary)
            chunk["position_ids"] = kwargs["position_ids"][..., start:end]
        if isinstance(kwargs.get("cache_position"), torch.Tensor):
            chunk["cache_position"] = kwargs["cache_position"][start:end]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            chunk["attention_mask"] = mask[:, : past + end]
        if i < len(spans) - 1:
            chunk["logits_to_keep"] = 1  # only the last chunk's logits are returned
        out = None  # (the previous chunk's activations and logits go before the next chunk runs)
        if before_chunk is not None:
            before_chunk(start, end)
        out = forward(**chunk)
        if bar is not None:
            bar.update(end - start)
    if bar is not None:
        bar.close()
    return out


# A chunk that runs out of device memory is undone and the rest of the prompt runs again from its start, in chunks of
# half the tokens, up to this many times in one prefill (`runtime/routing.py`, `ChunkMarks`): a prefill at the edge of
# a card (the allocator's segments split by earlier chunks: Qwen3-8B, 32K x 8 under a 24 GiB cap)
# goes on instead of failing. 0: the first out-of-memory error ends the prefill.
SHRINK_RETRIES = 3


class ChunkMarks:
    """What a chunked prefill's chunk changes in `cache` beyond its tokens' keys and values, marked before each chunk
    (`run_chunks`' `before_chunk`), so that a chunk that ran out of device memory can be undone (`undo`): every
    full-attention layer cropped back to the chunk's start, the summaries' channel weights as they were, the
    counters as they were, a draft head's ride-along started over if the chunk reached it."""

    def __init__(self, cache, past: int):
        from ..layer import OasisLayer

        self.cache, self.past = cache, past
        self.layers = [layer for layer in cache.layers if isinstance(layer, OasisLayer)]
        self.span = None

    def __call__(self, start: int, end: int) -> None:
        self.span = (start, end)
        self.weights = [layer.summaries.channel_weight if layer.is_initialized else None for layer in self.layers]
        counters = self.cache.counters
        self.counted = (counters.dense_forwards, counters.prefill_tokens)

    def undoable(self) -> bool:
        """Whether the chunk marked last can be undone: not where a layer stopped inside its own bookkeeping (its
        tokens neither those before the chunk nor those after it, or blocks in its host pool without summaries)."""
        if self.span is None:
            return False
        before, after = self.past + self.span[0], self.past + self.span[1]
        return not any(layer.is_initialized and (layer.get_seq_length() not in (before, after)
                                                 or layer.summaries.num_blocks != layer.pool.num_blocks)
                       for layer in self.layers)

    def undo(self) -> None:
        """Undo the chunk marked last (`undoable`)."""
        cache, (start, end) = self.cache, self.span
        keep = self.past + start
        reached = all(layer.is_initialized and layer.get_seq_length() >= self.past + end for layer in self.layers)
        for layer, weight in zip(self.layers, self.weights):
            if layer.is_initialized:
                held = layer.get_seq_length()
                if held > keep:
                    layer.crop(keep - held)
                layer.summaries.channel_weight = weight
                layer.resident_kv = None  # (the rest reads its past from host memory: `prefill_resident` False)
        cache.context.prefill_resident = False
        cache.counters.dense_forwards, cache.counters.prefill_tokens = self.counted
        if reached and cache.ride_along is not None:  # (the head may have read the chunk: it starts over)
            cache.ride_along.reset()
