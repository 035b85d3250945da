"""The reference of a narrow host pool (`OasisCache(host_dtype=...)` at `token_budget` >= context): transformers'
DynamicCache whose complete blocks are narrowed and widened with the package's rule after each forward (the forward
itself attends its own new tokens as the model made them, as the cache's prefill does), and whose decode steps attend
the blocks the cache holds in working-set slots as made (each sequence's sink blocks, the newest complete ones).
`tests/integration/test_host_dtype.py` compares the cache with it; `eval/wide_ends.py` measures what narrowing costs
with it."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from oasis_cache.memory.representation import representation_for

T = 16  # block_size (the default)
DECODE = 16  # max_decode_tokens (the default)


class WidenedLayer(DynamicLayer):
    """A DynamicLayer whose complete blocks of T tokens hold `widen(narrow(kv))` once the forward that completed them
    has attended them — but a decode forward (at most `DECODE` new tokens, after some complete block) attends the
    blocks it holds as the model made them: each sequence's sink blocks (those of its first `sink` real tokens,
    `first` its first real token, one per prompt: a batch `k` times as large repeats each k times, as `generate`
    expands one), and the newest `recent` of each forward's completed blocks until later completions push them out
    of the newest `recent` (the cache keeps those in working-set slots)."""

    def __init__(self, host_dtype: str, recent: int = 4, sink: int = 16, first: torch.Tensor | None = None):
        super().__init__()
        self.recent = recent  # blocks (`recent_tokens` // T; 64 tokens by default)
        self.sink, self.first = sink, first
        self.host_dtype, self.narrowed = host_dtype, 0  # tokens [0, narrowed) hold widened values
        self.rep = None  # (one per layer, as a host pool's: int4's key center is fixed by its first blocks)
        self.made, self.held = None, set()  # [2, B, H, N, D] as the model made them; newest blocks attended so

    def sink_blocks(self, batch_size: int) -> list[range]:
        first = torch.zeros(batch_size, dtype=torch.long) if self.first is None else self.first
        if len(first) != batch_size:
            first = self.first = first.repeat_interleave(batch_size // len(first))
        return [range(f // T, (f + self.sink - 1) // T + 1) if self.sink else range(0) for f in first.tolist()]

    def update(self, key_states, value_states, *args, **kwargs):
        before = self.keys.shape[2] // T if self.is_initialized else 0
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        seen = keys.clone(), values.clone()  # (this forward attends what the model made)
        if before and key_states.shape[2] <= DECODE:
            held = [(slice(None), b) for b in self.held] + [
                (row, b) for row, blocks in enumerate(self.sink_blocks(keys.shape[0])) for b in blocks
                if (b + 1) * T <= self.narrowed]
            for row, b in held:
                seen[0][row, :, b * T : (b + 1) * T] = self.made[0][row, :, b * T : (b + 1) * T]
                seen[1][row, :, b * T : (b + 1) * T] = self.made[1][row, :, b * T : (b + 1) * T]
        end = keys.shape[2] // T * T
        if end > self.narrowed:
            if self.rep is None:
                self.rep = representation_for(self.host_dtype, keys.dtype, T, keys.shape[-1])
            both = torch.stack([self.keys, self.values])[:, :, :, self.narrowed : end]  # [2, B, H, n, D]
            made = both.clone() if self.made is None else torch.cat([self.made[:, :, :, : self.narrowed], both], 3)
            blocks = both.unflatten(3, (-1, T)).permute(3, 0, 1, 2, 4, 5)  # [nb, 2, B, H, T, D], as offloaded
            widened = self.rep.widen(self.rep.narrow(blocks)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
            self.keys[:, :, self.narrowed : end], self.values[:, :, self.narrowed : end] = widened
            first, count = self.narrowed // T, end // T
            self.held = {b for b in self.held if b >= count - self.recent} | set(range(max(first, count - self.recent),
                                                                                  count))
            self.made, self.narrowed = made, end
        return seen

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        self.narrowed = min(self.narrowed, self.keys.shape[2] // T * T)
        self.held = {b for b in self.held if b < self.narrowed // T}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.made is not None:
            self.made = self.made.index_select(1, beam_idx.to(self.made.device))
        if self.first is not None and len(self.first) == len(beam_idx):
            self.first = self.first.index_select(0, beam_idx.cpu())


def widened_cache(model, host_dtype: str, recent_tokens: int = 64, sink_tokens: int = 16,
                  inputs: dict | None = None) -> DynamicCache:
    """The reference for a cache with these `recent_tokens` / `sink_tokens`; `inputs`: the prompt's (its padding)."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    mask = (inputs or {}).get("attention_mask")
    first = None if mask is None else mask.int().argmax(dim=1).cpu()
    cache.layers = [WidenedLayer(host_dtype, recent_tokens // T, sink_tokens, first) for _ in cache.layers]
    return cache
