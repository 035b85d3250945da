"""What a deployment relies on in the remote tier, on a real Mooncake Store: a request is never served another
prompt's or another model's keys and values, nothing read from the store runs as code, records of any size pass the
client's buffer, a store that stops answering is named within seconds, and a request's keys do not outlive it."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from oasis_cache import OasisCache
from oasis_cache.remote import RemoteTier, admit, cleanup, connect, publish
from oasis_cache.remote.publisher import AlreadyPublished
from oasis_cache.remote.wire import MAGIC, RecordError
from oasis_cache.runtime.build import cache_kwargs

from conftest import prompt_ids, tiny_model

TESTS = Path(__file__).resolve().parents[1]
OPTIONS = dict(token_budget=64, block_size=8, sink_tokens=8, recent_tokens=16, lookahead="previous")
KW = dict(max_new_tokens=10, do_sample=False)


def _prefilled(model, ids, **options):
    cache = OasisCache(model, **cache_kwargs(dict(**{**OPTIONS, **options})))
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **cache.generate_kwargs())
    return cache


def _own(model, ids, **options):
    """What the prefill process itself generates after `ids` (all but its last token prefilled), with a cache of
    these options."""
    return model.generate(input_ids=ids, **_prefilled(model, ids, **options).generate_kwargs(), **KW)


def test_publishing_over_a_request_is_refused_or_replaces_it_whole(mooncake_master):
    """A second prompt under a request's name: refused before anything is written (the first stays admissible and
    decodes as before); with replace=True the record names the new publication in one step, the old blocks go,
    and the admitted decode is the new prompt's (the store kept the first record before and served it: garbage)."""
    model = tiny_model("llama")
    first, second = prompt_ids(203, seed=1), prompt_ids(203, seed=2)
    store = connect(mooncake_master)
    publish(_prefilled(model, first), store, "twice", input_ids=first)
    old = admit.__globals__["read_manifest"](store, "twice")["generation"]
    with pytest.raises(AlreadyPublished, match=r"'twice' is in the Mooncake Store already: publish\(..., "
                                               r"replace=True\)"):
        publish(_prefilled(model, second), store, "twice", input_ids=second)
    assert torch.equal(model.generate(input_ids=first, **admit(model, store, "twice").generate_kwargs(), **KW),
                       _own(model, first))
    publish(_prefilled(model, first), store, "twice", input_ids=first)  # (the admitted cache above deleted it)
    publish(_prefilled(model, second), store, "twice", input_ids=second, replace=True)
    assert not any(RemoteTier(store, "twice", old).exists(0, range(4)))  # the old generation's blocks are gone
    cache = admit(model, store, "twice", input_ids=second)
    assert torch.equal(model.generate(input_ids=second, **cache.generate_kwargs(), **KW), _own(model, second))
    store.close()


def test_admit_refuses_another_prompt_and_other_weights(mooncake_master):
    model, other = tiny_model("llama"), tiny_model("llama", seed=3)  # (one architecture and shape, other weights)
    ids = prompt_ids(203)
    store = connect(mooncake_master)
    publish(_prefilled(model, ids), store, "whose", input_ids=ids)
    with pytest.raises(ValueError, match=r"published by another model than this one \(weights "):
        admit(other, store, "whose")
    with pytest.raises(ValueError, match="another prompt than input_ids' first 202 tokens"):
        admit(model, store, "whose", input_ids=prompt_ids(203, seed=9))
    cache = admit(model, store, "whose", input_ids=ids)
    assert torch.equal(model.generate(input_ids=ids, **cache.generate_kwargs(), **KW), _own(model, ids))
    publish(_prefilled(model, ids), store, "unchecked")
    with pytest.raises(ValueError, match=r"published without its prompt's digest.*publish\(..., input_ids=prompt\)"):
        admit(model, store, "unchecked", input_ids=ids)
    cleanup(store, "unchecked")
    store.close()


def test_nothing_read_from_the_store_runs_as_code(mooncake_master, tmp_path):
    """The admission record is a JSON header and raw tensor bytes: a pickle written in its place (a payload that
    would create a file when unpickled) is refused by name, and nothing runs."""
    model = tiny_model("llama")
    ids = prompt_ids(203)
    store = connect(mooncake_master)
    publish(_prefilled(model, ids), store, "trusted")
    manifest = admit.__globals__["read_manifest"](store, "trusted")
    tier = RemoteTier(store, "trusted", manifest["generation"])
    assert bytes(store.get(tier.key("record", 0)))[:8] == MAGIC
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    bomb = pickle.dumps({"config": Payload()})
    store.remove(tier.key("record", 0), True)
    assert store.put(tier.key("record", 0), bomb) == 0
    manifest.update(parts=[len(bomb)], sha256=__import__("hashlib").sha256(bomb).hexdigest())
    assert store.upsert(tier.record_key, json.dumps(manifest).encode()) == 0
    with pytest.raises(RecordError, match="not an oasis-cache admission record"):
        admit(model, store, "trusted")
    assert not marker.exists()
    cleanup(store, "trusted")
    store.close()


def test_a_record_larger_than_the_clients_buffer_travels_in_parts(mooncake_master):
    """A client with a 256 KiB buffer (records are put and got in parts of a quarter of it) publishes and admits a
    record larger than the buffer; the admitted decode equals the prefill's own."""
    model = tiny_model("llama")
    ids = prompt_ids(2403, batch=4)
    store = connect(mooncake_master, buffer_bytes=1 << 18)
    report = publish(_prefilled(model, ids, token_budget=1024), store, "parts")
    manifest = admit.__globals__["read_manifest"](store, "parts")
    assert report["record"] > 1 << 18 and len(manifest["parts"]) > 3 and max(manifest["parts"]) <= 1 << 16
    cache = admit(model, store, "parts")
    assert torch.equal(model.generate(input_ids=ids, **cache.generate_kwargs(), **KW),
                       _own(model, ids, token_budget=1024))
    store.close()


def test_at_a_budget_above_the_context_the_store_holds_the_kv_once(mooncake_master):
    """The working set's slots (every block, at a budget above the context) are not in the record: admission fills
    them from the blocks published once."""
    model = tiny_model("llama")
    ids = prompt_ids(803)
    store = connect(mooncake_master)
    report = publish(_prefilled(model, ids, token_budget=4096), store, "once")
    assert report["blocks"] <= report["full_kv"] and report["record"] < 0.2 * report["full_kv"]
    cache = admit(model, store, "once")
    assert torch.equal(model.generate(input_ids=ids, **cache.generate_kwargs(), **KW),
                       _own(model, ids, token_budget=4096))
    store.close()


def test_a_store_that_stops_answering_is_named_within_seconds():
    """The store's processes stopped (SIGSTOP: they hold their sockets and answer nothing, as a host that hangs):
    the decode step's store read gives up after the client's timeout with a ConnectionError naming it; the tokens
    generated before stay with the caller, and the client refuses further calls at once."""
    from oasis_cache.remote import local_store

    model = tiny_model("llama")
    ids = prompt_ids(803)
    with local_store() as master:
        store = connect(master, timeout=2.0)
        publish(_prefilled(model, ids, lookahead="none"), store, "hangs")
        cache = admit(model, store, "hangs")
        first = model.generate(input_ids=ids, **cache.generate_kwargs(), max_new_tokens=2, do_sample=False)
        frozen = [int(pid) for pid in subprocess.run(["pgrep", "-f", f"mooncake_.*{master.rsplit(':', 1)[1]}"],
                                                      capture_output=True, text=True).stdout.split()]
        assert frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(ConnectionError, match=r"did not answer a \w+ call within 2 s"):
                model.generate(input_ids=first, **cache.generate_kwargs(), max_new_tokens=40, do_sample=False)
            assert time.monotonic() - started < 10
            started = time.monotonic()
            with pytest.raises(ConnectionError):
                store.get("oasis/hangs/record")
            assert time.monotonic() - started < 0.5
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert first.shape[1] == ids.shape[1] + 2


def test_a_killed_decode_process_leaves_keys_that_cleanup_removes(mooncake_master):
    """A decode process killed with SIGKILL cannot delete its request's keys: `cleanup(store, request)` (from any
    process) removes them all; a cache that is reset or closed deletes its own."""
    model = tiny_model("llama")
    ids = prompt_ids(203)
    store = connect(mooncake_master)
    publish(_prefilled(model, ids), store, "killed")
    code = textwrap.dedent(f"""
        import sys, time; sys.path.insert(0, {str(TESTS)!r})
        from conftest import tiny_model
        from oasis_cache.remote import admit, connect
        cache = admit(tiny_model("llama"), connect({mooncake_master!r}), "killed")
        print("admitted", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "admitted"
    child.send_signal(signal.SIGKILL)
    child.wait()
    tier = RemoteTier(store, "killed", admit.__globals__["read_manifest"](store, "killed")["generation"])
    assert any(tier.exists(0, range(4)))
    assert cleanup(store, "killed") > 0
    assert not any(tier.exists(0, range(4))) and not store.get(tier.record_key)
    publish(_prefilled(model, ids), store, "closed")
    with admit(model, store, "closed") as cache:
        model.generate(input_ids=ids, **cache.generate_kwargs(), max_new_tokens=2, do_sample=False)
    assert not store.get(RemoteTier(store, "closed").record_key)
    store.close()


def test_a_failed_publication_leaves_nothing(mooncake_master, monkeypatch):
    """A publication that fails midway (here: the record refused) deletes the blocks it had put."""
    from oasis_cache.remote import publisher as disaggregate

    model = tiny_model("llama")
    ids = prompt_ids(203)
    store = connect(mooncake_master)
    made = []
    monkeypatch.setattr(disaggregate, "_new_generation", lambda: made.append("g" + str(len(made))) or made[-1])
    original = disaggregate.wire.encode

    def refuse(value):
        original(value)
        raise RuntimeError("record refused")
    monkeypatch.setattr(disaggregate.wire, "encode", refuse)
    with pytest.raises(RuntimeError, match="record refused"):
        publish(_prefilled(model, ids), store, "fails")
    assert not any(RemoteTier(store, "fails", made[-1]).exists(0, range(8)))
    assert not store.get(RemoteTier(store, "fails").record_key)
    store.close()


def test_the_docs_example_runs_as_written(mooncake_master):
    """`docs/remote.md`'s example, run as written (a tiny model and prompt in its place, the test's store): the
    decode side generates, and leaving the `with` block deletes the request's keys."""
    import re

    text = (TESTS.parent / "docs" / "remote.md").read_text()
    code = re.search(r"```python\n(.*?)\n```", text, re.S).group(1)
    assert "publish(" in code and "admit(" in code
    code = code.replace('"127.0.0.1:50051"', repr(mooncake_master)).replace("max_new_tokens=256", "max_new_tokens=8")
    scope = {"model": tiny_model("llama"), "prompt": prompt_ids(203)}
    exec(code, scope)
    assert scope["out"].shape[1] == 211
    assert not connect(mooncake_master).get("oasis/req-7/record")


@pytest.mark.parametrize("host_dtype, T, D, rotated", [("fp8", 8, 16, False), ("int4", 8, 16, False),
                                                        ("int4", 16, 32, True)])
def test_a_narrow_pool_travels_narrow_and_decodes_as_the_prefills_own(mooncake_master, host_dtype, T, D, rotated,
                                                                      monkeypatch):
    """The store holds a narrow pool's units as the pool holds them (their bytes: half or a quarter), the decode side
    admits the request with the same representation (int4 in the rotated basis too, `Int4.rotated`), and generates
    the prefill process's own tokens and logits."""
    from oasis_cache.memory.representation import Int4

    monkeypatch.setattr(Int4, "rotated", rotated)
    model = tiny_model("llama", head_dim=D)
    ids = prompt_ids(403)
    store = connect(mooncake_master)
    options = dict(host_dtype=host_dtype, block_size=T, sink_tokens=T, token_budget=8 * T)
    name = f"{host_dtype}-{T}x{D}"
    wide = publish(_prefilled(model, ids, **dict(options, host_dtype=None)), store, f"wide-{name}")
    narrow = publish(_prefilled(model, ids, **options), store, f"narrow-{name}")
    unit = T * D  # float32
    expected = {"fp8": unit + 16, "int4": unit // 2 + 4 * T}[host_dtype] / (unit * 4)
    assert narrow["blocks"] / wide["blocks"] == pytest.approx(expected)
    cache = admit(model, store, f"narrow-{name}")
    assert cache.config.host_dtype == host_dtype and cache.layers[0].pool.remote.arena.dtype == torch.uint8
    assert getattr(cache.layers[0].pool.representation, "rotates", False) == rotated
    kw = dict(KW, output_logits=True, return_dict_in_generate=True)
    got = model.generate(input_ids=ids, **cache.generate_kwargs(), **kw)
    own = model.generate(input_ids=ids, **_prefilled(model, ids, **options).generate_kwargs(), **kw)
    assert torch.equal(got.sequences, own.sequences)
    for a, b in zip(got.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert cache.stats()["remote_units_fetched"] > 0  # (blocks read from the store, narrow, and widened here)
    store.close()
