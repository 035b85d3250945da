"""The correctness anchor: with token_budget >= context, OasisCache generates exactly what SDPA + DynamicCache
generates (greedy tokens identical, logits within fp32 tolerance), in every generate mode, for every supported
architecture. The host pool is split into small chunks so that blocks span several allocations."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import dense_cache, generate, left_padded, oasis_cache_for, prompt_ids, tiny_model

ATOL = 2e-4  # fp32 logits; sums run in another order than SDPA's
SMALL_CHUNKS = dict(host_chunk_blocks=2)


def assert_same_generation(dense, oasis, check_logits=True):
    assert torch.equal(dense.sequences, oasis.sequences), (dense.sequences, oasis.sequences)
    if check_logits:
        for step, (a, b) in enumerate(zip(dense.logits, oasis.logits)):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4, msg=f"logits differ at step {step}")


def test_greedy(arch):
    model = tiny_model(arch)
    inputs = {"input_ids": prompt_ids(70)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=24, do_sample=False)
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, max_new_tokens=24, do_sample=False)
    assert_same_generation(dense, oasis)


def test_sampling(arch):
    model = tiny_model(arch)
    inputs = {"input_ids": prompt_ids(53)}
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20)
    dense = generate(model, dense_cache(model), inputs, seed=7, **kw)
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, seed=7, **kw)
    assert_same_generation(dense, oasis)


def test_left_padded_batch(arch):
    model = tiny_model(arch)
    inputs = left_padded([61, 37, 50])
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=20, do_sample=False)
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, max_new_tokens=20, do_sample=False)
    assert_same_generation(dense, oasis)


def test_prefill_chunking(arch):
    model = tiny_model(arch)
    inputs = left_padded([90, 71])
    kw = dict(max_new_tokens=12, do_sample=False, prefill_chunk_size=32)
    dense = generate(model, dense_cache(model), inputs, **kw)
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, **kw)
    assert_same_generation(dense, oasis)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_beam_search(arch):
    model = tiny_model(arch)
    inputs = left_padded([45, 33])
    kw = dict(max_new_tokens=12, do_sample=False, num_beams=3, num_return_sequences=2)
    dense = generate(model, dense_cache(model), inputs, **kw)
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, **kw)
    assert_same_generation(dense, oasis, check_logits=False)
    torch.testing.assert_close(oasis.sequences_scores, dense.sequences_scores, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prompt_lookup_decoding(arch):
    model = tiny_model(arch)
    base = prompt_ids(12)[0]
    inputs = {"input_ids": torch.cat([base, base, base, base[:5]])[None]}  # repetitive: lookup proposes tokens
    kw = dict(max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4)
    dense = generate(model, dense_cache(model), inputs, **kw)
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, **kw)
    assert_same_generation(dense, oasis, check_logits=False)


def test_assisted_decoding():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=3, num_hidden_layers=1)
    inputs = {"input_ids": prompt_ids(60)}
    kw = dict(max_new_tokens=20, do_sample=False)
    dense = generate(model, dense_cache(model), inputs, assistant_model=assistant, **kw)
    plain = generate(model, dense_cache(model), inputs, **kw)
    assert torch.equal(dense.sequences, plain.sequences)  # assisted greedy == greedy
    oasis = generate(model, oasis_cache_for(model, **SMALL_CHUNKS), inputs, assistant_model=assistant, **kw)
    assert_same_generation(dense, oasis, check_logits=False)


def test_past_key_values_and_cache_keywords():
    """Both spellings reach the cache (transformers 5.24 renamed `past_key_values` to `cache`)."""
    model = tiny_model("llama")
    inputs = {"input_ids": prompt_ids(40)}
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=8, do_sample=False)
    for keyword in ("past_key_values", "cache"):
        import inspect

        if keyword not in inspect.signature(model.forward).parameters:
            continue
        cache = oasis_cache_for(model)
        torch.manual_seed(0)
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None,
                             **{keyword: cache})
        assert torch.equal(out, dense.sequences)
        assert cache.get_seq_length() == 40 + 8 - 1
        assert cache.stats()["decode_steps"] == 7


def test_model_forward_loop_matches_dynamic_cache():
    """Manual forward calls (no generate), including a multi-token extend after decoding."""
    model = tiny_model("qwen3")
    ids = prompt_ids(80)
    more = prompt_ids(9, seed=5)
    results = []
    for make in (lambda: dense_cache(model), lambda: oasis_cache_for(model, **SMALL_CHUNKS)):
        cache = make()
        logits = []
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(5):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=more, past_key_values=cache, use_cache=True)  # 9-token extend (sparse path)
            logits.append(out.logits[:, -1])
            out = model(input_ids=prompt_ids(40, seed=6), past_key_values=cache, use_cache=True)  # dense extend
            logits.append(out.logits[:, -1])
        results.append(torch.stack(logits))
    torch.testing.assert_close(results[1], results[0], atol=ATOL, rtol=1e-4)


def test_oasis_attention_is_sdpa_for_other_caches():
    """A model switched to "oasis" still works with a DynamicCache, left padding included."""
    model = tiny_model("llama")
    inputs = left_padded([30, 22])
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=10, do_sample=False)
    kept = oasis_cache_for(model)  # switches the model to "oasis" while it lives
    assert model.config._attn_implementation == "oasis"
    other = generate(model, DynamicCache(config=model.config), inputs, max_new_tokens=10, do_sample=False)
    assert_same_generation(dense, other)


def test_other_caches_extend_a_past_exactly_after_the_switch():
    """Other caches after the switch give what they gave before: several new tokens over a past without padding (a
    DynamicCache's chunked prefill, a second turn, assisted decoding: once aligned top-left by SDPA's is_causal, most
    of the past hidden) and a StaticCache, padded or not (its unwritten slots were visible)."""
    model = tiny_model("qwen3")
    prompt, turn = prompt_ids(300, seed=3), prompt_ids(40, seed=4)

    def runs():
        out = {"chunked": generate(model, DynamicCache(config=model.config), {"input_ids": prompt},
                                   max_new_tokens=8, do_sample=False, prefill_chunk_size=64).sequences}
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            out["turn"] = model(input_ids=turn, past_key_values=cache, use_cache=True).logits
        assistant = tiny_model("qwen3", seed=5)
        out["assisted"] = model.generate(input_ids=prompt, assistant_model=assistant, max_new_tokens=12,
                                         do_sample=False, past_key_values=DynamicCache(config=model.config))
        out["static"] = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False,
                                       cache_implementation="static")
        out["static padded"] = model.generate(**left_padded([60, 45]), max_new_tokens=8, do_sample=False,
                                              cache_implementation="static")
        return out

    before = runs()
    kept = oasis_cache_for(model)  # switches the model to "oasis" while it lives
    assert model.config._attn_implementation == "oasis"
    after = runs()
    for name in ("chunked", "assisted", "static", "static padded"):
        assert torch.equal(after[name], before[name]), name
    torch.testing.assert_close(after["turn"], before["turn"], atol=ATOL, rtol=1e-4)


def test_oasis_mask_stays_none_for_mask_less_oasis_steps():
    """A captured step is called without a mask (it reads the cache's padding record), an eagle3 one with its draft
    row beside the token: the mask function must give None there, or the graph would keep one mask of one length
    for every later step. Several tokens after a past note their sizes for the fallback of other caches; a
    StaticCache's offset (a tensor) gets SDPA's own mask."""
    from oasis_cache.compute import attention

    none = attention.oasis_mask(batch_size=2, q_length=2, kv_length=300, q_offset=298, device=torch.device("cpu"))
    assert none is None and attention._handoff.bottom_right == (2, 300)
    assert attention.oasis_mask(batch_size=2, q_length=1, kv_length=300, q_offset=299) is None
    assert attention._handoff.bottom_right is None
    static = attention.oasis_mask(batch_size=2, q_length=1, kv_length=300, q_offset=torch.tensor(120),
                                  device=torch.device("cpu"), attention_mask=torch.ones(2, 300, dtype=torch.bool),
                                  allow_is_causal_skip=False)  # (as transformers asks for a static cache's step)
    assert static is not None and static.dim() == 4 and not bool(static[0, 0, 0, 121:].any())


def test_compiled_decode_in_every_generate_mode():
    """`compile_decode=True` (decode-sized calls of the layers compiled, the cache's update and attention as custom
    ops in the graph) keeps the anchor: at a budget above the context, greedy tokens identical to dense's (logits
    within tolerance) in greedy, sampling, a left-padded batch, beam search, prompt lookup and assisted decoding —
    what a user switching it on meets (one-row calls compiled; the verification forwards stay eager)."""
    model = tiny_model("qwen3")
    assistant = tiny_model("qwen3", seed=3, num_hidden_layers=1)
    base = prompt_ids(12)[0]
    cases = [({"input_ids": prompt_ids(70)}, dict(max_new_tokens=16, do_sample=False), True),
             ({"input_ids": prompt_ids(53)}, dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20,
                                                  seed=7), True),
             (left_padded([61, 37, 50]), dict(max_new_tokens=12, do_sample=False), True),
             (left_padded([45, 33]), dict(max_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=2),
              False),
             ({"input_ids": torch.cat([base, base, base, base[:5]])[None]},
              dict(max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4), False),
             ({"input_ids": prompt_ids(60)}, dict(max_new_tokens=12, do_sample=False, assistant_model=assistant),
              False)]
    for inputs, kw, check_logits in cases:
        dense = generate(model, dense_cache(model), inputs, **kw)
        oasis = generate(model, oasis_cache_for(model, compile_decode=True, **SMALL_CHUNKS), inputs, **kw)
        assert_same_generation(dense, oasis, check_logits=check_logits)
        assert all(layer.forward.compiled is not None for layer in model.model.layers)  # (the compiled path ran)


def test_text_generation_pipeline():
    """`pipeline("text-generation")` passes the cache through to `generate`: the same text as dense."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w2")
    model = tiny_model("llama")
    text = " ".join(f"w{i % 90 + 3}" for i in range(300))
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    dense = pipe(text, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    cache = oasis_cache_for(model, token_budget=4096)
    assert pipe(text, max_new_tokens=8, do_sample=False, **cache.generate_kwargs())[0]["generated_text"] == dense
    assert cache.stats()["decode_steps"] == 7
