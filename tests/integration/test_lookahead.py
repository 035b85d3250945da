"""Lookahead "previous": the next step's blocks are selected with this step's query and prefetched (on CPU the
gather runs inline; on CUDA on a side stream, see test_cuda.py). Exactness with a full budget, the exact
(miss-repair) option equal to on-demand selection, the fetch cap, and what attention uses each step."""

from __future__ import annotations

import pytest
import torch

from oasis_cache import OasisCache
from oasis_cache.compute.reference import block_masked_attention
from oasis_cache.layer import OasisLayer
from oasis_cache.runtime.build import cache_kwargs

from conftest import dense_cache, generate, left_padded, prompt_ids, tiny_model

ATOL = 2e-4


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_full_budget_equals_dense(arch, exact):
    model = tiny_model(arch)
    for inputs, kw in [
        ({"input_ids": prompt_ids(70)}, dict(max_new_tokens=20, do_sample=False)),
        (left_padded([61, 37, 50]), dict(max_new_tokens=16, do_sample=False, prefill_chunk_size=32)),
        (left_padded([45, 33]), dict(max_new_tokens=10, do_sample=False, num_beams=3)),
    ]:
        dense = generate(model, dense_cache(model), inputs, **kw)
        cache = OasisCache(model, token_budget=1024, lookahead="previous", exact=exact,
                           advanced=dict(host_chunk_blocks=2))
        oasis = generate(model, cache, inputs, **kw)
        assert torch.equal(dense.sequences, oasis.sequences)
        if "num_beams" not in kw:
            for a, b in zip(dense.logits, oasis.logits):
                torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)


def test_assisted_decoding_with_previous():
    model = tiny_model("llama")
    base = prompt_ids(12)[0]
    inputs = {"input_ids": torch.cat([base, base, base, base[:5]])[None]}
    kw = dict(max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4)
    dense = generate(model, dense_cache(model), inputs, **kw)
    oasis = generate(model, OasisCache(model, token_budget=1024, lookahead="previous"), inputs, **kw)
    assert torch.equal(dense.sequences, oasis.sequences)


def test_exact_repair_equals_on_demand_selection():
    """With exact=True the real query's top-K is attended whatever was prefetched: same output as "none"."""
    model = tiny_model("qwen3")
    inputs = left_padded([300, 260])
    kw = dict(max_new_tokens=12, do_sample=False)
    base = dict(token_budget=128, sink_tokens=16, recent_tokens=32)
    on_demand = generate(model, OasisCache(model, **cache_kwargs(base)), inputs, **kw)
    cache = OasisCache(model, **cache_kwargs(dict(lookahead="previous", exact=True, num_slots=12, **base)))
    repaired = generate(model, cache, inputs, **kw)
    assert torch.equal(on_demand.sequences, repaired.sequences)
    for a, b in zip(on_demand.logits, repaired.logits):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert stats["blocks_prefetched"] > 0
    # Prefetching into 12 slots leaves fewer misses for the critical path than on-demand fetching.
    assert stats["blocks_fetched_on_critical_path"] < stats["blocks_prefetched"]


def test_previous_attends_the_prediction_made_with_the_previous_query(monkeypatch):
    """Approximate mode: step t attends to the top-K chosen by step t-1's query (checked against the reference
    with that selection), and the recall of the prediction is measured."""
    model = tiny_model("llama")
    calls = []
    attend = OasisLayer.attend

    def recording(layer, query, visible, scale):
        out = attend(layer, query, visible, scale)
        if getattr(layer, "last_selection", None) is not None:
            calls.append((layer.layer_idx, query, visible, scale, out, layer.last_selection, layer.full_kv()))
            layer.last_selection = None
        return out

    monkeypatch.setattr(OasisLayer, "attend", recording)
    cache = OasisCache(model, token_budget=128, lookahead="previous", advanced=dict(sink_tokens=16, recent_tokens=32,
                                                                                    measure=True))
    cache.record_selection = True
    inputs = left_padded([300, 260])
    generate(model, cache, inputs, max_new_tokens=10, do_sample=False)
    assert len(calls) == 9 * 2
    K = cache.config.num_selected_blocks
    for layer_idx, query, visible, scale, out, sel, (keys, values) in calls:
        assert int(sel.sum(-1).max()) <= K
        ref = block_masked_attention(query, keys, values, sel, visible, 16, scale)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert stats["blocks_fetched_on_critical_path"] == 0  # every block arrived by prefetch
    assert 0.0 < stats["prediction_recall"] <= 1.0
    assert stats["hit_rate"] >= 0.0


def test_fetch_cap_limits_new_blocks_per_step(monkeypatch):
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=256, advanced=dict(sink_tokens=16, recent_tokens=16, fetch_ratio=0.05))
    ids = prompt_ids(800)  # 50 blocks: at most ceil(0.05 * 50) = 3 new blocks per step and head
    generate(model, cache, {"input_ids": ids}, max_new_tokens=8, do_sample=False)
    stats = cache.stats()
    steps, heads, layers = 7, 2, 2
    assert stats["blocks_fetched_on_critical_path"] <= 3 * steps * heads * layers
    assert stats["blocks_fetched_on_critical_path"] > 0
