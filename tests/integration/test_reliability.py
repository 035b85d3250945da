"""The edges of the contract and the misuse a demanding user tries: budgets at and around the context,
the attention implementation switched behind a filled cache, memory that must follow the context (not the budget),
copies and pickling, host memory refused up front, many caches in one process, and the statistics' step counts."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

from conftest import dense_cache, generate, left_padded, prompt_ids, random_head, tiny_model
from oasis_cache import OasisCache
from oasis_cache.config import OasisConfig
from oasis_cache.layer import OasisLayer
from oasis_cache.memory import host_memory
from oasis_cache.runtime.build import cache_kwargs

ATOL = 2e-4
PROMPT, NEW = 45, 14
CONTEXT = PROMPT + NEW - 1  # what the last step's query sees (the last new token is not attended)


def same_as_dense(dense, oasis):
    if not torch.equal(dense.sequences, oasis.sequences):
        return False
    return all(torch.allclose(b, a, atol=ATOL, rtol=1e-4) for a, b in zip(dense.logits, oasis.logits))


def attended_within_budget(model, cache, inputs, budget):
    """Greedy decode through `cache`, recording every step's selection: each layer's attended tokens (selected blocks
    and the recent ones, the new token included) never exceed the budget."""
    cache.record_selection = True
    worst = 0
    layers = [layer for layer in cache.layers if isinstance(layer, OasisLayer)]
    hooks = []

    def check(module, args, kwargs, output):
        nonlocal worst
        for layer in layers:
            selection = getattr(layer, "last_selection", None)
            if selection is not None:
                per_head = selection.sum(-1).max().item() * cache.config.block_size + layer.last_recent_tokens
                worst = max(worst, per_head)
                layer.last_selection = None
    hooks.append(model.model.register_forward_hook(check, with_kwargs=True))
    try:
        generate(model, cache, inputs, max_new_tokens=NEW, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_budget_sweep_around_the_context(arch, block_size):
    """Every budget from context - 1 to context + 2 * block_size: from the context on, exactly dense (greedy tokens,
    logits); below it, never more tokens attended than the budget."""
    model = tiny_model(arch)
    inputs = {"input_ids": prompt_ids(PROMPT)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=NEW, do_sample=False)
    small = dict(block_size=block_size, sink_tokens=block_size, recent_tokens=block_size)
    for budget in range(CONTEXT - 1, CONTEXT + 2 * block_size + 1):
        oasis = generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=budget, **small))), inputs,
                         max_new_tokens=NEW,
                         do_sample=False)
        if budget >= CONTEXT:
            assert same_as_dense(dense, oasis), f"budget {budget} >= context {CONTEXT}, block_size {block_size}"
    below = OasisCache(model, **cache_kwargs(dict(token_budget=CONTEXT - 1, **small)))
    assert attended_within_budget(model, below, inputs, CONTEXT - 1) <= CONTEXT - 1


@pytest.mark.parametrize("options", [
    dict(lookahead="previous"),
    dict(lookahead="previous", exact=True),
    dict(lookahead="none", num_slots=40),
])
def test_budget_at_the_context_in_every_lookahead(options):
    """The boundary budgets (the context, and up to the next block multiple) with predictions that decide or only
    prefetch, and with more slots than the budget selects."""
    model = tiny_model("llama")
    inputs = {"input_ids": prompt_ids(PROMPT)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=NEW, do_sample=False)
    for budget in (CONTEXT, CONTEXT + 1, -(-CONTEXT // 16) * 16 - 1):
        oasis = generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=budget, sink_tokens=16,
                                                                      recent_tokens=16, **options))),
                         inputs, max_new_tokens=NEW, do_sample=False)
        assert same_as_dense(dense, oasis), (budget, options)


def test_budget_at_the_context_with_eagle3_sampling_and_padding():
    model = tiny_model("llama", num_hidden_layers=4)
    padded = left_padded([PROMPT, 30, 38])
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20)
    dense = generate(model, dense_cache(model), padded, seed=5, **kw)
    for budget in (CONTEXT, CONTEXT + 3):
        cache = OasisCache(model, token_budget=budget, lookahead="eagle3",
                           draft=random_head(model), advanced=dict(sink_tokens=16, recent_tokens=16))
        assert same_as_dense(dense, generate(model, cache, padded, seed=5, **kw)), budget


@pytest.mark.parametrize("options", [dict(lookahead="none"), dict(lookahead="previous"), dict(lookahead="eagle3"),
                                     dict(lookahead="eagle3", exact=True)])
def test_budget_at_the_final_length_in_speculative_modes(options):
    """Assisted and prompt-lookup decoding verify candidates in multi-token forwards, and transformers' prompt lookup
    lets the cache hold one token past the final length for a forward: with the budget at the final length
    (prompt + new tokens), those forwards still attend every token (the first new token's context fits), so the
    tokens are dense's — they differed at the boundary before."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    if options["lookahead"] == "eagle3":
        options = dict(options, draft=random_head(model))
    prompt = prompt_ids(120, seed=2)
    assistant = tiny_model("qwen3", num_hidden_layers=2, seed=3)
    for kw in (dict(prompt_lookup_num_tokens=4), dict(assistant_model=assistant)):
        kw = dict(kw, max_new_tokens=20, do_sample=False)
        dense = model.generate(input_ids=prompt, past_key_values=dense_cache(model), **kw)
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=prompt.shape[1] + 20, **options)))
        assert torch.equal(model.generate(input_ids=prompt, past_key_values=cache, **kw), dense), (kw, options)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_attention_switched_behind_a_filled_cache_is_refused_before_writing(implementation, hybrid):
    extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=48, use_sliding_window=True) \
        if hybrid else {}
    model = tiny_model("qwen3", **extra)
    ids = prompt_ids(60)
    dense = generate(model, dense_cache(model), {"input_ids": ids}, max_new_tokens=12, do_sample=False)
    cache = OasisCache(model, token_budget=1024)
    first = generate(model, cache, {"input_ids": ids}, max_new_tokens=6, do_sample=False).sequences
    lengths = [layer.get_seq_length() for layer in cache.layers]
    model.set_attn_implementation(implementation)
    with pytest.raises(RuntimeError, match=r"Nothing of this forward was written.*set_attn_implementation\('oasis'\)"):
        generate(model, cache, {"input_ids": first}, max_new_tokens=6, do_sample=False)
    assert [layer.get_seq_length() for layer in cache.layers] == lengths  # untouched
    model.set_attn_implementation("oasis")  # the fix the message names: the same cache goes on, exactly
    again = generate(model, cache, {"input_ids": first}, max_new_tokens=6, do_sample=False)
    assert torch.equal(again.sequences, dense.sequences)


@pytest.mark.parametrize("lookahead", ["none", "previous", "eagle3"])
def test_forwards_with_and_without_autograd_mix_on_one_cache(lookahead):
    """A user's `model(...)` without `torch.no_grad()` between `generate` calls (scoring a continuation): the
    cache's state records no autograd either way, so the forward neither fails on generate's views (before: "a view
    was created in no_grad mode") nor changes what the next `generate` makes."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt_ids(60)
    draft = dict(draft=random_head(model)) if lookahead == "eagle3" else {}
    options = dict(token_budget=1024, lookahead=lookahead, **draft)
    expected = OasisCache(model, **cache_kwargs(options))
    first = generate(model, expected, {"input_ids": ids}, max_new_tokens=6, do_sample=False).sequences
    cache = OasisCache(model, **cache_kwargs(options))
    assert torch.equal(generate(model, cache, {"input_ids": ids}, max_new_tokens=6, do_sample=False).sequences, first)
    more = prompt_ids(8, seed=5)
    with torch.no_grad():
        reference = model(input_ids=more, **expected.generate_kwargs()).logits
    scored = model(input_ids=more, **cache.generate_kwargs()).logits  # autograd on (the default)
    assert scored.requires_grad
    torch.testing.assert_close(scored.detach(), reference, atol=ATOL, rtol=1e-4)
    after = torch.cat([first, more], dim=1)
    assert torch.equal(generate(model, cache, {"input_ids": after}, max_new_tokens=6, do_sample=False).sequences,
                       generate(model, expected, {"input_ids": after}, max_new_tokens=6, do_sample=False).sequences)


def test_a_refused_attention_call_takes_its_layers_new_tokens_back():
    """A forward the oasis attention refuses at its first full-attention layer (an additive 4D mask here) leaves the
    filled cache as it was: that layer's new tokens are taken back, and the same cache goes on exactly."""
    model = tiny_model("llama")
    ids = prompt_ids(60)
    dense = generate(model, dense_cache(model), {"input_ids": ids}, max_new_tokens=12, do_sample=False)
    cache = OasisCache(model, token_budget=1024)
    first = generate(model, cache, {"input_ids": ids}, max_new_tokens=6, do_sample=False).sequences
    lengths = [layer.get_seq_length() for layer in cache.layers]
    more = first[:, -1:]
    custom = torch.zeros((1, 1, 1, first.shape[1]))  # an additive 4D mask (bool ones are served: test_multimodal)
    with pytest.raises(NotImplementedError, match="4D float32 attention mask"), torch.no_grad():
        model(input_ids=more, attention_mask=custom, **cache.generate_kwargs())
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    again = generate(model, cache, {"input_ids": first}, max_new_tokens=6, do_sample=False)
    assert torch.equal(again.sequences, dense.sequences)


def test_device_memory_follows_the_context_not_the_budget():
    """A budget far above the context allocates what the context fills: the same bytes as a budget just above it."""
    model = tiny_model("llama")
    inputs = {"input_ids": prompt_ids(110)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=20, do_sample=False)
    held = {}
    for budget in (10**8, 10**6, 512):
        cache = OasisCache(model, token_budget=budget)
        assert same_as_dense(dense, generate(model, cache, inputs, max_new_tokens=20, do_sample=False))
        held[budget] = sum(cache.device_nbytes().values())
    assert held[10**8] == held[10**6] == held[512] < 256 * 1024  # (before: 520 MB at 10**6)


def test_slots_grow_with_the_context_and_keep_their_blocks():
    """Slots are added as blocks complete (decode included), up to what the budget selects; the blocks already
    resident stay where they are and the result stays exact."""
    model = tiny_model("llama")
    inputs = {"input_ids": prompt_ids(20)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=300, do_sample=False)
    cache = OasisCache(model, token_budget=512, lookahead="previous", exact=True, advanced=dict(sink_tokens=16,
                                                                                                recent_tokens=16))
    layer = cache.layers[0]
    oasis = generate(model, cache, inputs, max_new_tokens=300, do_sample=False)
    assert same_as_dense(dense, oasis)
    assert 16 < layer.working_set.num_slots <= cache.config.slots
    assert layer.slot_map.num_slots == layer.working_set.num_slots


def test_deepcopy_is_an_independent_cache():
    model = tiny_model("llama")
    ids = prompt_ids(70)
    dense = generate(model, dense_cache(model), {"input_ids": ids}, max_new_tokens=16, do_sample=False)
    cache = OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16, recent_tokens=16))
    first = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    twin = copy.deepcopy(cache)
    assert twin.get_seq_length() == cache.get_seq_length() and twin.layers[0]._cache == twin
    kw = dict(max_new_tokens=8, do_sample=False)
    from_twin = generate(model, twin, {"input_ids": first}, **kw)
    from_original = generate(model, cache, {"input_ids": first}, **kw)  # untouched by the twin's steps
    assert torch.equal(from_twin.sequences, from_original.sequences)
    for a, b in zip(from_twin.logits, from_original.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    exact = OasisCache(model, token_budget=1024)
    first = model.generate(input_ids=ids, past_key_values=exact, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(model, copy.deepcopy(exact), {"input_ids": first}, **kw).sequences, dense.sequences)


def test_deepcopy_with_eagle3_keeps_its_own_drafts():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt_ids(70)
    cache = OasisCache(model, token_budget=64, lookahead="eagle3",
                       draft=random_head(model), advanced=dict(sink_tokens=16, recent_tokens=16))
    first = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    hooks = len(model.model._forward_hooks)
    twin = copy.deepcopy(cache)
    assert len(model.model._forward_hooks) == hooks + 1 and twin.ride_along is not cache.ride_along
    kw = dict(max_new_tokens=8, do_sample=False)
    a = generate(model, twin, {"input_ids": first}, **kw)
    b = generate(model, cache, {"input_ids": first}, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert twin.stats()["draft_accuracy"] == cache.stats()["draft_accuracy"]
    del twin, a  # (generate's output holds its cache)
    assert len(model.model._forward_hooks) == hooks  # the copy's hooks left with it


def test_fork_shares_complete_blocks_and_neither_cache_sees_the_other():
    """`cache.fork()`: the host pools' chunks full of complete blocks are the same memory in both caches, the chunk
    being filled is the fork's own; each decodes what a deep copy decodes (bitwise), and a crop of the fork into the
    shared blocks copies them first: the original still decodes as before."""
    model = tiny_model("llama")
    ids = prompt_ids(150)
    options = dict(token_budget=64, sink_tokens=16, recent_tokens=16, host_chunk_blocks=2)
    cache = OasisCache(model, **cache_kwargs(options))
    first = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    twin, fork = copy.deepcopy(cache), cache.fork()
    for layer, forked in zip(cache.layers, fork.layers):
        pool, shared = layer.pool, forked.pool
        full = pool.num_blocks // pool.chunk_blocks  # 9 blocks: chunks 0-3 full, chunk 4 half
        assert full == 4 and pool.shared == shared.shared == set(range(full))
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(pool.chunks[:full], shared.chunks[:full]))
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(pool.chunks[full:], shared.chunks[full:]))
    kw = dict(max_new_tokens=40, do_sample=False)
    from_fork, from_twin = generate(model, fork, {"input_ids": first}, **kw), generate(model, twin, {"input_ids": first}, **kw)
    assert torch.equal(from_fork.sequences, from_twin.sequences)
    for a, b in zip(from_fork.logits, from_twin.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    fork.crop(60 - fork.get_seq_length())  # into the shared chunks: the fork copies what it will write
    assert fork.layers[0].pool.shared == set(range(60 // 16 // 2))
    generate(model, fork, {"input_ids": first[:, :60]}, max_new_tokens=40, do_sample=False)  # rewrites blocks 3-5
    from_original = generate(model, cache, {"input_ids": first}, **kw)
    assert torch.equal(from_original.sequences, from_twin.sequences)
    for a, b in zip(from_original.logits, from_twin.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def prefilled_but_the_last_chunk(model, cache, inputs):
    """`cache` after `generate` ran the prompt `inputs` but the last chunk of the chunked prefill its own
    `generate` on the whole prompt would run (the evaluation's shared prefill, `eval/report.py`)."""
    from oasis_cache.runtime.prefill import prefill_chunks

    cfg = cache.config
    split = prefill_chunks(dict(inputs, logits_to_keep=1), cfg.prefill_chunk_tokens, cfg.block_size,
                           cfg.max_decode_tokens)[-1][0]
    model.generate(**{k: v[:, :split] for k, v in inputs.items()}, past_key_values=cache, max_new_tokens=1,
                   do_sample=False, pad_token_id=0)
    return cache


@pytest.mark.parametrize("mode", ["previous", "eagle3-exact"])
def test_one_prefill_forked_to_larger_budgets_decodes_as_those_budgets_do(mode, one_thread):
    """The evaluation's shared prefill: the prompt but its last chunk prefilled once with the smallest budget, then
    per budget `fork(token_budget=b)` and `generate` on the whole prompt: the tokens a cache made with budget b
    generates (a left-padded batch, chunked prefill); a budget below the cache's is refused, naming the way."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    lookahead, _, exact = mode.partition("-")
    options = dict(lookahead=lookahead, exact=exact == "exact", prefill_chunk_tokens=512, host_chunk_blocks=4,
                   draft=random_head(model) if lookahead == "eagle3" else None)
    inputs = left_padded([700, 640])
    kw = dict(max_new_tokens=20, do_sample=False)
    base = prefilled_but_the_last_chunk(model, OasisCache(model, **cache_kwargs(dict(token_budget=96, **options))),
                                        inputs)
    assert base.layers[0].pool.shared == set()
    for budget in (96, 160, 256):
        direct = generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=budget, **options))), inputs, **kw)
        forked = generate(model, base.fork(token_budget=budget), inputs, **kw)
        assert torch.equal(forked.sequences, direct.sequences), budget
        for a, b in zip(forked.logits, direct.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # (blocks may sit in other slots)
    assert base.layers[0].pool.shared  # (the pools shared their full chunks)
    with pytest.raises(ValueError, match=r"below this cache's budget \(96\).*token_budget=64"):
        base.fork(token_budget=64)


def test_one_eagle3_prefill_forks_to_every_mode_and_budget(one_thread):
    """One prefill (but its last chunk) through an eagle3 + exact cache serves every mode: forks with
    lookahead none / previous (the head dropped, its hooks gone), eagle3 with or without exact, at larger budgets,
    each generating the tokens a cache made so generates; eagle3 from a cache without a head is refused."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    head = random_head(model)
    inputs = left_padded([700, 640])
    kw = dict(max_new_tokens=20, do_sample=False)
    common = dict(prefill_chunk_tokens=512, host_chunk_blocks=4)
    base = prefilled_but_the_last_chunk(
        model, OasisCache(model, **cache_kwargs(dict(token_budget=96, lookahead="eagle3", exact=True, draft=head,
                                                     **common))), inputs)
    hooks = len(model.model._forward_hooks)
    for lookahead, exact in [("none", False), ("previous", False), ("previous", True), ("eagle3", False)]:
        for budget in (96, 200):
            extra = dict(draft=head) if lookahead == "eagle3" else {}
            direct = generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=budget, lookahead=lookahead,
                                                                           exact=exact,
                                                **extra, **common))), inputs, **kw)
            fork = base.fork(token_budget=budget, lookahead=lookahead, exact=exact)
            assert (fork.ride_along is None) == (lookahead != "eagle3")
            forked = generate(model, fork, inputs, **kw)
            assert torch.equal(forked.sequences, direct.sequences), (lookahead, exact, budget)
            del fork, forked, direct
            gc.collect()
    assert len(model.model._forward_hooks) == hooks  # (the forks' hooks left with them)
    plain = OasisCache(model, **cache_kwargs(dict(token_budget=96, lookahead="previous", **common)))
    with pytest.raises(ValueError, match="needs a cache with a draft head"):
        plain.fork(lookahead="eagle3")


def test_pickle_names_the_way_out_and_the_dynamic_round_trip_is_exact():
    model = tiny_model("llama")
    ids = prompt_ids(70)
    dense = generate(model, dense_cache(model), {"input_ids": ids}, max_new_tokens=16, do_sample=False)
    cache = OasisCache(model, token_budget=1024, advanced=dict(host_chunk_blocks=2))
    first = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with pytest.raises(TypeError, match=r"deepcopy.*to_dynamic_cache"):
        pickle.dumps(cache)
    shipped = pickle.loads(pickle.dumps(cache.to_dynamic_cache()))
    assert shipped.get_seq_length() == cache.get_seq_length() == 77
    rebuilt = OasisCache.from_dynamic_cache(model, shipped, token_budget=1024, advanced=dict(host_chunk_blocks=2))
    assert rebuilt.get_seq_length() == 77 and rebuilt.layers[0].pool.num_blocks == 4
    again = generate(model, rebuilt, {"input_ids": first}, max_new_tokens=8, do_sample=False)
    assert torch.equal(again.sequences, dense.sequences)


def test_host_pool_that_cannot_fit_is_refused_before_writing(monkeypatch):
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=256)
    layer = cache.layers[0]
    like = torch.empty(1, 2, 1, 16)
    predicted = sum(l.host_bytes_for(300, like) for l in cache.layers)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: predicted + host_memory.HEADROOM_BYTES - 1)
    with pytest.raises(MemoryError, match=r"needs 0\.00 GiB of host memory.*Nothing was written"):
        model(input_ids=prompt_ids(300), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and not layer.is_initialized
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: predicted + host_memory.HEADROOM_BYTES)
    model(input_ids=prompt_ids(300), past_key_values=cache, use_cache=True)
    assert cache.host_nbytes() <= predicted  # the accounting covers what the pools took
    # Growth during decode is checked too (a chunk at a time), before anything is allocated.
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 0)
    chunks = len(layer.pool.chunks)
    with pytest.raises(MemoryError, match="growing a layer's host pool"):
        cache.transfer.reserve(layer.pool, layer.pool.capacity_blocks + 1)
    assert len(layer.pool.chunks) == chunks


def test_host_bytes_for_matches_the_pools():
    model = tiny_model("llama")
    for chunk in (2, 256):
        cache = OasisCache(model, token_budget=256, advanced=dict(host_chunk_blocks=chunk))
        like = torch.empty(3, 2, 1, 16)
        predicted = sum(layer.host_bytes_for(500, like) for layer in cache.layers)
        model(input_ids=prompt_ids(500, batch=3), past_key_values=cache, use_cache=True)
        block = 2 * 3 * 2 * 16 * 16 * 4  # K and V, 3 sequences, 2 heads, 16 tokens of 16 channels, fp32
        slack = 2 * -(-17 // chunk) * chunk * block  # the blocks reserved ahead, at most, per layer
        assert cache.host_nbytes() <= predicted <= cache.host_nbytes() + slack


def test_many_caches_in_one_process_return_memory():
    """Fifty caches of varying batch and length (eagle3 among them) made, used and dropped: each is freed by
    reference counting alone (no cycle), takes its hooks with it, and the process's memory returns to a bound."""
    model = tiny_model("llama", num_hidden_layers=4)
    head = random_head(model)
    hooks = len(model.model._forward_hooks)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def use(i):
        batch, length = 1 + i % 3, 40 + 37 * (i % 5)
        options = dict(lookahead="eagle3", draft=head) if i % 4 == 0 else {}
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=64 + 16 * (i % 3), sink_tokens=16, recent_tokens=16,
                                                      **options)))
        model.generate(input_ids=prompt_ids(length, batch=batch, seed=i), past_key_values=cache, max_new_tokens=5,
                       do_sample=False, pad_token_id=0)
        return weakref.ref(cache)

    for i in range(10):  # warm-up: allocator pools, lazily built kernels
        use(i)
    gc.collect()
    start = rss()
    for i in range(50):
        ref = use(i)
        assert ref() is None, f"cache {i} outlived its last reference (a cycle or a hook keeps it)"
        assert len(model.model._forward_hooks) == hooks
    gc.collect()
    assert rss() - start < 64 << 20


def test_selected_blocks_per_step_counts_only_steps():
    """`blocks_selected_per_step` with a prediction that decides (lookahead="previous"): the prediction made after
    the last step (for a step that never came) is not counted; the bytes it moved are."""
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=64, lookahead="previous", advanced=dict(sink_tokens=16, recent_tokens=16))
    generate(model, cache, {"input_ids": prompt_ids(110)}, max_new_tokens=20, do_sample=False)
    stats = cache.stats()
    assert stats["blocks_selected_per_step"] == cache.config.num_selected_blocks == 3
    assert stats["blocks_fetched"] == stats["blocks_fetched_on_critical_path"] + stats["blocks_prefetched"] > 0


def test_gather_programs_are_chosen_per_stream(monkeypatch):
    """gather_programs=None: a side-stream prefetch runs on a power of two near a sixteenth of the SMs (8 on an
    H200; 4x for rotated int4 units, whose widening bounds few programs) of 16 warps copying 4 blocks at once, a
    gather on the critical path on one program per block; 0 and n are the user's, everywhere (4 warps, one block at
    once); bad values are refused."""
    from types import SimpleNamespace

    from oasis_cache.memory.representation import representation_for

    from oasis_cache.memory import transfer

    for sms, programs in ((132, 8), (108, 4), (170, 8), (264, 16), (16, 4)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, n=sms: SimpleNamespace(multi_processor_count=n))
        assert transfer.side_stream_programs("cuda:0") == programs
    engine = transfer.TransferEngine("torch", torch.device("cpu"))
    side = object()
    engine.streams, engine.side_programs = SimpleNamespace(cuda=True, side=side), 32
    for on_side in (True, False):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device, s=on_side: side if s else object())
        assert engine._programs() == (32 if on_side else None)
        for host_dtype, rotated, times in ((None, False, 1), ("fp8", False, 1), ("int4", False, 1), ("int4", True, 4)):
            rep = representation_for(host_dtype, torch.bfloat16, 16, 128)
            rep.rotates = rotated
            assert engine._programs(rep) == (32 * times if on_side else None)
        engine.gather_programs = 0
        assert engine._programs() is None
        engine.gather_programs = 48
        assert engine._programs() == 48
        engine.gather_programs = None
    assert engine.gather_shape == dict(num_warps=transfer.SIDE_WARPS, entries=transfer.SIDE_ENTRIES) == \
        dict(num_warps=16, entries=4)
    assert transfer.TransferEngine("torch", torch.device("cpu"), gather_programs=32).gather_shape == \
        dict(num_warps=4, entries=1)
    with pytest.raises(ValueError, match="gather_programs"):
        OasisCache(tiny_model("llama"), token_budget=256, advanced=dict(gather_programs=-1))


def test_selection_is_recorded_and_drawn(tmp_path):
    """`oasis_cache.plot.record` keeps every decode step's attended blocks per layer (and, with a prediction, what it
    had placed); `selection` draws them."""
    from oasis_cache.plot import record, selection

    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=64, lookahead="previous", exact=True, advanced=dict(sink_tokens=16,
                                                                                               recent_tokens=16))
    with record(cache) as rec:
        generate(model, cache, {"input_ids": prompt_ids(200)}, max_new_tokens=10, do_sample=False)
    assert rec.layers == [0, 1] and len(rec.steps) == 9  # the first new token came from the prefill
    attended = rec.matrix()
    assert attended.shape == (9, 13)
    K = cache.config.num_selected_blocks
    assert torch.allclose(attended.sum(1), torch.full((9,), float(K)))  # every head attends K blocks
    assert attended[:, 0].eq(1).all()  # the sink block, always
    missed = rec.matrix(missed=True)
    assert (missed <= attended).all() and missed.sum() < attended.sum()
    fig = selection(rec, path=tmp_path / "selection.png")
    assert (tmp_path / "selection.png").stat().st_size > 10_000 and len(fig.axes) == 4  # two panels, two colorbars
    assert cache.selection_log is None and not cache.record_selection


def count_decoder_calls(model):
    calls = []
    handle = model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
    return calls, handle


@pytest.mark.parametrize("lookahead", ["none", "previous"])
def test_long_prefill_runs_in_chunks_and_equals_the_whole_forward(lookahead):
    """`prefill_chunk_tokens`: generate's prefill of a prompt longer than it runs as forwards of at most that many
    tokens over the batch (block multiples; a tail of at most `max_decode_tokens` joins the chunk before, so that
    the prefill stays dense and records the batch's padding), with the same tokens and logits as dense (no
    `prefill_chunk_size`)."""
    model = tiny_model("llama")
    for inputs, chunk_tokens, expected in [({"input_ids": prompt_ids(300)}, 64, [64] * 4 + [44]),
                                           (left_padded([200, 150, 170]), 96, [32] * 5 + [40])]:
        dense = generate(model, dense_cache(model), inputs, max_new_tokens=12, do_sample=False)
        cache = OasisCache(model, token_budget=1024, lookahead=lookahead, prefill_chunk_tokens=chunk_tokens)
        calls, handle = count_decoder_calls(model)
        try:
            oasis = generate(model, cache, inputs, max_new_tokens=12, do_sample=False)
        finally:
            handle.remove()
        assert calls[: len(expected)] == expected and set(calls[len(expected):]) == {1}
        assert same_as_dense(dense, oasis)
        assert (cache.context.padding.tokens is None) == ("attention_mask" not in inputs)  # decode steps read the record
    # Sparse decode after either prefill: the same cache. (Every key channel summarized: by default the summaries'
    # channels are chosen from the blocks of the first forward that completes any, here the first chunk.)
    sparse = dict(token_budget=96, sink_tokens=16, recent_tokens=16, summary_channels=1.0)
    whole = generate(model, OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=0, **sparse))),
                     {"input_ids": prompt_ids(300)},
                     max_new_tokens=12, do_sample=False)
    chunked = generate(model, OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=64, **sparse))),
                       {"input_ids": prompt_ids(300)},
                       max_new_tokens=12, do_sample=False)
    assert same_as_dense(whole, chunked)


@pytest.mark.parametrize("padded", [False, True])
def test_chunks_no_longer_than_a_decode_forward_still_prefill(padded):
    """`prefill_chunk_tokens` over a batch that leaves a sequence at most `max_decode_tokens` tokens a chunk: the
    chunks grow to the least that still prefills (`prefill.least_span`: 32 tokens with blocks of 16). Chunks of 16
    ran as decode steps, which do not write the prompt's keys and values kept on the device for the next chunk:
    the last chunk read unwritten memory (garbage or NaN logits)."""
    from oasis_cache.runtime.prefill import least_span, prefill_chunks

    model = tiny_model("llama")
    inputs = left_padded([121, 77, 100]) if padded else {"input_ids": prompt_ids(121, batch=3)}
    spans = prefill_chunks(dict(inputs, logits_to_keep=1), 64, 16, 16)
    assert least_span(16, 16) == 32 and all(end - start > 16 for start, end in spans)  # (each one prefills)
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=6, do_sample=False)
    junk = [torch.full((1 << k,), float("nan")) for k in range(8, 20) for _ in range(4)]
    del junk  # (freed memory full of NaN: what an unwritten read would meet)
    calls, handle = count_decoder_calls(model)
    try:
        oasis = generate(model, OasisCache(model, token_budget=1024, prefill_chunk_tokens=64), inputs,
                         max_new_tokens=6, do_sample=False)
    finally:
        handle.remove()
    assert calls[:4] == [32, 32, 32, 25] and same_as_dense(dense, oasis)


@pytest.mark.parametrize("lookahead", ["previous", "eagle3"])
def test_only_the_last_chunk_of_a_prefill_prefetches(lookahead):
    """A lookahead prefetches the next decode step's blocks after a dense forward; in a prefill the cache runs in
    chunks only the last chunk is followed by a decode step, so the chunks before it select and move nothing (on a
    new GPU machine each earlier chunk's selection width was one more top-k compilation, ~2 s each at 32K): the
    prefill moves what a whole-prompt prefill moves, and decodes the same."""
    model = tiny_model("llama", num_hidden_layers=4)
    options = dict(token_budget=96, sink_tokens=16, recent_tokens=16, summary_channels=1.0, lookahead=lookahead)
    if lookahead == "eagle3":
        options.update(draft=random_head(model), exact=True)
    moved, tokens = {}, {}
    for chunk in (0, 64):
        cache = OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=chunk, **options)))
        generate(model, cache, {"input_ids": prompt_ids(300)}, max_new_tokens=1, do_sample=False)
        moved[chunk] = cache.stats()["blocks_prefetched"]
        tokens[chunk] = generate(model, OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=chunk, **options))),
                                 {"input_ids": prompt_ids(300)}, max_new_tokens=8, do_sample=False)
    assert moved[0] == moved[64] > 0
    assert same_as_dense(tokens[0], tokens[64])


def test_a_dry_step_that_runs_out_of_memory_gives_way_to_the_real_one(monkeypatch):
    """`compile_ahead`'s dry step (`runtime/ahead.py`) is an optimization: where its copy of the cache runs out of
    device memory it answers False and the real step runs as without it; it is not retried for that signature."""
    from oasis_cache.runtime import ahead

    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=96, advanced=dict(sink_tokens=16, recent_tokens=16))
    generate(model, cache, {"input_ids": prompt_ids(200)}, max_new_tokens=2, do_sample=False)
    monkeypatch.setattr(ahead, "_DONE", set())

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    monkeypatch.setattr(ahead.copy, "deepcopy", out_of_memory)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    assert ahead.dry_step(cache, None, {"past_key_values": cache}, tokens) is False
    assert ahead.signature(cache, tokens) in ahead._DONE


def test_a_dry_step_runs_one_layers_attention_and_decodes_the_same(monkeypatch):
    """`compile_ahead`'s dry copy ends its forward at the first attention layer of shapes an earlier layer had
    (`stop_after_distinct_layers`): layers of one model share their shapes, so one layer's attention meets every
    kernel specialization of the step (`launch_keys --check --compile-ahead` checks that under the interpreter); the
    other layers' seconds were the dry step's largest part on a new machine. The real step runs every layer, and the
    greedy tokens equal a run without the dry step."""
    from oasis_cache.runtime import ahead

    model = tiny_model("llama", num_hidden_layers=4)
    options = dict(token_budget=96, sink_tokens=16, recent_tokens=16)
    calls, attend = [], OasisLayer.attend

    def spy(self, *args, **kwargs):
        calls.append((id(self), self.layer_idx))
        return attend(self, *args, **kwargs)

    plain = generate(model, OasisCache(model, **cache_kwargs(dict(compile_ahead=False, **options))),
                     {"input_ids": prompt_ids(200)},
                     max_new_tokens=3, do_sample=False)
    monkeypatch.setattr(OasisLayer, "attend", spy)
    monkeypatch.setattr(ahead, "wanted", lambda cache, tokens: tokens.shape[1] == 1 and not ahead.LAST)
    monkeypatch.setattr(ahead, "LAST", {})
    cache = OasisCache(model, **cache_kwargs(options))
    tokens = generate(model, cache, {"input_ids": prompt_ids(200)}, max_new_tokens=3, do_sample=False)
    assert ahead.LAST["layers_traced"] == 1
    own = {id(layer) for layer in cache.layers}
    dry = [layer for owner, layer in calls if owner not in own]
    assert dry == [0], dry  # (the copy's layer 1 raised before its attention ran)
    real_steps = [layer for owner, layer in calls if owner in own]
    assert real_steps == [0, 1, 2, 3] * 3  # the prefill and two decode steps: every layer
    assert torch.equal(tokens.sequences, plain.sequences)


def test_fast_pinning_extends_the_allocator_settings_and_keeps_the_users(monkeypatch):
    """`OasisConfig.fast_pinning` (`host_memory.use_fast_pinning`): once per process, torch's allocator settings become
    the current ones plus host registration (a settings string replaces the options it leaves out, so the user's
    `max_split_size_mb` must travel with it); settings that name `pinned_use_cuda_host_register` are the user's
    choice and stay; a torch that refuses the string leaves pinning as it was."""
    host_memory = pytest.importorskip("oasis_cache.memory.host_memory")
    applied = []
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256,expandable_segments:True")
    monkeypatch.setattr(host_memory, "_PINNING", {})
    assert host_memory.use_fast_pinning() is True
    assert host_memory.use_fast_pinning() is True  # (once: the settings are not applied again)
    assert applied == ["max_split_size_mb:256,expandable_segments:True,pinned_use_cuda_host_register:True,"
                       "pinned_num_register_threads:8"]

    applied.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:False")
    monkeypatch.setattr(host_memory, "_PINNING", {})
    assert host_memory.use_fast_pinning() is False and applied == []

    def refuse(settings):
        raise RuntimeError("Unrecognized key")

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    monkeypatch.setattr(host_memory, "_PINNING", {})
    assert host_memory.use_fast_pinning() is False
    with pytest.raises(ValueError, match="fast_pinning must be bool"):
        OasisConfig(token_budget=256, fast_pinning="yes")


def test_device_room_counts_the_per_process_cap(monkeypatch):
    """`device_room` (what a resident prefill and `compile_ahead`'s dry copy ask before taking device memory): the
    device's free bytes plus what torch's allocator holds unused, capped by `set_per_process_memory_fraction` — a
    35 GiB cap (a quarter) of a 140 GiB card with 100 GiB free leaves 15 GiB to a process holding 20, not 102."""
    from oasis_cache.memory.device_memory import device_room

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 22 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 20 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.25, raising=False)
    assert device_room("cuda:0") == 15 * gib
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert device_room("cuda:0") == 102 * gib  # (free, and the allocator's 2 GiB held unused)


def test_a_chunked_prefill_keeps_the_past_on_the_device_where_it_fits(monkeypatch):
    """`resident_prefill` (default): a prompt prefilled in chunks keeps its keys and values on the device until its
    last chunk, so each layer reads its past from the host pool once (at the first chunk: a conversation's earlier
    turns) instead of at every chunk; the same tokens and logits as reading it back each time; dropped after the
    prefill. Without room for it (half of what the process may still take) the chunks read the host pool, every
    layer and chunk of a prefill into one buffer sized for the prompt (`ForwardContext.past_buffer`: a past of a new size
    at each read split the allocator's segments), dropped after the prefill."""
    from oasis_cache.memory.transfer import TransferEngine
    from oasis_cache.runtime import context as cache_module

    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    loads, load_range = [], TransferEngine.load_range
    monkeypatch.setattr(TransferEngine, "load_range",
                        lambda self, *a, **k: loads.append(k["out"].untyped_storage().data_ptr())
                        or load_range(self, *a, **k))
    options = dict(token_budget=96, sink_tokens=16, recent_tokens=16, summary_channels=1.0, prefill_chunk_tokens=64,
                   lookahead="previous")
    first, second = prompt_ids(300), prompt_ids(200, seed=7)
    runs = {}
    for name, resident in (("resident", True), ("host", False), ("no room", True)):
        if name == "no room":
            monkeypatch.setattr(cache_module, "available_host_bytes", lambda: 1000)  # (host: the CPU device)
        cache = OasisCache(model, **cache_kwargs(dict(resident_prefill=resident, **options)))
        loads.clear()
        out = generate(model, cache, {"input_ids": first}, max_new_tokens=6, do_sample=False)
        prefill_loads, buffers = len(loads), {0: set(loads)}
        turn = torch.cat([out.sequences, second], dim=1)  # the conversation goes on: a long message, in chunks
        loads.clear()
        again = generate(model, cache, {"input_ids": turn}, max_new_tokens=6, do_sample=False)
        runs[name] = (out, again, prefill_loads, len(loads))
        buffers[1] = set(loads)
        assert [len(b) for b in buffers.values()] == ([1, 1] if name != "resident" else [layers, layers]), name
        assert cache.context.prefill_resident is None and cache.context.prefill_past is None and all(
            layer.resident_kv is None for layer in cache.layers if isinstance(layer, OasisLayer))
    assert runs["resident"][2:] == (layers, layers)  # once per layer and prefill
    assert runs["host"][2:] == runs["no room"][2:] == (5 * layers, 3 * layers)  # once per layer and chunk
    for name in ("host", "no room"):
        for a, b in zip(runs["resident"][:2], runs[name][:2]):
            assert same_as_dense(a, b)


def test_a_chunked_prefill_sizes_the_summaries_for_its_prompt_once(monkeypatch):
    """A prompt prefilled in chunks: each layer's block summaries, block -> slot table and working set are sized for
    the whole prompt at its first chunk (one new tensor each, not a larger one at every chunk: those, among the
    chunks' activations, split the allocator's segments), with room for the first decode step's block; the tokens
    and logits are those of the prompt in one forward."""
    from oasis_cache.pools.slot_map import SlotMap
    from oasis_cache.pools.summaries import BlockSummaries
    from oasis_cache.pools.working_set import WorkingSet

    model = tiny_model("llama")
    prompt = prompt_ids(1200)  # (75 blocks: past the 64 a first growth makes room for)
    grown, grow, reserve = [], BlockSummaries._grown, SlotMap.reserve
    monkeypatch.setattr(BlockSummaries, "_grown",
                        lambda self, *a: grown.append(("summaries", id(self))) or grow(self, *a))

    def table(self, n):
        before = self.capacity_blocks
        reserve(self, n)
        if self.capacity_blocks != before:
            grown.append(("slot_map", id(self)))

    monkeypatch.setattr(SlotMap, "reserve", table)
    slots = WorkingSet.grown
    monkeypatch.setattr(WorkingSet, "grown", lambda self, n: grown.append(("working_set", n)) or slots(self, n))
    options = dict(token_budget=1024, sink_tokens=16, recent_tokens=16, lookahead="previous")  # (~64 slots)
    cache = OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=128, **options)))
    chunked = generate(model, cache, {"input_ids": prompt}, max_new_tokens=4, do_sample=False)
    layers = [layer for layer in cache.layers if isinstance(layer, OasisLayer)]
    summaries = layers[0].summaries
    kinds = sum(t is not None for t in (summaries.levels, summaries.codes, summaries.scales))
    assert len(grown) == len(layers) * (kinds + 2), grown  # once per layer and tensor
    assert [n for what, n in grown if what == "working_set"] == [cache.config.slots] * len(layers)  # (all at once)
    assert all(layer.summaries.capacity_blocks >= 1200 // 16 + 1 for layer in layers)
    grown.clear()
    cache = OasisCache(model, **cache_kwargs(options))
    whole = generate(model, cache, {"input_ids": prompt}, max_new_tokens=4, do_sample=False)
    assert same_as_dense(chunked, whole)


def test_a_chunked_prefill_makes_and_sizes_every_layer_before_its_first_chunk_runs(monkeypatch):
    """`ForwardContext.size_for_prompt`: at the first chunk, before any layer stores a token, every full-attention
    layer is made and sized for the whole prompt (summaries, slot table, working set; with the past read from host
    memory, the past buffer too): made layer by layer among the chunk's activations, they split the allocator's free
    memory. Tokens and logits as before; a layer made ahead for keys of another shape is made again at its update."""
    model = tiny_model("llama", num_hidden_layers=4)
    prompt = {"input_ids": prompt_ids(1200)}
    options = dict(token_budget=512, sink_tokens=16, recent_tokens=16, prefill_chunk_tokens=128, resident_prefill=False)
    reference = generate(model, OasisCache(model, **cache_kwargs(options)), prompt, max_new_tokens=6, do_sample=False)
    seen, update = [], OasisLayer.update

    def watched(self, key_states, *args, **kwargs):
        if not seen:  # (the first layer's first update)
            cache = self._cache
            seen.append(([(layer.is_initialized and layer.summaries.capacity_blocks,
                           layer.is_initialized and layer.working_set.num_slots) for layer in cache.layers],
                         cache.context.prefill_past is not None and cache.context.prefill_past.shape[3]))
        return update(self, key_states, *args, **kwargs)

    monkeypatch.setattr(OasisLayer, "update", watched)
    cache = OasisCache(model, **cache_kwargs(options))
    out = generate(model, cache, prompt, max_new_tokens=6, do_sample=False)
    from oasis_cache.pools.summaries import capacity_for

    assert seen == [([(capacity_for(1200 // 16 + 1), cache.config.slots)] * 4, 1200)]
    assert same_as_dense(reference, out)
    cache = OasisCache(model, **cache_kwargs(options))
    wrong = torch.zeros(1, 1, 0, 8)  # (one head of 8: the model's are 2 of 16)
    cache.layers[2].lazy_initialization(wrong, wrong)
    assert same_as_dense(reference, generate(model, cache, prompt, max_new_tokens=6, do_sample=False))
    assert cache.layers[2].shaped_as(None) == cache.layers[0].shaped_as(None)


@pytest.mark.parametrize("where", ["in a layer", "after the layers"])
def test_a_prefill_chunk_out_of_device_memory_goes_on_in_smaller_chunks(monkeypatch, where):
    """A chunk of a chunked prefill that runs out of device memory — in a layer (some layers hold its tokens, some
    not) or after every layer (a draft head's ride-along read it) — is undone and the prompt goes on from its start
    in chunks of half the tokens, with a warning naming the setting: the tokens and logits of a prefill that never
    failed (dense-equal budget), its channel weights, its tokens counted once; the ride-along as it was where the
    chunk did not reach it, else started over. A chunk that keeps failing ends in the MemoryError after
    `prefill.SHRINK_RETRIES` halvings."""
    from oasis_cache.runtime import prefill
    from oasis_cache.pools.summaries import BlockSummaries

    model = tiny_model("llama", num_hidden_layers=4)
    prompt = {"input_ids": prompt_ids(700)}
    options = dict(token_budget=1024, sink_tokens=16, recent_tokens=16, prefill_chunk_tokens=128, lookahead="eagle3",
                   draft=random_head(model), exact=True)
    weights, fix = [], BlockSummaries.fix_channels  # (each layer's channel weights at the prefill's end)
    monkeypatch.setattr(BlockSummaries, "fix_channels", lambda self: weights.append(self.channel_weight) or fix(self))
    reference_cache = OasisCache(model, **cache_kwargs(options))
    reference = generate(model, reference_cache, prompt, max_new_tokens=8, do_sample=False)
    reference_weights = list(weights)
    chunks, starts, failures = [], [], []  # (the forward at token 256 fails `fail_times` times)
    update = OasisLayer.update

    def failing(self, key_states, *args, **kwargs):
        if self.layer_idx == 0 and key_states.shape[2] > 1:
            chunks.append(key_states.shape[2])
            starts.append(self.get_seq_length())
        if where == "in a layer" and self.layer_idx == 2 and starts[-1] == 256 and len(failures) < fail_times:
            failures.append(len(chunks))
            raise torch.OutOfMemoryError("CUDA out of memory. (a test's)")
        return update(self, key_states, *args, **kwargs)

    def after_layers(module, args):  # (the LM head: after the ride-along read the chunk's rows)
        if where == "after the layers" and starts[-1] == 256 and len(failures) < fail_times:
            failures.append(len(chunks))
            raise torch.OutOfMemoryError("CUDA out of memory. (a test's)")

    monkeypatch.setattr(OasisLayer, "update", failing)
    model.lm_head.register_forward_pre_hook(after_layers)
    fail_times = 1
    weights.clear()
    cache = OasisCache(model, **cache_kwargs(options))
    with pytest.warns(RuntimeWarning, match=r"1 x 128 tokens ran out of device memory; going on from token 256 in "
                                            r"chunks of 1 x 64 \(set prefill_chunk_tokens=64"):
        out = generate(model, cache, prompt, max_new_tokens=8, do_sample=False)
    assert chunks[:6] == [128, 128, 128, 64, 64, 64] and failures == [3]
    assert same_as_dense(reference, out)
    assert len(weights) == len(reference_weights) == 4
    for a, b in zip(reference_weights, weights):
        torch.testing.assert_close(a, b)
    stats, expected, shortest = cache.stats(), reference_cache.stats(), cache.config.max_decode_tokens
    assert stats["prefill_tokens"] == expected["prefill_tokens"] == 700  # (the undone chunk's forward not counted)
    forwards = 2 + len(prefill.spans_from(256, 700, 64, shortest)) - len(prefill.spans_from(0, 700, 128, shortest))
    assert stats["dense_forwards"] == expected["dense_forwards"] + forwards
    rows, expected_rows = cache.ride_along._rows, reference_cache.ride_along._rows
    assert rows == expected_rows if where == "in a layer" else rows < expected_rows
    chunks.clear(), starts.clear(), failures.clear()
    fail_times = 99
    cache = OasisCache(model, **cache_kwargs(options))
    # (halved down to the least chunk that still prefills, `least_span`: 128, 64, 32 — 16 tokens would decode)
    least = prefill.least_span(cache.config.block_size, shortest)
    halvings = min(prefill.SHRINK_RETRIES, (128 // least).bit_length() - 1)
    with pytest.warns(RuntimeWarning), pytest.raises(MemoryError, match=r"ran out of device memory in forwards of 1 x "
                                                                       rf"128 tokens \(and of 1 x {least} after it\)\. "
                                                                       r"Even the least chunk did not fit"):
        generate(model, cache, prompt, max_new_tokens=8, do_sample=False)
    assert least == 32 and len(failures) == halvings + 1 and chunks[-1] == 128 // 2**halvings
    if where == "in a layer":  # (halvings stop before the least chunk: the working set named first)
        monkeypatch.setattr(prefill, "SHRINK_RETRIES", 1)
        failures.clear()
        with pytest.warns(RuntimeWarning), pytest.raises(MemoryError, match=r"\(and of 1 x 64 after it\)\. Smaller "
                                                                           r"chunks did not fit either: .* Lower the "
                                                                           r"batch or token_budget \(or "
                                                                           r"prefill_chunk_tokens further, e\.g\. 32"):
            generate(model, OasisCache(model, **cache_kwargs(options)), prompt, max_new_tokens=8, do_sample=False)
        assert len(failures) == 2


def test_a_chunk_out_of_memory_inside_a_layers_bookkeeping_is_not_retried(monkeypatch):
    """A chunk that runs out of device memory where a layer cannot be cropped back — its blocks in the host pool,
    their summaries not written — ends in the MemoryError at once: no smaller chunks over an inconsistent layer."""
    import warnings

    from oasis_cache.pools.summaries import BlockSummaries

    model = tiny_model("llama")
    append, calls = BlockSummaries.append, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # (the third chunk's first layer)
            raise torch.OutOfMemoryError("CUDA out of memory. (a test's)")
        return append(self, *args, **kwargs)

    monkeypatch.setattr(BlockSummaries, "append", failing)
    cache = OasisCache(model, token_budget=1024, prefill_chunk_tokens=128, advanced=dict(sink_tokens=16,
                                                                                         recent_tokens=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no "going on" warning)
        with pytest.raises(MemoryError, match=r"in forwards of 1 x 128 tokens\. Lower prefill_chunk_tokens \(now "
                                              r"128; e\.g\. .*prefill_chunk_tokens=64\)\), the batch"):
            generate(model, cache, {"input_ids": prompt_ids(700)}, max_new_tokens=2, do_sample=False)
    assert len(calls) == 5


def test_forwards_that_need_every_position_are_not_split():
    model = tiny_model("llama")
    ids = prompt_ids(300)
    cache = OasisCache(model, token_budget=1024, prefill_chunk_tokens=64)
    calls, handle = count_decoder_calls(model)
    try:
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits  # every position's logits
        assert calls == [300] and logits.shape[1] == 300
        cache.reset()
        model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        assert calls[-1] == 300
        cache.reset()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        assert calls[-5:] == [64, 64, 64, 64, 44] and out.logits.shape[1] == 1
    finally:
        handle.remove()
    reference = model(input_ids=ids).logits[:, -1:]
    torch.testing.assert_close(out.logits, reference, atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        OasisCache(model, token_budget=256, prefill_chunk_tokens=-1)


def test_chunked_prefill_feeds_the_draft_head_the_same_rows():
    """With eagle3 the head reads every chunk's features: after a chunked prefill it holds the keys it holds after the
    whole one, and decodes the same tokens."""
    model = tiny_model("llama", num_hidden_layers=4)
    head = random_head(model)
    runs = []
    for chunk_tokens in (0, 64):
        cache = OasisCache(model, token_budget=96, lookahead="eagle3", draft=head,
                           prefill_chunk_tokens=chunk_tokens, advanced=dict(sink_tokens=16, recent_tokens=16,
                                                                            summary_channels=1.0))
        out = generate(model, cache, {"input_ids": prompt_ids(300)}, max_new_tokens=12, do_sample=False)
        runs.append((out.sequences, cache.ride_along._head_kv.k.clone(), cache.stats()["drafts_checked"]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][2] == runs[1][2] > 0
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-4)


def test_progress_bar_over_a_chunked_prefill(capsys):
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=1024, prefill_chunk_tokens=64, advanced=dict(progress=True))
    generate(model, cache, {"input_ids": prompt_ids(300)}, max_new_tokens=2, do_sample=False)
    err = capsys.readouterr().err
    assert "prefill" in err and "300/300" in err
    quiet = OasisCache(model, token_budget=1024, prefill_chunk_tokens=64)  # off by default
    generate(model, quiet, {"input_ids": prompt_ids(300)}, max_new_tokens=2, do_sample=False)
    assert "prefill" not in capsys.readouterr().err


def test_forwards_recording_autograd_make_their_dry_copy_too(monkeypatch):
    """The dry decode step (`compile_ahead`, at the prefill by default or before the first decode step) copies the
    cache. Forwards that record autograd (a user's `model(...)` without `torch.no_grad()`) once put the state tensors
    in autograd's graph, where they cannot be copied (on CUDA the prefill raised at its first layer with
    `ahead_at_prefill`), so neither dry way was tried; the
    cache's state records no autograd, so both ways copy in either mode. (On CPU the
    option is made to apply and the copy records.)"""
    from oasis_cache.runtime import ahead

    copies = []

    def no_room(cache):
        for layer in cache.layers:
            assert not any(t.requires_grad for t in vars(layer).values() if isinstance(t, torch.Tensor))
        copies.append(cache)
        raise torch.OutOfMemoryError("(recorded)")  # (either dry way then goes on without its copy)

    monkeypatch.setattr(ahead, "applies", lambda cache, device=None: True)
    monkeypatch.setattr(ahead, "_read_only_copy", no_room)
    model = tiny_model("llama")
    ids = prompt_ids(200)

    def forwards(ahead_at_prefill: bool) -> torch.Tensor:
        monkeypatch.setattr(ahead, "_DONE", set())
        cache = OasisCache(model, token_budget=64,  advanced=dict(sink_tokens=16, recent_tokens=16, compile_ahead=True,
                                                                  ahead_at_prefill=ahead_at_prefill))
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        return model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits

    for at_prefill in (True, False):
        recorded = forwards(at_prefill)
        assert len(copies) == 1 and recorded.requires_grad, at_prefill
        with torch.no_grad():
            torch.testing.assert_close(forwards(at_prefill), recorded.detach())
        assert len(copies) == 2, at_prefill
        copies.clear()


def test_a_prefill_without_room_for_the_dry_copy_leaves_it_to_the_first_decode_step(monkeypatch):
    """`ahead_at_prefill` (the default) copies the cache beside the prefill's activations; where there is no room for
    the copy then (`_room_for_copy`: a capped card, a large batch), the dry step runs before the first decode step
    instead, where the prefill's activations are gone — not never. (On CPU the option is made to apply and the copy records.)"""
    from oasis_cache.runtime import ahead

    copies, room = [], iter([False, True])

    def copy_of(cache):
        copies.append(cache)
        raise torch.OutOfMemoryError("(recorded)")

    monkeypatch.setattr(ahead, "applies", lambda cache, device=None: True)
    monkeypatch.setattr(ahead, "_read_only_copy", copy_of)
    monkeypatch.setattr(ahead, "_room_for_copy", lambda cache: next(room))
    monkeypatch.setattr(ahead, "_DONE", set())
    dry_steps = []
    monkeypatch.setattr(ahead, "dry_step", lambda *a, run=ahead.dry_step: dry_steps.append(1) or run(*a))
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16, recent_tokens=16, compile_ahead=True))
    with torch.no_grad():
        out = model(input_ids=prompt_ids(200), past_key_values=cache, use_cache=True)
        assert copies == [] and dry_steps == []  # no room beside the prefill
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert dry_steps == [1] and len(copies) == 1


def test_output_attentions_says_that_no_weights_come_back():
    """`output_attentions=True` gets no attention weights from the oasis attention (as from SDPA, which warns too):
    a warning names it and the way to them; the tokens are dense's."""
    from oasis_cache.compute import attention

    model = tiny_model("llama")
    inputs, kw = {"input_ids": prompt_ids(60)}, dict(max_new_tokens=4, do_sample=False, output_attentions=True)
    dense = generate(model, dense_cache(model), inputs, **kw)
    attention._warn_no_weights.cache_clear()
    with pytest.warns(UserWarning, match="returns no attention weights.*DynamicCache and attn_implementation='eager'"):
        oasis = generate(model, OasisCache(model, token_budget=1024), inputs, **kw)
    assert torch.equal(dense.sequences, oasis.sequences)
