"""The remote tier on a real Mooncake Store (started by the `mooncake_master` fixture): a prefill process publishes
its host pools and exits; this process fetches any blocks back, bit for bit; missing blocks and a master that is not
there are named; a request's keys go away when it is deleted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oasis_cache import OasisCache
from oasis_cache.layer import OasisLayer
from oasis_cache.pools.host_kv import HostKVPool
from oasis_cache.remote import RemoteBlocksMissing, RemoteTier, connect
from oasis_cache.runtime import replay
from oasis_cache.runtime.build import cache_kwargs

from conftest import generate, prompt_ids, tiny_hybrid, tiny_model

TESTS = Path(__file__).resolve().parents[1]
OPTIONS = dict(token_budget=64, block_size=8, sink_tokens=8, recent_tokens=16, lookahead="previous")


def prefilled(batch=2, length=203):
    model = tiny_model("llama")
    cache = OasisCache(model, **cache_kwargs(OPTIONS))
    model(input_ids=prompt_ids(length, batch=batch), past_key_values=cache, use_cache=True)
    return cache


def published_and_admitted(model, ids, store, request: str):
    """`(prefill, admitted)`: the prefill's own cache over all of `ids` but the last token, published as `request`,
    and the cache a decode process admits from that record."""
    from oasis_cache.remote import admit, publish

    prefill = OasisCache(model, **cache_kwargs(OPTIONS))
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **prefill.generate_kwargs())
    publish(prefill, store, request)
    return prefill, admit(model, store, request)

def empty_like(pool: HostKVPool) -> HostKVPool:
    fresh = HostKVPool(pool.batch_size, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype,
                       pool.chunk_blocks, pin_memory=False)
    fresh.reserve(pool.num_blocks)
    for chunk in fresh.chunks:
        chunk.fill_(float("nan"))
    return fresh


SPLITS = [(64, "previous", 2), (64, "none", 1), (1024, "previous", 2), (64, "eagle3", 2),  # (budget, lookahead
          (64, "previous-exact", 1)]  # (-exact: with exact=True), batch)


def split_model(lookahead):
    return tiny_model("llama", **({"num_hidden_layers": 4} if lookahead.startswith("eagle3") else {}))  # (its head
    # reads 3 layers)


def split_options(model, budget, lookahead) -> dict:
    """A split's cache options; eagle3 with a random head both processes build alike (`conftest.random_head`)."""
    from conftest import random_head

    name, _, variant = lookahead.partition("-")
    return {**OPTIONS, "token_budget": budget, "lookahead": name, "exact": variant == "exact",
            **({"draft": random_head(model)} if name == "eagle3" else {})}
SPLIT_LENGTH = 803


def split_prompt(lookahead: str, batch: int) -> torch.Tensor:
    """A split's prompt `[batch, SPLIT_LENGTH]`: random ids."""
    return prompt_ids(SPLIT_LENGTH, batch=batch)


def publish_everything(master: str) -> dict:
    """The prefill process's work (run in a child): the pools of `prefilled()` under "exited-prefill", then each
    split of SPLITS prefilled (all but the last prompt token) and published. Returns the publish reports."""
    from oasis_cache.remote import publish

    store = connect(master)
    tier = RemoteTier(store, "exited-prefill")
    for idx, layer in enumerate(prefilled().layers):
        if isinstance(layer, OasisLayer):
            tier.publish(idx, layer.pool)
    reports = {}
    for budget, lookahead, batch in SPLITS:
        model = split_model(lookahead)
        cache = OasisCache(model, **cache_kwargs(dict(**split_options(model, budget, lookahead))))
        model(input_ids=split_prompt(lookahead, batch)[:, :-1], past_key_values=cache, use_cache=True)
        name = f"split-{budget}-{lookahead}-{batch}"
        reports[name] = publish(cache, store, name)
        if (budget, lookahead, batch) == SPLITS[1]:
            reports["midway"] = publish(cache, store, "midway")  # the same cache, a second request
        if (budget, lookahead, batch) == SPLITS[0]:
            reports["evict"] = publish(cache, store, "evict")
            reports["midway-previous"] = publish(cache, store, "midway-previous")
            reports["midway-overlap"] = publish(cache, store, "midway-overlap")
    store.close()
    return reports


@pytest.fixture(scope="module")
def published(mooncake_master) -> dict:
    """One prefill process publishes everything this file reads, then exits."""
    code = textwrap.dedent(f"""
        import json, sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / "remote")!r}]
        from test_remote import publish_everything
        print(json.dumps(publish_everything({mooncake_master!r})))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    return json.loads(run.stdout.strip().splitlines()[-1])


def units_of(pool: HostKVPool) -> torch.Tensor:
    """Every block of a local pool unit-major: `[NB, B, Hkv, 2, T, D]` (what the store holds, one object per row)."""
    return torch.cat([chunk for chunk in pool.chunks])[: pool.num_blocks].permute(0, 2, 3, 1, 4, 5).contiguous()


def get_units(tier, idx, units, like) -> torch.Tensor:
    """Units `[(block, sequence, head)]` of layer `idx` got into a NaN-filled tensor `[n, 2, T, D]` like `like`."""
    out = torch.full((len(units),) + tuple(like.shape[-3:]), float("nan"), dtype=like.dtype)
    size = out[0].numel() * out.element_size()
    assert tier.get_units(idx, units, [row.data_ptr() for row in out], size) == size * len(units)
    return out


def test_blocks_published_by_a_process_that_exited_come_back_bit_for_bit(mooncake_master, published):
    local = prefilled()
    store = connect(mooncake_master)
    tier = RemoteTier(store, "exited-prefill")
    try:
        layers = [(idx, layer) for idx, layer in enumerate(local.layers) if isinstance(layer, OasisLayer)]
        assert layers and all(layer.pool.num_blocks == 203 // 8 for _, layer in layers)
        for idx, layer in layers:
            want = units_of(layer.pool)  # [NB, B, H, 2, T, D]
            NB, B, H = want.shape[:3]
            every = [(n, b, h) for n in range(NB) for b in range(B) for h in range(H)]
            assert torch.equal(get_units(tier, idx, every, want), want.reshape(-1, *want.shape[3:]))
            some = [(0, 1, 0), (5, 0, 1), (NB - 1, 1, 1)]  # partial: one sequence's one head of a block
            got = get_units(tier, idx, some, want)
            for row, (n, b, h) in zip(got, some):
                assert torch.equal(row, want[n, b, h])
    finally:
        assert tier.delete() > 0
        assert not any(tier.exists(0, range(4)))
        store.close()


def test_more_objects_than_one_store_call_takes_are_put_and_got(mooncake_master):
    """Mooncake's batched calls fail every object of a batch of more than ~2K objects (after a 60 s timeout): a pool
    of 3,200 (block, sequence, KV head) units goes in and comes back bit for bit, in calls of `BATCH_OBJECTS`."""
    pool = HostKVPool(4, 8, 8, 8, torch.float32, 128, pin_memory=False)  # B 4, Hkv 8, D 8, T 8: 512-byte units
    pool.reserve(100)
    pool.num_blocks = 100
    torch.manual_seed(0)
    for chunk in pool.chunks:
        chunk.normal_()
    want = units_of(pool)
    every = [(n, b, h) for n in range(100) for b in range(4) for h in range(8)]
    assert len(every) == 3200  # (3,000 in one call failed)
    store = connect(mooncake_master)
    tier = RemoteTier(store, "many-units")
    try:
        assert tier.publish(0, pool) == want.numel() * 4
        assert torch.equal(get_units(tier, 0, every, want), want.reshape(-1, *want.shape[3:]))
        assert all(tier.exists(0, range(100), sequence=3, head=7))
    finally:
        assert tier.delete() == len(every)
        store.close()


def test_closing_the_store_waits_for_a_fetch_in_flight(mooncake_master):
    """`StoreClient.close()` from one thread while another's batched get is in flight (a prefetch on the host worker)
    waits for that get, which completes; calls after it raise instead of reaching the closed client."""
    import threading
    import time

    store = connect(mooncake_master)
    data = torch.arange(1024, dtype=torch.float32)
    size = data.numel() * data.element_size()
    assert store.put_from("oasis-test/in-flight", data.data_ptr(), size) == 0
    got, events = torch.zeros_like(data), []

    class SlowGet:  # the real client, whose get takes a while: the call in flight
        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        def batch_get_into(self, *args):
            events.append("get started")
            time.sleep(0.3)
            result = self.client.batch_get_into(*args)
            events.append("get done")
            return result

    store.client = SlowGet(store.client)
    fetch = threading.Thread(target=lambda: events.append(store.batch_get_into(["oasis-test/in-flight"],
                                                                               [got.data_ptr()], [size])))
    fetch.start()
    while not events:
        time.sleep(0.01)
    store.close()  # waits for the get
    events.append("closed")
    fetch.join()
    assert events.index("get started") < events.index("get done") < events.index("closed") and [size] in events
    assert torch.equal(got, data)
    with pytest.raises(ConnectionError, match="client is closed"):
        store.batch_get_into(["oasis-test/in-flight"], [got.data_ptr()], [size])


def test_a_full_store_is_named():
    """Publishing more than the store's storage holds raises an error that says so and names the fix."""
    from oasis_cache.remote import local_store

    pool = HostKVPool(1, 8, 128, 16, torch.float32, 64, pin_memory=False)  # 16 KiB units
    pool.reserve(256)
    pool.num_blocks = 256  # 32 MiB of units
    with local_store("16MB") as master:
        store = connect(master)
        with pytest.raises(RuntimeError, match=r"refused .* objects of layer 0 \(request 'too-big'.*status \[-200\]\): "
                                               r"its storage is full: give the storage processes a larger "
                                               r"--global_segment_size"):
            RemoteTier(store, "too-big").publish(0, pool)
        store.close()


def test_missing_blocks_are_named(mooncake_master):
    cache = prefilled(batch=1, length=64)
    idx, layer = next((i, l) for i, l in enumerate(cache.layers) if isinstance(l, OasisLayer))
    store = connect(mooncake_master)
    tier = RemoteTier(store, "half-published")
    try:
        tier.publish(idx, layer.pool, 0, 4)
        like = units_of(layer.pool)
        with pytest.raises(RemoteBlocksMissing, match=r"2 of 4 \(block, sequence, KV head\) units of layer 0 "
                                                      r"\(blocks \[4, 5\]\) of request 'half-published'"):
            get_units(tier, idx, [(2, 0, 0), (3, 0, 1), (4, 0, 0), (5, 0, 1)], like)
        assert tier.delete() == 4 * layer.pool.batch_size * layer.pool.num_kv_heads
        with pytest.raises(RemoteBlocksMissing, match="deleted"):
            get_units(tier, idx, [(0, 0, 0)], like)
    finally:
        store.close()


def test_bad_names_and_an_absent_master_are_refused_quickly():
    with pytest.raises(ValueError, match="request must be a non-empty name"):
        RemoteTier(object(), "a/b")
    with pytest.raises(ConnectionError, match="mooncake_master --rpc_port=1"):
        connect("127.0.0.1:1")
    from oasis_cache.remote import admit

    with pytest.raises(TypeError, match=r"store must be a Mooncake Store client: oasis_cache.remote.connect"):
        admit(tiny_model("llama"), "127.0.0.1:50051", "req-7")  # the master's address, not a client


@pytest.mark.parametrize("budget, lookahead, batch", SPLITS)
def test_prefill_process_then_decode_process_equals_one_process(mooncake_master, published, budget, lookahead, batch,
                                                                monkeypatch):
    """A prefill process publishes and exits; this process admits the request from the store and generates: the
    tokens (and logits) of one process doing the same (prefill all but the last prompt token, then generate on that
    cache); with the budget over the context, those of dense attention. The admission moved a record, not the KV."""
    from oasis_cache.remote import admit

    length, request = SPLIT_LENGTH, f"split-{budget}-{lookahead}-{batch}"
    report = published[request]
    model = split_model(lookahead)
    ids = split_prompt(lookahead, batch)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    local = OasisCache(model, **cache_kwargs(dict(**split_options(model, budget, lookahead))))
    model(input_ids=ids[:, :-1], past_key_values=local, use_cache=True)
    expected = model.generate(input_ids=ids, **local.generate_kwargs(), **kw)
    store = connect(mooncake_master)
    if lookahead.startswith("eagle3"):  # the decode side continues with the prefill's head, and refuses another
        from conftest import random_head

        with pytest.raises(ValueError, match="published with lookahead='eagle3' and a draft head that this process "
                                             "does not have"):
            admit(model, store, request, draft=random_head(model, seed=1))
    cache = admit(model, store, request, draft=split_options(model, budget, lookahead).get("draft"))
    import threading

    from oasis_cache.remote import LocalBlockCache, LocalCacheGroup

    # where the store reads are planned: (thread, inside the repair after a step)
    reads, plan, repair_plan, repairing = set(), LocalBlockCache.plan, LocalBlockCache.repair_plan, []
    monkeypatch.setattr(LocalBlockCache, "plan", lambda self, *a: reads.add(
        (threading.current_thread().name, bool(repairing))) or plan(self, *a))

    def repairing_plan(self, *args):
        repairing.append(1)
        try:
            return repair_plan(self, *args)
        finally:
            repairing.clear()
    monkeypatch.setattr(LocalBlockCache, "repair_plan", repairing_plan)
    group_plan = LocalCacheGroup.plan  # (the after-step repair of layers of one shape plans them together)
    monkeypatch.setattr(LocalCacheGroup, "plan", lambda self, *a: reads.add(
        (threading.current_thread().name, True)) or group_plan(self, *a))
    got = model.generate(input_ids=ids, **cache.generate_kwargs(), **kw)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    if lookahead.startswith("eagle3"):  # the head's state came along : drafts checked alike
        assert stats["draft_accuracy"] == local.stats()["draft_accuracy"]
    layers = sum(isinstance(layer, OasisLayer) for layer in cache.layers)
    heads = cache.layers[0].pool.num_kv_heads
    # 100 blocks per layer, one unit per (block, sequence, KV head)
    assert layers >= 2 and stats["remote_units_published"] == layers * ((length - 1) // 8) * batch * heads
    if budget >= length + 8:
        from conftest import dense_cache

        dense = model.generate(input_ids=ids, past_key_values=dense_cache(model), **kw)
        assert torch.equal(got.sequences, dense.sequences)
        # (the prefill's prediction placed every block in the working set, which the record carries: nothing to fetch)
        assert stats["remote_units_fetched"] <= stats["remote_units_published"]
    else:
        # partial fetch, per head (exact fills twice the slots: its prefetch picks more blocks)
        assert 0 < stats["remote_units_fetched"] < stats["remote_units_published"] / (1 if "exact" in lookahead else 2)
        # Prefetches read the store on the host worker, off the step's thread (where steps are not captured: on
        # CUDA they read it after the step, below); "none" and exact's misses read it on the step's thread.
        assert all(not repaired for _, repaired in reads)
        assert any(name.startswith("oasis-prefetch") for name, _ in reads) == (lookahead != "none")
        # print(cache) says why such steps are never captured
        assert ("read the store inside the step" in str(cache)) == (lookahead == "none" or "exact" in lookahead)
        assert report["record"] < report["full_kv"]
        # the decode side holds its local caches and the blocks decode completed, not the prompt's KV
        assert stats["remote_local_cache_bytes"] < report["full_kv"] / 2.2
    assert report["blocks"] == stats["remote_units_published"] * 2 * 8 * 16 * 4  # fp32 [2, T, D] per unit
    if lookahead.partition("-")[0] in ("previous", "eagle3") and "exact" not in lookahead:  # deferred store reads
        # (what a CUDA cache captures): the same tokens,
        cache.streams.settle()  # (the last step's prefetch of the first cache may still run on its worker)
        reads.clear()  # the store read only after each step, on the step's thread
        deferred = admit(model, store, request, draft=split_options(model, budget, lookahead).get("draft"),
                         deferred=True)
        got = model.generate(input_ids=ids, **deferred.generate_kwargs(), **kw)
        assert torch.equal(got.sequences, expected.sequences)
        for a, b in zip(got.logits, expected.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert reads <= {("MainThread", True)} and (budget >= length + 8 or reads)
        # the same LRU decisions (the first cache's last prefetch joined above)
        assert deferred.stats()["remote_units_fetched"] == cache.stats()["remote_units_fetched"]
        phases = deferred.stats()["remote_repair_phases_ms"]  # the after-step time by phase adds up to the whole
        assert set(phases) == {"copy_back", "plan", "store_reads", "maps_and_gathers"} and min(phases.values()) >= 0
        assert sum(phases.values()) - phases["copy_back"] == pytest.approx(
            deferred.stats()["remote_repair_ms_per_step"], rel=1e-6)
        # reading the store while the step runs (a host thread; the next forward finishes it): the same again
        reads.clear()
        overlapped = admit(model, store, request, draft=split_options(model, budget, lookahead).get("draft"),
                           deferred=True, overlap=True)
        got = model.generate(input_ids=ids, **overlapped.generate_kwargs(), **kw)
        assert torch.equal(got.sequences, expected.sequences)
        for a, b in zip(got.logits, expected.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # (the last step's reads may still run on the host thread: stats finishes them before it counts)
        assert overlapped.stats()["remote_units_fetched"] == cache.stats()["remote_units_fetched"]
        assert {name for name, _ in reads} <= {"oasis-prefetch-held_0"}
        with pytest.raises(ValueError, match=r"cuda_graph=True.*\(deferred=False\), which a CUDA graph cannot"):
            admit(model, store, request, deferred=False, cuda_graph=True)
        with pytest.raises(ValueError, match=r"overlap=True\) overlaps the store reads that deferred prefetches"):
            admit(model, store, request, draft=split_options(model, budget, lookahead).get("draft"),
                  overlap=True)  # (on the CPU nothing is captured: not deferred unless asked)
    else:
        with pytest.raises(ValueError, match=r"deferred=True.*whose steps read the store on their critical path"):
            admit(model, store, request, deferred=True)
        refused = r"cuda_graph=True.*\(lookahead='(none|previous)'( with exact=True)?\), which a CUDA graph cannot"
        with pytest.raises(ValueError, match=refused):
            admit(model, store, request, cuda_graph=True)
    tier = cache.remote_tier
    cache.reset()  # the request's keys go with its tokens
    assert not any(tier.exists(0, range(3)))
    store.close()


def test_a_small_local_cache_evicts_and_a_too_small_one_is_named(mooncake_master, published):
    """A local cache of one working set per layer (the default holds four, up to a quarter of the published units)
    evicts least recently used units and still generates the default's tokens; one that cannot hold a step's
    selection raises a MemoryError naming the fix."""
    from oasis_cache.remote import admit

    model = tiny_model("llama")
    ids = prompt_ids(SPLIT_LENGTH, batch=SPLITS[0][2])
    kw = dict(max_new_tokens=12, do_sample=False)
    store = connect(mooncake_master)
    default = admit(model, store, "evict")
    expected = model.generate(input_ids=ids, **default.generate_kwargs(), **kw)
    layer = next(layer for layer in default.layers if isinstance(layer, OasisLayer))
    one_step = layer.pool.batch_size * layer.pool.num_kv_heads * layer.working_set.num_slots
    small = admit(model, store, "evict", local_cache_units=one_step)
    assert torch.equal(model.generate(input_ids=ids, **small.generate_kwargs(), **kw), expected)
    stats = small.stats()  # (its last prefetch may still read the store on the host thread: stats finishes it)
    assert stats["remote_units_evicted"] > 0 and stats["remote_units_fetched"] > default.stats()["remote_units_fetched"]
    # the after-step repair of every layer at once (`LocalCacheGroup`) decides what the per-layer repair and the
    # immediate path decide: the same units fetched and evicted, the same slot maps
    # and so does the repair that reads the store while the step runs (overlap; on the CPU its host thread starts
    # after the forward and the next forward finishes it)
    grouped = admit(model, store, "evict", local_cache_units=one_step, deferred=True)
    per_layer = admit(model, store, "evict", local_cache_units=one_step, deferred=True)
    overlapped = admit(model, store, "evict", local_cache_units=one_step, deferred=True, overlap=True)
    assert grouped.remote_tier.local_group is not None
    per_layer.remote_tier.local_group = None
    for other in (grouped, per_layer, overlapped):
        assert torch.equal(model.generate(input_ids=ids, **other.generate_kwargs(), **kw), expected)
    group = grouped.remote_tier.local_group  # its layers' records are rows of stacked ones (one copy back, one lookup)
    assert group.stacked(group.links) and not bool(group.records[2].any())  # (cleared after the last repair)
    counted = ("remote_units_fetched", "remote_units_evicted")
    assert [grouped.stats()[key] for key in counted] == [per_layer.stats()[key] for key in counted] == [
        overlapped.stats()[key] for key in counted] == [stats[key] for key in counted]
    assert grouped.stats()["remote_units_evicted"] > 0
    assert overlapped.stats()["remote_repair_exposed_ms_per_step"] > 0
    assert grouped.stats()["remote_repair_exposed_ms_per_step"] is None
    maps = [[(layer.pool.remote.slot_of, layer.pool.remote.unit_of, layer.pool.remote.last_used)
             for layer in cache.layers if isinstance(layer, OasisLayer)]
            for cache in (grouped, per_layer, small, overlapped)]
    assert all(torch.equal(a, b) for first, *others in zip(*maps) for other in others for a, b in zip(first, other))
    published = layer.pool.remote.published * layer.pool.batch_size * layer.pool.num_kv_heads
    default_units = max(one_step, min(4 * one_step, published // 4))
    assert stats["remote_local_cache_bytes"] * default_units == default.stats()["remote_local_cache_bytes"] * one_step
    starved = admit(model, store, "evict", local_cache_units=1)
    with pytest.raises(MemoryError, match=r"more than the local cache holds \(1\).*local_cache_units="):
        model.generate(input_ids=ids, **starved.generate_kwargs(), **kw)
    assert not starved.streams._futures  # every prefetch was joined before the error left `generate`
    # Closing the store while caches use it (a prefetch may still be fetching on the host thread) is safe: the
    # next fetch raises an error naming it, not a crash of the process (Mooncake's closed clients crash).
    store.close()
    with pytest.raises(ConnectionError, match=r"client is closed"):
        model.generate(input_ids=expected, **small.generate_kwargs(), max_new_tokens=40, do_sample=False)
    with pytest.raises(ConnectionError, match=r"store.close\(\) was called.*connect\(\) again"):
        store.get("oasis/evict/admission/0")


def test_admission_by_another_model_is_refused(mooncake_master, published):
    """The record names the model its keys and values came from: a decode side whose model differs in architecture,
    attention shapes or dtype gets a ValueError naming the difference, before any cache exists; the request stays
    admissible by the right model."""
    from oasis_cache.remote import admit

    store = connect(mooncake_master)
    for other, differs in ((tiny_model("llama").to(torch.bfloat16), r"dtype 'torch.float32' there, 'torch.bfloat16'"),
                           (tiny_model("llama", num_key_value_heads=4), r"num_key_value_heads 2 there, 4 here"),
                           (tiny_model("qwen2"), r"model_type 'llama' there, 'qwen2' here")):
        with pytest.raises(ValueError, match=rf"published by another model than this one \({differs}.*Admit with the "
                                             r"prefill's model"):
            admit(other, store, "evict")
    cache = admit(tiny_model("llama"), store, "evict")
    assert cache.get_seq_length() == SPLIT_LENGTH - 1
    store.close()


def test_deferred_prefetches_are_repaired_after_the_step(mooncake_master, published, monkeypatch):
    """An admitted cache with lookahead "previous" (no exact) reads nothing from the store inside a step (so the step
    can be captured): its prefetches gather the units already local and record the others, which the repair after
    the step fetches and gathers into their slots before the next step reads them (the default where steps are
    captured; forced here). Skip the repair's gathers and the tokens change (the repair is what makes them equal to
    one process's, checked above); no host thread is started."""
    from oasis_cache.memory.transfer import TransferEngine
    from oasis_cache.remote import admit

    model = tiny_model("llama")
    ids = prompt_ids(SPLIT_LENGTH, batch=SPLITS[0][2])
    kw = dict(max_new_tokens=12, do_sample=False)
    store = connect(mooncake_master)
    cache = admit(model, store, "evict", deferred=True)
    links = [layer.pool.remote for layer in cache.layers if isinstance(layer, OasisLayer)]
    assert links and all(link.deferred for link in links) and cache.streams._worker is None
    kinds, signatures = [], set()  # what each step would be on CUDA, read before its first layer runs

    def before_step(module, args):
        kinds.append(replay.step_kind(cache))
        if kinds[-1] == "steady" and len(kinds) > 1:  # (the first step, eager on CUDA too, makes the records)
            signatures.add(replay.replay_signature(cache))
    hook = model.model.layers[0].register_forward_pre_hook(before_step)
    expected = model.generate(input_ids=ids, **cache.generate_kwargs(), **kw)
    hook.remove()
    # every step could be captured (deferred reads, the prompt's padding came along); the steady steps share one
    # graph but where the local pool's first completed block changes the layout (and grows capacities)
    assert len(kinds) == kw["max_new_tokens"] and None not in kinds and "completing" in kinds
    assert len(signatures) <= 2
    assert all(not link.pending[3].any() for link in links)  # every record repaired and cleared
    assert cache.stats()["remote_repair_ms_per_step"] > 0
    default = admit(model, store, "evict")  # (kept: a dropped admitted cache deletes its request's keys)
    assert not any(layer.pool.remote.deferred for layer in default.layers if isinstance(layer, OasisLayer))
    assert default.streams._worker is not None  # on CPU (no captured steps) the store is read during the step
    gathered = []
    monkeypatch.setattr(TransferEngine, "gather_units", lambda self, *a: gathered.append(1))
    skipped = admit(model, store, "evict", deferred=True)
    assert not torch.equal(model.generate(input_ids=ids, **skipped.generate_kwargs(), **kw), expected)
    assert gathered
    store.close()


def test_an_admitted_cache_carries_the_prompts_padding(mooncake_master):
    """A left-padded batch's padding record travels with the admission record: a decode step called without a mask
    (as a captured step is) reads it, so the admitted cache's steps can be captured like the prefill's; the tokens
    equal the prefill's own cache's."""
    from conftest import left_padded

    from oasis_cache.remote import admit, publish

    model = tiny_model("llama")
    inputs = left_padded([203, 150])
    prefix = {k: v[:, :-1] for k, v in inputs.items()}
    local = OasisCache(model, **cache_kwargs(OPTIONS))
    with torch.no_grad():
        model(**prefix, **local.generate_kwargs())
    store = connect(mooncake_master)
    publish(local, store, "padded")
    cache = admit(model, store, "padded")
    padding, expected = cache.context.padding, local.context.padding
    assert padding is not None and padding.clear_from == expected.clear_from > 0
    assert torch.equal(padding.tokens, expected.tokens) and torch.equal(padding.first, expected.first)
    assert cache.context.padding_covers(cache.layers[0].pool.num_blocks)
    kw = dict(max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(**inputs, **cache.generate_kwargs(), **kw),
                       model.generate(**inputs, **local.generate_kwargs(), **kw))
    cache.reset()
    store.close()


@pytest.mark.parametrize("reads", ["in the step", "after the step", "overlapped"])
def test_blocks_lost_mid_decode_are_named_and_the_tokens_so_far_kept(mooncake_master, published, reads):
    """The store loses the blocks (deleted, or a restarted store) between two `generate` calls of one conversation:
    the next step that needs one raises `RemoteBlocksMissing` naming the request and the fix (inside the step, in
    the repair after it, or when the next forward finishes an overlapped repair); what was generated before stays
    with the caller."""
    from oasis_cache.remote import admit

    model = tiny_model("llama")
    request, batch = {"in the step": ("midway", SPLITS[1][2]), "after the step": ("midway-previous", SPLITS[0][2]),
                      "overlapped": ("midway-overlap", SPLITS[0][2])}[reads]  # (deferred reads: lookahead previous)
    ids = prompt_ids(SPLIT_LENGTH, batch=batch)
    store = connect(mooncake_master)
    cache = admit(model, store, request, deferred=reads != "in the step", overlap=reads == "overlapped")
    first = model.generate(input_ids=ids, **cache.generate_kwargs(), max_new_tokens=3, do_sample=False)
    cache.streams.settle()  # (an overlapped repair of the last step finishes before the blocks go)
    length = cache.get_seq_length()
    tier = cache.remote_tier
    links = [layer.pool.remote for layer in cache.layers if isinstance(layer, OasisLayer)]
    lost = [tier.key(link.layer_idx, *unit) for link in links
            for unit in link.triples((link.slot_of.view(-1) < 0).nonzero().flatten())]
    assert lost and all(status == 0 for status in store.batch_remove(lost, True))
    named = rf"units of layer \d+ \(blocks .*\) of request '{request}' \(status \[-704\]\) are not in the Mooncake"
    with pytest.raises(RemoteBlocksMissing, match=named + ".*Publish the request again"):
        model.generate(input_ids=first, **cache.generate_kwargs(), max_new_tokens=40, do_sample=False)
    assert first.shape[1] == SPLIT_LENGTH + 3 and length == SPLIT_LENGTH + 2
    del cache
    import gc

    gc.collect()  # dropped: the request's remaining keys (its admission record) are deleted
    assert store.get(tier.record_key) in (None, b"")
    store.close()


def test_a_store_that_stops_mid_decode_is_named_and_the_tokens_so_far_kept():
    """The store (master and storage process) stops between two `generate` calls of an admitted request: the next step
    that needs a unit not in the local cache raises `RemoteBlocksMissing` saying the store did not serve them and what
    to do; the tokens generated before stay with the caller; dropping the cache afterwards does not raise."""
    import gc

    from oasis_cache.remote import local_store

    model = tiny_model("llama")
    ids = prompt_ids(SPLIT_LENGTH, batch=1)
    with local_store() as master:
        store = connect(master)
        _, cache = published_and_admitted(model, ids, store, "stops")
        first = model.generate(input_ids=ids, **cache.generate_kwargs(), max_new_tokens=3, do_sample=False)
    from oasis_cache.remote.mooncake import _KEPT_AFTER_FAILED_TRANSFER

    with pytest.raises(RemoteBlocksMissing, match=r"request 'stops'.*(did not serve them|not in the Mooncake "
                                                  r"Store).*publish the request again") as raised:
        model.generate(input_ids=first, **cache.generate_kwargs(), max_new_tokens=40, do_sample=False)
    assert first.shape[1] == SPLIT_LENGTH + 3
    # a transfer that failed (not a missing object) may still write into the local cache: its arena is never freed
    arenas = [layer.pool.remote.arena for layer in cache.layers if isinstance(layer, OasisLayer)]
    kept = any(any(kept is arena for kept in _KEPT_AFTER_FAILED_TRANSFER) for arena in arenas)
    assert kept == ("did not serve them" in str(raised.value))
    del cache
    gc.collect()
    store.close()


def test_crop_copy_and_batch_selection_of_an_admitted_cache(mooncake_master):
    """An admitted cache cropped into its complete blocks (those come back from the store) continues as the
    prefill's own cache does; `copy.deepcopy`, `batch_select_indices` and `publish` first bring every block home."""
    import copy

    from oasis_cache.remote import admit, publish

    model = tiny_model("llama")
    ids = prompt_ids(403, batch=2)
    kw = dict(max_new_tokens=6, do_sample=False)
    store = connect(mooncake_master)
    prefill, cache = published_and_admitted(model, ids, store, "crop-copy-select")
    for c in (prefill, cache):
        c.crop(-37)  # into complete blocks
    short = ids[:, :-37]
    expected = model.generate(input_ids=short, **prefill.generate_kwargs(), **kw)
    got = model.generate(input_ids=short, **cache.generate_kwargs(), **kw)
    assert torch.equal(got, expected)
    copied = copy.deepcopy(cache)
    assert copied.remote_tier is None and all(layer.pool.remote is None for layer in copied.layers)
    assert torch.equal(model.generate(input_ids=got, **copied.generate_kwargs(), **kw),
                       model.generate(input_ids=got, **cache.generate_kwargs(), **kw))
    other = admit(model, store, "crop-copy-select")
    other.batch_select_indices(torch.tensor([1]))
    assert all(layer.pool.remote is None and layer.pool.batch_size == 1 for layer in other.layers)
    source = admit(model, store, "crop-copy-select")
    publish(source, store, "republished")  # an admitted cache publishes every block (fetched first)
    assert all(layer.pool.remote is None for layer in source.layers)
    again = admit(model, store, "republished")
    assert torch.equal(model.generate(input_ids=ids, **again.generate_kwargs(), **kw),
                       model.generate(input_ids=ids, **source.generate_kwargs(), **kw))
    # cropped right after a generate whose last store reads still run on the host thread (overlap): those finish
    # first, and the cache goes on as one that read after each step
    runs, turns = [], []  # (kept: a dropped admitted cache deletes its request's keys)
    for overlap in (False, True):
        turns.append(turn := admit(model, store, "crop-copy-select", deferred=True, overlap=overlap))
        first = model.generate(input_ids=ids, **turn.generate_kwargs(), **kw)
        turn.crop(-4)
        runs.append((first, model.generate(input_ids=first[:, :-4], **turn.generate_kwargs(), **kw)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    store.close()


def test_a_copy_made_after_decode_completed_blocks_continues_as_the_prefills_cache(mooncake_master):
    """`copy.deepcopy` of an admitted cache whose pools hold blocks completed during decode (past the published ones)
    makes every block local in order: the copy, the admitted cache and the prefill's own cache continue alike."""
    import copy

    model = tiny_model("llama")
    ids = prompt_ids(403, batch=2)
    kw = dict(max_new_tokens=30, do_sample=False)
    store = connect(mooncake_master)
    prefill, cache = published_and_admitted(model, ids, store, "copied-after-decode")
    got = model.generate(input_ids=ids, **cache.generate_kwargs(), **kw)
    assert torch.equal(got, model.generate(input_ids=ids, **prefill.generate_kwargs(), **kw))
    pools = [layer.pool for layer in cache.layers if isinstance(layer, OasisLayer)]
    assert all(pool.num_blocks > pool.first_block > 0 for pool in pools)  # blocks completed here, after the store's
    twin = copy.deepcopy(cache)
    assert all(layer.pool.first_block == 0 and layer.pool.remote is None for layer in twin.layers)
    expected = model.generate(input_ids=got, **prefill.generate_kwargs(), **kw)
    assert torch.equal(model.generate(input_ids=got, **twin.generate_kwargs(), **kw), expected)
    assert torch.equal(model.generate(input_ids=got, **cache.generate_kwargs(), **kw), expected)
    store.close()


def test_blocks_are_published_while_the_prefill_runs(mooncake_master):
    """`publishing`: the blocks each prefill chunk completes are put while the next chunk computes; leaving the block
    puts the record; the decode side admits it and generates what it generates from `publish` after the prefill. An
    error in the prefill leaves nothing under the request."""
    from oasis_cache.remote import admit, publish, publishing

    model = tiny_model("llama")
    ids = prompt_ids(SPLIT_LENGTH, batch=2)
    options = {**OPTIONS, "prefill_chunk_tokens": 256}  # 802 prompt tokens x 2: chunks of 128 tokens per sequence
    kw = dict(max_new_tokens=12, do_sample=False)
    store = connect(mooncake_master)
    cache = OasisCache(model, **cache_kwargs(options))
    with publishing(cache, store, "pipelined") as job:
        with torch.no_grad():
            model(input_ids=ids[:, :-1], **cache.generate_kwargs())
    report = job.report
    assert 0 < report["blocks_in_background"] == report["blocks"]  # every block went while the prefill ran
    after = OasisCache(model, **cache_kwargs(options))
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **after.generate_kwargs())
    assert publish(after, store, "after")["blocks"] == report["blocks"]
    decoded = admit(model, store, "after")  # (kept: dropping an admitted cache deletes its request's keys)
    expected = model.generate(input_ids=ids, **decoded.generate_kwargs(), **kw)
    assert torch.equal(model.generate(input_ids=ids, **admit(model, store, "pipelined").generate_kwargs(), **kw),
                       expected)
    failing = OasisCache(model, **cache_kwargs(options))
    with pytest.raises(RuntimeError, match="prefill stopped"):
        with publishing(failing, store, "failed"):
            with torch.no_grad():
                model(input_ids=ids[:, :-1], **failing.generate_kwargs())
            raise RuntimeError("prefill stopped")
    assert not any(RemoteTier(store, "failed").exists(0, range(8)))
    assert store.get(RemoteTier(store, "failed").record_key) in (None, b"")
    with pytest.raises(ValueError, match="admitted from a store; publish"):
        publishing(decoded, store, "again")
    store.close()


def test_eviction_order_is_a_stable_sort_of_the_last_use():
    """`least_recent` (a top-k over one key per slot) picks what a stable argsort of the last use picks first: free
    slots (-1), then the least recently used, ties by slot index; per row of a stacked `[L, capacity]` too."""
    from oasis_cache.remote.local_cache import least_recent

    generator = torch.Generator().manual_seed(0)
    for capacity in (1, 7, 256, 1024):
        last_used = torch.randint(-1, 6, (5, capacity), generator=generator)  # many ties
        for k in sorted({1, capacity // 2 or 1, capacity}):
            expected = torch.argsort(last_used, dim=1, stable=True)[:, :k]
            assert torch.equal(least_recent(last_used, k), expected)
            assert torch.equal(least_recent(last_used[2], k), expected[2])


@pytest.mark.parametrize("kind", ["sliding", "linear"])
def test_a_hybrid_models_other_layers_travel_with_the_record(mooncake_master, kind):
    """A hybrid's layers of transformers' own kind — a sliding window's keys, a linear-attention layer's states —
    travel in the admission record: the admitted cache decodes as the prefill's own."""
    model = tiny_model("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=48,
                       use_sliding_window=True) if kind == "sliding" else tiny_hybrid("qwen3_5")
    ids = prompt_ids(203)
    store = connect(mooncake_master)
    prefill, cache = published_and_admitted(model, ids, store, f"hybrid-{kind}")
    assert type(cache.layers[0]) is type(prefill.layers[0]) and not isinstance(cache.layers[0], OasisLayer)
    kw = dict(max_new_tokens=8, do_sample=False)
    admitted, own = generate(model, cache, {"input_ids": ids}, **kw), generate(model, prefill, {"input_ids": ids}, **kw)
    assert torch.equal(admitted.sequences, own.sequences)  # (without the linear states the logits move by ~8)
    for a, b in zip(admitted.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    cache.reset()
    store.close()
