"""The same anchors on CUDA: pinned host pool, the Triton gather through unified addressing (and the staging
fallback), stream-ordered offload. Skipped without a GPU."""

from __future__ import annotations

import gc
import inspect
import os

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache

from oasis_cache import OasisCache
from oasis_cache.compute.reference import block_masked_attention
from oasis_cache.layer import OasisLayer
from oasis_cache.runtime import replay
from oasis_cache.runtime.build import cache_kwargs

from conftest import cuda_runtime, dense_cache, generate, left_padded, prompt_ids, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ATOL = 2e-4


def on_cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


def test_an_unchecked_cuda_error_is_seen_where_torch_would_raise_it():
    """The suite's check for CUDA errors left pending (conftest `_no_cuda_error_left`) reads the runtime torch uses:
    an error left there by a call nobody checked is what torch's next kernel launch raises."""
    runtime = cuda_runtime()
    if runtime is None:
        pytest.skip("torch links the CUDA runtime statically: no pending error can be read")
    torch.ones(4, device="cuda").add_(1)
    assert runtime.cudaPeekAtLastError() == 0
    assert runtime.cudaSetDevice(10**6) != 0  # fails, and nobody checks: its error stays pending
    assert runtime.cudaPeekAtLastError() != 0
    with pytest.raises(RuntimeError):  # torch's next launch check raises it (and clears it)
        torch.ones(4, device="cuda").add_(1)
    assert runtime.cudaPeekAtLastError() == 0


MODES = [dict(lookahead="none"), dict(lookahead="previous"), dict(lookahead="previous", exact=True)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen2"])
def test_exact_on_cuda(arch, backend, mode):
    model = tiny_model(arch).cuda()
    for inputs, kw in [
        ({"input_ids": prompt_ids(70)}, dict(max_new_tokens=20, do_sample=False)),
        (left_padded([61, 37, 50]), dict(max_new_tokens=16, do_sample=False, prefill_chunk_size=32)),
        (left_padded([45, 33]), dict(max_new_tokens=10, do_sample=False, num_beams=3)),
    ]:
        inputs = on_cuda(inputs)
        dense = generate(model, dense_cache(model), inputs, **kw)
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=1024, host_chunk_blocks=2, backend=backend, **mode)))
        oasis = generate(model, cache, inputs, **kw)
        assert torch.equal(dense.sequences, oasis.sequences)
        if "num_beams" not in kw:
            for a, b in zip(dense.logits, oasis.logits):
                torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
        assert cache.stats()["backend"] == backend


@pytest.mark.parametrize("lookahead", ["none", "previous"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sparse_decode_equals_reference_on_cuda(monkeypatch, backend, lookahead):
    model = tiny_model("qwen3").cuda()
    calls = []
    attend = OasisLayer.attend

    def recording(layer, query, visible, scale):
        out = attend(layer, query, visible, scale)
        if getattr(layer, "last_selection", None) is not None:
            torch.cuda.synchronize()
            calls.append((query, visible, scale, out, layer.last_selection, layer.full_kv()))
            layer.last_selection = None
        return out

    monkeypatch.setattr(OasisLayer, "attend", recording)
    cache = OasisCache(model, token_budget=128, 
                       lookahead=lookahead, advanced=dict(sink_tokens=16, recent_tokens=32, host_chunk_blocks=4,
                                                          backend=backend, compile_ahead=False))  # (no dry step's layers recorded)
    cache.record_selection = True
    model.generate(**on_cuda(left_padded([300, 260])), past_key_values=cache, max_new_tokens=10,
                   do_sample=False, pad_token_id=0, eos_token_id=None)
    assert len(calls) == 9 * 2
    for query, visible, scale, out, sel, (keys, values) in calls:
        ref = block_masked_attention(query, keys, values, sel, visible, 16, scale)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_device_memory_is_bounded_on_cuda():
    """Measured with the CUDA allocator: what the cache adds on the device at 4x the context is summaries only; its
    captured steps (the default) add the same few buffers at every context."""
    model = tiny_model("llama", num_key_value_heads=4, num_attention_heads=4, hidden_size=256).cuda()
    # Warm up first: the first matmuls allocate library workspaces (cuBLAS: ~32 MiB per stream, the capture stream's
    # included: one per device, `memory/streams.py: capture_stream`) that are not the cache's.
    model.generate(input_ids=prompt_ids(300).cuda(), past_key_values=OasisCache(model, token_budget=256, cuda_graph=True),
                   max_new_tokens=8, pad_token_id=0, eos_token_id=None, do_sample=False)
    besides_metadata, captured_extra = {}, {}
    for context in (1024, 4096):
        added, held = {}, {}
        for cuda_graph in (False, True):
            gc.collect()  # the previous cache's memory is back before counting
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            cache = OasisCache(model, token_budget=256, cuda_graph=cuda_graph)
            model.generate(input_ids=prompt_ids(context).cuda(), past_key_values=cache, max_new_tokens=8,
                           pad_token_id=0, eos_token_id=None, do_sample=False)
            torch.cuda.synchronize()
            added[cuda_graph] = torch.cuda.memory_allocated() - before
            held = cache.device_nbytes() if not cuda_graph else held
            if cuda_graph:
                assert cache.captured_steps.replays > 0
            del cache
        besides_metadata[context] = added[False] - held["summaries"] - held["slot_map"]
        captured_extra[context] = added[True] - added[False]
        # Everything else is the fixed working set, the partial block and a few small buffers.
        assert besides_metadata[context] <= held["working_set"] + held["recent_overflow"] + 64 * 1024, (added, held)
        dense_kv = 2 * 2 * 4 * context * 64 * 4  # K+V, 2 layers, 4 heads, D=64, fp32
    assert abs(besides_metadata[4096] - besides_metadata[1024]) <= 64 * 1024, besides_metadata
    assert abs(captured_extra[4096] - captured_extra[1024]) <= 64 * 1024, captured_extra
    assert max(added.values()) < 0.25 * dense_kv, (added, dense_kv)


def test_smollm2_on_cuda_matches_dense():
    try:
        from oasis_cache.loaders import load_smollm2

        model, tok = load_smollm2(device="cuda", cache_dir=None)
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(str(e))
    import pydoc_data.topics as topics

    text = " ".join(list(topics.topics.values())[:60])
    ids = tok(text)["input_ids"][:3000]
    prompts = [tok.decode(ids[:3000]), tok.decode(ids[500:2200])]
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    inputs = on_cuda(dict(tok(prompts, return_tensors="pt", padding=True)))
    kw = dict(max_new_tokens=16, do_sample=False)
    dense = generate(model, dense_cache(model), inputs, **kw)
    oasis = generate(model, OasisCache(model, token_budget=4096), inputs, **kw)
    assert torch.equal(dense.sequences, oasis.sequences)
    for a, b in zip(dense.logits, oasis.logits):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)


def test_exposed_wait_is_measured():
    """A prefetch that compute waits on at once is exposed; one that finished long before is not."""
    from oasis_cache.memory.streams import PrefetchStreams

    streams = PrefetchStreams(torch.device("cuda"), measure=True)
    host = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)  # 256 MiB
    dev = torch.empty_like(host, device="cuda")
    streams.launch(0, lambda: dev.copy_(host, non_blocking=True))
    streams.wait(0)
    torch.cuda.synchronize()
    exposed = streams.exposed_wait_ms()
    assert exposed > 1.0  # 256 MiB over PCIe takes milliseconds
    streams.reset_measurements()
    streams.launch(1, lambda: dev[:1024].copy_(host[:1024], non_blocking=True))
    torch.cuda.synchronize()
    torch.cuda._sleep(10_000_000)  # compute is busy long after the copy ended
    streams.wait(1)
    torch.cuda.synchronize()
    assert streams.exposed_wait_ms() < 0.5


@pytest.mark.parametrize("programs", [None, 16])
def test_gather_with_few_programs_is_exact(programs):
    model = tiny_model("qwen3").cuda()
    inputs = on_cuda(left_padded([300, 260]))
    kw = dict(max_new_tokens=8, do_sample=False)
    ref = generate(model, OasisCache(model, token_budget=128, advanced=dict(backend="torch")), inputs, **kw)
    got = generate(model, OasisCache(model, token_budget=128, advanced=dict(gather_programs=programs)), inputs, **kw)
    assert torch.equal(ref.sequences, got.sequences)


def test_prefill_device_memory_is_about_one_layer():
    """Peak device memory of a prefill through OasisCache exceeds a cache-free forward by a few layers' K/V at most
    (each layer's K/V leaves for the host before the next layer runs); DynamicCache keeps all layers'."""
    layers, heads, D, N = 8, 4, 64, 4096
    model = tiny_model("llama", num_hidden_layers=layers, hidden_size=heads * D, num_attention_heads=heads,
                       num_key_value_heads=heads, intermediate_size=256).cuda()
    ids = prompt_ids(N).cuda()
    layer_kv = 2 * heads * N * D * 4  # K + V of one layer, fp32

    def peak(**kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1, **kwargs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    no_cache = peak(use_cache=False)
    oasis = peak(past_key_values=OasisCache(model, token_budget=256), use_cache=True)
    dense = peak(past_key_values=dense_cache(model), use_cache=True)
    assert oasis - no_cache < 5 * layer_kv, (oasis, no_cache, layer_kv)
    assert dense - no_cache >= (layers - 1) * layer_kv  # the contrast: every layer stays


EAGLE3_MODES = [dict(lookahead="eagle3"), dict(lookahead="eagle3", exact=True),
                dict(lookahead="eagle3", exact=True, static_head="graph")]
# (the others run captured steps: the default on CUDA)
EAGER_MODES = [dict(lookahead="previous", cuda_graph=False), dict(lookahead="previous", exact=True, cuda_graph=False),
               dict(lookahead="eagle3", cuda_graph=False), dict(lookahead="eagle3", exact=True, cuda_graph=False)]


NARROW_MODES = [dict(lookahead="previous", host_dtype="fp8"), dict(lookahead="previous", exact=True, host_dtype="int4")]


@pytest.mark.parametrize("mode", MODES + EAGLE3_MODES + EAGER_MODES + NARROW_MODES,
                         ids=lambda m: "-".join(str(v) for v in m.values()))
def test_decode_steps_make_no_host_sync(mode):
    """The decode hot path issues no synchronizing CUDA call (`.item()`, blocking copies, ...): checked with
    PyTorch's sync debug mode over decode steps that select, fetch, prefetch and offload blocks (and, with eagle3,
    draft and ride along; the head's graph is captured during the warm-up steps)."""
    from conftest import random_head

    model = tiny_model("qwen3", num_hidden_layers=4).cuda()  # a head reads three of its layers' hidden states
    mode = dict(mode)
    static_head = mode.pop("static_head", None)
    if mode["lookahead"] == "eagle3":
        mode["draft"] = random_head(model)
    cache = OasisCache(model, **cache_kwargs(dict(token_budget=128, sink_tokens=16, recent_tokens=32,
                                                  host_chunk_blocks=4, **mode)))
    if static_head:
        cache.ride_along.static_head = static_head
    ids = prompt_ids(400).cuda()
    with torch.no_grad():
        token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):  # warm-up: kernels compile, address tables are built
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(40):  # crosses block boundaries: offloads, new chunks, new address tables
                logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("exact", [False, True])
def test_eagle3_ride_along_on_cuda(exact):
    from conftest import random_head

    model = tiny_model("qwen3", num_hidden_layers=4).cuda()
    head = random_head(model)
    for inputs, kw in [
        ({"input_ids": prompt_ids(70)}, dict(max_new_tokens=20, do_sample=False)),
        (left_padded([61, 37, 50]), dict(max_new_tokens=16, do_sample=False, prefill_chunk_size=32)),
    ]:
        inputs = on_cuda(inputs)
        dense = generate(model, dense_cache(model), inputs, **kw)
        oasis = generate(model, OasisCache(model, token_budget=1024, lookahead="eagle3", draft=head, exact=exact),
                         inputs, **kw)
        assert torch.equal(dense.sequences, oasis.sequences)
        for a, b in zip(dense.logits, oasis.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("batch, layers", [(1, 1), (3, 1), (3, 2)])
def test_head_graph_drafts_what_the_plain_call_drafts(batch, layers):
    """The head's decode call replayed as a CUDA graph (`RideAlong.static_head = "graph"`, `draft/head_step.py`)
    drafts what the plain call drafts, through wraps of its ring and an extend (which recaptures); a deeper head
    (ours) too."""
    from conftest import drafts_of_two_generates, random_head

    model = tiny_model("qwen3", num_hidden_layers=4).cuda()
    head = random_head(model, scale=0.5)
    if layers > 1:
        head = head.deepen(layers)
        with torch.no_grad():
            for p in head.post_layers.parameters():
                p.normal_(0, 0.5)
    head.config.attention_window = 5
    prompt, extend = prompt_ids(90, batch=batch).cuda(), prompt_ids(40, batch=batch, seed=3).cuda()
    runs = []
    for static in (None, "graph"):
        cache = OasisCache(model, token_budget=1024, lookahead="eagle3", draft=head)
        ride = cache.ride_along
        ride.static_head = static
        runs.append(drafts_of_two_generates(model, cache, prompt, extend))
        if static:
            assert ride._static is not None and ride._static.graph is not None
    assert runs[0].shape == (batch, 22) and torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("mode", MODES + EAGLE3_MODES[:2] + [dict(lookahead="previous", top_k_kernel=True)],
                         ids=lambda m: "-".join(str(v) for v in m.values()))
def test_captured_steps_decode_what_eager_steps_decode(mode):
    """cuda_graph=True (the default here) replays decode steps as CUDA graphs (`runtime/captured_step.py`): the same greedy tokens
    and logits as the eager cache, sparse (budget below the context) and dense-equal (budget above it), batch 1 and
    3; sparse, one graph per kind of step (steady, completing a block) serves every block count (the blocks exceed
    the slots), dense-equal they are recaptured as blocks complete (every block selected: shapes follow the count);
    a left-padded batch replays too (its steps are called without their masks and read the padding recorded at the
    prefill), sparse and dense-equal, with the same result. With eagle3 the ride-along is in the graph: the same
    drafts (their count of right guesses) and, without `exact` (the draft's choice is attended), the same tokens.
    With the select kernel's top-k (`top_k_kernel`), whose size follows the summaries' capacity: compiled at the
    capture of a grown capacity too."""
    from conftest import random_head

    model = tiny_model("qwen3", num_hidden_layers=4).cuda()
    if mode["lookahead"] == "eagle3":
        mode = dict(mode, draft=random_head(model))
    kw = dict(max_new_tokens=60, do_sample=False)
    cases = [
        ({"input_ids": prompt_ids(300)}, 128, True),
        ({"input_ids": prompt_ids(300, batch=3)}, 128, True),
        ({"input_ids": prompt_ids(300)}, 1024, True),
        (left_padded([300, 240, 270]), 128, True),  # (as wide as the unpadded prompt: eagle3's steps stay eager
        (left_padded([300, 240, 270]), 1024, True),  # until the head's ring of 255 rows fills, as many as for it)
    ]
    if mode.get("top_k_kernel"):  # the ranked rows grow from 64 to 128 blocks at a captured step (CPU-checked)
        cases.append(({"input_ids": prompt_ids(1000)}, 128, True))
    for inputs, budget, replays in cases:
        inputs = on_cuda(inputs)
        options = dict(token_budget=budget, recent_tokens=32, host_chunk_blocks=4, **mode)
        eager_cache = OasisCache(model, **cache_kwargs(dict(cuda_graph=False, **options)))
        eager = generate(model, eager_cache, inputs, **kw)
        cache = OasisCache(model, **cache_kwargs(dict(cuda_graph=True, **options)))
        graphed = generate(model, cache, inputs, **kw)
        steps = cache.captured_steps
        assert torch.equal(eager.sequences, graphed.sequences), (budget, steps.captures, steps.replays)
        for a, b in zip(eager.logits, graphed.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
        if cache.ride_along is not None:  # the head's keys (its ring) and its right guesses evolved alike
            assert cache.stats()["draft_accuracy"] == eager_cache.stats()["draft_accuracy"]
            torch.testing.assert_close(cache.ride_along._head_kv.k, eager_cache.ride_along._head_kv.k,
                                       atol=ATOL, rtol=1e-3)
        if budget >= 1024:
            assert torch.equal(generate(model, dense_cache(model), inputs, **kw).sequences, graphed.sequences)
        if not replays:
            assert steps.replays == 0
        elif budget < 1024:  # a steady graph and a completing one, replayed across the block completions
            assert steps.replays >= 50 and steps.completing_replays >= 2 and steps.captures <= 5, (
                steps.captures, steps.replays, steps.completing_replays)
        else:
            assert steps.replays >= 40 and steps.captures >= 3, (steps.captures, steps.replays)


def test_compiled_decode_captured_decodes_what_eager_decodes():
    """`compile_decode=True` on CUDA, steps captured (the default here): every layer of a model deeper than dynamo's
    recompile limit runs compiled (one graph for all) and the greedy
    tokens equal the eager cache's, with logits within rounding, across block completions."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model("qwen3", num_hidden_layers=10).cuda()
    inputs = on_cuda({"input_ids": prompt_ids(300, batch=2)})
    kw = dict(max_new_tokens=40, do_sample=False)
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous")
    eager = generate(model, OasisCache(model, **cache_kwargs(dict(cuda_graph=False, **options))), inputs, **kw)
    before, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    cache = OasisCache(model, **cache_kwargs(dict(compile_decode=True, **options)))
    compiled = generate(model, cache, inputs, **kw)
    # one graph for all 10 layers (2: a torch without `dynamic_sources`), no break at the cache's calls (torch 2.11
    # broke at the token's attribute write: then 10 graphs)
    assert 0 < counters["stats"]["unique_graphs"] - before <= 2
    assert sum(counters["graph_break"].values()) == breaks
    assert cache.captured_steps.replays >= 30
    assert torch.equal(eager.sequences, compiled.sequences)
    for a, b in zip(eager.logits, compiled.logits):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)


def test_compile_decode_none_captures_compiled_steps_once_the_model_has_decoded_enough():
    """`compile_decode=None` (the default) with captured steps: uncompiled steps captured and replayed until the model
    has decoded `compile_after_steps` steps in the process, then one eager step that compiles and a new capture with
    the compiled kernels (one graph for all layers); every greedy token equals the eager uncompiled cache's, logits
    within rounding. Under the default count (2048) a short run compiles nothing."""
    from torch._dynamo.utils import counters

    from oasis_cache.runtime import compiled_layers

    torch._dynamo.reset()
    model = tiny_model("qwen3", num_hidden_layers=10).cuda()
    inputs = on_cuda({"input_ids": prompt_ids(300, batch=2)})
    kw = dict(max_new_tokens=40, do_sample=False)
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous")
    eager = generate(model, OasisCache(model, **cache_kwargs(dict(cuda_graph=False, compile_decode=False, **options))),
                     inputs, **kw)
    before = counters["stats"]["unique_graphs"]
    short = OasisCache(model, **cache_kwargs(options))
    assert short.captured_steps is not None and not replay.compiles_decode(short)
    assert torch.equal(generate(model, short, inputs, **kw).sequences, eager.sequences)
    assert counters["stats"]["unique_graphs"] == before and compiled_layers.decoded_steps(model) == 39
    cache = OasisCache(model, **cache_kwargs(dict(compile_after_steps=39 + 20, **options)))
    got = generate(model, cache, inputs, **kw)
    steps = cache.captured_steps
    assert replay.compiles_decode(cache) and 0 < counters["stats"]["unique_graphs"] - before <= 2
    assert steps.captures >= 4 and steps.replays >= 25, (steps.captures, steps.replays)  # before and after
    assert torch.equal(got.sequences, eager.sequences)
    for a, b in zip(eager.logits, got.logits):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    # A later cache compiles nothing new: its first step (eager, with the caller's mask) runs uncompiled, not a
    # second graph (: 1.4-2.4 s at the next call's first step on the H200); another prompt length
    graphs = counters["stats"]["unique_graphs"]
    other = on_cuda({"input_ids": prompt_ids(270, batch=2)})
    later = OasisCache(model, **cache_kwargs(dict(compile_after_steps=39 + 20, **options)))
    assert torch.equal(generate(model, later, other, **kw).sequences, generate(
        model, OasisCache(model, **cache_kwargs(dict(cuda_graph=False, compile_decode=False,
                                                     **options))), other, **kw).sequences)
    assert replay.compiles_decode(later) and later.captured_steps.replays >= 30
    assert counters["stats"]["unique_graphs"] == graphs


def test_captured_steps_are_the_default_where_checked():
    """cuda_graph=None (default): captured steps for a checked architecture with the Triton backend, eager steps with
    the torch backend (its staging copies cannot be recorded) — where cuda_graph=True is an error naming the fix."""
    if os.environ.get("OASIS_TEST_CUDA_GRAPH") == "0":
        pytest.skip("OASIS_TEST_CUDA_GRAPH=0 makes every cache eager: the default is not what this run tests")
    model = tiny_model("llama", num_hidden_layers=2).cuda()
    assert OasisCache(model, token_budget=128, lookahead="previous").captured_steps is not None
    assert OasisCache(model, token_budget=128, lookahead="previous", cuda_graph=False).captured_steps is None
    assert OasisCache(model, token_budget=128, lookahead="previous",
                      advanced=dict(backend="torch")).captured_steps is None
    with pytest.raises(ValueError, match="Triton backend"):
        OasisCache(model, token_budget=128, lookahead="previous", cuda_graph=True, advanced=dict(backend="torch"))


def test_a_failed_capture_names_the_fix():
    """A decode step that cannot be captured (here a layer hook that refuses, as a host sync would) stops with an
    error naming `cuda_graph=False`, not a half-recorded graph."""
    model = tiny_model("qwen3", num_hidden_layers=2).cuda()

    def refuse(module, args, output):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this hook cannot be captured")

    handle = model.model.layers[0].register_forward_hook(refuse)
    try:
        cache = OasisCache(model, token_budget=128, lookahead="previous", cuda_graph=True,
                           advanced=dict(recent_tokens=32))
        with pytest.raises(RuntimeError, match="cuda_graph=False"):
            generate(model, cache, on_cuda({"input_ids": prompt_ids(300)}), max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()


def test_half_channel_summaries_on_cuda():
    """The default summaries (half the key channels) on CUDA: the Triton kernels rank with the queries read on the
    chosen channels as the torch backend does (same tokens), the captured steps replay once the channels are chosen
    (at the first decode step), and the summaries hold half the bytes of codes and levels of those on every channel."""
    model = tiny_model("qwen3", num_hidden_layers=4).cuda()
    inputs = on_cuda({"input_ids": prompt_ids(300, batch=2)})
    kw = dict(max_new_tokens=40, do_sample=False)
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous")
    captured = OasisCache(model, **cache_kwargs(dict(cuda_graph=True, **options)))
    by_kernels = generate(model, captured, inputs, **kw)
    by_torch = generate(model, OasisCache(model, **cache_kwargs(dict(backend="torch", **options))), inputs, **kw)
    assert torch.equal(by_kernels.sequences, by_torch.sequences)
    assert captured.captured_steps.replays >= 30
    full = OasisCache(model, **cache_kwargs(dict(summary_channels=1.0, **options)))
    generate(model, full, inputs, **kw)
    layer, whole = captured.layers[0].summaries, full.layers[0].summaries
    assert layer.levels.shape[-1] == whole.levels.shape[-1] // 2 and layer.codes.shape[-1] == whole.codes.shape[-1] // 2


@pytest.mark.parametrize("lookahead", ["none", "previous"])
def test_budget_at_the_context_on_cuda(lookahead):
    """boundary on the default CUDA path (captured steps, Triton kernels): from the context on, every
    budget (block multiple or not) decodes exactly what dense decodes; slots grown during decode keep it exact."""
    model = tiny_model("llama").cuda()
    inputs = on_cuda({"input_ids": prompt_ids(45)})
    kw = dict(max_new_tokens=14, do_sample=False)
    dense = generate(model, dense_cache(model), inputs, **kw)
    context = 45 + 14 - 1
    for budget in (context, context + 1, 63, 64, 10**7):
        cache = OasisCache(model, token_budget=budget, lookahead=lookahead, advanced=dict(sink_tokens=16,
                                                                                          recent_tokens=16))
        oasis = generate(model, cache, inputs, **kw)
        assert torch.equal(dense.sequences, oasis.sequences), budget
        for a, b in zip(dense.logits, oasis.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
    long = on_cuda({"input_ids": prompt_ids(20)})
    dense = generate(model, dense_cache(model), long, max_new_tokens=300, do_sample=False)
    cache = OasisCache(model, token_budget=512, lookahead=lookahead, advanced=dict(sink_tokens=16, recent_tokens=16))
    assert torch.equal(generate(model, cache, long, max_new_tokens=300, do_sample=False).sequences, dense.sequences)
    assert cache.layers[0].working_set.num_slots > 16


@pytest.mark.parametrize("change", ["moved", "a setting"])
def test_a_cache_reused_after_its_model_changed_captures_its_steps_anew(change):
    """Steps captured, then the model changed between two calls of a cache that continues the conversation: moved
    to the CPU and back, its old weights' memory taken by other tensors; or a setting that moves no tensor (every
    attention's `scaling`, a Python number the captured kernels were launched with — as a LoRA adapter switched is a
    name). The second call decodes what a cache that never captures decodes, because the prefill saw the weights
    move or the settings change (`captured_step.weights_where_they_are`, `module_settings`) and the steps were
    captured anew. Replaying the first call's graphs would read the other tensors, or the old setting."""
    model = tiny_model("qwen3").cuda()
    ids = prompt_ids(300).cuda()
    kw = dict(max_new_tokens=24, do_sample=False)
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous")
    cache, eager = OasisCache(model, **cache_kwargs(options)), OasisCache(model, **cache_kwargs(dict(cuda_graph=False,
                                                                                                     **options)))
    first = generate(model, cache, {"input_ids": ids}, **kw)
    assert torch.equal(first.sequences, generate(model, eager, {"input_ids": ids}, **kw).sequences)
    captures = cache.captured_steps.captures
    assert captures > 0
    squatters = []
    if change == "moved":
        model.cpu()
        squatters = [torch.full_like(p, 3.0, device="cuda") for p in model.parameters()]  # (the freed blocks, refilled)
        model.cuda()
    else:
        for layer in model.model.layers:
            layer.self_attn.scaling *= 4.0  # (sharper attention: other tokens)
    follow = torch.cat([first.sequences, prompt_ids(20, seed=5).cuda()], dim=1)
    second = generate(model, cache, {"input_ids": follow}, **kw)
    again = generate(model, eager, {"input_ids": follow}, **kw)
    assert torch.equal(second.sequences, again.sequences)
    torch.testing.assert_close(torch.stack(second.logits), torch.stack(again.logits), rtol=1e-4, atol=1e-4)
    assert cache.captured_steps.captures > captures
    del squatters


@pytest.mark.parametrize("lookahead", ["none", "previous"])
def test_compile_ahead_compiles_the_first_step_and_decodes_the_same(lookahead, monkeypatch, tmp_path):
    """`compile_ahead=True` on CUDA, in a new kernel cache: the dry copy's launches are compilations in Triton's thread
    pool and run nothing; the real steps (captured ones too) decode what a cache without the option decodes, and the
    dry step runs once per process and signature (`runtime/ahead.py`)."""
    from oasis_cache.runtime import ahead
    from oasis_cache.kernels.ahead import kernels

    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # (a new machine's kernel cache:)
    for kernel in kernels():
        kernel.device_caches.clear()  # (this process's compiled kernels forgotten)
    model = tiny_model("qwen3").cuda()
    ids = prompt_ids(300).cuda()
    kw = dict(max_new_tokens=24, do_sample=False)
    options = dict(token_budget=128, lookahead=lookahead)
    calls = []
    monkeypatch.setattr(ahead, "dry_step", lambda *a, run=ahead.dry_step: calls.append(run(*a)) or calls[-1])
    first = generate(model, OasisCache(model, **options, advanced=dict(
        recent_tokens=32, compile_ahead=True, ahead_at_prefill=False)), {"input_ids": ids}, **kw)
    assert calls == [True]
    plain = generate(model, OasisCache(model, **options, advanced=dict(recent_tokens=32, compile_ahead=False)),
                     {"input_ids": ids}, **kw)
    assert torch.equal(first.sequences, plain.sequences)
    generate(model, OasisCache(model, **options, advanced=dict(recent_tokens=32, compile_ahead=True)),
             {"input_ids": ids}, **kw)
    assert calls == [True]  # (once per signature)


@pytest.mark.parametrize("chunk", [0, 128], ids=["whole", "chunked"])
def test_ahead_at_prefill_compiles_during_the_prefill_and_decodes_the_same(chunk, monkeypatch):
    """`ahead_at_prefill=True` on CUDA (research): the first attention layer's dry decode token starts the step's
    compilations during the prefill (whole, or at its last chunk with the prompt resident on the device); the first
    decode step waits for them and runs no dry step; the tokens equal a cache without the option."""
    from oasis_cache.runtime import ahead

    monkeypatch.setattr(ahead, "_DONE", set())
    model = tiny_model("qwen3").cuda()
    ids = prompt_ids(300).cuda()
    kw = dict(max_new_tokens=24, do_sample=False)
    options = dict(token_budget=128, recent_tokens=32, prefill_chunk_tokens=chunk)
    ran, dry = [], []
    monkeypatch.setattr(ahead, "at_prefill", lambda *a, run=ahead.at_prefill: ran.append(run(*a)) or ran[-1])
    monkeypatch.setattr(ahead, "dry_step", lambda *a: dry.append(1) or False)
    first = generate(model, OasisCache(model, **cache_kwargs(dict(compile_ahead=True, ahead_at_prefill=True,
                                                                  **options))),
                     {"input_ids": ids}, **kw)
    assert ran == [True] and dry == [] and ahead.PENDING == []
    plain = generate(model, OasisCache(model, **cache_kwargs(dict(compile_ahead=False, **options))),
                     {"input_ids": ids}, **kw)
    assert torch.equal(first.sequences, plain.sequences)


def test_a_cache_collected_during_another_caches_capture_leaves_no_bad_event(monkeypatch):
    """The H200, 2026-12-03 (twice, 7-12 tests each): "CUDA error: invalid argument" at `generate`'s `.item()` and at
    pinned allocations. A pinned host block last used on a stream and freed while that stream is captured leaves
    torch's host allocator an event it cannot query (a micro-benchmark). Here an earlier cache
    in a reference cycle shares the capturing cache's side stream (streams come from torch's pool of 32), and a
    collection runs inside each capture wherever Python's automatic collection is on, as it may at any
    allocation (here once the side stream has joined the capture): captures pause it, so nothing of the earlier cache
    is freed inside a graph."""
    from oasis_cache.runtime import context as cache_module
    from oasis_cache.memory.streams import PrefetchStreams

    model = tiny_model("llama").cuda()
    inputs = on_cuda({"input_ids": prompt_ids(45)})
    kw = dict(max_new_tokens=40, do_sample=False)
    options = dict(token_budget=64, sink_tokens=16, recent_tokens=16, lookahead="previous")
    first = OasisCache(model, **cache_kwargs(options))  # its blocks are offloaded into pinned memory on its side stream
    generate(model, first, inputs, **kw)
    side = first.streams.side
    assert first.layers[0].pool.pin_memory and first.layers[0].pool.num_blocks > 0
    loop = [first]
    loop.append(loop)
    del first, loop  # garbage now, freed by the next collection

    collections = []

    class SharedSide(PrefetchStreams):
        def __init__(self, device, measure=False):
            super().__init__(device, measure)
            self.side = side

        def run_after_compute(self, work, *tensors):
            super().run_after_compute(work, *tensors)  # the side stream is now in the capture, if one runs
            if self.capturing() and gc.isenabled():
                collections.append(gc.collect())

    monkeypatch.setattr(cache_module, "PrefetchStreams", SharedSide)
    second = OasisCache(model, **cache_kwargs(options))
    out = generate(model, second, inputs, **kw)
    torch.empty(1, pin_memory=True)  # the host allocator queries every pending event here
    torch.ones(1, device="cuda").sum().item()
    assert second.streams.side is side and second.captured_steps.captures > 0
    assert collections == [], "a collection ran inside a capture"
    monkeypatch.undo()
    again = generate(model, OasisCache(model, **cache_kwargs(options)), inputs, **kw)
    assert torch.equal(out.sequences, again.sequences)


@pytest.mark.parametrize("mode", MODES + EAGLE3_MODES[::2] + EAGER_MODES[:1],
                         ids=lambda m: "-".join(str(v) for v in m.values()))
def test_a_dropped_cache_is_freed_at_once_and_the_next_reuses_its_pinned_memory(mode):
    """A cache nothing references any more is freed with its last reference, not at Python's next collection, so the
    next cache of the same shape takes its pinned blocks from torch's host allocator instead of pinning anew. The
    H200: a captured step's kept output held its cache (`past_key_values`), a reference
    cycle; each later 32K `generate` of an 8B model pinned 5 GiB anew (1.7-2.0 s) and the pinned pool grew by as
    much per call until a collection."""
    import weakref

    from conftest import random_head

    model = tiny_model("qwen3", num_hidden_layers=4).cuda()  # (a head reads three of its layers' hidden states)
    mode = dict(mode)
    static_head = mode.pop("static_head", None)
    if mode["lookahead"] == "eagle3":
        mode["draft"] = random_head(model)
    inputs = on_cuda({"input_ids": prompt_ids(300)})
    gc.collect()  # (caches earlier tests left in reference cycles go now)
    enabled = gc.isenabled()
    gc.disable()
    try:
        pinned, pools = [], []
        for _ in range(3):
            cache = OasisCache(model, **cache_kwargs(dict(token_budget=128, sink_tokens=16, recent_tokens=32,
                                                          host_chunk_blocks=4, **mode)))
            if static_head:
                cache.ride_along.static_head = static_head
            generate(model, cache, inputs, max_new_tokens=40, do_sample=False)
            assert (cache.captured_steps is not None) == mode.get("cuda_graph", True)
            if mode.get("cuda_graph", True) and static_head is None:  # (the head's own graph: eager target steps)
                assert cache.captured_steps.captures > 0
            torch.cuda.synchronize()
            pools.append(cache.host_nbytes())
            gone = weakref.ref(cache)
            del cache
            held = gone()
            assert held is None, f"the dropped cache lives on, held by {[type(r) for r in gc.get_referrers(held)]}"
            pinned.append(torch.cuda.host_memory_stats()["allocated_bytes.allocated"])  # (bytes pinned so far)
        assert pools[2] > 0
        # (with the head's own graph ~12% of this tiny pool was pinned anew per cache while its capture went through
        # `torch.cuda.graph`, which empties torch's pinned cache as it begins: `draft/head_step.py`)
        assert pinned[2] - pinned[1] < pools[2] / 10, (pinned, pools)
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("past", [16, 1000, 8192])
def test_a_chunk_over_its_past_by_cudnn_merged_equals_the_lower_right_mask(past):
    """`compute.dense.SPLIT_PAST` (default): a chunk's queries over their past without a mask and over themselves
    causally, both by cuDNN with log-sum-exps, merged (`_past_then_chunk`), equal SDPA with a lower-right causal mask
    within bf16's rounding, and both equal float32 attention as closely; grouped query heads as a layer has them."""
    from oasis_cache.compute import dense

    torch.manual_seed(0)
    Qn, D = 512, 128
    q = torch.randn(2, 8, Qn, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, past + Qn, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    calls = []
    split = dense._past_then_chunk
    try:
        dense._past_then_chunk = lambda *a: calls.append(1) or split(*a)
        dense.SPLIT_PAST = False
        masked = dense.dense_causal_attention(q, k, v, None, D ** -0.5)
        dense.SPLIT_PAST = True
        merged = dense.dense_causal_attention(q, k, v, None, D ** -0.5)
    finally:
        dense._past_then_chunk, dense.SPLIT_PAST = split, True
    assert calls == [1] and not dense._CUDNN["failed"]
    reference = dense.dense_causal_attention(q.float(), k.float(), v.float(), None, D ** -0.5)
    for out in (masked, merged):
        torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    assert (merged.float() - reference).abs().max() <= 2 * (masked.float() - reference).abs().max() + 1e-3


def test_a_prompts_first_chunk_warms_cudnns_kernels_in_a_thread_and_decodes_the_same(monkeypatch):
    """`compute.dense.warm_split_past`: a prompt prefilled in chunks starts the later chunks' cuDNN calls in a thread
    at its first chunk; on CUDA that thread's calls run without error (bf16, grouped heads), it has ended when
    `generate` returns, and the tokens and the first step's logits equal a run without it."""
    from oasis_cache.compute import dense

    model = tiny_model("llama", num_key_value_heads=2, num_attention_heads=4).cuda().to(torch.bfloat16)
    inputs = on_cuda({"input_ids": prompt_ids(1200)})
    runs = []
    for queries in (dense.SPLIT_WARM_QUERIES or 1024, 0):
        monkeypatch.setattr(dense, "SPLIT_WARM_QUERIES", queries)
        monkeypatch.setattr(dense, "_WARM_THREADS", {})
        monkeypatch.setattr(dense, "WARM_FAILED", {})
        cache = OasisCache(model, token_budget=256, prefill_chunk_tokens=512)
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False, past_key_values=cache,
                             output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences[0, 1200:].tolist(), out.logits[0].float()))
        assert len(dense._WARM_THREADS) == (1 if queries else 0) and not dense.WARM_FAILED, dense.WARM_FAILED
        assert not any(thread.is_alive() for thread in dense._WARM_THREADS.values())
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1])


def test_pinned_host_memory_is_released(monkeypatch):
    """Caches of different shapes made and dropped one after another leave pinned memory in torch's caching host
    allocator; a reset, or a host pool that would not fit
    otherwise, hands it back to the system."""
    from oasis_cache.memory import host_memory

    model = tiny_model("llama", num_key_value_heads=4, num_attention_heads=4).cuda()
    gc.collect()  # (caches earlier tests left in reference cycles go now, not inside the measurement)
    torch.cuda.synchronize()
    host_memory.release_cached_pinned()
    baseline = host_memory.pinned_bytes_held()  # what other live tensors hold
    for batch, length in ((1, 2000), (3, 1500), (2, 3000)):
        cache = OasisCache(model, token_budget=256)
        model(input_ids=prompt_ids(length, batch=batch).cuda(), past_key_values=cache, use_cache=True)
        del cache
        gc.collect()
    torch.cuda.synchronize()
    cached = host_memory.pinned_bytes_held() - baseline  # no cache lives: all of it is kept for reuse
    assert cached > 0
    real = host_memory.available_host_bytes()
    # short of room until the cached pinned memory is released: the check releases it and lets the pool through
    monkeypatch.setattr(host_memory, "available_host_bytes",
                        lambda: real + (baseline + cached - host_memory.pinned_bytes_held()))
    host_memory.check_host_room(real - host_memory.HEADROOM_BYTES + cached // 2, "a test pool")
    assert host_memory.pinned_bytes_held() <= baseline
    monkeypatch.undo()
    cache = OasisCache(model, token_budget=256)
    model(input_ids=prompt_ids(2000).cuda(), past_key_values=cache, use_cache=True)
    assert cache.host_nbytes() > 0 and host_memory.pinned_bytes_held() > baseline
    cache.reset()
    torch.cuda.synchronize()
    assert host_memory.pinned_bytes_held() <= baseline


@pytest.mark.parametrize("overlap", [False, True])
def test_an_admitted_cache_replays_captured_steps(request, overlap):
    """A cache admitted from a Mooncake Store with lookahead "previous" (no exact) replays its decode steps as CUDA
    graphs: a prefetch gathers the units its local cache holds and leaves the store reads to after the step
    (`remote.repair.repair_after_step`; with `overlap`, a host thread reads each layer's record after its
    external event inside the graph and the store while the step runs). Same greedy tokens and logits as the
    prefill's own cache decoding eagerly in this process; steady and completing steps replayed across the blocks
    decode completes (its local pool's first block included); units did come from the store."""
    pytest.importorskip("mooncake.store")  # (the GPU image has no Mooncake: bench/mooncake_for_gpu.sh brings it)
    mooncake_master = request.getfixturevalue("mooncake_master")
    from oasis_cache.remote import admit, connect, publish

    model = tiny_model("qwen3", num_hidden_layers=4).cuda()
    ids = prompt_ids(600, batch=2).cuda()
    options = dict(token_budget=128, recent_tokens=32, host_chunk_blocks=4, lookahead="previous")
    # 90 tokens: ~5 completed blocks (the first two recapture: the local pool's first block changes the layout)
    kw = dict(max_new_tokens=90, do_sample=False, output_logits=True, return_dict_in_generate=True)
    local = OasisCache(model, **cache_kwargs(dict(cuda_graph=False, **options)))
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **local.generate_kwargs())
    store = connect(mooncake_master)
    publish(local, store, f"cuda-captured-{overlap}")
    expected = model.generate(input_ids=ids, **local.generate_kwargs(), **kw)
    # (the record carries the eager cache's cuda_graph=False)
    cache = admit(model, store, f"cuda-captured-{overlap}", cuda_graph=True, overlap=overlap)
    got = model.generate(input_ids=ids, **cache.generate_kwargs(), **kw)
    cache.streams.settle()
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    assert cache.stats()["remote_units_fetched"] > 0
    if os.environ.get("OASIS_TEST_CUDA_GRAPH") != "0":
        steps = cache.captured_steps
        assert steps.replays >= 70 and steps.completing_replays >= 2, (steps.captures, steps.replays)
    cache.reset()
    if not overlap:  # a request whose steps must read the store inside them: eager steps, and a warning naming the fix
        options["lookahead"] = "none"
        none = OasisCache(model, **cache_kwargs(options))
        with torch.no_grad():
            model(input_ids=ids[:, :-1], **none.generate_kwargs())
        publish(none, store, "cuda-in-step")
        with pytest.warns(UserWarning, match=r"lookahead='none'.*run eagerly.*lookahead='previous'"):
            eager = admit(model, store, "cuda-in-step")
        assert eager.captured_steps is None and "read the store inside the step" in str(eager)
        eager.reset()
    store.close()


def test_other_cache_kinds_on_cuda_are_unchanged_by_the_switch():
    """After OasisCache(model) switched the model to "oasis", transformers' CUDA cache kinds (static, and offloaded /
    offloaded static where transformers' own offloading is sound) and the default cache generate what they generated
    before, padded and not; the earlier tests left the default stream current."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream(), torch.cuda.current_stream()
    model = tiny_model("qwen3", num_hidden_layers=4).cuda()
    inputs = {"plain": {"input_ids": prompt_ids(100).cuda()},
              "padded": {key: value.cuda() for key, value in left_padded([70, 45]).items()}}

    kinds = ["static", "dynamic"]
    if "self.prefetch_stream.wait_stream" in inspect.getsource(Cache.update):
        kinds += ["offloaded", "offloaded_static"]  # else transformers' own offloading races (5.17, the H200's image:
        # a prefetch may overwrite keys the default stream still reads; run-to-run other tokens before any OasisCache)

    def runs():
        # disable_compile: generate compiles static caches' steps, and on torch 2.11 + transformers 5.17 (the H200's
        # image) dynamo crashes the process there (segmentation fault), before any OasisCache is made
        return {(kind, name): model.generate(**given, max_new_tokens=8, do_sample=False, cache_implementation=kind,
                                             disable_compile=True)
                for kind in kinds for name, given in inputs.items()}

    model.set_attn_implementation("sdpa")
    before = runs()
    OasisCache(model, token_budget=512)
    after = runs()
    for key in before:
        assert torch.equal(after[key], before[key]), key


@pytest.mark.parametrize("lookahead", ["previous", "none"])
def test_fork_on_cuda_decodes_what_a_copy_decodes_and_leaves_the_original(lookahead):
    """`cache.fork()` on CUDA (pinned pools, the Triton gather reading shared chunks, captured steps): the fork and a
    deep copy decode the same tokens; a crop of the fork into the shared chunks leaves the original's decode as it
    was."""
    import copy

    model = tiny_model("llama").cuda()
    ids = prompt_ids(150).cuda()
    cache = OasisCache(model, token_budget=64, 
                       lookahead=lookahead, advanced=dict(sink_tokens=16, recent_tokens=16, host_chunk_blocks=2))
    first = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    twin, fork = copy.deepcopy(cache), cache.fork()
    assert fork.layers[0].pool.chunks[0].data_ptr() == cache.layers[0].pool.chunks[0].data_ptr()
    kw = dict(max_new_tokens=40, do_sample=False)
    from_fork = generate(model, fork, {"input_ids": first}, **kw)
    from_twin = generate(model, twin, {"input_ids": first}, **kw)
    assert torch.equal(from_fork.sequences, from_twin.sequences)
    fork.crop(60 - fork.get_seq_length())
    generate(model, fork, {"input_ids": first[:, :60]}, **kw)
    from_original = generate(model, cache, {"input_ids": first}, **kw)
    assert torch.equal(from_original.sequences, from_twin.sequences)
    for a, b in zip(from_original.logits, from_twin.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


GENERATE_ONCE = """
import glob, json, os, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from oasis_cache import OasisCache
start = time.time() - 1
config = AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
ids = torch.randint(0, config.vocab_size, (1, int(sys.argv[2])), device="cuda")
cache = OasisCache(model, token_budget=int(sys.argv[3]))
model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
               pad_token_id=0, **cache.generate_kwargs())
torch.cuda.synchronize()
names = [json.load(open(p)).get("name") for p in glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*/*.json")
         if not os.path.basename(p).startswith("__grp__") and os.path.getmtime(p) >= start]
print("COMPILED", json.dumps(sorted(n for n in names if n)))
"""


def test_a_warmed_machine_s_first_generate_compiles_no_kernel(tmp_path):
    """`python -m oasis_cache.warm` (two layers, random weights) compiles every Triton kernel a process's first
    `generate` of the whole model would: run in a new kernel cache, that process compiles none; without the warm-up,
    the same process compiles the package's kernels (the check can fail)."""
    import json
    import subprocess
    import sys

    import transformers

    transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             dtype="bfloat16").save_pretrained(tmp_path / "model")
    context, budget = "2000", "512"

    def compiled(cache_dir, warm_first):
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "CUDA_CACHE_PATH": str(cache_dir / "nv")}
        if warm_first:
            subprocess.run([sys.executable, "-m", "oasis_cache.warm", str(tmp_path / "model"), "--context", context,
                            "--token-budget", budget], env=env, check=True, capture_output=True)
        done = subprocess.run([sys.executable, "-c", GENERATE_ONCE, str(tmp_path / "model"), context, budget],
                              env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.split("COMPILED", 1)[1])

    cold = compiled(tmp_path / "cold", warm_first=False)
    assert {"_top_k_kernel", "_split_kernel", "_gather_blocks_kernel"} <= set(cold), cold
    assert compiled(tmp_path / "warm", warm_first=True) == []


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_linear_attention_hybrids_on_cuda(name):
    """A Qwen3.5- / Qwen3-Next-shaped hybrid on CUDA (the gated delta net's torch path, the full-attention layer
    through the Triton kernels; its steps captured, `CAPTURE_CHECKED_MODEL_TYPES`): equal to dense at a budget
    above the context — greedy, a left-padded batch, the cache's own chunks —, and a sparse budget decodes within
    it."""
    from conftest import tiny_hybrid

    model = tiny_hybrid(name).cuda()
    options = dict(token_budget=4096, sink_tokens=16, recent_tokens=16)
    for inputs, kw, extra in [
        ({"input_ids": prompt_ids(150)}, dict(max_new_tokens=16, do_sample=False), {}),
        (left_padded([61, 37, 50]), dict(max_new_tokens=12, do_sample=False), {}),
        ({"input_ids": prompt_ids(300)}, dict(max_new_tokens=10, do_sample=False), dict(prefill_chunk_tokens=64)),
    ]:
        inputs = on_cuda(inputs)
        dense = generate(model, dense_cache(model), inputs, **kw)
        cache = OasisCache(model, **cache_kwargs(dict(**options, **extra)))
        assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer", "OasisLayer"]
        oasis = generate(model, cache, inputs, **kw)
        assert torch.equal(dense.sequences, oasis.sequences)
        for a, b in zip(dense.logits, oasis.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
    cache = OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16, recent_tokens=16))
    out = generate(model, cache, on_cuda({"input_ids": prompt_ids(400)}), max_new_tokens=20, do_sample=False)
    stats = cache.stats()
    assert out.sequences.shape == (1, 420) and stats["tokens_attended_per_step"] <= 64 < stats["seq_length"]
    assert torch.isfinite(torch.stack(out.logits)).all()


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_linear_attention_hybrid_s_steps_replay_captured_as_they_decode_eagerly(name):
    """Qwen3.5's and Qwen3-Next's linear-attention layers keep their states at fixed addresses (transformers copies
    into them), so their decode steps can be captured: `cuda_graph=True` replays them with dense's tokens and logits
    (the check before `CAPTURE_CHECKED_MODEL_TYPES` takes them: `cuda_graph=None` captures them then)."""
    from conftest import tiny_hybrid

    model = tiny_hybrid(name).cuda()
    for inputs in ({"input_ids": prompt_ids(150)}, left_padded([61, 37, 50])):
        inputs = on_cuda(inputs)
        dense = generate(model, dense_cache(model), inputs, max_new_tokens=40, do_sample=False)
        cache = OasisCache(model, token_budget=4096, cuda_graph=True, advanced=dict(sink_tokens=16, recent_tokens=16))
        oasis = generate(model, cache, inputs, max_new_tokens=40, do_sample=False)
        assert cache.captured_steps.replays > 20
        assert torch.equal(dense.sequences, oasis.sequences)
        for a, b in zip(dense.logits, oasis.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)
    cache = OasisCache(model, token_budget=64, cuda_graph=True, advanced=dict(sink_tokens=16, recent_tokens=16))
    eager = OasisCache(model, token_budget=64, cuda_graph=False, advanced=dict(sink_tokens=16, recent_tokens=16))
    inputs = on_cuda({"input_ids": prompt_ids(400)})
    captured = generate(model, cache, inputs, max_new_tokens=40, do_sample=False)
    assert cache.captured_steps.replays > 20
    assert torch.equal(captured.sequences, generate(model, eager, inputs, max_new_tokens=40, do_sample=False).sequences)


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma3_text"])
def test_sliding_window_models_replay_captured_steps_as_they_decode_eagerly(model_type):
    """Sliding windows beside full layers (gpt-oss with learned sinks, Gemma 3): once a window is full and clear of
    padding its steps write in place (`window.WindowLayer`), so `cuda_graph=True` replays them — eager's tokens and
    logits, unpadded and in a left-padded batch whose window holds padding for its first ~20 steps."""
    from eval.architectures import tiny_model_of

    model = tiny_model_of(model_type).cuda()
    options = dict(token_budget=4096, sink_tokens=16, recent_tokens=16)
    for inputs in ({"input_ids": prompt_ids(200)}, left_padded([40, 10])):
        inputs = on_cuda(inputs)
        eager = generate(model, OasisCache(model, **cache_kwargs(dict(cuda_graph=False, **options))), inputs,
                         max_new_tokens=60,
                         do_sample=False)
        cache = OasisCache(model, **cache_kwargs(dict(cuda_graph=True, **options)))
        captured = generate(model, cache, inputs, max_new_tokens=60, do_sample=False)
        assert cache.captured_steps.replays > 20
        assert torch.equal(eager.sequences, captured.sequences)
        for a, b in zip(eager.logits, captured.logits):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)


def test_learned_attention_sinks_on_cuda():
    """gpt-oss's learned sinks on CUDA (the prefill through cuDNN's log-sum-exp, `compute/sinks.py`; decode steps
    through the Triton decode kernel, the sink in its combine): dense eager's tokens and logits at a budget above the
    context, in one prompt, a left-padded batch and the cache's own chunks; a sparse budget decodes within it, with
    the tokens of the torch attention (`attention_kernel=False`) over the same selections."""
    from test_architectures import sinks_dense, tiny_sinks_model

    model = tiny_sinks_model().cuda()
    equal_to_dense_on_cuda(model, lambda inputs: sinks_dense(model, inputs, do_sample=False))
    out, torch_out = within_a_sparse_budget(model), within_a_sparse_budget(model, attention_kernel=False)
    assert_same_on_cuda(torch_out, out)


def test_values_narrower_than_keys_on_cuda():
    """MiMo-V2-Flash shaped (keys of 16 channels, values of 8, learned sinks, sliding layers): the values padded to
    the keys' size through cuDNN's log-sum-exp prefill and the Triton decode kernel, the output cut back — dense's
    tokens and logits above the context; a sparse budget gives the torch attention's tokens over the same selections;
    the sliding layers' two rings replayed as captured steps (`cuda_graph=True`) give eager's tokens."""
    from test_architectures import sinks_dense, tiny_narrow_values_model

    model = tiny_narrow_values_model().cuda()
    equal_to_dense_on_cuda(model, lambda inputs: sinks_dense(model, inputs, do_sample=False))
    out, torch_out = within_a_sparse_budget(model), within_a_sparse_budget(model, attention_kernel=False)
    assert_same_on_cuda(torch_out, out)
    inputs = on_cuda({"input_ids": prompt_ids(200)})
    options = dict(token_budget=4096, sink_tokens=16, recent_tokens=16)
    eager = generate(model, OasisCache(model, **cache_kwargs(dict(cuda_graph=False, **options))), inputs,
                     max_new_tokens=40, do_sample=False)
    cache = OasisCache(model, **cache_kwargs(dict(cuda_graph=True, **options)))
    captured = generate(model, cache, inputs, max_new_tokens=40, do_sample=False)
    assert cache.captured_steps.replays > 20
    assert_same_on_cuda(eager, captured)


def equal_to_dense_on_cuda(model, dense, chunks: bool = True):
    """Through OasisCache (budget above the context) `model` generates `dense(inputs)`'s greedy tokens and logits: one
    prompt, a left-padded batch and (`chunks`) the cache's own chunks."""
    cases = [({"input_ids": prompt_ids(150)}, {}), (left_padded([61, 37, 50]), {})]
    for inputs, extra in cases + ([({"input_ids": prompt_ids(300)}, dict(prefill_chunk_tokens=64))] if chunks else []):
        inputs = on_cuda(inputs)
        expected = dense(inputs)  # (before the cache: a dense run may switch the model's attention)
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=4096, sink_tokens=16, recent_tokens=16, **extra)))
        assert_same_on_cuda(expected, generate(model, cache, inputs, seed=7, max_new_tokens=16, do_sample=False))


def assert_same_on_cuda(expected, got):
    assert torch.equal(expected.sequences, got.sequences)
    for a, b in zip(expected.logits, got.logits):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=1e-4)


def within_a_sparse_budget(model, **options):
    """A 400-token prompt decoded within a budget of 64 tokens: finite logits, no more tokens attended a step."""
    cache = OasisCache(model, **cache_kwargs(dict(token_budget=64, sink_tokens=16, recent_tokens=16, **options)))
    out = generate(model, cache, on_cuda({"input_ids": prompt_ids(400)}), max_new_tokens=20, do_sample=False)
    assert cache.stats()["tokens_attended_per_step"] <= 64 and torch.isfinite(torch.stack(out.logits)).all()
    return out


def test_soft_capping_and_image_masks_on_cuda():
    """Gemma 2's soft-capping on CUDA (explicit scores; decode steps on the torch attention, which the Triton kernel
    leaves to it): dense eager's tokens and logits, one prompt and a left-padded batch, and a sparse budget within
    it; Gemma 3 with an image (its 4D mask at the prefill, SDPA with it): dense's tokens."""
    from test_architectures import sinks_dense, tiny_capped_model
    from test_multimodal import image_prompt, run, tiny_gemma3_vision

    model = tiny_capped_model().cuda()
    equal_to_dense_on_cuda(model, lambda inputs: sinks_dense(model, inputs, do_sample=False), chunks=False)
    within_a_sparse_budget(model)
    vision = tiny_gemma3_vision().cuda()
    inputs = on_cuda(image_prompt(2, 7))
    assert_same_on_cuda(run(vision, DynamicCache(config=vision.config), inputs),
                        run(vision, OasisCache(vision, token_budget=1024), inputs))


def test_latent_attention_on_cuda():
    """DeepSeek-V3's MLA on CUDA (latent rows of R + rope channels, one KV head, attended absorbed; the sparse step on
    the torch attention, the block scores and gathers through the Triton kernels): dense's tokens and logits in one
    prompt, a left-padded batch and the cache's own chunks, and a sparse budget within it."""
    from test_architectures import tiny_latent_model

    model = tiny_latent_model().cuda()
    equal_to_dense_on_cuda(model, lambda inputs: generate(model, DynamicCache(config=model.config), inputs, seed=7,
                                                          max_new_tokens=16, do_sample=False))
    within_a_sparse_budget(model)


@pytest.mark.parametrize("kind", ["softcap", "latent"])
def test_capped_and_latent_steps_replay_captured_as_they_decode_eagerly(kind):
    """Gemma 2's soft-capped and DeepSeek's latent attention in captured steps (`cuda_graph=True`): eager's tokens
    and logits, one prompt and a left-padded batch, at a budget above the context and a sparse one."""
    from test_architectures import tiny_capped_model, tiny_latent_model

    model = (tiny_capped_model() if kind == "softcap" else tiny_latent_model()).cuda()
    for budget, inputs in ((4096, {"input_ids": prompt_ids(150)}), (4096, left_padded([61, 37, 50])),
                           (64, {"input_ids": prompt_ids(400)})):
        inputs = on_cuda(inputs)
        runs = []
        for graph in (False, True):
            cache = OasisCache(model, token_budget=budget, cuda_graph=graph, advanced=dict(sink_tokens=16,
                                                                                           recent_tokens=16))
            runs.append(generate(model, cache, inputs, max_new_tokens=40, do_sample=False))
        assert cache.captured_steps.replays > 20
        assert_same_on_cuda(*runs)


def test_gemma3_with_an_image_replays_captured_as_it_decodes_eagerly():
    """Gemma 3 prompted with an image (its prefill's 4D mask; windows in rings at decode) with `cuda_graph=True`:
    eager's tokens and logits over 40 steps, one prompt and a left-padded batch — the check behind `gemma3_text` in
    `CAPTURE_CHECKED_MODEL_TYPES` (passed on the H200)."""
    from test_multimodal import image_prompt, run, tiny_gemma3_vision

    model = tiny_gemma3_vision().cuda()
    for batch, padded in ((1, 0), (2, 7)):
        inputs = on_cuda(image_prompt(batch, padded))
        eager = run(model, OasisCache(model, token_budget=1024, cuda_graph=False), inputs, new_tokens=40)
        cache = OasisCache(model, token_budget=1024, cuda_graph=True)
        assert_same_on_cuda(eager, run(model, cache, inputs, new_tokens=40))
        assert cache.captured_steps.replays > 20


@pytest.mark.parametrize("name", ["falcon_h1", "zamba2"])
def test_layers_holding_keys_and_a_state_on_cuda(name):
    """Falcon-H1's layers (attention and a Mamba mixer, one cache layer: `HybridLayer`) and Zamba2's (shared
    attention blocks whose modules name no layer) on CUDA: dense's tokens and logits in one prompt, a left-padded
    batch and the cache's own chunks, a sparse budget within it; and with `cuda_graph=True` (the state updated in
    place, its addresses in the replay signature) the replayed steps give eager's tokens."""
    from test_architectures import sharpened

    model = sharpened(name).cuda()
    equal_to_dense_on_cuda(model, lambda inputs: generate(model, dense_cache(model), inputs, seed=7,
                                                          max_new_tokens=16, do_sample=False))
    within_a_sparse_budget(model)
    eager = within_a_sparse_budget(model, cuda_graph=False)
    captured = OasisCache(model, token_budget=64, cuda_graph=True, advanced=dict(sink_tokens=16, recent_tokens=16))
    out = generate(model, captured, on_cuda({"input_ids": prompt_ids(400)}), max_new_tokens=20, do_sample=False)
    assert captured.captured_steps.replays > 10 and torch.equal(out.sequences, eager.sequences)


@pytest.mark.parametrize("past", [0, 200])
def test_sinks_through_cudnn_s_log_sum_exp_equal_explicit_scores(past, monkeypatch):
    """On CUDA in bf16 with ≥ 128 queries the dense attention with sinks runs cuDNN's kernels with their log-sum-exp
    (the past and the chunk's own tokens merged), not explicit scores: equal to the explicit float32 scores within
    bf16's rounding."""
    from oasis_cache.compute import sinks as sink_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, Qn, D = 2, 8, 2, 256, 64
    query = torch.randn((B, Hq, Qn, D), generator=g, device="cuda").bfloat16()
    keys, values = (torch.randn((B, Hkv, past + Qn, D), generator=g, device="cuda").bfloat16() for _ in range(2))
    sinks = torch.randn(Hq, generator=g, device="cuda") * 2
    explicit = sink_attention._explicit(query, keys, values, D ** -0.5, sinks, None, None)
    monkeypatch.setattr(sink_attention, "_explicit", lambda *args: pytest.fail("explicit scores computed"))
    fast = sink_attention.attention_with_sinks(query, keys, values, D ** -0.5, sinks)
    torch.testing.assert_close(fast.float(), explicit.float(), atol=2e-2, rtol=2e-2)


def test_gemma4_s_wide_heads_through_the_kernels():
    """Gemma 4's full-attention layers have 512-wide heads (256 in its sliding ones): the Triton kernels (selection,
    gather, decode attention) at that width, greedy tokens equal to dense at a budget above the context and a sparse
    budget decoding within it."""
    import transformers

    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    from eval.architectures import tiny_model_of

    settings = {k: v for k, v in tiny_model_of("gemma4_text").config.to_dict().items()
                if k not in ("model_type", "transformers_version")}
    settings.update(head_dim=256, per_layer_config={"01": {"head_dim": 512}, "03": {"head_dim": 512}})
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**settings)).eval().cuda()
    model.set_attn_implementation("sdpa")
    inputs = on_cuda({"input_ids": prompt_ids(150)})
    dense = generate(model, dense_cache(model), inputs, max_new_tokens=16, do_sample=False)
    oasis = generate(model, OasisCache(model, token_budget=4096, advanced=dict(sink_tokens=16, recent_tokens=16)),
                     inputs,
                     max_new_tokens=16, do_sample=False)
    assert torch.equal(dense.sequences, oasis.sequences)
    for a, b in zip(dense.logits, oasis.logits):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    cache = OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16, recent_tokens=16))
    out = generate(model, cache, on_cuda({"input_ids": prompt_ids(400)}), max_new_tokens=20, do_sample=False)
    assert cache.stats()["tokens_attended_per_step"] <= 64 and torch.isfinite(torch.stack(out.logits)).all()



def test_a_rotary_scaled_by_length_decodes_eagerly_on_cuda():
    """A Llama with "dynamic" rotary scaling (its forward compares the position on the host and registers new
    frequencies as the sequence grows; a capture of it fails) on CUDA with the defaults: no captured steps, dense's
    tokens and logits while the decode passes the original length (one prompt, a padded batch), and a longer prompt
    with chunks asked for prefilled whole."""
    def fresh():  # (the rotary keeps the longest length it met: a new model for each run)
        return tiny_model("llama", max_position_embeddings=160,
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}).cuda()

    assert OasisCache(fresh(), token_budget=4096).captured_steps is None
    cases = [({"input_ids": prompt_ids(150)}, {}), (left_padded([161, 137, 150]), {}),
             ({"input_ids": prompt_ids(300)}, dict(prefill_chunk_tokens=64))]
    for inputs, extra in cases:
        inputs = on_cuda(inputs)
        expected = generate(model := fresh(), dense_cache(model), inputs, seed=7, max_new_tokens=16, do_sample=False)
        cache = OasisCache(model := fresh(), **cache_kwargs(dict(token_budget=4096, sink_tokens=16, recent_tokens=16,
                                                                 **extra)))
        assert_same_on_cuda(expected, generate(model, cache, inputs, seed=7, max_new_tokens=16, do_sample=False))


def test_a_weight_rebound_or_moved_in_a_loop_of_one_s_own_replays_the_new_weight():
    """A decode loop of one's own (one-token forwards) with captured steps: a projection's weight rebound to other
    values between two steps (`module.weight = nn.Parameter(...)`, no prefill between) is what the next steps read, as
    is a weight changed while the model was on the CPU (`model.to("cpu")` and back: new addresses, the old storages
    kept alive so a stale replay would read the old values) — the steps capture anew (`captured_step.module_changes`)
    and give the eager loop's tokens and logits."""
    from oasis_cache.compat import generate_cache_argument

    def loop(cuda_graph):
        model = tiny_model("llama").cuda()
        cache = OasisCache(model, token_budget=64, cuda_graph=cuda_graph, advanced=dict(sink_tokens=16,
                                                                                        recent_tokens=16))
        argument, logits = generate_cache_argument(model), []
        with torch.no_grad():
            out = model(input_ids=prompt_ids(200).cuda(), **{argument: cache}).logits[:, -1:]
            for step in range(24):
                if step == 10:
                    projection = model.model.layers[1].self_attn.k_proj
                    projection.weight = torch.nn.Parameter(projection.weight.detach() * 1.5)
                if step == 16:
                    kept = [p.data for p in model.parameters()]  # noqa: F841
                    model.to("cpu")
                    model.model.layers[0].mlp.up_proj.weight.data.mul_(1.5)
                    model.to("cuda")
                logits.append(out.float())
                out = model(input_ids=out.argmax(-1), **{argument: cache}).logits[:, -1:]
        return torch.cat(logits, 1), cache

    eager, _ = loop(False)
    captured, cache = loop(True)
    assert cache.captured_steps.replays > 8 and cache.captured_steps.captures >= 3
    assert torch.equal(eager.argmax(-1), captured.argmax(-1))
    torch.testing.assert_close(captured, eager, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_a_narrow_host_pool_on_cuda(host_dtype):
    """A narrow host pool on CUDA: captured steps with the Triton gather's widening and the narrowing offload decode
    what eager steps decode (tokens and logits), sparse and dense-equal, in fp32 and bf16; in fp32 the torch backend's
    tokens too (its widening is the rule `kernel_cases` checks the kernel against, bit for bit); at a budget above the
    context, what dense attention over the widened keys and values generates."""
    from eval.widened import widened_cache

    kw = dict(max_new_tokens=60, do_sample=False)
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("qwen3", num_hidden_layers=4).cuda().to(dtype)
        for inputs, budget in (({"input_ids": prompt_ids(300)}, 128), ({"input_ids": prompt_ids(300, batch=3)}, 128),
                               (left_padded([300, 240, 270]), 1024)):
            inputs = on_cuda(inputs)
            options = dict(token_budget=budget, recent_tokens=32, host_chunk_blocks=4, host_dtype=host_dtype,
                           lookahead="previous")
            eager = generate(model, OasisCache(model, **cache_kwargs(dict(cuda_graph=False, **options))), inputs, **kw)
            cache = OasisCache(model, **cache_kwargs(options))
            graphed = generate(model, cache, inputs, **kw)
            assert cache.captured_steps is not None and cache.captured_steps.replays >= 40
            assert cache.transfer.backend == "triton"
            assert torch.equal(eager.sequences, graphed.sequences), (dtype, budget)
            for a, b in zip(eager.logits, graphed.logits):
                torch.testing.assert_close(b, a, atol=ATOL if dtype == torch.float32 else 2e-2, rtol=1e-4)
            if dtype == torch.float32:  # the torch backend's eager steps (another attention: its tokens)
                torch_cache = OasisCache(model, **cache_kwargs(dict(backend="torch", cuda_graph=False, **options)))
                assert torch.equal(generate(model, torch_cache, inputs, **kw).sequences, graphed.sequences)
            if budget >= 1024 and dtype == torch.float32:
                reference = generate(model, widened_cache(model, host_dtype, 32, inputs=inputs), inputs, **kw)
                assert torch.equal(reference.sequences, graphed.sequences)
            stats = cache.stats()
            assert stats["host_dtype"] == host_dtype and stats["bytes_fetched"] > 0
