"""A narrow host pool (`host_dtype="fp8"` / `"int4"`) with `token_budget` >= context generates exactly what dense
attention generates over the same widened keys and values: the reference (`eval/widened.py`) is transformers'
DynamicCache whose complete blocks are narrowed and widened with the package's rule after each forward. Greedy tokens
identical, logits within fp32 tolerance, in every generate mode."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from eval.widened import T, widened_cache

from conftest import generate, left_padded, oasis_cache_for, prompt_ids, tiny_model

ATOL = 2e-4


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


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_a_layer_whose_scores_narrowing_would_move_far_keeps_the_models_dtype(host_dtype):
    """Layer 0's queries made 200 times as large (as Qwen2's first layer has them: scores in the hundreds): its keys
    narrowed would move its attention scores by nats, and tokens whose scores carry such noise take attention from
    those attended as made. Measured on the prompt's own queries at its first blocks, that layer's pool keeps the
    model's dtype (said in `stats()` and `print`); the other layer stays narrow; decoding goes on, and at a budget
    >= context it equals dense attention over layer 1's widened keys and values and layer 0's own."""
    from oasis_cache.memory.representation import SCORE_NOISE_LIMIT

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(200.0)
    inputs = {"input_ids": prompt_ids(70, batch=2)}
    cache = oasis_cache_for(model, host_dtype=host_dtype, host_chunk_blocks=2)
    got = generate(model, cache, inputs, max_new_tokens=20, do_sample=False)
    first, second = cache.layers[:2]
    assert first.pool.host_dtype is None and second.pool.host_dtype == host_dtype
    assert first.score_noise > SCORE_NOISE_LIMIT >= second.score_noise
    assert cache.stats()["layers_in_model_dtype"] == [0] and "layers [0] in the model's dtype" in str(cache)
    reference = widened_cache(model, host_dtype, inputs=inputs)
    reference.layers[0] = DynamicCache(config=model.config).layers[0]  # (layer 0 as made)
    assert_same(generate(model, reference, inputs, max_new_tokens=20, do_sample=False), got)


def test_a_pool_whose_first_block_completes_in_a_decode_step_keeps_its_form_unmeasured():
    """A prompt shorter than a block: the pool's first block completes in a one-token decode step, where nothing is
    measured (it would read a number back to the host in a step a CUDA graph may replay): the pool stays narrow."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(200.0)
    cache = oasis_cache_for(model, host_dtype="int4", host_chunk_blocks=2)
    generate(model, cache, {"input_ids": prompt_ids(T - 4)}, max_new_tokens=T, do_sample=False)
    assert cache.layers[0].pool.num_blocks == 1 and cache.layers[0].pool.host_dtype == "int4"
    assert getattr(cache.layers[0], "score_noise", None) is None and cache.stats()["layers_in_model_dtype"] == []
