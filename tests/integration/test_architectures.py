"""Architectures beyond the four of the exactness suite: linear-attention hybrids (Qwen3.5, Qwen3-Next) in every
generate mode, a spread of other transformers families equal to dense, and the models OasisCache must refuse —
named, never silently wrong (`eval/architectures.py` runs every causal LM transformers ships; `docs/models.md`)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache

from conftest import _COMMON, HYBRIDS, dense_cache, generate, left_padded, prompt_ids, tiny_hybrid
from eval.architectures import compare, tiny_model_of
from oasis_cache import OasisCache
from oasis_cache.layer import OasisLayer
from oasis_cache.compat import holds_no_keys
from oasis_cache.runtime import replay
from oasis_cache.runtime.build import cache_kwargs

OPTIONS = dict(token_budget=4096, block_size=16, sink_tokens=16, recent_tokens=16, host_chunk_blocks=2)
def assert_same(dense, oasis):
    assert torch.equal(dense.sequences, oasis.sequences), (dense.sequences, oasis.sequences)
    for step, (a, b) in enumerate(zip(dense.logits, oasis.logits)):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4, msg=f"logits differ at step {step}")


MODES = {
    "greedy": ({"input_ids": prompt_ids(150)}, dict(do_sample=False)),
    "sampling": ({"input_ids": prompt_ids(53)}, dict(do_sample=True, temperature=0.8, top_k=20)),
    "left-padded batch": (left_padded([61, 37, 50]), dict(do_sample=False)),
    "prefill_chunk_size": (left_padded([90, 71]), dict(do_sample=False, prefill_chunk_size=32)),
    "beam search": ({"input_ids": prompt_ids(40)}, dict(do_sample=False, num_beams=3)),
    "prompt lookup": ({"input_ids": prompt_ids(60)}, dict(do_sample=False, prompt_lookup_num_tokens=3)),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", [*HYBRIDS, "falcon_h1", "zamba2"])
def test_linear_attention_hybrids_equal_dense(name, mode):
    """Linear-attention layers keep transformers' own state layer; the full-attention ones are offloaded. Falcon-H1's
    layers run attention and a Mamba mixer side by side and cache both in one layer ("hybrid"): `HybridLayer`
    offloads the keys and keeps transformers' state beside them. Zamba2's hybrid layers run shared attention blocks
    (tied weights) whose modules name no layer: told it at each call."""
    model = tiny_hybrid(name) if name in HYBRIDS else sharpened(name)
    inputs, kw = MODES[mode]
    try:
        dense = generate(model, dense_cache(model), inputs, seed=7, max_new_tokens=16, **kw)
    except ValueError as error:  # (transformers 5.17: no assisted generation for models with a state)
        if "stateful" not in str(error):
            raise
        pytest.skip(f"transformers refuses it with any cache: {error}")
    cache = OasisCache(model, **cache_kwargs(OPTIONS))
    kinds = {"falcon_h1": ["HybridLayer"] * 4, "zamba2": ["LinearAttentionLayer", "HybridLayer"] * 2}.get(
        name, ["LinearAttentionLayer", "OasisLayer"])
    assert [type(layer).__name__ for layer in cache.layers] == kinds
    if name == "zamba2":  # (shared blocks' modules, told their layer at each call)
        assert cache._modules[1].layer_idx == cache._modules[3].layer_idx == -1
        with pytest.raises(ValueError, match="told its layer at each call"):  # (the compiled op reads `layer_idx`)
            OasisCache(model, token_budget=1024, compile_decode=True)
    assert_same(dense, generate(model, cache, inputs, seed=7, max_new_tokens=16, **kw))


def test_a_linear_attention_hybrid_chunks_continues_and_converts_as_dense():
    """The cache's own chunked prefill, a second `generate` continuing the first, and `from_dynamic_cache` (the
    linear layers' states copied with the keys) all decode as dense does."""
    model = tiny_hybrid("qwen3_5")
    ids = prompt_ids(300)
    kw = dict(max_new_tokens=10, do_sample=False)
    dense = generate(model, dense_cache(model), {"input_ids": ids}, **kw)
    assert_same(dense, generate(model, OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=64, **OPTIONS))),
                                {"input_ids": ids}, **kw))

    dense_turns, oasis_turns = dense_cache(model), OasisCache(model, **cache_kwargs(OPTIONS))
    for turn in range(2):  # the second turn: the first's sequences plus new text
        inputs = {"input_ids": ids[:, :100] if turn == 0 else torch.cat([first.sequences, ids[:, 200:240]], 1)}
        first = generate(model, dense_turns, inputs, **kw)
        assert_same(first, generate(model, oasis_turns, inputs, **kw))

    prefilled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=prefilled)
    converted = OasisCache.from_dynamic_cache(model, prefilled, **cache_kwargs(OPTIONS))
    assert type(converted.layers[0]).__name__ == "LinearAttentionLayer"
    assert_same(dense, generate(model, converted, {"input_ids": ids}, **kw))


def test_assisted_decoding_on_a_linear_attention_hybrid_prefills_whole():
    """Prompt lookup records the linear layers' past for its rollbacks (`activate_past_recording`); a prefill the
    cache split into chunks then decoded 4e-2 away from dense for OLMo hybrid: such a prefill runs whole."""
    model = sharpened("olmo_hybrid")
    inputs, kw = {"input_ids": prompt_ids(100)}, dict(do_sample=False, prompt_lookup_num_tokens=3, max_new_tokens=12)
    try:
        dense = generate(model, dense_cache(model), inputs, **kw)
    except ValueError as error:  # (transformers 5.17: no assisted generation for models with a state)
        if "stateful" not in str(error):
            raise
        pytest.skip(f"transformers refuses it with any cache: {error}")
    assert_same(dense, generate(model, OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=64, **OPTIONS))),
                                inputs, **kw))


def test_a_linear_attention_hybrid_decodes_sparsely_and_says_what_it_keeps():
    model = tiny_hybrid("qwen3_5")
    cache = OasisCache(model, token_budget=64, advanced=dict(block_size=16, sink_tokens=16, recent_tokens=16))
    out = generate(model, cache, {"input_ids": prompt_ids(300)}, max_new_tokens=8, do_sample=False)
    stats = cache.stats()
    assert out.sequences.shape == (1, 308) and stats["decode_steps"] == 7
    assert stats["tokens_attended_per_step"] <= 64 < stats["seq_length"]
    assert "1 others kept by transformers (LinearAttentionLayer)" in str(cache)
    with pytest.raises(NotImplementedError, match="linear-attention"):
        OasisCache(model, token_budget=256, lookahead="eagle3", draft=object())


def steps_asked(model, cache, part: int, steps: int = 4) -> tuple[list, list]:
    """A 150-token prompt then `steps` greedy one-token forwards; before each, what the cache answers to capture's
    questions: `step_kind()` and part `part` of `replay_signature()` (0: the oasis layers', 1: the kept layers')."""
    kinds, signatures = [], []
    with torch.no_grad():
        out = model(input_ids=prompt_ids(150), past_key_values=cache, use_cache=True)
        for _ in range(steps):
            kinds.append(replay.step_kind(cache))
            signatures.append(replay.replay_signature(cache)[part])
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    return kinds, signatures


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_a_linear_attention_hybrid_s_decode_steps_may_be_captured(name):
    """Its linear-attention states are updated in place (transformers copies into them), so a one-token decode step
    is one a CUDA graph may replay (`step_kind`: CUDA replays it, CPU asks the same question), the states' addresses
    in the replay signature and unchanged across steps; a sliding window's keys (a new tensor each step) or a state
    recording its past for assisted decoding keep every step eager."""
    from oasis_cache import compat

    model = tiny_hybrid(name)
    cache = OasisCache(model, token_budget=4096, advanced=dict(sink_tokens=16, recent_tokens=16))
    kinds, signatures = steps_asked(model, cache, part=1)
    linear = cache.layers[0]
    assert kinds[1:] == ["steady"] * 3  # (the first decode step fixes the summaries' channels: eager)
    assert signatures[1] == signatures[3] and len(signatures[1][0]) >= 2
    assert signatures[1][0][0] == linear.conv_states[0].data_ptr()
    linear.record_past = True
    assert replay.step_kind(cache) is None and compat.state_addresses(linear) is None
    linear.record_past = False
    assert replay.step_kind(cache) == "steady"
    assert compat.state_addresses(transformers.cache_utils.DynamicSlidingWindowLayer(sliding_window=8)) is None


def test_a_layer_holding_keys_and_a_state_chunks_continues_copies_and_converts_as_dense():
    """`HybridLayer` through the cache's chunked prefill, a second turn, a copy decoding alone, a batch repeated
    (the state with the keys), `to_dynamic_cache` / `from_dynamic_cache` (the state carried both
    ways), a reset for a batch of another size, and a sparse budget (the state untouched by the selection)."""
    model = sharpened("falcon_h1")
    ids = prompt_ids(300)
    kw = dict(max_new_tokens=10, do_sample=False)
    dense = generate(model, dense_cache(model), {"input_ids": ids}, **kw)
    chunked = OasisCache(model, **cache_kwargs(dict(prefill_chunk_tokens=64, **OPTIONS)))
    assert_same(dense, generate(model, chunked, {"input_ids": ids}, **kw))

    dense_turns, oasis_turns = dense_cache(model), OasisCache(model, **cache_kwargs(OPTIONS))
    for turn in range(2):  # the second turn: the first's sequences plus new text
        inputs = {"input_ids": ids[:, :100] if turn == 0 else torch.cat([first.sequences, ids[:, 200:240]], 1)}
        if turn == 1:
            copied = copy.deepcopy(oasis_turns)
            assert copied.layers[0].conv_states[0].data_ptr() != oasis_turns.layers[0].conv_states[0].data_ptr()
        first = generate(model, dense_turns, inputs, **kw)
        assert_same(first, generate(model, oasis_turns, inputs, **kw))
    assert_same(first, generate(model, copied, inputs, **kw))  # (the copy, from the first turn's state)

    prefilled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=prefilled)
    converted = OasisCache.from_dynamic_cache(model, copy.deepcopy(prefilled), **cache_kwargs(OPTIONS))
    assert_same(dense, generate(model, converted, {"input_ids": ids}, **kw))
    back = OasisCache.from_dynamic_cache(model, copy.deepcopy(prefilled), **cache_kwargs(OPTIONS)).to_dynamic_cache()
    for mine, theirs in zip(back.layers, prefilled.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.conv_states[0], theirs.conv_states[0])
        assert torch.equal(mine.recurrent_states[0], theirs.recurrent_states[0]) and mine.has_previous_state[0]

    repeated = OasisCache(model,
                          **cache_kwargs(OPTIONS))  # (one sequence prefilled, then repeated, as contrastive search does)
    with torch.no_grad():
        model(input_ids=ids[:, :80], past_key_values=repeated)
        repeated.batch_repeat_interleave(3)
        step = model(input_ids=ids[:, 80:81].expand(3, 1), past_key_values=repeated).logits
        model.set_attn_implementation("sdpa")
        whole = model(input_ids=ids[:, :81].expand(3, 81)).logits[:, -1:]
        model.set_attn_implementation("oasis")
    torch.testing.assert_close(step, whole, atol=2e-4, rtol=1e-4)

    batch = left_padded([70, 55])
    dense_batch = generate(model, dense_cache(model), batch, **kw)
    model.set_attn_implementation("oasis")  # (dense_cache switched it to SDPA after the cache was made)
    oasis_turns.reset()  # (a batch of two now: the state made anew at its size)
    assert_same(dense_batch, generate(model, oasis_turns, batch, **kw))

    sparse = OasisCache(model, token_budget=64, advanced=dict(block_size=16, sink_tokens=16, recent_tokens=16))
    out = generate(model, sparse, {"input_ids": ids}, **kw)
    stats = sparse.stats()
    assert out.sequences.shape == (1, 310) and stats["tokens_attended_per_step"] <= 64 < stats["seq_length"]
    assert sparse.device_nbytes()["linear_state"] > 0 and not sparse.all_oasis_layers  # (no chunk retried smaller)
    with pytest.raises(NotImplementedError, match="Mamba layers"):  # (the draft row would enter the state)
        OasisCache(model, token_budget=256, lookahead="eagle3", draft=object())


def test_a_layer_holding_keys_and_a_state_may_be_captured():
    """A `HybridLayer`'s state is updated in place, so its one-token decode steps may be captured (`step_kind`, which
    CUDA replays), the state's addresses in the replay signature, unchanged across steps; recording its past for
    assisted decoding keeps every step eager."""
    model = sharpened("falcon_h1")
    cache = OasisCache(model, token_budget=4096, advanced=dict(sink_tokens=16, recent_tokens=16))
    kinds, signatures = steps_asked(model, cache, part=0)
    layer = cache.layers[0]
    assert kinds[1:] == ["steady"] * 3 and signatures[1] == signatures[3]
    assert layer.conv_states[0].data_ptr() in signatures[1][0][2][-2]  # (the state's addresses, `state_stamps`)
    layer.record_past = True
    assert replay.step_kind(cache) is None
    layer.record_past = False
    assert replay.step_kind(cache) == "steady"


def test_a_sliding_window_holding_a_state_updates_as_transformers_own_layer():
    """`HybridWindowLayer` ("hybrid_sliding": the only model naming it, Inkling, is refused for its relative
    position bias) against transformers' `LinearAttentionAndSlidingWindowAttentionLayer`, the same calls on both: a
    prefill, one-token steps past the window (ours in its ring), a beam reorder, conversions both ways, and a reset
    then a batch of another size."""
    from transformers.cache_utils import LinearAttentionAndSlidingWindowAttentionLayer

    from oasis_cache.hybrid import HybridWindowLayer

    g = torch.Generator().manual_seed(0)
    ours, theirs = HybridWindowLayer(sliding_window=8), LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=8)

    def step(tokens: int, batch: int = 2, layers=(ours, theirs)):
        kv = torch.randn(2, batch, 2, tokens, 4, generator=g)
        conv, state = torch.randn(batch, 6, tokens, generator=g), torch.randn(batch, 3, 5, generator=g)
        for layer in layers:
            yield (layer.update(kv[0], kv[1]), layer.update_conv_state(conv.clone()),
                   layer.update_recurrent_state(state.clone()))

    def assert_alike(a, b):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert int(a.get_seq_length()) == int(b.get_seq_length())
        assert torch.equal(a.conv_states[0], b.conv_states[0]) and torch.equal(a.recurrent_states[0],
                                                                               b.recurrent_states[0])

    for tokens in (4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1):  # (the prefill sets the convolution's width: 4)
        (our_kv, our_conv, our_state), (their_kv, their_conv, their_state) = step(tokens)
        assert all(torch.equal(x, y) for x, y in zip((*our_kv, our_conv, our_state),
                                                     (*their_kv, their_conv, their_state)))
        assert_alike(ours, theirs)
    assert ours.ring is not None and ours.steady_step() is False  # (in its ring; no padding record: not replayed)
    for layer in (ours, theirs):
        layer.reorder_cache(torch.tensor([1, 1]))
    assert_alike(ours, theirs)
    assert_alike(ours.as_transformers(), theirs) and type(ours.as_transformers()) is type(theirs)
    assert_alike(HybridWindowLayer.of(theirs), theirs)
    ours.reset()
    list(step(3, batch=3, layers=(ours,)))  # (a batch of three after a reset: made anew)
    assert ours.keys.shape[0] == ours.conv_states[0].shape[0] == 3


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "gemma3_text"])
def test_a_reset_hybrid_cache_serves_a_batch_of_another_size(name):
    """`cache.reset()` then a batch of two after a prompt of one: the layers transformers keeps (a gated delta net's
    state, LFM's convolutions, a sliding window) start anew, as the offloaded ones do (transformers' `reset` zeroes a
    linear-attention state in place, and the next batch's update failed on its size)."""
    model = tiny_hybrid(name) if name in HYBRIDS else sharpened(name)
    kw = dict(max_new_tokens=8, do_sample=False)
    batch = left_padded([70, 55])
    expected = generate(model, dense_cache(model), batch, **kw)
    cache = OasisCache(model, **cache_kwargs(OPTIONS))
    generate(model, cache, {"input_ids": prompt_ids(90)}, **kw)
    cache.reset()
    assert_same(expected, generate(model, cache, batch, **kw))


def test_sliding_windows_wider_than_the_context_name_the_way_to_full_attention():
    """Phi-3's 128K variants: a 262,144-token window over 131,072 positions is no bound; the refusal names
    `sliding_window = None`, after which the model is full attention with the same outputs, and is served."""
    config = transformers.Phi3Config(**{**_COMMON, "sliding_window": 8192})  # 4,096 positions
    config._attn_implementation = "sdpa"
    model = transformers.Phi3ForCausalLM(config).eval()
    inputs = {"input_ids": prompt_ids(100)}
    windowed = generate(model, dense_cache(model), inputs, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match="sliding_window = None"):
        OasisCache(model, **cache_kwargs(OPTIONS))
    model.config.sliding_window = None
    assert_same(windowed, generate(model, OasisCache(model, **cache_kwargs(OPTIONS)), inputs, max_new_tokens=8,
                                   do_sample=False))
    model.config.sliding_window = 1024  # a real bound: refused as bounded, nothing to offload
    with pytest.raises(ValueError, match="no full-attention layer"):
        OasisCache(model, **cache_kwargs(OPTIONS))


def test_which_layer_kinds_are_kept():
    assert holds_no_keys("linear_attention") and holds_no_keys("conv")
    assert not holds_no_keys("full_attention") and not holds_no_keys("sliding_attention")
    assert not holds_no_keys("hybrid")  # a state and keys in one layer: not kept whole, not offloaded either
    assert not holds_no_keys("no such kind")


# Families whose tiny random models equal dense through OasisCache (`eval/architectures.py`'s rows), one per way
# their attention differs: query/key norms, partial rotary, biases, parallel blocks, scaling multipliers, NoPE
# layers, sliding-window hybrids, MoE, learned positions, BERT made a decoder (`is_decoder=True`).
EQUAL = ["bert", "gemma", "gemma3_text", "olmo2", "granite", "cohere2", "phi", "stablelm", "gpt_neox", "nemotron",
         "smollm3", "llama4_text", "exaone4", "glm4", "gpt2", "opt", "qwen2_moe", "lfm2", "olmo_hybrid",
         "jamba", "granitemoehybrid", "zamba", "gemma3", "qwen2_5_vl", "llava"]  # (the last three: multimodal, text prompts)


@pytest.mark.parametrize("model_type", EQUAL)
def test_other_families_equal_dense(model_type):
    result, detail = compare(tiny_model_of(model_type))
    assert result == "equal", detail


@pytest.mark.parametrize("model_type, refusal", [
    # attends a transform of what it wrote into the cache: caught at the first layer's attention
    ("diffllama", "attends keys or values other than those it wrote"),
    ("jetmoe", "attends keys or values other than those it wrote"),
    # seen at construction
    ("mllama", "cross-attention layers"),
    ("deepseek_v4", "does not support layer type"),
    ("bloom", "AttentionInterface"),
    ("bert", "not causal"),  # made without is_decoder=True (below)
    ("xlm-roberta-xl", "not causal"),
])
def test_models_oasis_cannot_serve_are_refused_by_name(model_type, refusal):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = tiny_model_of(model_type, is_decoder=refusal != "not causal")
    result, detail = compare(model)
    assert result == "refused" and refusal in detail, (result, detail)
    if "attends" in refusal:  # (refused at the first layer's attention: its new tokens taken back)
        cache = OasisCache(model, token_budget=1024)
        with pytest.raises(NotImplementedError, match=refusal):
            model(prompt_ids(40), **cache.generate_kwargs())
        assert cache.get_seq_length() == 0 and all(layer.get_seq_length() == 0 for layer in cache.layers)


def sharpened(model_type: str):
    """`tiny_model_of(model_type)` with its output embeddings scaled up: greedy choices away from near-ties."""
    model = tiny_model_of(model_type)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def tiny_sinks_model(model_type: str = "gpt_oss"):
    """A model with learned attention sinks (`s_aux`), its sinks drawn large enough to move every softmax, on its
    eager attention (gpt-oss has no SDPA path)."""
    model = sharpened(model_type)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 1.5)
    return model


def sinks_dense(model, inputs, **kw):
    model.set_attn_implementation(model.dense_attention)
    return generate(model, DynamicCache(config=model.config), inputs, seed=7, max_new_tokens=16, **kw)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["sinks", "soft-capped"])
def test_learned_sinks_and_soft_capping_equal_dense(kind, mode):
    """gpt-oss's sinks (one logit per query head in every softmax's sum, `compute/sinks.py`) and Gemma 2's
    soft-capping (`softcap * tanh(score / softcap)`), in the full-attention layers (the cache's: the prefill and the
    sparse step) and the sliding ones (transformers'), in every generate mode."""
    model = tiny_sinks_model() if kind == "sinks" else tiny_capped_model()
    inputs, kw = MODES[mode]
    dense = sinks_dense(model, inputs, **kw)
    cache = OasisCache(model, **cache_kwargs(OPTIONS))
    assert [type(layer).__name__ for layer in cache.layers][:2] == ["WindowLayer", "OasisLayer"]
    assert_same(dense, generate(model, cache, inputs, seed=7, max_new_tokens=16, **kw))


def test_learned_sinks_through_the_cache_s_chunks_turns_and_lookaheads_and_they_count():
    """The cache's own chunked prefill (a chunk over its past kept on the device), a second turn, each lookahead,
    exact: dense's tokens; a sparse budget decodes within it; and the sinks move the outputs (the check can fail)."""
    model = tiny_sinks_model()
    ids = prompt_ids(300)
    dense = sinks_dense(model, {"input_ids": ids})
    for options in (dict(prefill_chunk_tokens=64), dict(lookahead="none"), dict(lookahead="previous", exact=True)):
        assert_same(dense, generate(model, OasisCache(model, **cache_kwargs(dict(**{**OPTIONS, **options}))),
                                    {"input_ids": ids}, seed=7,
                                    max_new_tokens=16))
    turns = OasisCache(model, **cache_kwargs(OPTIONS))
    first = generate(model, turns, {"input_ids": ids[:, :100]}, max_new_tokens=8, do_sample=False)
    second = {"input_ids": torch.cat([first.sequences, ids[:, 200:240]], 1)}
    second_dense = sinks_dense(model, second)
    model.set_attn_implementation("oasis")  # (the dense run switched the model away from the cache's attention)
    assert_same(second_dense, generate(model, turns, second, seed=7, max_new_tokens=16))

    sparse = OasisCache(model, token_budget=64, advanced=dict(block_size=16, sink_tokens=16, recent_tokens=16))
    out = generate(model, sparse, {"input_ids": prompt_ids(400)}, max_new_tokens=12, do_sample=False)
    assert sparse.stats()["tokens_attended_per_step"] <= 64 and torch.isfinite(torch.stack(out.logits)).all()

    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.fill_(-1e4)  # (no weight to the sinks: another model)
    moved = generate(model, OasisCache(model, **cache_kwargs(OPTIONS)), {"input_ids": ids}, max_new_tokens=16,
                     do_sample=False)
    assert not all(torch.allclose(a, b, atol=1e-2) for a, b in zip(dense.logits, moved.logits))


def test_learned_sinks_of_another_shape_and_a_compiled_decode_are_refused_by_name():
    model = tiny_sinks_model()
    with pytest.raises(ValueError, match="learned sinks, which the compiled decode step does not carry"):
        OasisCache(model, token_budget=1024, compile_decode=True)
    attention = next(m for m in model.modules() if getattr(m, "layer_idx", None) == 1 and hasattr(m, "sinks"))
    attention.sinks = torch.nn.Parameter(torch.zeros(2))  # (one per KV head: not what the cache computes)
    cache = OasisCache(model, token_budget=1024)
    with pytest.raises(NotImplementedError, match=r"sinks of shape \(2,\); OasisCache computes one learned sink "
                                                  r"logit per query head \(\[4\]\)"):
        model(prompt_ids(40), **cache.generate_kwargs())
    assert all(layer.get_seq_length() == 0 for layer in cache.layers[1:2])  # (its new tokens taken back)


@pytest.mark.parametrize("model_type", ["flint", "granite_swa", "granitemoe_swa"])
def test_other_families_with_learned_sinks_equal_dense(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    result, detail = compare(tiny_sinks_model(model_type))
    assert result == "equal", detail


@pytest.mark.parametrize("case", ["square", "after a past", "left-padded", "other mask"])
def test_sinks_through_a_kernel_s_log_sum_exp_equal_explicit_scores(case, monkeypatch):
    """`compute/sinks.py`: the kernel way (the flash kernel for CPU here, cuDNN's on CUDA: output scaled by
    sigmoid(lse - sink)) equals the explicit scores, grouped query heads, with the past split from the chunk."""
    from oasis_cache.compute import sinks as sink_attention

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D = 3, 8, 2, 96, 16
    Qn = L if case in ("square", "left-padded") else 40
    query, keys, values = (torch.randn(shape, generator=g) for shape in ((B, Hq, Qn, D), (B, Hkv, L, D),
                                                                         (B, Hkv, L, D)))
    sinks = torch.randn(Hq, generator=g) * 2
    visible = None
    if case == "left-padded":
        visible = torch.arange(L)[None] >= torch.tensor([0, 20, 50])[:, None]
    elif case == "other mask":
        visible = torch.rand(B, L, generator=g) > 0.3
    fast = sink_attention.attention_with_sinks(query, keys, values, 0.25, sinks, visible=visible)
    explicit = sink_attention._explicit(query, keys, values, 0.25, sinks, visible, None)
    rows = slice(None) if visible is None else visible[:, None, L - Qn:, None]  # (padding rows: meaningless)
    torch.testing.assert_close(torch.where(rows, fast, 0) if visible is not None else fast,
                               torch.where(rows, explicit, 0) if visible is not None else explicit,
                               atol=1e-5, rtol=1e-5)
    if case != "other mask":  # (the kernel way is taken: the explicit scores are not computed)
        monkeypatch.setattr(sink_attention, "_explicit", lambda *args: pytest.fail("explicit scores computed"))
        sink_attention.attention_with_sinks(query, keys, values, 0.25, sinks, visible=visible)


@pytest.mark.parametrize("chunk_rows", [False, True])
def test_a_sliding_window_s_sinks_score_only_the_window(chunk_rows, monkeypatch):
    """A sliding layer with learned sinks (gpt-oss's every other layer): given its window, each chunk of queries
    scores only the keys within the window of one of them — the same output as scoring every key under the mask,
    left padding and a past included, whether the queries fit one chunk or many; and fewer scores (a prompt's
    sliding layers cost O(L * window), not O(L^2))."""
    from oasis_cache.compute import sinks as sink_attention
    from transformers.masking_utils import sliding_window_overlay

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Qn, P, D, W = 2, 4, 2, 60, 7, 16, 8  # (P: the past window's tokens before the queries)
    L = P + Qn
    query, keys, values = (torch.randn(shape, generator=g) for shape in ((B, Hq, Qn, D), (B, Hkv, L, D),
                                                                         (B, Hkv, L, D)))
    sinks = torch.randn(Hq, generator=g) * 2
    q_pos, k_pos = torch.arange(P, L)[:, None], torch.arange(L)[None]
    window = sliding_window_overlay(W)(0, 0, q_pos, k_pos) & (k_pos <= q_pos)  # [Qn, L], as transformers masks
    padded = k_pos >= torch.tensor([0, 20])[:, None]  # [B, L]: the second sequence left-padded
    mask = (window[None] & padded[:, None])[:, None]  # [B, 1, Qn, L]
    if chunk_rows:
        monkeypatch.setattr(sink_attention, "_SCORE_ELEMENTS", B * Hq * 3 * (W + 2))  # a few rows a chunk
    scored = []
    softmax = sink_attention.softmax_with_sinks
    monkeypatch.setattr(sink_attention, "softmax_with_sinks",
                        lambda scores, *args: scored.append(scores.shape[-2] * scores.shape[-1]) or softmax(scores,
                                                                                                           *args))
    windowed = sink_attention.attention_with_sinks(query, keys, values, 0.25, sinks, mask=mask, window=W)
    windowed_scores, scored[:] = sum(scored), []
    everything = sink_attention.attention_with_sinks(query, keys, values, 0.25, sinks, mask=mask)
    rows = mask.any(-1, keepdim=True)  # (a fully padded query row: meaningless)
    torch.testing.assert_close(torch.where(rows, windowed, 0), torch.where(rows, everything, 0), atol=1e-5, rtol=1e-5)
    assert windowed_scores < sum(scored) / 2 if chunk_rows else windowed_scores == sum(scored)  # (one chunk: all)


def tiny_capped_model(model_type: str = "gemma2", cap: float = 1.0):
    """A model with attention logit soft-capping (Gemma 2: sliding and full layers, eager attention), capped low
    enough to move every softmax (its configs cap at 50, which random tiny scores never reach)."""
    model = sharpened(model_type)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "attn_logit_softcapping", None) is not None:
                module.attn_logit_softcapping = cap
                module.q_proj.weight.mul_(10.0)  # (scores of a few units: the cap bends them)
                module.k_proj.weight.mul_(10.0)
    model.set_attn_implementation("eager")  # (transformers 5.17's SDPA path for Gemma 2 drops the cap: the
    model.dense_attention = "eager"  # reference is the model's eager attention, which caps)
    return model


def test_soft_capping_through_the_cache_s_chunks_and_a_sparse_budget_and_it_counts():
    """The cache's own chunks and an exact lookahead give dense's tokens; a sparse budget decodes within it; another
    cap gives other logits (the check can fail); compile_decode=True is refused by name."""
    model = tiny_capped_model()
    ids = prompt_ids(300)
    dense = sinks_dense(model, {"input_ids": ids})
    for options in (dict(prefill_chunk_tokens=64), dict(lookahead="previous", exact=True)):
        assert_same(dense, generate(model, OasisCache(model, **cache_kwargs(dict(**{**OPTIONS, **options}))),
                                    {"input_ids": ids}, seed=7,
                                    max_new_tokens=16))
    sparse = OasisCache(model, token_budget=64, advanced=dict(block_size=16, sink_tokens=16, recent_tokens=16))
    out = generate(model, sparse, {"input_ids": prompt_ids(400)}, max_new_tokens=12, do_sample=False)
    assert sparse.stats()["tokens_attended_per_step"] <= 64 and torch.isfinite(torch.stack(out.logits)).all()
    moved = generate(model.apply(lambda m: setattr(m, "attn_logit_softcapping", 50.0)
                                 if getattr(m, "attn_logit_softcapping", None) else None),
                     OasisCache(model, **cache_kwargs(OPTIONS)), {"input_ids": ids}, max_new_tokens=16, do_sample=False)
    assert not all(torch.allclose(a, b, atol=1e-2) for a, b in zip(dense.logits, moved.logits))
    with pytest.raises(ValueError, match="caps its scores"):
        OasisCache(model, token_budget=1024, compile_decode=True)


def tiny_latent_model(model_type: str = "deepseek_v3"):
    """A model with multi-head latent attention (its layers cache a latent row per token, `compute/latent.py`)."""
    return sharpened(model_type)


@pytest.mark.parametrize("mode", list(MODES))
def test_latent_attention_equals_dense(mode):
    """DeepSeek-V3's MLA: the layers store the latent rows ([kv_nope, k_rot], one KV head) and attend them absorbed,
    in every generate mode."""
    model = tiny_latent_model()
    inputs, kw = MODES[mode]
    dense = generate(model, DynamicCache(config=model.config), inputs, seed=7, max_new_tokens=16, **kw)
    cache = OasisCache(model, **cache_kwargs(OPTIONS))
    assert_same(dense, generate(model, cache, inputs, seed=7, max_new_tokens=16, **kw))
    attn = model.model.layers[0].self_attn
    layer = cache.layers[0]
    assert (layer.num_kv_heads, layer.head_dim) == (1, attn.kv_lora_rank + attn.qk_rope_head_dim)
    # The model's attention is the cache's now: for any other cache it is SDPA's, values narrower than the queries.
    assert model.config._attn_implementation == "oasis"
    assert_same(dense, generate(model, DynamicCache(config=model.config), inputs, seed=7, max_new_tokens=16, **kw))


def test_latent_attention_through_chunks_turns_conversions_and_a_sparse_budget():
    """The cache's own chunks and an exact lookahead, a second turn, a round trip through transformers' cache (its
    latent and rotary keys) and a fork give dense's tokens; a sparse budget decodes within it; compile_decode=True
    and a learned indexer (DSA) are refused by name."""
    model = tiny_latent_model()
    ids = prompt_ids(300)
    dense = generate(model, DynamicCache(config=model.config), {"input_ids": ids}, max_new_tokens=16, do_sample=False)
    for options in (dict(prefill_chunk_tokens=64), dict(lookahead="previous", exact=True)):
        assert_same(dense, generate(model, OasisCache(model, **cache_kwargs(dict(**{**OPTIONS, **options}))),
                                    {"input_ids": ids},
                                    max_new_tokens=16, do_sample=False))
    turns = OasisCache(model, **cache_kwargs(OPTIONS))
    first = generate(model, turns, {"input_ids": ids[:, :100]}, max_new_tokens=8, do_sample=False)
    second = torch.cat([first.sequences, ids[:, 200:240]], 1)
    second = {"input_ids": second, "attention_mask": torch.ones_like(second)}  # (a generated 0 is no padding)
    assert_same(generate(model, DynamicCache(config=model.config), second, max_new_tokens=16, do_sample=False),
                generate(model, turns, second, max_new_tokens=16, do_sample=False))

    prefilled = OasisCache(model, **cache_kwargs(OPTIONS))
    model(ids[:, :-1], **prefilled.generate_kwargs())
    plain = prefilled.to_dynamic_cache()
    assert plain.layers[0].keys.shape[-1] == model.model.layers[0].self_attn.kv_lora_rank  # (transformers' own form)
    for cache in (OasisCache.from_dynamic_cache(model, plain, **cache_kwargs(OPTIONS)), prefilled.fork()):
        assert_same(dense, generate(model, cache, {"input_ids": ids}, max_new_tokens=16, do_sample=False))

    sparse = OasisCache(model, token_budget=64, advanced=dict(block_size=16, sink_tokens=16, recent_tokens=16))
    out = generate(model, sparse, {"input_ids": prompt_ids(400)}, max_new_tokens=12, do_sample=False)
    assert sparse.stats()["tokens_attended_per_step"] <= 64 and torch.isfinite(torch.stack(out.logits)).all()
    with pytest.raises(ValueError, match=r"attends latent rows \(MLA\)"):
        OasisCache(model, token_budget=1024, compile_decode=True)
    model.model.layers[1].self_attn.indexer = torch.nn.Identity()
    with pytest.raises(NotImplementedError, match="learned indexer"):
        OasisCache(model, token_budget=1024)


@pytest.mark.parametrize("expanded", [True, False])
def test_latent_dense_forwards_expanded_or_absorbed_equal_dense(expanded, monkeypatch):
    """A dense forward of an MLA layer (a prefill, the cache's chunks, a left-padded batch's) attends the keys and
    values expanded from the rows where they fit `latent.EXPAND_BYTES`, else the rows absorbed: dense's tokens and
    logits either way; decode steps always attend absorbed."""
    from oasis_cache.compute import latent

    made = []
    expand = latent.expanded_attention
    monkeypatch.setattr(latent, "expanded_attention", lambda *args: made.append(expand(*args)) or made[-1])
    if not expanded:
        monkeypatch.setattr(latent, "EXPAND_BYTES", 0)
    model = tiny_latent_model()
    for inputs, options in (({"input_ids": prompt_ids(300)}, dict(prefill_chunk_tokens=64)),
                            (left_padded([61, 37, 50]), {})):
        dense = generate(model, DynamicCache(config=model.config), inputs, max_new_tokens=12, do_sample=False)
        assert_same(dense, generate(model, OasisCache(model, **cache_kwargs(dict(**OPTIONS, **options))), inputs,
                                    max_new_tokens=12,
                                    do_sample=False))
    layers = sum(isinstance(layer, OasisLayer) for layer in OasisCache(model, **cache_kwargs(OPTIONS)).layers)
    assert len(made) == layers * (300 // 64 + 1 + 1)  # (a dense forward a chunk and a prompt, each layer)
    assert all((attend is not None) == expanded for attend in made)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "glm4_moe_lite", "minicpm3", "kimi_linear", "youtu"])
def test_other_latent_attention_families_equal_dense(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    result, detail = compare(tiny_model_of(model_type))
    assert result == "equal", detail


def test_gemma4_without_shared_layers_is_served_and_with_them_refused():
    """Gemma 4's full-attention layers with their own (wider) head size, keys equal to values or not: dense's
    tokens; its configs always name a KV-sharing mode ("store": a layer keeps what its update returned), refused only
    where a layer reuses another's keys and values (`num_kv_shared_layers`, the small Gemma 4s)."""
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    model = tiny_model_of("gemma4_text")
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert full and all(model.model.layers[i].self_attn.head_dim == 32 for i in full)  # (16 in the sliding ones)
    settings = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "transformers_version")}
    for k_eq_v in (False, True):
        torch.manual_seed(0)
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**settings,
                                                                              "attention_k_eq_v": k_eq_v})).eval()
        model.set_attn_implementation("sdpa")
        result, detail = compare(model)
        assert result == "equal", (k_eq_v, detail)
    shared = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**settings,
                                                                          "num_kv_shared_layers": 2})).eval()
    with pytest.raises(NotImplementedError, match="shares KV caches between layers"):
        OasisCache(shared, token_budget=1024)


def tiny_narrow_values_model():
    """MiMo-V2-Flash shaped tiny: keys of 16 channels, values of 8, learned sinks, sliding and full layers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if "mimo_v2_flash" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no mimo_v2_flash")
    model = tiny_sinks_model("mimo_v2_flash")
    assert model.config.v_head_dim < model.config.head_dim
    return model


@pytest.mark.parametrize("mode", list(MODES))
def test_values_narrower_than_keys_equal_dense(mode):
    """Values of fewer channels than keys (MiMo-V2-Flash: 128 and 192) are stored padded with zeros to the keys' head
    size (`OasisLayer._as_wide_as_keys`) and the attention's output cut back; its sliding layers keep two rings
    (`window.WindowLayer`). Every generate mode gives dense's tokens and logits."""
    model = tiny_narrow_values_model()
    inputs, kw = MODES[mode]
    dense = sinks_dense(model, inputs, **kw)
    cache = OasisCache(model, **cache_kwargs(OPTIONS))
    assert_same(dense, generate(model, cache, inputs, seed=7, max_new_tokens=16, **kw))


def test_values_narrower_than_keys_round_trip_and_decode_sparsely():
    """What the cache holds of narrower values is dense's values (a `DynamicCache` round trip: no padding comes
    out); the cache's chunks and a second turn give dense's tokens; a sparse budget decodes within it. Wider values
    than keys are refused by name."""
    model = tiny_narrow_values_model()
    ids = prompt_ids(300)
    dense_cache_ = DynamicCache(config=model.config)
    model.set_attn_implementation(model.dense_attention)
    dense = generate(model, dense_cache_, {"input_ids": ids}, seed=7, max_new_tokens=16)
    cache = OasisCache(model, **cache_kwargs(dict(**{**OPTIONS, "prefill_chunk_tokens": 64})))
    assert_same(dense, generate(model, cache, {"input_ids": ids}, seed=7, max_new_tokens=16))
    held = cache.to_dynamic_cache()
    full = [i for i, layer in enumerate(cache.layers) if isinstance(layer, OasisLayer)]
    assert full and all(cache.layers[i].value_dim == model.config.v_head_dim for i in full)
    for i in full:  # (dense's cache holds the last token's keys too: it ran one forward more)
        n = held.layers[i].values.shape[-2]
        assert held.layers[i].values.shape[-1] == model.config.v_head_dim
        torch.testing.assert_close(held.layers[i].values, dense_cache_.layers[i].values[:, :, :n])
        torch.testing.assert_close(held.layers[i].keys, dense_cache_.layers[i].keys[:, :, :n])
    sparse = OasisCache(model, token_budget=64, advanced=dict(block_size=16, sink_tokens=16, recent_tokens=16))
    out = generate(model, sparse, {"input_ids": prompt_ids(400)}, max_new_tokens=12, do_sample=False)
    assert sparse.stats()["tokens_attended_per_step"] <= 64 and torch.isfinite(torch.stack(out.logits)).all()
    layer = OasisLayer(cache, full[0])
    with pytest.raises(NotImplementedError, match="values of 32 channels are wider than keys of 16"):
        layer.update(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 32))
