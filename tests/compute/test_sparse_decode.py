"""With a small budget, sparse decode is exactly what it claims: dense attention restricted to the selected blocks
(plus recent tokens), checked layer by layer against an independent float64 reference. The host pool holds exactly
the K/V the model produced, and the summaries are the min/max of the pooled keys."""

from __future__ import annotations

import pytest
import torch

from oasis_cache.compute.reference import block_masked_attention
from oasis_cache.layer import OasisLayer

from conftest import left_padded, oasis_cache_for, prompt_ids, tiny_model


class Recorder:
    """Wraps `OasisLayer.attend` and `.update` to keep each call's inputs and output."""

    def __init__(self, monkeypatch):
        self.attends, self.updates = [], []
        attend, update = OasisLayer.attend, OasisLayer.update

        def recording_attend(layer, query, visible, scale):
            num_blocks = layer.pool.num_blocks
            out = attend(layer, query, visible, scale)
            self.attends.append(dict(layer=layer, query=query, visible=visible, scale=scale, out=out,
                                     num_blocks=num_blocks, selection=getattr(layer, "last_selection", None),
                                     kv=layer.full_kv()))
            layer.last_selection = None
            return out

        def recording_update(layer, key_states, value_states, *args, **kwargs):
            self.updates.append((layer.layer_idx, key_states.clone(), value_states.clone()))
            return update(layer, key_states, value_states, *args, **kwargs)

        monkeypatch.setattr(OasisLayer, "attend", recording_attend)
        monkeypatch.setattr(OasisLayer, "update", recording_update)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("padded", [False, True])
def test_sparse_decode_equals_masked_dense_reference(monkeypatch, arch, padded):
    model = tiny_model(arch)
    inputs = left_padded([300, 260]) if padded else {"input_ids": prompt_ids(300, batch=2)}
    cache = oasis_cache_for(model, token_budget=128, sink_tokens=16, recent_tokens=32, host_chunk_blocks=4)
    cache.record_selection = True
    rec = Recorder(monkeypatch)
    model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False, pad_token_id=0,
                   eos_token_id=None)

    T = cache.config.block_size
    K = cache.config.num_selected_blocks
    checked = 0
    for call in rec.attends:
        if call["selection"] is None:
            continue  # dense prefill
        sel = call["selection"]
        NB = call["num_blocks"]
        assert NB > K, "the context must exceed the budget for this test to mean anything"
        per_head = sel.sum(-1)
        assert int(per_head.max()) <= K and int(per_head.min()) >= 1
        keys, values = call["kv"]
        ref = block_masked_attention(call["query"], keys, values, sel, call["visible"], T, call["scale"])
        torch.testing.assert_close(call["out"], ref, atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked == 11 * 2  # 11 decode steps x 2 layers
    stats = cache.stats()
    assert stats["blocks_selected_per_step"] <= K
    assert 0 < stats["tokens_attended_per_step"] <= cache.config.token_budget


def test_selection_keeps_sink_and_recent_blocks(monkeypatch):
    model = tiny_model("llama")
    inputs = left_padded([330, 301])
    cache = oasis_cache_for(model, token_budget=128, sink_tokens=16, recent_tokens=32)
    cache.record_selection = True
    rec = Recorder(monkeypatch)
    model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
                   eos_token_id=None)
    T = cache.config.block_size
    mask = inputs["attention_mask"]
    for call in rec.attends:
        sel, NB = call["selection"], call["num_blocks"]
        if sel is None:
            continue
        for b in range(2):
            first = int(mask[b].argmax())
            assert sel[b, :, first // T].all(), "the block holding the first real token is a sink"
            assert sel[b, :, NB - 2 :].all(), "the newest 32 tokens (2 blocks) are always attended"
            fully_padded = first // T  # blocks before it hold only padding
            assert not sel[b, :, :fully_padded].any(), "blocks of padding are never selected"


def test_host_pool_holds_exactly_the_models_kv(monkeypatch):
    model = tiny_model("qwen3")
    cache = oasis_cache_for(model, token_budget=64, sink_tokens=16, recent_tokens=16, host_chunk_blocks=3,
                            fp8_levels=False, summary_channels=1.0)  # exact levels on every channel below (their
    # fp8 rounding and the channels kept by default: test_pools_and_control)
    rec = Recorder(monkeypatch)
    model.generate(input_ids=prompt_ids(150, batch=2), past_key_values=cache, max_new_tokens=30,
                   do_sample=False, pad_token_id=0, eos_token_id=None)
    for layer in (l for l in cache.layers if isinstance(l, OasisLayer)):
        seen = [(k, v) for idx, k, v in rec.updates if idx == layer.layer_idx]
        expected_k = torch.cat([k for k, _ in seen], dim=2)
        expected_v = torch.cat([v for _, v in seen], dim=2)
        keys, values = layer.full_kv()
        assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)  # bitwise

        T, NB = cache.config.block_size, layer.pool.num_blocks
        assert NB == (150 + 29) // T
        blocks = keys[:, :, : NB * T].reshape(2, layer.num_kv_heads, NB, T, -1)
        low, high = layer.summaries.view()  # the bits scorer's levels: means of the keys below / above the block mean
        above = blocks > blocks.mean(dim=3, keepdim=True)
        torch.testing.assert_close(high, ((blocks * above).sum(3) / above.sum(3).clamp(min=1)).where(
            above.any(3), low))
        torch.testing.assert_close(low, (blocks * ~above).sum(3) / (~above).sum(3))


def test_slot_map_stays_consistent_during_decode(monkeypatch):
    model = tiny_model("llama")
    cache = oasis_cache_for(model, token_budget=96, sink_tokens=16, recent_tokens=16, num_slots=9)
    model.generate(input_ids=prompt_ids(400), past_key_values=cache, max_new_tokens=40, do_sample=False,
                   pad_token_id=0, eos_token_id=None)
    for layer in (l for l in cache.layers if isinstance(l, OasisLayer)):
        sm = layer.slot_map
        S = sm.num_slots
        slot_block = sm.slot_block[..., :S]
        for b in range(slot_block.shape[0]):
            for h in range(slot_block.shape[1]):
                for s, block in enumerate(slot_block[b, h].tolist()):
                    if block >= 0:
                        assert sm.block_slot[b, h, block] == s
                resident = (sm.block_slot[b, h, : sm.capacity_blocks] >= 0).nonzero().flatten().tolist()
                assert sorted(resident) == sorted(x for x in slot_block[b, h].tolist() if x >= 0)
        # The resident blocks' slot contents are the host blocks.
        keys, _ = layer.full_kv()
        T = cache.config.block_size
        for s in range(S):
            block = int(slot_block[0, 0, s])
            if block >= 0:
                assert torch.equal(layer.working_set.slots[0, 0, 0, s], keys[0, 0, block * T : block * T + T])
    stats = cache.stats()
    assert 0.0 < stats["hit_rate"] < 1.0


def fp8_rounded(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels `[..., D]` as fp8 (e4m3) times a power of two per block that keeps them within +-448."""
    largest = torch.maximum(low.abs().amax(-1, keepdim=True), high.abs().amax(-1, keepdim=True))
    scale = 2.0 ** torch.ceil(torch.log2(largest / 448))
    return tuple((x / scale).to(torch.float8_e4m3fn).double() * scale for x in (low, high))


@pytest.mark.parametrize("scorer", ["bits", "bound", "bits-fp8", "bits-half"])
def test_decode_attends_the_scorers_top_blocks(monkeypatch, scorer):
    """Each decode step attends the sink and recent blocks plus the best others by the scorer, recomputed here from
    the pooled keys: the bound (relu(q).kmax + min(q,0).kmin) or the best coarse key (each channel the mean of the
    block's values on its side of the block mean; "bits-fp8": those levels rounded to fp8 with a power-of-two scale
    per block; "bits-half", the default: fp8 levels on the half of the channels each sequence and KV head keeps),
    maximised over the KV head's query rows."""
    model = tiny_model("qwen3")
    cache = oasis_cache_for(model, token_budget=128, sink_tokens=16, recent_tokens=32, scorer=scorer[:5].strip("-"),
                            fp8_levels=scorer in ("bits-fp8", "bits-half"),
                            summary_channels=None if scorer == "bits-half" else 1.0)
    cache.record_selection = True
    rec = Recorder(monkeypatch)
    model.generate(input_ids=prompt_ids(300, batch=2), past_key_values=cache, max_new_tokens=6, do_sample=False,
                   pad_token_id=0, eos_token_id=None)
    T, K = cache.config.block_size, cache.config.num_selected_blocks
    checked = 0
    for call in rec.attends:
        if call["selection"] is None:
            continue
        NB = call["num_blocks"]
        B, H = call["selection"].shape[:2]
        blocks = call["kv"][0][:, :, : NB * T].reshape(B, H, NB, T, -1).double()
        q = call["query"].reshape(B, H, -1, blocks.shape[-1]).double()  # [B, H, G, D]
        if scorer == "bits-half":  # the channels the default keeps: chosen once, at the prompt's blocks
            channels = call["layer"].summaries.channels  # [B, H, D / 2]
            assert channels.shape == (B, H, blocks.shape[-1] // 2)
            q = q.gather(-1, channels[:, :, None].expand(*q.shape[:3], -1))
            blocks = blocks.gather(-1, channels[:, :, None, None].expand(*blocks.shape[:4], -1))
        kmin, kmax = blocks.amin(dim=3, keepdim=True), blocks.amax(dim=3, keepdim=True)
        if scorer.startswith("bits"):
            above = blocks > blocks.mean(dim=3, keepdim=True)
            high = (blocks * above).sum(3, keepdim=True) / above.sum(3, keepdim=True).clamp(min=1)
            high = torch.where(above.any(3, keepdim=True), high, blocks.mean(dim=3, keepdim=True))
            low = (blocks * ~above).sum(3, keepdim=True) / (~above).sum(3, keepdim=True)
            if scorer in ("bits-fp8", "bits-half"):
                low, high = fp8_rounded(low.float(), high.float())
            coarse = torch.where(above, high, low)
            scores = torch.einsum("bhgd,bhntd->bhgnt", q, coarse).amax(dim=(2, 4))
        else:
            bound = q.clamp(min=0)[:, :, :, None] * kmax[:, :, None, :, 0] + q.clamp(max=0)[:, :, :, None] * kmin[
                :, :, None, :, 0]
            scores = bound.sum(-1).amax(dim=2)
        forced = [0, NB - 2, NB - 1]  # the sink block and the two recent blocks
        scores[..., forced] = torch.inf
        expected = torch.zeros(B, H, NB, dtype=torch.bool).scatter_(-1, scores.topk(K, dim=-1).indices, True)
        assert torch.equal(call["selection"], expected)
        checked += 1
    assert checked == 5 * 2


def test_host_pools_grow_ahead_at_staggered_steps():
    """Layers take their next host chunk at different decode steps (pinning memory is slow: the layers should not all
    pay in one step), each before it is needed and at most HOST_GROWTH_SPREAD blocks early; what the pools hold is what
    a pool that never grows holds."""
    from oasis_cache import OasisCache
    from oasis_cache.layer import HOST_GROWTH_SPREAD

    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt_ids(8 * 16)  # 8 blocks: two chunks exactly

    def run(chunk_blocks, check):
        cache = OasisCache(model, token_budget=128, lookahead="none", advanced=dict(host_chunk_blocks=chunk_blocks))
        with torch.no_grad():
            token = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
            check(cache)
            for _ in range(6 * 16):
                token = model(input_ids=token, past_key_values=cache).logits[:, -1:].argmax(-1)
                check(cache)
        return [layer.full_kv() for layer in cache.layers]

    grew_at: dict[int, list[int]] = {i: [] for i in range(4)}
    capacity = {}

    def check(cache):
        for i, layer in enumerate(cache.layers):
            pool = layer.pool
            assert pool.num_blocks < pool.capacity_blocks <= pool.num_blocks + 4 + HOST_GROWTH_SPREAD
            if i in capacity and pool.capacity_blocks > capacity[i]:
                grew_at[i].append(pool.num_blocks)
            capacity[i] = pool.capacity_blocks

    staggered = run(4, check)
    assert len({steps[0] for steps in grew_at.values()}) == 4, grew_at  # each layer grew at another block count
    for (k, v), (k_ref, v_ref) in zip(staggered, run(256, lambda cache: None)):
        assert k.shape[2] == 8 * 16 + 6 * 16 and torch.equal(k, k_ref) and torch.equal(v, v_ref)
