"""Public API behaviour: clear errors on bad input, stats, reset/crop, and bounded device memory."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from oasis_cache import OasisCache, OasisConfig
from oasis_cache.layer import OasisLayer
from oasis_cache.runtime.build import cache_kwargs

from conftest import dense_cache, generate, oasis_cache_for, prompt_ids, tiny_model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(token_budget=64, block_size=12), "power of two"),
        (dict(token_budget=64, block_size=0), "power of two"),
        (dict(token_budget=64, sink_tokens=32, recent_tokens=32), "below what sink and recent"),
        (dict(token_budget=0), "positive int"),
        (dict(token_budget=256, lookahead="psychic"), "lookahead must be one of"),
        (dict(token_budget=256, num_slots=3), "num_slots"),
        (dict(token_budget=256, backend="carrier-pigeon"), "backend must be one of"),
        (dict(token_budget=256, scorer="psychic"), "scorer must be one of"),
        (dict(token_budget=256, scorer="bound", fp8_levels=True), "fp8_levels=True is for scorer='bits'"),
        (dict(token_budget=256, fp8_levels="yes"), "fp8_levels must be bool or None"),
        (dict(token_budget=256, summary_channels=0), r"summary_channels must be None \(automatic\) or in"),
        (dict(token_budget=256, summary_channels=1.5), r"summary_channels must be None \(automatic\) or in"),
        (dict(token_budget=256, scorer="bound", summary_channels=0.5), "summary_channels < 1 is for scorer='bits'"),
        (dict(token_budget=256, attention_kernel="yes"), "attention_kernel must be bool or None"),
        (dict(token_budget=256, top_k_kernel="yes"), "top_k_kernel must be bool or None"),
        (dict(token_budget=256, compile_ahead="yes"), "compile_ahead must be bool or None"),
        (dict(token_budget=256, top_k_kernel=True, fetch_ratio=0.1), "pass one of top_k_kernel=True and fetch_ratio"),
        (dict(token_budget=256, backend="torch", attention_kernel=True), "attention_kernel=True runs a Triton kernel"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OasisConfig(**kwargs)


@pytest.mark.parametrize("option", ["attention_kernel", "top_k_kernel"])
def test_a_triton_kernel_without_the_triton_backend_names_the_fix(option):
    """On CPU ("auto" resolves to the torch backend) the Triton decode attention or top-k cannot run: the first
    forward says so instead of running the torch path silently."""
    model = tiny_model("llama")
    cache = OasisCache(model, **cache_kwargs(dict(token_budget=128, **{option: True})))
    with pytest.raises(ValueError, match=f"leave {option} at its default"):
        generate(model, cache, {"input_ids": prompt_ids(40)}, max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(token_budget=256, fetch_ratio=0.0), "fetch_ratio must be in"),
        (dict(token_budget=256, fetch_ratio=1.5), "fetch_ratio must be in"),
        (dict(token_budget=256, exact=True), "use it with lookahead='previous'"),
    ],
)
def test_bad_lookahead_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OasisConfig(**kwargs)


def test_cache_used_with_another_model_raises():
    first, second = tiny_model("llama"), tiny_model("llama", seed=1)
    cache = OasisCache(first, token_budget=256)
    second.set_attn_implementation("oasis")
    with pytest.raises(RuntimeError, match="created for another model"):
        second.generate(input_ids=prompt_ids(20), past_key_values=cache, max_new_tokens=2, pad_token_id=0)


def test_cache_of_another_model_instance_raises_before_writing():
    """Two models each with an OasisCache (their forwards both routed through one): the cache of one in the other's
    generate is refused before anything is written, naming the fix."""
    first, second = tiny_model("llama"), tiny_model("llama", seed=1)
    cache, _ = OasisCache(first, token_budget=256), OasisCache(second, token_budget=256)
    with pytest.raises(ValueError, match=r"made for another model instance .* OasisCache\(model"):
        second.generate(input_ids=prompt_ids(20), past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    assert cache.get_seq_length() == 0


def test_unknown_options_and_bool_budgets_are_refused_naming_the_fix():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="unknown option 'lookahed'. Did you mean 'lookahead'"):
        OasisCache(model, token_budget=256, lookahed="none")
    with pytest.raises(TypeError, match="unknown option 'colour'. Every option: docs/options.md"):
        OasisCache(model, token_budget=256, colour="blue")
    with pytest.raises(TypeError, match=r"token_budget must be int, got True \(bool\)"):
        OasisCache(model, token_budget=True)


def test_a_prompt_no_longer_than_the_cache_names_reset():
    """generate given a prompt no longer than what the cache holds slices it to nothing: a clear error, the cache
    untouched, instead of a reshape error deep in the model."""
    model = tiny_model("qwen3")
    cache = OasisCache(model, token_budget=512)
    prompt = prompt_ids(100)
    model.generate(input_ids=prompt, past_key_values=cache, max_new_tokens=3, do_sample=False)
    held = cache.get_seq_length()
    with pytest.raises(ValueError, match=rf"holds {held} tokens and the forward brings no new one.*cache.reset"):
        model.generate(input_ids=prompt[:, :50], past_key_values=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="brings no new one"):
        model(input_ids=prompt[:, :0], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == held


def test_attention_implementation_changed_behind_the_cache_raises():
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=256)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="Nothing of this forward was written"):
        model(input_ids=prompt_ids(20), past_key_values=cache, use_cache=True)


def test_reusing_a_filled_cache_for_another_batch_names_reset():
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=256)
    model.generate(input_ids=prompt_ids(20), past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"cache.reset\(\)"):
        model(input_ids=prompt_ids(20, batch=3), past_key_values=cache, use_cache=True)
    cache.reset()
    assert cache.get_seq_length() == 0
    dense = generate(model, dense_cache(model), {"input_ids": prompt_ids(33, batch=3)}, max_new_tokens=5,
                     do_sample=False)
    model.set_attn_implementation("oasis")
    again = generate(model, cache, {"input_ids": prompt_ids(33, batch=3)}, max_new_tokens=5, do_sample=False)
    assert torch.equal(dense.sequences, again.sequences)


def test_model_without_full_attention_layer_is_refused():
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         layer_types=["sliding_attention", "sliding_attention"], sliding_window=32,
                         use_sliding_window=True)
    with pytest.raises(ValueError, match="no full-attention layer"):
        OasisCache(Qwen3ForCausalLM(config), token_budget=256)


def test_hybrid_model_keeps_sliding_layers_and_matches_dense():
    model = tiny_model("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=48,
                       use_sliding_window=True)
    cache = oasis_cache_for(model)
    assert [type(layer).__name__ for layer in cache.layers] == ["WindowLayer", "OasisLayer"]
    inputs = {"input_ids": prompt_ids(100)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=10, do_sample=False)
    oasis = generate(model, oasis_cache_for(model), inputs, max_new_tokens=10, do_sample=False)
    assert torch.equal(dense.sequences, oasis.sequences)
    for a, b in zip(dense.logits, oasis.logits):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_encoder_decoder_is_refused():
    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = LlamaConfig(is_encoder_decoder=True)

        def set_attn_implementation(self, name):
            pass

    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        OasisCache(Fake(), token_budget=256)


def test_stats_are_a_plain_dict_with_the_documented_fields():
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16, recent_tokens=16))
    model.generate(input_ids=prompt_ids(200), past_key_values=cache, max_new_tokens=11, pad_token_id=0,
                   eos_token_id=None, do_sample=False)
    stats = cache.stats()
    assert type(stats) is dict
    for key in ("decode_steps", "tokens_attended_per_step", "blocks_selected_per_step", "blocks_fetched",
                "bytes_fetched", "hit_rate", "device_bytes", "host_bytes"):
        assert key in stats
    assert stats["decode_steps"] == 10 and stats["prefill_tokens"] == 200 and stats["scorer"] == "bits"
    assert stats["blocks_selected_per_step"] == cache.config.num_selected_blocks
    assert stats["tokens_attended_per_step"] <= 64
    assert stats["bytes_fetched"] == stats["blocks_fetched"] * 2 * 16 * 16 * 4  # K+V, T=16, D=16, fp32


def test_crop_into_complete_blocks_then_continue():
    model = tiny_model("llama")
    ids = prompt_ids(100)
    cache = oasis_cache_for(model, host_chunk_blocks=2)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.crop(-37)  # back to 63 tokens: blocks 3..5 return to the device
        assert cache.get_seq_length() == 63
        layer = next(l for l in cache.layers if isinstance(l, OasisLayer))
        assert layer.pool.num_blocks == 3 and layer.recent.num_tokens == 15
        out = model(input_ids=ids[:, 63:], past_key_values=cache, use_cache=True).logits
    reference = model(input_ids=ids).logits  # "oasis" without a cache behaves like SDPA
    torch.testing.assert_close(out, reference[:, 63:], atol=2e-4, rtol=1e-4)


def test_device_memory_does_not_grow_with_context_beyond_summaries():
    """What the cache holds on the compute device: a fixed working set plus O(context / block_size) metadata."""
    model = tiny_model("llama")
    held = {}
    for context in (300, 1200):
        cache = OasisCache(model, token_budget=128, advanced=dict(sink_tokens=16, recent_tokens=16))
        model.generate(input_ids=prompt_ids(context), past_key_values=cache, max_new_tokens=3, pad_token_id=0,
                       eos_token_id=None, do_sample=False)
        held[context] = cache.device_nbytes()
    small, large = held[300], held[1200]
    assert small["working_set"] == large["working_set"]  # slots and the recent-token region: fixed
    assert large["recent_overflow"] == 0
    # Summaries (min+max per block, 1 bit per key channel and token) and the block -> slot table grow with blocks,
    # i.e. context / T.
    H, D, T, layers = 2, 16, 16, 2
    blocks = 1200 // T + 1
    summary_bytes = (2 * H * D * 4 + H * T * D // 8) * layers  # per block
    table_bytes = H * 8 * layers  # per block
    assert large["summaries"] <= 2 * blocks * summary_bytes  # capacity doubles
    assert large["slot_map"] <= 2 * blocks * table_bytes + small["slot_map"]
    dense_kv = 2 * layers * H * 1200 * D * 4
    assert sum(large.values()) < dense_kv / 2


def test_device_clock_is_the_decode_clock_on_the_device():
    """The slot map's LRU clock lives on the device (a captured step reads it there): it equals the host's count of
    decode forwards whenever read, advancing by an add, and starts over on `reset`."""
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=160, lookahead="previous")
    generate(model, cache, {"input_ids": prompt_ids(300)}, max_new_tokens=12, do_sample=False)
    clock = cache.context.device_clock("cpu")
    assert cache.decode_clock > 0 and clock.tolist() == [cache.decode_clock]
    cache.decode_clock += 3
    assert cache.context.device_clock("cpu") is clock and clock.tolist() == [cache.decode_clock]
    cache.reset()
    assert cache.context.device_clock("cpu").tolist() == [0]


def test_summary_channels_must_keep_rotary_pairs():
    """A fraction of the key channels that is not an even count for this model's heads is refused when the layers
    learn the head size (the first forward), naming fractions that fit."""
    model = tiny_model("qwen3")  # head_dim 16
    cache = OasisCache(model, token_budget=256, advanced=dict(summary_channels=0.3))
    with pytest.raises(ValueError, match=r"keeps 4.8 of this model's 16 key channels.*0.5 \(8\)"):
        generate(model, cache, {"input_ids": prompt_ids(40)}, max_new_tokens=2, do_sample=False)


def test_every_option_variant_is_a_valid_config():
    """The "@name" variants of bench/eval (`eval/variants.py`) each make a valid config, and so do two joined by "+";
    an unknown name is refused with the list, two that disagree by what they set."""
    from eval.variants import OPTION_VARIANTS, variant_options

    for name in OPTION_VARIANTS:
        options = variant_options(name)
        config = OasisConfig(token_budget=512, **options)
        assert all(getattr(config, key) == value for key, value in options.items())
    with pytest.raises(ValueError, match="@gather32"):
        variant_options("gather33")
    assert variant_options("compiled+gather64") == dict(compile_decode=True, gather_programs=64)
    with pytest.raises(ValueError, match="@compiled sets compile_decode otherwise"):
        variant_options("compiledsoon+compiled")


def test_print_says_what_was_chosen_and_why(monkeypatch):
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=128)
    text = str(cache)
    assert "lookahead 'none' (picked: on the CPU no transfer is there to hide" in text
    assert "decode steps: eager" in text
    from oasis_cache.runtime import build as cache_module

    with monkeypatch.context() as patched:  # (where blocks cross a link and no head ships: the trainer is named)
        patched.setattr(cache_module, "on_an_accelerator", lambda model: True)
        assert "oasis_cache.draft.train" in str(OasisCache(model, token_budget=128))
    model.generate(input_ids=prompt_ids(100), past_key_values=cache, max_new_tokens=3, pad_token_id=0)
    text = str(cache)
    assert "102 tokens cached" in text and "50% of the key channels" in text and "torch backend" in text
    assert cache.stats()["why"]["lookahead"].startswith("picked")
    assert repr(cache).startswith("OasisCache(token_budget=128")  # one line, as in generate's outputs


def test_eagle3_without_a_matching_head_names_the_trainer():
    with pytest.raises(ValueError, match=r"python -m oasis_cache.draft.train --target"):
        OasisCache(tiny_model("llama"), token_budget=256, lookahead="eagle3")


def test_generate_kwargs_run_without_a_deprecation_warning():
    """`model.generate(**inputs, **cache.generate_kwargs())`: the keyword the installed transformers wants (`cache`
    from 5.24, `past_key_values` before), no FutureWarning, and the tokens of `past_key_values=`."""
    import warnings

    import transformers

    model = tiny_model("llama")
    ids = prompt_ids(90)
    cache = OasisCache(model, token_budget=64, advanced=dict(block_size=8, sink_tokens=8, recent_tokens=16))
    kwargs = cache.generate_kwargs()
    newer = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 24)
    assert list(kwargs) == (["cache"] if newer else ["past_key_values"]) and kwargs[next(iter(kwargs))] is cache
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(input_ids=ids, **kwargs, max_new_tokens=12, do_sample=False)
    other = OasisCache(model, token_budget=64, advanced=dict(block_size=8, sink_tokens=8, recent_tokens=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert torch.equal(model.generate(input_ids=ids, past_key_values=other, max_new_tokens=12, do_sample=False), out)
