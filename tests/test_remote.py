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

from conftest import prompt_ids, tiny_model

TESTS = Path(__file__).resolve().parent
OPTIONS = dict(token_budget=64, block_size=8, sink_tokens=8, recent_tokens=16, lookahead="previous")


def prefilled(batch=2, length=203):
    model = tiny_model("llama")
    cache = OasisCache(model, **OPTIONS)
    model(input_ids=prompt_ids(length, batch=batch), past_key_values=cache, use_cache=True)
    return cache


def empty_like(pool: HostKVPool) -> HostKVPool:
    fresh = HostKVPool(pool.batch_size, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype,
                       pool.chunk_blocks, pin_memory=False)
    fresh.reserve(pool.num_blocks)
    for chunk in fresh.chunks:
        chunk.fill_(float("nan"))
    return fresh


def publish_in_another_process(master: str, request: str) -> None:
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(TESTS)!r})
        from test_remote import prefilled
        from oasis_cache.layer import OasisLayer
        from oasis_cache.remote import RemoteTier, connect
        store = connect({master!r})
        tier = RemoteTier(store, {request!r})
        cache = prefilled()
        for idx, layer in enumerate(cache.layers):
            if isinstance(layer, OasisLayer):
                tier.publish(idx, layer.pool)
        print("published", tier.bytes_put)
        store.close()
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "published" in run.stdout, run.stderr[-3000:]


def test_blocks_published_by_a_process_that_exited_come_back_bit_for_bit(mooncake_master):
    publish_in_another_process(mooncake_master, "exited-prefill")
    local = prefilled()
    store = connect(mooncake_master)
    tier = RemoteTier(store, "exited-prefill")
    try:
        layers = [(idx, layer) for idx, layer in enumerate(local.layers) if isinstance(layer, OasisLayer)]
        assert layers and all(layer.pool.num_blocks == 203 // 8 for _, layer in layers)
        for idx, layer in layers:
            pool = layer.pool
            whole = empty_like(pool)
            assert tier.fetch(idx, whole, range(pool.num_blocks)) == pool.num_blocks * pool.chunks[0][0].nbytes
            for block in range(pool.num_blocks):
                C = pool.chunk_blocks
                assert torch.equal(whole.chunks[block // C][block % C], pool.chunks[block // C][block % C])
            part = empty_like(pool)  # partial fetch: only the blocks asked for are written
            tier.fetch(idx, part, [0, 5, pool.num_blocks - 1])
            for block in range(pool.num_blocks):
                C = pool.chunk_blocks
                got = part.chunks[block // C][block % C]
                if block in (0, 5, pool.num_blocks - 1):
                    assert torch.equal(got, pool.chunks[block // C][block % C])
                else:
                    assert torch.isnan(got).all()
    finally:
        assert tier.delete() > 0
        assert not any(tier.exists(0, range(4)))
        store.close()


def test_missing_blocks_are_named(mooncake_master):
    cache = prefilled(batch=1, length=64)
    idx, layer = next((i, l) for i, l in enumerate(cache.layers) if isinstance(l, OasisLayer))
    store = connect(mooncake_master)
    tier = RemoteTier(store, "half-published")
    try:
        tier.publish(idx, layer.pool, 0, 4)
        target = empty_like(layer.pool)
        with pytest.raises(RemoteBlocksMissing, match=r"2 of 4 blocks of layer 0 of request 'half-published'.*\[4, 5\]"):
            tier.fetch(idx, target, [2, 3, 4, 5])
        assert tier.delete() == 4
        with pytest.raises(RemoteBlocksMissing, match="deleted"):
            tier.fetch(idx, target, [0])
    finally:
        store.close()


def test_bad_names_and_an_absent_master_are_refused_quickly():
    with pytest.raises(ValueError, match="request must be a non-empty name"):
        RemoteTier(object(), "a/b")
    with pytest.raises(ConnectionError, match="mooncake_master --rpc_port=1"):
        connect("127.0.0.1:1")
