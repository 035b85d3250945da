"""A narrow host pool (`host_dtype="fp8"` / `"int4"`) with `token_budget` >= context generates exactly what dense
attention generates over the same widened keys and values: `WidenedCache` below is transformers' DynamicCache whose
complete blocks are narrowed and widened with the package's rule after each forward (the forward itself attends its
own new tokens as the model made them, as the cache's prefill does). Greedy tokens identical, logits within fp32
tolerance, in every generate mode."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from oasis_cache.memory.representation import representation_for

from conftest import generate, left_padded, oasis_cache_for, prompt_ids, tiny_model

ATOL = 2e-4
T = 16
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


def assert_same(reference, oasis, check_logits=True):
    assert torch.equal(reference.sequences, oasis.sequences), (reference.sequences, oasis.sequences)
    if check_logits:
        for step, (a, b) in enumerate(zip(reference.logits, oasis.logits)):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4, msg=f"logits differ at step {step}")


def both(arch: str, host_dtype: str, inputs: dict, options=None, seed=0, **kw):
    """(reference, oasis) generations of `inputs` with `kw`."""
    model = tiny_model(arch)
    recent, sink = (options or {}).get("recent_tokens", 64), (options or {}).get("sink_tokens", 16)
    reference = generate(model, widened_cache(model, host_dtype, recent, sink, inputs), inputs, seed=seed, **kw)
    cache = oasis_cache_for(model, host_dtype=host_dtype, host_chunk_blocks=2, **(options or {}))
    return reference, generate(model, cache, inputs, seed=seed, **kw)


@pytest.mark.parametrize("host_dtype, arch", [("fp8", "llama"), ("int4", "qwen3"), ("int4", "mistral")])
def test_greedy_batch(host_dtype, arch):
    ref, got = both(arch, host_dtype, {"input_ids": prompt_ids(70, batch=2)}, max_new_tokens=30, do_sample=False)
    assert_same(ref, got)
    dense = generate(tiny_model(arch), None, {"input_ids": prompt_ids(70, batch=2)}, max_new_tokens=30,
                     do_sample=False)
    # (the narrow form is not the model's: its logits differ from plain dense attention's)
    assert max((a - b).abs().max() for a, b in zip(dense.logits, got.logits)) > 1e-3


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_sampling_and_left_padding(host_dtype):
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20)
    assert_same(*both("llama", host_dtype, left_padded([61, 37, 50]), seed=7, **kw))


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_prefill_in_chunks_and_lookahead(host_dtype):
    kw = dict(max_new_tokens=20, do_sample=False, prefill_chunk_size=32)
    assert_same(*both("qwen3", host_dtype, left_padded([90, 71]), **kw))
    for lookahead, exact in (("previous", True), ("previous", False)):
        assert_same(*both("llama", host_dtype, {"input_ids": prompt_ids(83)}, dict(lookahead=lookahead, exact=exact),
                          max_new_tokens=20, do_sample=False))


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_the_sink_and_newest_blocks_are_attended_as_made(host_dtype):
    """Decode steps attend the sink block and the newest `recent_tokens` complete blocks as the model made them,
    sparse or not: equal to the reference that holds them so, unequal to one that widens every complete block."""
    inputs = {"input_ids": prompt_ids(90, batch=2)}
    kw = dict(max_new_tokens=40, do_sample=False)
    ref, got = both("llama", host_dtype, inputs, dict(recent_tokens=32), **kw)
    assert_same(ref, got)
    all_widened = generate(tiny_model("llama"), widened_cache(tiny_model("llama"), host_dtype, 0, 0), inputs, **kw)
    assert max((a - b).abs().max() for a, b in zip(all_widened.logits, got.logits)) > 1e-4
    model = tiny_model("llama")  # sparse (a budget below the context): the slots of the newest blocks hold them as made
    cache = oasis_cache_for(model, host_dtype=host_dtype, token_budget=96, recent_tokens=32)
    sequences = generate(model, cache, inputs, **kw).sequences
    with torch.no_grad():
        made = model(input_ids=sequences, past_key_values=DynamicCache(config=model.config)).past_key_values
    layer = cache.layers[0]
    NB, slots = layer.pool.num_blocks, layer.working_set.slots  # [2, B, H, S, T, D]
    assert NB * T > 96
    for block in (0, NB - 2, NB - 1):  # (sink_tokens=16: one block; recent_tokens=32: two)
        held = layer.slot_map.block_slot[..., block]  # [B, H]
        assert (held >= 0).all()
        index = held[None, :, :, None, None, None].expand(2, -1, -1, 1, T, slots.shape[-1])
        got_block = slots.gather(3, index)[:, :, :, 0]  # [2, B, H, T, D]
        keys = made.layers[0].keys[:, :, block * T : (block + 1) * T]
        torch.testing.assert_close(got_block[0], keys, atol=1e-5, rtol=1e-5)
        widened = layer.pool.representation.widen(layer.pool.chunks[block // layer.pool.chunk_blocks][
            block % layer.pool.chunk_blocks])  # [2, B, H, T, D]
        assert (widened[0] - keys).abs().max() > 1e-3


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_beam_search_and_prompt_lookup(host_dtype):
    ref, got = both("llama", host_dtype, left_padded([45, 33]), max_new_tokens=12, do_sample=False, num_beams=3,
                    num_return_sequences=2)
    assert_same(ref, got, check_logits=False)
    torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=1e-4)
    base = prompt_ids(12)[0]
    inputs = {"input_ids": torch.cat([base, base, base, base[:5]])[None]}  # lookup proposes tokens: crops
    assert_same(*both("mistral", host_dtype, inputs, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4),
                check_logits=False)


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_fork_and_conversions_keep_the_narrow_form(host_dtype):
    """A fork decodes as its origin; `to_dynamic_cache` gives the widened keys and values (the reference's);
    `from_dynamic_cache` of those narrows them again and decodes as the reference."""
    from oasis_cache import OasisCache

    model = tiny_model("llama")
    ids = prompt_ids(75)
    kw = dict(max_new_tokens=16, do_sample=False)
    reference_cache = widened_cache(model, host_dtype)
    cache = oasis_cache_for(model, host_dtype=host_dtype)
    with torch.no_grad():  # both prefilled but the last token (whose forward then attends the widened blocks)
        model(input_ids=ids[:, :-1], past_key_values=reference_cache, use_cache=True)
        model(input_ids=ids[:, :-1], **cache.generate_kwargs())
    ref = generate(model, reference_cache, {"input_ids": ids}, **kw)
    fork = cache.fork(token_budget=2048)
    assert_same(ref, generate(model, cache, {"input_ids": ids}, **kw))
    assert_same(ref, generate(model, fork, {"input_ids": ids}, **kw))
    dynamic = fork.to_dynamic_cache()
    for idx, (mine, theirs) in enumerate(zip(dynamic.layers, reference_cache.layers)):
        assert mine.keys.shape == theirs.keys.shape
        if idx == 0:  # (the first layer's keys and values follow from the tokens alone: bit for bit)
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    rebuilt = OasisCache.from_dynamic_cache(model, dynamic, token_budget=1024, host_dtype=host_dtype)
    assert rebuilt.layers[0].pool.chunks[0].dtype == torch.uint8
    stats = rebuilt.stats()
    assert stats["host_dtype"] == host_dtype
    pool = rebuilt.layers[0].pool
    per_layer = 2 * pool.num_kv_heads * pool.representation.unit_nbytes // T  # (keys and values, scales included)
    assert stats["host_bytes_per_token"] == len(rebuilt.layers) * per_layer
    assert f"as {host_dtype}" in str(rebuilt)
