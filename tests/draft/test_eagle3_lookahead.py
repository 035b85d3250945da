"""lookahead="eagle3": the draft token rides beside the real one. With a budget covering the context the output equals
dense (the draft row changes nothing it must not), its keys/values never enter the cache, and with a small budget
the attended blocks are those the draft row chose one step earlier."""

from __future__ import annotations

import pytest
import torch

from oasis_cache import OasisCache
from oasis_cache.layer import OasisLayer

from conftest import dense_cache, drafts_of_two_generates, generate, left_padded, prompt_ids, random_head, tiny_model

ATOL = 2e-4


def _deeper(head, layers):
    """`head` with `layers` decoder layers, the added ones random (`Eagle3Head.deepen` starts them as the identity)."""
    if layers == 1:
        return head
    deeper = head.deepen(layers)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in deeper.post_layers.parameters():
            p.normal_(0, 0.5)
    return deeper


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("arch, layers", [("llama", 1), ("qwen3", 1), ("qwen3", 2)])
def test_full_budget_equals_dense(arch, layers, exact):
    model = tiny_model(arch, num_hidden_layers=4)
    head = _deeper(random_head(model), layers)
    for inputs, kw in [
        ({"input_ids": prompt_ids(70)}, dict(max_new_tokens=20, do_sample=False)),
        (left_padded([61, 37, 50]), dict(max_new_tokens=16, do_sample=False, prefill_chunk_size=32)),
        (left_padded([45, 33]), dict(max_new_tokens=10, do_sample=False, num_beams=3)),
        ({"input_ids": prompt_ids(40)}, dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)),
    ]:
        dense = generate(model, dense_cache(model), inputs, **kw)
        cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=head, exact=exact)
        oasis = generate(model, cache, inputs, **kw)
        assert torch.equal(dense.sequences, oasis.sequences), kw
        if "num_beams" not in kw:
            for a, b in zip(dense.logits, oasis.logits):
                torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
        n = inputs["input_ids"].shape[1] + kw["max_new_tokens"] - 1
        assert cache.get_seq_length() == n  # no draft token stayed
        stats = cache.stats()
        assert stats["decode_tokens"] == stats["decode_steps"]  # the draft rows are not counted as decoded


def test_draft_keys_and_values_never_enter_the_pool():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt_ids(150)
    ref = dense_cache(model)
    model.generate(input_ids=ids, past_key_values=ref, max_new_tokens=30, do_sample=False, pad_token_id=0,
                   eos_token_id=None)
    cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=random_head(model),
                       advanced=dict(host_chunk_blocks=3))
    model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=30, do_sample=False, pad_token_id=0,
                   eos_token_id=None)
    for layer, dense_layer in zip(cache.layers, ref.layers):
        keys, values = layer.full_kv()
        torch.testing.assert_close(keys, dense_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, dense_layer.values, atol=1e-5, rtol=1e-5)


def test_small_budget_attends_what_the_draft_row_selected(monkeypatch):
    model = tiny_model("qwen3", num_hidden_layers=4)
    calls = []
    attend = OasisLayer.attend

    def recording(layer, query, visible, scale):
        out = attend(layer, query, visible, scale)
        if getattr(layer, "last_selection", None) is not None:
            calls.append((query, visible, scale, out, layer.last_selection))
            layer.last_selection = None
        return out

    monkeypatch.setattr(OasisLayer, "attend", recording)
    cache = OasisCache(model, token_budget=128, lookahead="eagle3",
                       draft=random_head(model), advanced=dict(sink_tokens=16, recent_tokens=32, measure=True))
    cache.record_selection = True
    out = generate(model, cache, left_padded([300, 260]), max_new_tokens=8, do_sample=False)
    assert len(calls) == 7 * 4
    for query, visible, scale, result, selected in calls:
        assert query.shape[2] == 2  # the real row and the draft row
    stats = cache.stats()
    assert stats["blocks_fetched_on_critical_path"] == 0
    assert stats["prediction_recall"] is not None
    assert out.sequences.shape[1] == 300 + 8


def test_eagle3_needs_a_head_and_full_attention_layers():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs a draft head"):
        OasisCache(model, token_budget=256, lookahead="eagle3")
    with pytest.raises(ValueError, match="used by lookahead='eagle3' only"):
        OasisCache(model, token_budget=256, lookahead="previous", draft=random_head(model))
    hybrid = tiny_model("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=48,
                        use_sliding_window=True)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        OasisCache(hybrid, token_budget=256, lookahead="eagle3", draft=random_head(hybrid))


def test_oracle_draft_plumbing():
    """An oracle (the true next token as the draft) replaces the head's guess and counts how often the head agreed;
    the recall it reaches on real weights is checked in test_smollm2.py (a random tiny model has no locality)."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    ids = prompt_ids(600)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    truth = model.generate(input_ids=ids, past_key_values=dense_cache(model), **kw)[0]
    cache = OasisCache(model, token_budget=512, lookahead="eagle3",
                       draft=random_head(model), advanced=dict(sink_tokens=16, recent_tokens=16, measure=True))
    cache.ride_along.oracle = lambda position: truth[position].view(1, 1)
    model.generate(input_ids=ids, past_key_values=cache, **kw)
    assert cache.ride_along.draft_hits[1] == 15
    assert 0.0 < cache.stats()["prediction_recall"] <= 1.0


def test_default_lookahead_uses_a_matching_bundled_head(tmp_path, monkeypatch):
    """No `lookahead` given: eagle3 with the bundled head trained for this model (also for a slightly perturbed,
    e.g. quantized, copy of its weights), none for another model of the same shape; an explicit choice wins."""
    from oasis_cache.draft import bundled, save_eagle3

    from oasis_cache.runtime import build as cache_module

    model = tiny_model("llama", num_hidden_layers=4)
    save_eagle3(random_head(model), tmp_path / "tiny-head")
    bundled.write_target(model, tmp_path / "tiny-head")
    monkeypatch.setattr(bundled, "HEADS_DIR", tmp_path)
    on_cpu = OasisCache(model, token_budget=256)  # (the CPU: no transfer to hide, the fastest exact way)
    assert on_cpu.config.lookahead == "none" and "CPU" in on_cpu.why["lookahead"]
    monkeypatch.setattr(cache_module, "on_an_accelerator", lambda model: True)  # (as on a GPU)

    cache = OasisCache(model, token_budget=256)
    assert cache.config.lookahead == "eagle3" and cache.config.exact and cache.ride_along is not None
    cache.ride_along.remove()
    assert not OasisCache(model, token_budget=256, exact=False).config.exact
    assert OasisCache(model, token_budget=256, lookahead="previous").ride_along is None

    quantized = tiny_model("llama", num_hidden_layers=4)
    with torch.no_grad():
        weight = quantized.get_input_embeddings().weight
        weight.add_(0.05 * weight.abs().mean() * torch.randn_like(weight))
    assert bundled.bundled_head_for(quantized) == tmp_path / "tiny-head"

    other = tiny_model("llama", seed=1, num_hidden_layers=4)
    assert bundled.bundled_head_for(other) is None
    assert OasisCache(other, token_budget=256).config.lookahead == "none"
    wider = tiny_model("llama", num_hidden_layers=4, num_attention_heads=8)
    assert bundled.bundled_head_for(wider) is None


def test_a_draft_without_lookahead_means_eagle3():
    model = tiny_model("llama", num_hidden_layers=4)
    cache = OasisCache(model, token_budget=256, draft=random_head(model))
    assert cache.config.lookahead == "eagle3"


def test_exact_eagle3_attends_what_none_attends():
    """With miss repair the draft only prefetches: at a small budget eagle3 + exact generates what "none" does (the
    default that picks eagle3 sets exact for this reason)."""
    model = tiny_model("llama", num_hidden_layers=4)
    inputs = left_padded([300, 270])
    kw = dict(max_new_tokens=10, do_sample=False)
    base = generate(model, OasisCache(model, token_budget=128, lookahead="none"), inputs, **kw)
    cache = OasisCache(model, token_budget=128, lookahead="eagle3", exact=True, draft=random_head(model))
    drafted = generate(model, cache, inputs, **kw)
    assert torch.equal(base.sequences, drafted.sequences)
    for a, b in zip(base.logits, drafted.logits):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
    assert cache.stats()["blocks_fetched_on_critical_path"] > 0  # an untrained draft misses: repaired, not attended


def test_stats_report_how_often_the_draft_was_the_next_token():
    """`stats()["draft_accuracy"]`: each one-token decode step checks the draft made at the step before against the
    token that came (a device counter). Drafts forced right on even steps and wrong on odd ones give exactly 1/2."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    inputs = left_padded([40, 33])
    kw = dict(max_new_tokens=12, do_sample=False)
    tokens = generate(model, dense_cache(model), inputs, **kw).sequences[:, inputs["input_ids"].shape[1]:]  # [B, 12]
    cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=random_head(model))
    assert cache.stats()["draft_accuracy"] is None
    ride, made = cache.ride_along, []
    draft = ride._draft

    def forced(token, rode):  # decode step k is fed token k and guesses token k + 1
        k = len(made)
        head = draft(token, rode)  # the head still runs (its rows, its ring)
        right = tokens[:, k + 1 : k + 2].to(head.device)
        made.append(right if k % 2 == 0 else (right + 1) % model.config.vocab_size)
        return made[-1]

    ride._draft = forced
    out = generate(model, cache, inputs, **kw)
    assert torch.equal(out.sequences[:, inputs["input_ids"].shape[1]:], tokens)  # budget >= context: dense's tokens
    stats = cache.stats()
    assert len(made) == 11 and stats["drafts_checked"] == 2 * 10  # the last draft has no next step to check
    assert stats["draft_accuracy"] == pytest.approx(0.5)


def _head_right_once(head, tokens: torch.Tensor, vocab_size: int) -> list:
    """Makes `head`'s guess at decode step k (fed token k of `tokens` `[B, n]`) the true token k + 1 at k = 0 only,
    a wrong one after; returns the list its guesses are appended to."""
    guesses = []

    def guess(logits):
        right = tokens[:, len(guesses) + 1 : len(guesses) + 2].to(logits.device)
        guesses.append(right if not guesses else (right + 1) % vocab_size)
        return guesses[-1]

    head.greedy_draft = guess
    return guesses


@pytest.mark.parametrize("chain", [True, False])
def test_a_right_draft_chains_the_targets_next_token(chain):
    """Chained drafts (`chain_drafts`): the LM head scores the draft row too, and where the draft was right, the
    target's prediction after it is the next draft. With a budget covering the context that prediction is the next
    greedy token, so one right guess of the head keeps every later draft right: a head forced right at the first
    step only (wrong after) drafts 20 of 20 right with the chain, 2 of 20 without; the tokens and logits stay
    dense's either way."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    inputs = left_padded([40, 33])
    kw = dict(max_new_tokens=12, do_sample=False)
    base = generate(model, dense_cache(model), inputs, **kw)
    tokens = base.sequences[:, inputs["input_ids"].shape[1]:]  # [B, 12]
    cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=random_head(model),
                       advanced=dict(chain_drafts=chain))
    guesses = _head_right_once(cache.ride_along.head, tokens, model.config.vocab_size)
    out = generate(model, cache, inputs, **kw)
    assert torch.equal(out.sequences, base.sequences)
    for a, b in zip(base.logits, out.logits):  # the draft row's logits were cut from the real rows'
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
    stats = cache.stats()
    assert len(guesses) == 11 and stats["drafts_checked"] == 20
    assert stats["draft_accuracy"] == pytest.approx(1.0 if chain else 0.1)


def test_chained_drafts_survive_another_caches_steps_in_between():
    """Two caches decoding on one model by turns (as `bench/decode.py --interleave` does): the other cache's forwards
    run this cache's hooks too, and leave its chained token for its next step."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    ids = prompt_ids(40)
    tokens = generate(model, dense_cache(model), {"input_ids": ids}, max_new_tokens=12,
                      do_sample=False).sequences[:, ids.shape[1]:]  # [1, 12]
    chained = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=random_head(model))
    other = OasisCache(model, token_budget=1024, lookahead="previous")
    _head_right_once(chained.ride_along.head, tokens, model.config.vocab_size)
    with torch.no_grad():
        for cache in (chained, other):
            model(input_ids=ids, past_key_values=cache)
        for k in range(11):
            for cache in (chained, other):
                model(input_ids=tokens[:, k : k + 1], past_key_values=cache)
    stats = chained.stats()
    assert stats["drafts_checked"] == 10 and stats["draft_accuracy"] == 1.0


def test_chained_drafts_need_a_model_lm_head():
    """A model without an output-embedding module (`get_output_embeddings()` None) drafts by the head alone."""
    model = tiny_model("llama", num_hidden_layers=4)
    model.get_output_embeddings = lambda: None
    dense = generate(model, dense_cache(model), {"input_ids": prompt_ids(40)}, max_new_tokens=6, do_sample=False)
    cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=random_head(model))
    assert cache.ride_along.lm_head is None
    out = generate(model, cache, {"input_ids": prompt_ids(40)}, max_new_tokens=6, do_sample=False)
    assert torch.equal(out.sequences, dense.sequences)


def test_draft_ranked_with_the_real_rows_prefetches_what_it_ranked_alone(monkeypatch):
    """In exact mode the real rows and the draft row are ranked in one pass over the summaries (`rank_blocks(...,
    split_last=True)`, one kernel launch on CUDA); the next step's prefetch then uses the draft's ranking, unless a
    block completed in between. It must prefetch exactly what ranking the draft row alone prefetches: same fetches,
    same hits, same tokens — with fewer rankings."""
    import oasis_cache.layer as layer_module

    model = tiny_model("llama", num_hidden_layers=4)
    inputs = left_padded([300, 270])
    kw = dict(max_new_tokens=20, do_sample=False)  # crosses block boundaries: the fallback runs too
    calls = []
    rank = layer_module.rank_blocks

    def counting(*args, **kwargs):
        calls.append(kwargs.get("split_last", False))
        return rank(*args, **kwargs)

    monkeypatch.setattr(layer_module, "rank_blocks", counting)
    runs = []
    for joint in (True, False):
        if not joint:  # the real rows ranked alone; the draft ranked again after attention
            monkeypatch.setattr(OasisLayer, "_select_with_draft",
                                lambda self, query, view, k: self._select(query[:, :, :-1], view, k))
        calls.clear()
        cache = OasisCache(model, token_budget=128, lookahead="eagle3", exact=True, 
                           draft=random_head(model), advanced=dict(num_slots=9))
        out = generate(model, cache, inputs, **kw)
        runs.append((out, cache.stats(), list(calls)))
    (joint_out, joint_stats, joint_calls), (alone_out, alone_stats, alone_calls) = runs
    assert torch.equal(joint_out.sequences, alone_out.sequences)
    for key in ("blocks_fetched", "blocks_fetched_on_critical_path", "hit_rate", "bytes_fetched"):
        assert joint_stats[key] == alone_stats[key], key
    assert any(joint_calls) and not any(alone_calls)
    assert len(joint_calls) < len(alone_calls)  # one pass instead of two on the steps where no block completed


class _OrderedHeadKV:
    """Reference for `HeadKV`: the rows in order, the last `window - 1` kept by concatenating and slicing."""

    has_ring = False

    def __init__(self, window):
        self.window, self.kv = window, None

    def reset(self):
        self.kv = None

    def past(self):
        return self.kv

    def store(self, k, v):
        if self.kv is not None:
            k, v = torch.cat((self.kv[0], k), -2), torch.cat((self.kv[1], v), -2)  # [L, B, Hkv, rows, Dh]
        start = max(0, k.shape[-2] - (self.window - 1))
        self.kv = (k[..., start:, :], v[..., start:, :])

    def index_batch(self, indices):
        if self.kv is not None:
            self.kv = tuple(t.index_select(-4, indices) for t in self.kv)


@pytest.mark.parametrize("static", [None, "eager"])
@pytest.mark.parametrize("window, layers", [(1, 1), (2, 1), (5, 1), (5, 2)])
def test_head_ring_drafts_what_ordered_rows_draft(window, layers, static):
    """The head's keys/values in a ring of `window - 1` rows (static shapes for a decode step) give the drafts that
    the rows kept in order give, through prompt, many wraps of the ring, and a second prompt (an extend); so does
    the decode call on static buffers (`head_step.py`, what a CUDA graph replays; here run eagerly). A deeper head
    (ours) keeps every layer's rows in one ring."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    head = _deeper(random_head(model, scale=0.5), layers)
    head.config.attention_window = window
    prompt, extend = prompt_ids(90), prompt_ids(40, seed=3)
    runs = []
    for reference in (False, True):
        cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=head)
        ride = cache.ride_along
        if reference:
            ride._head_kv = _OrderedHeadKV(window)
        else:
            ride.static_head = static
        runs.append(drafts_of_two_generates(model, cache, prompt, extend))
        if not reference:
            static_used = ride._static is not None  # the last draft of the run went through the static call
    assert runs[0].shape[1] == 22 and torch.equal(runs[0], runs[1])
    assert static_used == (static is not None and window > 1)
    assert len(set(runs[0][0].tolist())) > 3  # the head drafts varied tokens: the comparison means something

