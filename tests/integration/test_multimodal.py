"""Masks that say more than which tokens are padding: a multimodal prompt's image tokens attend each other (Gemma 3's
4D masks, `token_type_ids`), attended as given in the forwards that attend densely; a 4D mask a sparse step cannot
follow, or one that is not boolean, refused before the cache keeps the forward's tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoConfig, DynamicCache

from conftest import prompt_ids
from eval.architectures import SMALL, TOWER, tiny_model_of
from oasis_cache import OasisCache

BOI, IMAGE, EOI = 253, 255, 254  # Gemma 3's image markers, inside the tiny vocabulary
IMAGE_TOKENS = 16  # one image: 4 x 4 patches of 14 pixels, one token each
TOL = 1e-4  # ignoring the image tokens' mutual attention moves these logits by 4e-4 to 6e-3


def tiny_gemma3_vision():
    """Gemma 3 with its vision tower (`Gemma3ForConditionalGeneration`), tiny and random: sliding and full layers,
    an image of `IMAGE_TOKENS` tokens."""
    whole = AutoConfig.for_model("gemma3")
    text = whole.text_config
    for name, value in SMALL.items():
        if hasattr(text, name):
            setattr(text, name, value)
    text.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    text.sliding_window = 32
    for name, value in {**TOWER, "image_size": 56}.items():
        setattr(whole.vision_config, name, value)
    whole.mm_tokens_per_image, whole.image_token_index = IMAGE_TOKENS, IMAGE
    whole.boi_token_index, whole.eoi_token_index = BOI, EOI
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(whole).eval()
    model.set_attn_implementation("sdpa")
    return model


def with_image(ids: torch.Tensor, at: int, seed: int) -> dict:
    """`ids` with an image's markers and tokens from position `at`, its pixels and token types."""
    ids = ids.clone()
    ids[:, at], ids[:, at + 1 : at + 1 + IMAGE_TOKENS], ids[:, at + 1 + IMAGE_TOKENS] = BOI, IMAGE, EOI
    pixels = torch.randn(ids.shape[0], 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long())


def run(model, cache, inputs, new_tokens=8):
    return model.generate(**inputs, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)


def assert_same(dense, oasis, steps=None):
    assert torch.equal(dense.sequences, oasis.sequences)
    worst = max((a - b).abs().max().item() for a, b in list(zip(dense.logits, oasis.logits))[:steps])
    assert worst <= TOL, worst


def image_prompt(batch: int, padded: int = 0) -> dict:
    ids = prompt_ids(150, batch=batch) + 3
    mask = torch.ones_like(ids)
    mask[-1, :padded], ids[-1, :padded] = 0, 0  # (the last sequence left-padded)
    return {**with_image(ids, 20, seed=4), "attention_mask": mask}


@pytest.mark.parametrize("batch, padded", [(1, 0), (2, 7)])
def test_gemma3_with_an_image_equals_dense(batch, padded):
    model = tiny_gemma3_vision()
    inputs = image_prompt(batch, padded)
    assert_same(run(model, DynamicCache(config=model.config), inputs),
                run(model, OasisCache(model, token_budget=1024), inputs))


def test_a_second_turn_with_another_image_continues_as_dense():
    model = tiny_gemma3_vision()
    inputs = image_prompt(2, 5)

    def two_turns(cache):
        first = run(model, cache, inputs, new_tokens=4)
        more = with_image(torch.cat([first.sequences, prompt_ids(40, batch=2, seed=3) + 3], dim=1), 160, seed=5)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 44, dtype=torch.long)], dim=1)
        return run(model, cache, {**more, "attention_mask": mask}, new_tokens=6)

    assert_same(two_turns(DynamicCache(config=model.config)), two_turns(OasisCache(model, token_budget=2048)))


def test_an_image_prompt_under_a_sparse_budget_prefills_as_dense():
    model = tiny_gemma3_vision()
    inputs = image_prompt(2, 7)
    cache = OasisCache(model, token_budget=128)
    dense, oasis = run(model, DynamicCache(config=model.config), inputs), run(model, cache, inputs)
    assert (dense.logits[0] - oasis.logits[0]).abs().max().item() <= TOL  # (the prefill's own token: dense)
    assert cache.get_seq_length() == 157 and cache.stats()["decode_steps"] > 0


def test_4d_masks_the_cache_cannot_follow_are_refused_before_it_keeps_the_tokens():
    """A user's 4D mask reaches the attention as given (transformers makes none of its own then)."""
    model = tiny_model_of("llama")
    cache = OasisCache(model, token_budget=1024)
    model(prompt_ids(200) + 3, past_key_values=cache, use_cache=True)  # (blocks in the pool: short forwards decode)
    assert cache.layers[0].decodes(3)

    def forward(mask, new=3):
        return model(prompt_ids(new, seed=2) + 3, attention_mask=mask, past_key_values=cache, use_cache=True).logits

    causal = torch.ones(3, 203, dtype=torch.bool).tril(diagonal=200)[None, None]
    both_ways = causal.clone()
    both_ways[..., 200:] = True  # the three new tokens see each other: not a causal step
    for mask, error, words in [(causal.float(), NotImplementedError, "4D float32 attention mask"),
                               (causal[..., :202], ValueError, "does not fit this forward"),
                               (both_ways, NotImplementedError, "decodes sparsely")]:
        with pytest.raises(error, match=words):
            forward(mask)
        assert cache.get_seq_length() == 200 and all(layer.get_seq_length() == 200 for layer in cache.layers)
    # A causal 4D mask is a decode step's own: the same logits as the 2D mask's.
    twin = OasisCache(model, token_budget=1024)
    model(prompt_ids(200) + 3, past_key_values=twin, use_cache=True)
    given = forward(causal)
    plain = model(prompt_ids(3, seed=2) + 3, attention_mask=torch.ones(1, 203, dtype=torch.long), past_key_values=twin,
                  use_cache=True).logits
    torch.testing.assert_close(given, plain)
