"""Where a cache could answer silently wrong, or fail late: chunked attention past a chunk, forks to a larger budget,
a forward that fails midway, padding SDPA hides, and misuse refused by name before anything is written."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import _COMMON, dense_cache, generate, left_padded, prompt_ids, random_head, tiny_model
from transformers import DynamicCache

from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.runtime.build import cache_kwargs


def _same(a, b, atol=1e-4):
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


def _with(model, cache) -> dict:
    return {generate_cache_argument(model): cache}


def _greedy(model, cache, inputs, new=12, **kwargs):
    return generate(model, cache, inputs, max_new_tokens=new, do_sample=False, **kwargs)


# ------------------------------------------------------------------------------------------ chunked attention
def tiny_llama4(chunk: int = 32):
    """Three chunked-attention layers (chunks of `chunk` tokens) and a full one, as Llama 4 spreads them."""
    config = transformers.Llama4TextConfig(**{**_COMMON, "head_dim": 16, "num_hidden_layers": 4},
                                           attention_chunk_size=chunk, num_local_experts=2,
                                           intermediate_size_mlp=128, moe_layers=[])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("mode", ["greedy", "sampling", "padded", "cache chunks", "prompt lookup"])
def test_chunked_attention_equals_dense_past_its_chunks(mode):
    """A 50-token prompt and 30 new tokens cross chunks of 32: every chunked layer attends within its chunk at
    every step (it attended the whole window before, logits off by ~10 from the second new token)."""
    model = tiny_llama4()
    assert "chunked_attention" in model.config.layer_types
    inputs = left_padded([50, 41]) if mode == "padded" else {"input_ids": prompt_ids(50)}
    options = dict(token_budget=4096, lookahead="none")
    kwargs = dict(max_new_tokens=30, do_sample=mode == "sampling")
    if mode == "cache chunks":
        options["prefill_chunk_tokens"] = 16
    if mode == "prompt lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    dense = generate(model, dense_cache(model), inputs, **kwargs)
    _same(dense, generate(model, OasisCache(model, **cache_kwargs(options)), inputs, **kwargs))


# ------------------------------------------------------------------------------------------------------ forks
@pytest.mark.parametrize("lookahead, exact", [("previous", True), ("previous", False), ("none", False)])
@pytest.mark.parametrize("budget", [1024, 10**12])
def test_a_fork_to_a_larger_budget_grows_its_working_set_for_a_short_first_forward(lookahead, exact, budget):
    """The fork's first forward is one token (no block completes, where the working set grew before): it attends
    with the fork's budget, equal to dense."""
    model = tiny_model("llama")
    ids = prompt_ids(300)
    dense = _greedy(model, dense_cache(model), {"input_ids": ids}, new=20)
    base = OasisCache(model, token_budget=128, lookahead=lookahead, exact=exact)
    _greedy(model, base, {"input_ids": ids[:, :-1]}, new=1)
    fork = base.fork(token_budget=budget)
    _same(dense, _greedy(model, fork, {"input_ids": ids}, new=20))
    assert len({layer.get_seq_length() for layer in fork.layers}) == 1


@pytest.mark.parametrize("lookahead, exact", [("previous", True), ("none", False)])
def test_a_fork_to_a_larger_sparse_budget_decodes_as_a_cache_made_with_it(lookahead, exact, one_thread):
    model = tiny_model("llama")
    ids = prompt_ids(300)
    made = OasisCache(model, token_budget=192, lookahead=lookahead, exact=exact)
    _greedy(model, made, {"input_ids": ids[:, :-1]}, new=1)
    expected = _greedy(model, made, {"input_ids": ids}, new=20)
    base = OasisCache(model, token_budget=96, lookahead=lookahead, exact=exact)
    _greedy(model, base, {"input_ids": ids[:, :-1]}, new=1)
    _same(expected, _greedy(model, base.fork(token_budget=192), {"input_ids": ids}, new=20))


# ------------------------------------------------------------------------------------ a forward that fails
class Interrupted(Exception):
    pass


def _fail_at(model, layer: int, call: int, error=Interrupted):
    """A hook on decoder layer `layer` that raises `error` at its `call`-th forward."""
    count = [0]

    def hook(module, args):
        count[0] += 1
        if count[0] == call:
            raise error()
    return model.model.layers[layer].register_forward_pre_hook(hook)


@pytest.mark.parametrize("stage, call, chunk", [("prefill", 1, 0), ("second prefill chunk", 2, 64),
                                                ("decode step", 3, 0)])
@pytest.mark.parametrize("layer", [1, 3])
@pytest.mark.parametrize("budget", [4096, 128])
def test_a_forward_that_fails_midway_leaves_the_cache_as_before_it(stage, call, chunk, layer, budget):
    """An exception after some layers ran (a hook here; an interrupt or an out-of-memory error alike): the layers
    that had written take their tokens back, and the conversation goes on as if the failed forward never ran
    (layers left at different lengths decoded with logits off by ~15 before)."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt_ids(200)
    options = dict(token_budget=budget, lookahead="none", prefill_chunk_tokens=chunk)
    expected = _greedy(model, OasisCache(model, **cache_kwargs(options)), {"input_ids": ids})
    cache = OasisCache(model, **cache_kwargs(options))
    hook = _fail_at(model, layer, call, KeyboardInterrupt if layer == 3 else Interrupted)
    try:
        with pytest.raises((Interrupted, KeyboardInterrupt)):
            _greedy(model, cache, {"input_ids": ids})
    finally:
        hook.remove()
    held = {each.get_seq_length() for each in cache.layers}
    assert held == ({0} if stage != "decode step" else {201})
    upto = max(ids.shape[1], held.pop() + 1)  # the conversation so far and one new token
    again = _greedy(model, cache, {"input_ids": expected.sequences[:, :upto]}, new=12 - (upto - ids.shape[1]))
    assert torch.equal(again.sequences, expected.sequences)
    for x, y in zip(again.logits, expected.logits[-len(again.logits):]):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)


def test_a_forward_that_fails_after_a_window_moved_refuses_until_reset():
    """A sliding window cannot be rolled back: the cache refuses to serve, naming `cache.reset()`, and serves again
    after it."""
    from eval.architectures import tiny_model_of

    model = tiny_model_of("cohere2")  # (sliding windows of 32 tokens, then full attention, twice)
    assert model.config.layer_types[2:] == ["sliding_attention", "full_attention"]
    ids = prompt_ids(100)
    dense = _greedy(model, dense_cache(model), {"input_ids": ids})
    cache = OasisCache(model, token_budget=4096, lookahead="none")
    hook = _fail_at(model, 3, 3)
    try:
        with pytest.raises(Interrupted):
            _greedy(model, cache, {"input_ids": ids})
    finally:
        hook.remove()
    with pytest.raises(RuntimeError, match=r"cache.reset\(\)"):
        _greedy(model, cache, {"input_ids": ids})
    cache.reset()
    _same(dense, _greedy(model, cache, {"input_ids": ids}))


def test_another_model_run_with_the_cache_is_refused_and_writes_nothing():
    """A second model of the same shapes (other weights, left on SDPA) given the cache: refused by name (one cache
    per model), every layer it reached given back; the cache's own model goes on equal to dense."""
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = prompt_ids(100)
    dense = _greedy(model, dense_cache(model), {"input_ids": ids}, new=20)
    cache = OasisCache(model, token_budget=4096, lookahead="none")
    _greedy(model, cache, {"input_ids": ids}, new=8)
    held = [layer.get_seq_length() for layer in cache.layers]
    other.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="one OasisCache per model"):
        other(input_ids=dense.sequences[:, held[0]:held[0] + 1], **_with(model, cache))
    assert [layer.get_seq_length() for layer in cache.layers] == held
    rest = _greedy(model, cache, {"input_ids": dense.sequences[:, : held[0] + 1]}, new=20 - (held[0] + 1 - 100))
    assert torch.equal(rest.sequences, dense.sequences)


def test_a_used_cache_given_to_a_model_of_other_shapes_names_the_fix():
    model, other = tiny_model("llama"), tiny_model("llama", num_key_value_heads=4)
    cache = OasisCache(model, token_budget=4096, lookahead="none")
    _greedy(model, cache, {"input_ids": prompt_ids(40)}, new=2)
    other.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="one OasisCache per model"):
        other(input_ids=prompt_ids(1), **_with(model, cache))
    assert {layer.get_seq_length() for layer in cache.layers} == {41}


def test_a_batch_of_another_size_is_refused_before_any_layer_or_draft_runs():
    model = tiny_model("llama", num_hidden_layers=4)
    cache = OasisCache(model, token_budget=4096, lookahead="eagle3", draft=random_head(model))
    _greedy(model, cache, {"input_ids": prompt_ids(40)}, new=2)
    with pytest.raises(ValueError, match=r"batch of 2.*cache.reset\(\)"):
        _greedy(model, cache, {"input_ids": prompt_ids(45, batch=2)}, new=2)
    assert {layer.get_seq_length() for layer in cache.layers} == {41}


# ---------------------------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("where", ["right padding", "last prompt token masked", "left padding and a hole"])
@pytest.mark.parametrize("chunk", [0, 16])
def test_padding_is_attended_as_sdpa_attends_it(where, chunk):
    """A padding query sees what SDPA's mask lets it see (not itself: the last prompt position's logits, which
    generate reads, were up to 0.9 apart with right padding)."""
    model = tiny_model("llama")
    ids = prompt_ids(40, batch=2)
    mask = torch.ones_like(ids)
    if where == "right padding":
        mask[0, -5:] = 0
    elif where == "last prompt token masked":
        mask[1, -1] = 0
    else:
        mask[0, :7] = mask[0, 20:23] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    dense = _greedy(model, dense_cache(model), inputs, new=6)
    _same(dense, _greedy(model, OasisCache(model, token_budget=4096, lookahead="none", prefill_chunk_tokens=chunk),
                         inputs, new=6))
    whole = model(**inputs).logits
    cache = OasisCache(model, token_budget=4096, lookahead="none")
    torch.testing.assert_close(model(**inputs, **_with(model, cache)).logits, whole, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------- errors that name the fix
def test_from_dynamic_cache_refuses_keys_another_model_made():
    model = tiny_model("llama")
    ids = prompt_ids(40)
    for other, what in ((tiny_model("llama", num_key_value_heads=4), "4 KV heads"),
                        (tiny_model("llama", head_dim=8), "x 8 channels")):
        other.set_attn_implementation("sdpa")
        dynamic = DynamicCache(config=other.config)
        other(input_ids=ids, **_with(model, dynamic))
        with pytest.raises(ValueError, match=what):
            OasisCache.from_dynamic_cache(model, dynamic, token_budget=4096)
    dynamic = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    model(input_ids=ids, **_with(model, dynamic))
    for layer in dynamic.layers:
        layer.keys, layer.values = layer.keys.double(), layer.values.double()
    with pytest.raises(ValueError, match="float64"):
        OasisCache.from_dynamic_cache(model, dynamic, token_budget=4096)


def test_from_dynamic_cache_takes_the_legacy_tuple_form():
    model = tiny_model("llama")
    ids = prompt_ids(60)
    dense = _greedy(model, dense_cache(model), {"input_ids": ids})
    dynamic = DynamicCache(config=model.config)
    model(input_ids=ids[:, :-1], **_with(model, dynamic))
    legacy = tuple((layer.keys, layer.values) for layer in dynamic.layers)
    cache = OasisCache.from_dynamic_cache(model, legacy, token_budget=4096, lookahead="none")
    _same(dense, _greedy(model, cache, {"input_ids": ids}))
    with pytest.raises(TypeError, match="DynamicCache"):
        OasisCache.from_dynamic_cache(model, object(), token_budget=4096)


@pytest.mark.parametrize("option", [dict(block_size=True), dict(token_budget=True), dict(exact=1),
                                    dict(recent_tokens=64.0), dict(num_slots=False)])
def test_options_of_the_wrong_type_are_refused(option):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=next(iter(option))):
        OasisCache(model, **cache_kwargs(dict(**{"token_budget": 4096, "lookahead": "previous", **option})))


def test_crop_with_a_positive_count_answers_as_the_installed_dynamic_cache():
    model = tiny_model("llama")
    ids = prompt_ids(60)
    dynamic = dense_cache(model)
    model(input_ids=ids, **_with(model, dynamic))
    cache = OasisCache(model, token_budget=4096, lookahead="none")
    model(input_ids=ids, **_with(model, cache))
    try:
        dynamic.crop(40)
    except (ValueError, RuntimeError) as error:
        with pytest.raises(type(error)):
            cache.crop(40)
        assert cache.get_seq_length() == 60
    else:
        cache.crop(40)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 40
