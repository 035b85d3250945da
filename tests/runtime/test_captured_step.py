"""The captured decode step (`OasisCache(..., cuda_graph=True)`, `runtime/captured_step.py`), what CPU can check of
it: a replay re-runs the captured device work and skips the Python, so (1) a steady decode step must update every
tensor the cache keeps in place (a replay writes where the capture wrote) and (2) `advance_replayed_step` must have
the host effects of an eager step. Replays themselves: `tests/gpu/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from oasis_cache import OasisCache
from oasis_cache.runtime import replay
from oasis_cache.runtime.build import cache_kwargs

from conftest import dense_cache, generate, prompt_ids, random_head, tiny_model

MODES = [dict(lookahead="none"), dict(lookahead="previous"), dict(lookahead="previous", exact=True),
         dict(lookahead="eagle3"), dict(lookahead="eagle3", exact=True)]
_SKIPPED = {"_model", "_modules", "memo", "_cache", "captured_steps", "config"}


def _walk(obj, path, seen, visit):
    """Calls `visit(path, value)` on every value reachable from `obj` through attributes, lists, tuples and dicts
    (the cache's own state: not the model, not the per-forward memo)."""
    if id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (bool, int, float, str)):
        visit(path, obj)
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        visit(path + ".len", len(obj))
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", seen, visit)
    elif isinstance(obj, dict):  # (some are keyed by id(): compared by position)
        visit(path + ".len", len(obj))
        for i, value in enumerate(obj.values()):
            _walk(value, f"{path}[{i}]", seen, visit)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("oasis_cache"):
        for name, value in vars(obj).items():
            if name not in _SKIPPED:
                _walk(value, f"{path}.{name}", seen, visit)


def tensors_of(cache) -> dict:
    """`{path: (data_ptr, shape, dtype)}` of every tensor the cache keeps."""
    found = {}
    _walk(cache, "cache", set(), lambda p, v: isinstance(v, torch.Tensor) and found.__setitem__(
        p, (v.data_ptr(), tuple(v.shape), v.dtype)))
    return found


def host_state_of(cache) -> dict:
    """`{path: value}` of every host value the cache keeps (numbers, flags, container sizes); not the pools' stamps,
    which name the pools (`pools/stamped.py`) as addresses name tensors: another cache's differ."""
    found = {}
    _walk(cache, "cache", set(), lambda p, v: not isinstance(v, torch.Tensor) and not p.endswith(".stamp")
          and found.__setitem__(p, v))
    return found


def decoding_cache(model, mode, steps):
    """A cache after a 400-token prefill (25 blocks: more than the 14 slots of the exact mode) and `steps` decode
    steps; returns `(cache, next token)`. With eagle3: a random head of a 12-row window whose decode call runs on
    static buffers (on CUDA the default; here asked for), as a captured step runs it."""
    mode = dict(mode)
    draft = {}
    if mode.get("lookahead") == "eagle3":
        head = random_head(model)
        head.config.attention_window = 12
        draft = dict(draft=head)
    cache = OasisCache(model, **cache_kwargs(dict(token_budget=128, recent_tokens=32, host_chunk_blocks=4, **mode,
                                                  **draft)))
    if cache.ride_along is not None:
        cache.ride_along.static_head = "eager"
    token = prompt_ids(400)
    with torch.no_grad():
        for _ in range(steps + 1):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return cache, token


def step_kind(cache) -> str:
    """The kind of captured step the next one-token decode step is (`replay.replayable_step`'s answer on CUDA)."""
    kind = "steady" if replay.steady_step(cache) else "completing" if replay.completing_step(cache) else None
    assert kind is not None
    return kind


def step(model, cache, token):
    with torch.no_grad():
        return model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_decode_steps_update_state_in_place(mode):
    """Over 40 steps, every steady step and every step that completes a block (once `prepare_step` made room) leaves
    each kept tensor where it was — same address, shape, dtype (the host pool's chunks aside: host memory, reached
    through the address table) — and the replay signature stays one: one graph per kind of step serves every block
    count past the slots."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    cache, token = decoding_cache(model, mode, steps=2)
    counts, signatures = {"steady": 0, "completing": 0}, set()
    for _ in range(40):
        kind = step_kind(cache)
        replay.prepare_step(cache, kind)
        signatures.add(replay.replay_signature(cache))
        before = {p: t for p, t in tensors_of(cache).items() if ".chunks[" not in p}
        blocks = cache.layers[0].pool.num_blocks
        token = step(model, cache, token)
        assert (kind == "completing") == (cache.layers[0].pool.num_blocks == blocks + 1)
        assert {p: t for p, t in tensors_of(cache).items() if ".chunks[" not in p} == before, kind
        counts[kind] += 1
    assert counts["steady"] >= 35 and counts["completing"] >= 2
    assert len(signatures) == 1


@pytest.mark.parametrize("length", [1024, 2000])
def test_a_prompts_first_completed_block_leaves_the_steady_steps_layout(length):
    """After a prefill, the first decode step that completes a block needs no room the prefill did not make: the
    summaries and the slot map grew at the prefill (`OasisLayer._offload_complete_blocks`), so the steady steps
    before and after it share one replay signature — one captured graph of each kind, not a steady one captured
    again right after the first completion (H200: ~90-110 ms at decode step 17 of every 32K call) — and a prompt not a multiple of the top-k's row sizes meets its grown row width at the first step
    (the dry step compiles its kernels), not ~16 steps later."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    cache = OasisCache(model, token_budget=128, advanced=dict(recent_tokens=32))
    token = prompt_ids(length)
    with torch.no_grad():
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    layer = cache.layers[0]
    assert layer.summaries.capacity_blocks > layer.pool.num_blocks  # (room for the next block: grown at the prefill)
    token = step(model, cache, token)  # (the first step: the cache's clocks and chosen channels are made)
    first_seen, completed = {}, 0
    for index in range(2, 40):
        kind = step_kind(cache)
        replay.prepare_step(cache, kind)
        first_seen.setdefault((kind, replay.replay_signature(cache)), index)
        completed += kind == "completing"
        token = step(model, cache, token)
    assert completed >= 2 and sorted(kind for kind, _ in first_seen) == ["completing", "steady"], first_seen.values()


def test_equal_pool_stamps_mean_the_same_state_tensors(monkeypatch):
    """The replay signature reads each layer's pool stamps instead of its state tensors' addresses
    (`pools/stamped.py`): after every update in greedy decoding past the initial slots (working sets grow), sampling,
    beam search (reordered rows), prompt lookup (rejected drafts cropped), a deep copy decoding on its own and a reset
    cache prefilled again, equal stamps always come with the same tensors at the same addresses, shapes and dtypes."""
    import copy

    from conftest import generate
    from oasis_cache.layer import OasisLayer

    seen: dict = {}
    update = OasisLayer.update

    def recorded(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        state = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in self.state_tensors())
        assert seen.setdefault(self.state_stamps(), state) == state, "equal stamps, other tensors"
        return out

    monkeypatch.setattr(OasisLayer, "update", recorded)
    model = tiny_model("qwen3", num_hidden_layers=2)
    options = dict(token_budget=96, recent_tokens=32, host_chunk_blocks=2)
    cache = OasisCache(model, lookahead="previous", token_budget=512, advanced=dict(recent_tokens=32,
                                                                                    host_chunk_blocks=2))
    generate(model, cache, {"input_ids": prompt_ids(40)}, max_new_tokens=60, do_sample=False)
    slots = cache.layers[0].working_set.num_slots
    cache.reset()
    generate(model, cache, {"input_ids": prompt_ids(600)}, max_new_tokens=8, do_sample=False)
    assert cache.layers[0].working_set.num_slots > slots
    grown = len(seen)
    twin = copy.deepcopy(cache)
    ids = torch.cat([prompt_ids(600), prompt_ids(621, seed=3)[:, 600:]], dim=1)
    for c in (twin, cache):
        generate(model, c, {"input_ids": ids}, max_new_tokens=8, do_sample=False)
    for kw in (dict(do_sample=True, temperature=0.8, top_k=20), dict(num_beams=3, num_return_sequences=2),
               dict(prompt_lookup_num_tokens=4)):
        generate(model, OasisCache(model, **cache_kwargs(options)), {"input_ids": prompt_ids(70)}, max_new_tokens=12,
                 **kw)
    assert grown > 4 and len(seen) > grown  # (the runs above made many pools and rebound their tensors)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_replay_bookkeeping_equals_an_eager_step(mode):
    """`advance_replayed_step` (the host side of a replay) leaves the host state an eager step of the same kind
    leaves — steady, or completing a block: counters, clocks, token counts, block counts, host-pool chunks, flags,
    container sizes — everything but tensor contents."""
    model, twin = tiny_model("qwen3", num_hidden_layers=3), tiny_model("qwen3", num_hidden_layers=3)  # (a ride-along
    eager, token = decoding_cache(model, mode, steps=3)  # hooks its model's decoder: one cache per model)
    replayed, _ = decoding_cache(twin, mode, steps=3)
    checked = {"steady": 0, "completing": 0}
    for _ in range(36):
        assert host_state_of(eager) == host_state_of(replayed)
        kind = step_kind(eager)
        for cache in (eager, replayed):  # (what the captured forward does before capturing or replaying)
            replay.prepare_step(cache, kind)
        replay.advance_replayed_step(replayed, kind)
        checked[kind] += 1
        token = step(model, eager, token)
    assert host_state_of(eager) == host_state_of(replayed)
    assert checked["steady"] >= 30 and checked["completing"] >= 2


def test_cuda_graph_options():
    model = tiny_model("qwen3", num_hidden_layers=3)
    with pytest.raises(ValueError, match="one CUDA device"):
        OasisCache(model, token_budget=128, lookahead="previous", cuda_graph=True)
    split = tiny_model("qwen3", num_hidden_layers=3)
    split.model.layers[2].to("meta")  # a model spread over devices (device_map="auto") cannot be one graph
    with pytest.raises(ValueError, match=r"one CUDA device.*\['cpu', 'meta'\]"):
        OasisCache(split, token_budget=128, lookahead="previous", cuda_graph=True)
    assert OasisCache(split, token_budget=128, lookahead="previous").captured_steps is None
    with pytest.raises(ValueError, match="cuda_graph must be bool or None"):
        OasisCache(model, token_budget=128, lookahead="previous", cuda_graph="yes")
    cache = OasisCache(model, token_budget=128, lookahead="previous")  # the default on CPU: every step eager
    assert cache.config.cuda_graph is None and cache.captured_steps is None
    from oasis_cache.runtime.routing import CapturedForward

    # (the forward is routed for every OasisCache all the same: a long prefill runs in chunks, `runtime/prefill.py`)
    assert isinstance(model.__dict__["forward"], CapturedForward)


def test_routed_forward_keeps_the_model_as_it_was():
    """The forward that routes calls to captured steps keeps the model's signature (generate reads it) and runs the
    eager forward for calls it cannot replay (on CPU: all of them), with the same results."""
    import inspect

    from oasis_cache.compat import generate_cache_argument
    from oasis_cache.runtime.captured_step import CapturedSteps
    from oasis_cache.runtime.routing import CapturedForward

    from conftest import generate

    model = tiny_model("qwen3", num_hidden_layers=3)
    signature, argument = inspect.signature(model.forward), generate_cache_argument(model)
    inputs = {"input_ids": prompt_ids(120, batch=2)}
    kw = dict(max_new_tokens=24, do_sample=False)
    expected = generate(model, OasisCache(model, token_budget=128, lookahead="previous",
                                          advanced=dict(recent_tokens=32)), inputs, **kw)
    assert isinstance(model.__dict__["forward"], CapturedForward)  # (while a cache of the model lives)
    assert inspect.signature(model.forward) == signature and generate_cache_argument(model) == argument
    cache = OasisCache(model, token_budget=128, lookahead="previous", advanced=dict(recent_tokens=32))
    cache.captured_steps = steps = CapturedSteps()  # as cuda_graph=True would (on CUDA)
    out = generate(model, cache, inputs, **kw)
    assert torch.equal(out.sequences, expected.sequences)
    assert cache.context.padding is not None and cache.context.padding.tokens is None  # the prompt's record: no padding
    assert steps.captures == steps.replays == 0


def test_a_reshaped_cache_runs_eagerly_until_its_next_prefill():
    """Beam search reorders (and assisted decoding crops) the cache every step: each would change the layout and
    recapture, so after such a call no step is steady until the next dense forward."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    cache, token = decoding_cache(model, dict(lookahead="previous"), steps=2)
    while not replay.steady_step(cache):
        token = step(model, cache, token)
    cache.reorder_cache(torch.zeros(1, dtype=torch.long))
    assert not replay.steady_step(cache)
    for _ in range(20):
        token = step(model, cache, token)
        assert not replay.steady_step(cache)
    cache.reset()
    step(model, cache, prompt_ids(400))  # a new prompt: steady steps again
    token = step(model, cache, token)
    assert replay.steady_step(cache)


def test_decode_steps_of_a_left_padded_batch_read_the_padding_recorded_at_the_prefill():
    """A captured step cannot read a mask that grows every step: it is called without one, and the prefill has
    recorded the batch's padding (`control.Padding`) for it (fixed shapes, the block count on the device). `generate`
    with its one-token steps called that way gives the tokens and logits of steps that read their masks, bit for bit;
    a mask given is still read (one that hides a token more counts); a reshaped cache forgets the record."""
    import copy

    from conftest import generate, left_padded

    model = tiny_model("qwen3", num_hidden_layers=3)
    inputs = left_padded([150, 97, 123])
    kw = dict(max_new_tokens=24, do_sample=False)
    options = dict(token_budget=64, recent_tokens=32, lookahead="previous")  # sparse: 150 tokens, 64 attended
    read = generate(model, OasisCache(model, **cache_kwargs(options)), inputs, **kw)  # every step reads its mask
    maskless = []

    def as_captured(module, args, kwargs):  # one-token steps without their mask, as a captured step is called
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1:
            maskless.append(kwargs.pop("attention_mask", None) is not None)
        return args, kwargs

    handle = model.register_forward_pre_hook(as_captured, with_kwargs=True)
    try:
        cache = OasisCache(model, **cache_kwargs(options))
        recorded = generate(model, cache, inputs, **kw)
    finally:
        handle.remove()
    assert len(maskless) == 23 and all(maskless)
    assert cache.context.padding.tokens is not None and cache.context.padding.clear_from == 150 - 97  # after the last padding token
    assert cache.context.padding.first.flatten().tolist() == [0, 53, 27]
    assert torch.equal(recorded.sequences, read.sequences)
    for a, b in zip(recorded.logits, read.logits):
        assert torch.equal(a, b)
    assert cache.context.padding_covers(cache.layers[0].pool.num_blocks) and not cache.context.padding_covers(2)

    def step(c, mask=None):
        with torch.no_grad():
            return model(input_ids=recorded.sequences[:, -1:], past_key_values=c, attention_mask=mask).logits

    length = cache.get_seq_length() + 1
    mask = torch.cat((inputs["attention_mask"], torch.ones(3, length - 150, dtype=torch.long)), 1)
    without = step(copy.deepcopy(cache))
    assert torch.equal(step(copy.deepcopy(cache), mask), without)
    mask[1, 60] = 0  # a token of the prompt hidden by this step's mask: the mask is read
    assert not torch.allclose(step(copy.deepcopy(cache), mask)[1], without[1])
    # A next turn (a multi-token forward) records the padding anew: a graph captured over the old record's tensors
    # is not replayed over the new one (its signature names them).
    signature = replay.replay_signature(cache)
    mask[1, 60] = 1
    turn = prompt_ids(40, batch=3, seed=5)
    with torch.no_grad():
        model(input_ids=turn, past_key_values=cache, attention_mask=torch.cat((mask[:, :-1], torch.ones(3, 40,
              dtype=torch.long)), 1))
    assert cache.context.padding.tokens.shape[1] == length - 1 + 40 and replay.replay_signature(cache) != signature
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.context.padding is None
    # generate's own chunked prefill whose last chunk is short enough to decode sparsely (140 = 64 + 64 + 12) records
    # the padding from that chunk's mask: the steps after it can be captured
    chunked = OasisCache(model, **cache_kwargs(options))
    generate(model, chunked, left_padded([140, 97, 123]), max_new_tokens=4, do_sample=False, prefill_chunk_size=64)
    assert chunked.context.padding is not None and chunked.context.padding.clear_from == 140 - 97


def test_step_visibility_from_a_padding_record_equals_the_one_from_the_mask():
    """`step_visibility` from a `Padding` (any capacity width, the block count on the device) gives the mask's blocks
    and tokens wherever a step reads them (blocks below the count)."""
    from oasis_cache.control import Padding, step_visibility

    T, B = 8, 3
    visible = torch.ones(B, 200, dtype=torch.bool)
    visible[0, :37], visible[2, :5] = False, False
    for num_blocks, width in ((20, 24), (23, 24), (24, 32)):
        N = num_blocks * T + 5
        mask = torch.cat((visible, torch.ones(B, max(0, N - 200), dtype=torch.bool)), 1)[:, :N]
        record = Padding.of(visible[:, :150], B, "cpu")
        assert record.clear_from == 37
        count = torch.tensor([num_blocks])
        a = step_visibility(mask, B, num_blocks, count, width, T, T, 2, "cpu")
        b = step_visibility(None, B, num_blocks, count, width, T, T, 2, "cpu", record)
        assert torch.equal(a.allowed, b.allowed) and torch.equal(a.forced, b.forced)
        assert torch.equal(a.block_tokens, b.block_tokens[:, :num_blocks]) and b.recent is None
        assert a.recent.all()
    unpadded = Padding.of(torch.ones(B, 50, dtype=torch.bool), B, "cpu")
    assert unpadded.tokens is None and unpadded.clear_from == 0


def test_compiled_decode_steps_decode_what_eager_steps_decode():
    """`compile_decode=True` runs each decoder layer's own work compiled in decode steps (the cache's update and the
    oasis attention left out of the graphs): the same greedy tokens as eager and logits within rounding, with a
    riding draft too; a second cache compiles nothing new; a cache without the option runs the layers as they are."""
    from torch._dynamo.utils import counters

    from conftest import generate, left_padded

    model = tiny_model("qwen3", num_hidden_layers=3)
    kw = dict(max_new_tokens=24, do_sample=False)
    cases = [({"input_ids": prompt_ids(300, batch=2)}, dict(token_budget=128, recent_tokens=32, lookahead="previous")),
             (left_padded([250, 190]), dict(token_budget=96, recent_tokens=32, lookahead="eagle3", exact=True,
                                            draft=random_head(model)))]
    for inputs, options in cases:
        expected = generate(model, OasisCache(model, **cache_kwargs(options)), inputs, **kw)
        before = counters["stats"]["unique_graphs"]
        got = generate(model, OasisCache(model, **cache_kwargs(dict(compile_decode=True, **options))), inputs, **kw)
        assert counters["stats"]["unique_graphs"] > before  # (one and two query rows: each its own graphs)
        assert torch.equal(got.sequences, expected.sequences)
        for a, b in zip(got.logits, expected.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    graphs = counters["stats"]["unique_graphs"]
    again = generate(model, OasisCache(model, **cache_kwargs(dict(compile_decode=True, **cases[0][1]))), cases[0][0],
                     **kw)
    assert torch.equal(again.sequences, generate(model, OasisCache(model, **cache_kwargs(dict(**cases[0][1]))),
                                                 cases[0][0], **kw).sequences)
    assert counters["stats"]["unique_graphs"] == graphs  # compiled once per process, not per cache
    # Called as a captured step is (no mask, its own positions), across steps that complete blocks: nothing is
    # compiled after the first step (a compilation inside a CUDA graph's capture would fail it).
    cache = OasisCache(model, **cache_kwargs(dict(compile_decode=True, **cases[0][1])))
    ids = prompt_ids(300, batch=2)
    with torch.no_grad():
        token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for position in range(300, 340):
            out = model(input_ids=token, position_ids=torch.full((2, 1), position), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            if position == 300:
                graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs and cache.layers[0].pool.num_blocks >= 21
    with pytest.raises(ValueError, match=r"compile_decode must be bool or None"):
        OasisCache(model, token_budget=128, compile_decode="yes")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="compile_after_steps must be"):
            OasisCache(model, token_budget=128, advanced=dict(compile_after_steps=bad))
    for decided in (True, False):
        with pytest.raises(ValueError, match=f"with compile_decode={decided} it would do nothing"):
            OasisCache(model, token_budget=128, compile_decode=decided, advanced=dict(compile_after_steps=8))


def _fresh_uncompiled_run(layers: int, new_tokens: int):
    """A new tiny Qwen3 (dynamo's caches reset), its generate options and prompt, and an uncompiled cache's output."""
    from conftest import generate

    torch._dynamo.reset()
    model = tiny_model("qwen3", num_hidden_layers=layers)
    kw = dict(max_new_tokens=new_tokens, do_sample=False)
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous")
    inputs = {"input_ids": prompt_ids(300, batch=2)}
    return model, kw, options, inputs, generate(model, OasisCache(model, **cache_kwargs(dict(compile_decode=False,
                                                                                             **options))), inputs, **kw)


def test_compile_decode_none_compiles_once_the_model_has_decoded_enough_steps(monkeypatch):
    """`compile_decode=None` (the default): where a cache may compile its steps (captured steps on CUDA; here the same
    policy forced on the CPU's eager steps) the layers run their own forward until the model has decoded
    `compile_after_steps` steps in the process — counted over its caches and calls — and compiled from the step that
    reaches it on, all layers of a step alike; the tokens equal an uncompiled cache's throughout. Where it may not
    (the CPU without the patch), nothing is counted or compiled."""
    from torch._dynamo.utils import counters

    from conftest import generate
    from oasis_cache.runtime import compiled_layers

    model, kw, options, inputs, expected = _fresh_uncompiled_run(layers=3, new_tokens=12)
    plain = OasisCache(model, **cache_kwargs(options))
    generate(model, plain, inputs, **kw)
    assert not replay.compiles_decode(plain) and compiled_layers.decoded_steps(model) == 0
    assert "forward" not in model.model.layers[0].__dict__  # (no layer wrapped)

    monkeypatch.setattr(compiled_layers, "may_compile_automatically", lambda cache: True)
    compiled_calls = []
    run_compiled = compiled_layers.CompiledDecode.run_compiled
    monkeypatch.setattr(compiled_layers.CompiledDecode, "run_compiled", lambda self, cache, *a, **k: (
        compiled_calls.append(compiled_layers.decoded_steps(model)), run_compiled(self, cache, *a, **k))[1])
    before = counters["stats"]["unique_graphs"]
    first = OasisCache(model, **cache_kwargs(dict(compile_after_steps=16, **options)))
    got = generate(model, first, inputs, **kw)  # 11 decode steps (the prefill gives the first token)
    assert compiled_layers.decoded_steps(model) == 11 and not replay.compiles_decode(first)
    assert "eager; torch.compile'd once the model has decoded 16 steps in this process (11 so far" in str(first)
    assert not compiled_calls and counters["stats"]["unique_graphs"] == before
    assert torch.equal(got.sequences, expected.sequences)
    second = OasisCache(model, **cache_kwargs(dict(compile_after_steps=16, **options)))
    got = generate(model, second, inputs, **kw)  # steps 12..22 of the model: compiled from its 16th on
    assert replay.compiles_decode(second) and counters["stats"]["unique_graphs"] > before
    assert "decode steps: torch.compile'd (compile_decode)" in str(second)
    assert compiled_calls == [step for step in range(16, 23) for _ in range(3)]  # every layer of those steps
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # a riding draft (two query rows a step) and a left-padded batch, switched midway: the same tokens as eager
    from conftest import left_padded

    riding = dict(token_budget=96, recent_tokens=32, lookahead="eagle3", exact=True, draft=random_head(model))
    padded = left_padded([250, 190])
    expected = generate(model, OasisCache(model, **cache_kwargs(dict(compile_decode=False, **riding))), padded, **kw)
    compiled_calls.clear()
    steps = compiled_layers.decoded_steps(model)
    got = generate(model, OasisCache(model, **cache_kwargs(dict(compile_after_steps=steps + 6, **riding))), padded,
                   **kw)
    assert compiled_calls == [step for step in range(steps + 6, steps + 12) for _ in range(3)]
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_compile_decode_none_goes_on_uncompiled_when_the_compilation_fails(monkeypatch):
    """The automatic compilation comes late in a run: if it fails (here a backend that raises), the step goes on with
    the layers' own forward — the same tokens, one warning naming the options — and the model is not compiled again;
    `compile_decode=True` still raises."""
    import warnings

    from conftest import generate
    from oasis_cache.runtime import compiled_layers

    def failing(graph, example_inputs):
        raise RuntimeError("no compiler here")

    real_compile = torch.compile
    model, kw, options, inputs, expected = _fresh_uncompiled_run(layers=2, new_tokens=10)
    monkeypatch.setattr(compiled_layers, "may_compile_automatically", lambda cache: True)
    monkeypatch.setattr(torch, "compile", lambda fn, **k: real_compile(fn, backend=failing))
    cache = OasisCache(model, **cache_kwargs(dict(compile_after_steps=4, **options)))
    with pytest.warns(RuntimeWarning, match="decode steps failed .*no compiler here.*compile_decode=False"):
        got = generate(model, cache, inputs, **kw)
    assert torch.equal(got.sequences, expected.sequences) and compiled_layers.compile_failed(model)
    assert not replay.compiles_decode(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no second attempt, no second warning)
        again = generate(model, OasisCache(model, **cache_kwargs(dict(compile_after_steps=4, **options))), inputs, **kw)
    assert torch.equal(again.sequences, expected.sequences)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        generate(model, OasisCache(model, **cache_kwargs(dict(compile_decode=True, **options))), inputs, **kw)


def test_compiled_decode_compiles_once_for_all_layers():
    """The decoder layers share their forward's code: a model deeper than dynamo's recompile limit (8) compiles the
    same graphs as a two-layer one, so no layer past the limit runs eager, unseen (an H200 profile once
    showed 8 of 36 layers compiled), and the first step compiles once, not once per layer. Where every layer is
    an oasis layer, the cache's update and the attention are custom ops (`compute/compiled_ops.py`): a layer is one
    graph, without a graph break; a model with sliding-window layers keeps the breaks and decodes the same too."""
    from torch._dynamo.utils import counters

    from conftest import generate

    graphs = []
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous")
    for layers in (2, 10):
        torch._dynamo.reset()
        model = tiny_model("qwen3", num_hidden_layers=layers)
        before, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        got = generate(model, OasisCache(model, **cache_kwargs(dict(compile_decode=True, **options))),
                       {"input_ids": prompt_ids(300)},
                       max_new_tokens=6, do_sample=False)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        assert sum(counters["graph_break"].values()) == breaks  # one graph a layer: no break at the cache's calls
        expected = generate(model, OasisCache(model, **cache_kwargs(options)), {"input_ids": prompt_ids(300)},
                            max_new_tokens=6,
                            do_sample=False)
        assert torch.equal(got.sequences, expected.sequences)
    assert 0 < graphs[0] <= 2 and graphs[1] == graphs[0], graphs  # (2: a torch without `dynamic_sources`)
    assert not torch._dynamo.config.allow_unspec_int_on_nn_module  # patched around the layers' calls only
    assert getattr(torch.compiler.config, "dynamic_sources", "") == ""  # (likewise)
    torch._dynamo.reset()
    hybrid = tiny_model("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=48,
                        use_sliding_window=True)
    breaks = sum(counters["graph_break"].values())
    got = generate(hybrid, OasisCache(hybrid, **cache_kwargs(dict(compile_decode=True, **options))),
                   {"input_ids": prompt_ids(300)},
                   max_new_tokens=6, do_sample=False)
    assert sum(counters["graph_break"].values()) > breaks  # (the update and the attention run outside the graphs)
    expected = generate(hybrid, OasisCache(hybrid, **cache_kwargs(options)), {"input_ids": prompt_ids(300)},
                        max_new_tokens=6,
                        do_sample=False)
    assert torch.equal(got.sequences, expected.sequences)


def test_fused_projections_compute_one_product_per_group(tmp_path):
    """`fuse_projections=True` (with `compile_decode`): each layer's q/k/v (with qwen2's biases) and gate/up become one
    product each inside the compiled step — 4 matmuls a layer in the generated code instead of 7 — and decode the
    unfused compiled cache's tokens with its logits; the parameters are rows of one buffer per group, saved and
    reloaded unchanged by `save_pretrained`; a group whose parameters moved (`model.to(dtype)`) computes unfused, and
    `unfuse` gives each projection its own storage back."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from conftest import generate
    from oasis_cache.runtime.fused_projections import unfuse

    model = tiny_model("qwen2", num_hidden_layers=3)
    options = dict(token_budget=128, recent_tokens=32, lookahead="previous", compile_decode=True)
    inputs, kw = {"input_ids": prompt_ids(300)}, dict(max_new_tokens=6, do_sample=False)
    products, graphs, outs = [], [], []
    for fuse in (False, True):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        cache = OasisCache(model, **cache_kwargs(dict(fuse_projections=fuse, **options)))
        out, code = run_and_get_code(lambda: generate(model, cache, inputs, **kw))
        products.append(sum("\n".join(code).count(f"extern_kernels.{op}(") for op in ("mm", "addmm")))
        graphs.append(counters["stats"]["unique_graphs"] - before)
        outs.append(out)
    assert products == [7, 4], products
    # one compiled graph serves every layer, fused too (per-module forwards were guarded
    # by identity: a graph a layer up to the recompile limit, later layers eager, on the H200 too)
    assert graphs[1] == graphs[0] <= 2, graphs
    assert len(cache.fused_groups) == 6 and all(group.on for group in cache.fused_groups)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    attn = model.model.layers[0].self_attn
    group = cache.fused_groups[0]
    assert attn.k_proj.weight.data_ptr() == group.weight[attn.q_proj.out_features:].data_ptr()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    model.save_pretrained(tmp_path)  # (transformers clones the disjoint views of one storage)
    reloaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(state[name], t) for name, t in reloaded.state_dict().items())

    model.to(torch.float64)  # the parameters get new storage: the groups end; a fused cache fuses them anew
    torch._dynamo.reset()
    alone = generate(model, OasisCache(model, **cache_kwargs(options)), inputs,
                     **kw)  # (a cache without the option: unfused)
    old_groups = cache.fused_groups
    cache = OasisCache(model, **cache_kwargs(dict(fuse_projections=True, **options)))
    assert not any(group.on for group in old_groups) and all(group.on for group in cache.fused_groups)
    assert cache.fused_groups[0].weight.dtype == torch.float64
    assert torch.equal(generate(model, cache, inputs, **kw).sequences, alone.sequences)
    unfuse(model)
    pointers = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(pointers) == len(list(model.parameters()))  # every parameter its own storage
    assert type(attn.q_proj) is torch.nn.Linear and not hasattr(attn.q_proj, "fused_group")
    assert torch.equal(generate(model, OasisCache(model, **cache_kwargs(options)), inputs, **kw).sequences,
                       alone.sequences)
    with pytest.raises(ValueError, match="pass compile_decode=True with it"):
        OasisCache(model, token_budget=128, advanced=dict(fuse_projections=True))


def test_a_copy_of_a_fused_cache_shares_the_models_buffers():
    """`copy.deepcopy` of a cache with `fuse_projections` (what `compile_ahead`'s dry step makes at a first decode
    step) shares the model's fused buffers instead of copying them: on the H200 the copies stayed alive through the
    decode, +16.8 GiB for an 8B model (a micro-benchmark). Nothing else of the model is copied
    with it."""
    import copy

    model = tiny_model("qwen3", num_hidden_layers=2)
    cache = OasisCache(model, token_budget=128, compile_decode=True, advanced=dict(recent_tokens=32,
                                                                                   fuse_projections=True))
    dup = copy.deepcopy(cache)
    assert len(cache.fused_groups) == 4 and len(dup.fused_groups) == 4
    assert all(a is b for a, b in zip(dup.fused_groups, cache.fused_groups))
    assert dup.fused_groups is not cache.fused_groups  # (each cache its own list)
    memo = {}  # (and nothing else of the model is copied with the cache)
    copy.deepcopy(cache, memo)
    assert not any(id(p) in memo for p in model.parameters()) and not any(id(m) in memo for m in model.modules())


def test_where_the_weights_are_changes_when_they_move_only():
    """`weights_where_they_are` (part of a captured cache's replay signature, taken at each prefill): the same while
    the parameters and buffers stay where they are, another number once one is rebound (a module's weight replaced,
    `model.to(...)` that copies)."""
    from oasis_cache.runtime.captured_step import weights_where_they_are

    model = tiny_model("qwen3")
    before = weights_where_they_are(model)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.0)  # (in place: same storage)
    assert weights_where_they_are(model) == before
    layer = model.model.layers[1].self_attn.k_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    moved = weights_where_they_are(model)
    assert moved != before
    model.to(torch.float64)
    assert weights_where_they_are(model) != moved


def test_the_modules_settings_change_when_a_setting_does_only():
    """`module_settings` (with the weights' addresses, part of a captured cache's replay signature, taken at each
    prefill): the same across `generate` calls with an OasisCache and across in-place weight updates; another number
    once a module's plain setting changes — `train()`, an attention's `scaling`, a PEFT-style adapter switched or
    disabled (a name, a flag), a dict of per-adapter scales — and the first number again once it is set back."""
    from oasis_cache.runtime.captured_step import module_settings

    class Adapted(torch.nn.Module):  # (what PEFT's LoRA layers keep: names, flags, per-adapter dicts)
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self._active_adapter = ["default"]
            self._disable_adapters = False
            self.scaling = {"default": 2.0, "other": 0.5}

        def forward(self, x):
            return self.base_layer(x)

    model = tiny_model("qwen3", num_hidden_layers=4)  # (a draft head reads three layers)
    attention = model.model.layers[0].self_attn
    attention.q_proj = Adapted(attention.q_proj)
    before = module_settings(model)
    ids = prompt_ids(40)
    for draft in ({}, {"lookahead": "eagle3", "draft": random_head(model)}):  # (the ride-along's hooks too)
        for _ in range(2):
            cache = OasisCache(model, **cache_kwargs(dict(token_budget=64, sink_tokens=16, recent_tokens=16, **draft)))
            model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
            assert module_settings(model) == before
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.0)
    assert module_settings(model) == before
    changes = [(model, "training", True), (attention, "scaling", attention.scaling * 2),
               (attention.q_proj, "_active_adapter", ["other"]), (attention.q_proj, "_disable_adapters", True),
               (attention.q_proj, "scaling", {"default": 1.0, "other": 0.5})]
    for module, name, value in changes:
        kept = getattr(module, name)
        module.__dict__[name] = value
        assert module_settings(model) != before, name
        module.__dict__[name] = kept
        assert module_settings(model) == before, name


def test_a_captured_steps_kept_output_does_not_hold_its_cache():
    """A captured step keeps its forward's output (the logits are the graph's buffer), but not the cache in it
    (`past_key_values`): the cycle cache -> graphs -> output -> cache kept a dropped cache and its pinned host pools
    alive until Python's next collection (H200: 5 GiB pinned anew at each later 32K call). The
    output handed back per step carries the cache and a copy of the logits."""
    import gc

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from oasis_cache.runtime.captured_step import _Graph

    model = tiny_model("llama", num_hidden_layers=2)
    cache = OasisCache(model, token_budget=128)
    logits = torch.randn(1, 1, 8)
    slot = _Graph()
    output = CausalLMOutputWithPast(logits=logits, past_key_values=cache)  # (transformers 5.2x names it `cache`)
    names = list(output.keys())
    slot.keep(output, cache)
    del output

    def reaches(root, target) -> bool:
        seen, todo = set(), [root]
        while todo:
            obj = todo.pop()
            if obj is target:
                return True
            if id(obj) not in seen and not isinstance(obj, torch.Tensor):
                seen.add(id(obj))
                todo.extend(gc.get_referents(obj))
        return False

    assert not reaches(slot, cache) and reaches(slot, logits)
    out = slot.result(cache)
    assert isinstance(out, CausalLMOutputWithPast) and list(out.keys()) == names and out[names[1]] is cache
    assert torch.equal(out.logits, logits) and out.logits.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma3_text"])
def test_sliding_windows_decode_in_place_once_full(model_type):
    """A model with sliding-window layers beside full ones (gpt-oss with learned sinks, Gemma 3): once a window is
    full and holds no padding, its one-token steps write into a ring at a fixed address (`window.WindowLayer`),
    so the steps are ones a CUDA graph may replay — every kept tensor where it was, one replay signature — and
    `advance_replayed_step` has an eager step's host effects (its token count); the tokens stay dense's (the
    equality tests of tests/integration/test_architectures.py run the same layers in every generate mode)."""
    from conftest import generate, left_padded
    from eval.architectures import tiny_model_of
    from transformers import DynamicCache
    from oasis_cache.window import WindowLayer

    model, twin = tiny_model_of(model_type), tiny_model_of(model_type)
    options = dict(token_budget=128, recent_tokens=32, host_chunk_blocks=4, lookahead="previous")
    caches, tokens = [], []
    for m in (model, twin):
        cache = OasisCache(m, **cache_kwargs(options))
        with torch.no_grad():
            token = prompt_ids(400)
            for _ in range(3):
                token = m(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        caches.append(cache)
        tokens.append(token)
    eager, replayed = caches
    windows = [layer for layer in eager.layers if isinstance(layer, WindowLayer)]
    assert windows and all(layer.steady_step() for layer in windows)
    token, counts, signatures = tokens[0], {"steady": 0, "completing": 0}, set()
    for _ in range(36):
        assert host_state_of(eager) == host_state_of(replayed)
        kind = step_kind(eager)
        for cache in (eager, replayed):
            replay.prepare_step(cache, kind)
        replay.advance_replayed_step(replayed, kind)
        signatures.add(replay.replay_signature(eager))
        before = {p: t for p, t in tensors_of(eager).items() if ".chunks[" not in p}
        token = step(model, eager, token)
        assert {p: t for p, t in tensors_of(eager).items() if ".chunks[" not in p} == before, kind
        counts[kind] += 1
    assert host_state_of(eager) == host_state_of(replayed)
    assert counts["steady"] >= 30 and counts["completing"] >= 2 and len(signatures) == 1
    # dense's tokens and logits: steady steps attend with no mask (as a replayed one does); a left-padded batch's
    # window holds padding for its first ~20 steps (transformers' mask applies), none after
    for inputs in ({"input_ids": prompt_ids(200)}, left_padded([40, 10])):
        model.set_attn_implementation(model.dense_attention)  # (gpt-oss: eager, it has no SDPA path)
        dense = generate(model, DynamicCache(config=model.config), inputs, max_new_tokens=40, do_sample=False)
        oasis = generate(model, OasisCache(model, token_budget=4096, advanced=dict(recent_tokens=32)), inputs,
                         max_new_tokens=40,
                         do_sample=False)
        assert torch.equal(dense.sequences, oasis.sequences)
        for a, b in zip(dense.logits, oasis.logits):
            torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("rotary", [dict(rope_type="dynamic", factor=2.0),
                                    dict(rope_type="longrope", original_max_position_embeddings=128,
                                         short_factor=[1.0] * 8, long_factor=[1.5] * 8)])
def test_a_rotary_scaled_by_length_is_prefilled_whole_and_equals_dense(rotary):
    """A rotary scaling that follows the length a forward reaches ("dynamic": updated on the host, a new `inv_freq`;
    "longrope": short or long factors by the forward's last position): a prompt in the cache's own chunks would
    rotate its early chunks by a shorter length than dense's one forward, so it is prefilled whole — dense's tokens
    and logits for a prompt past the original length, with chunks asked for (mutation: chunked, the logits differ
    by ~14). Neither is captured: `cuda_graph=None` leaves their steps eager, `cuda_graph=True` says why before
    anything runs."""
    import types

    from oasis_cache.runtime.model_checks import rotary_scaled_by_length as _rotary_scaled_by_length

    def fresh():  # (a "dynamic" rotary keeps the longest length it met across calls: a new model for each run)
        return tiny_model("llama", max_position_embeddings=160, rope_parameters={**rotary, "rope_theta": 10000.0})

    model = fresh()
    assert _rotary_scaled_by_length(model.config) == rotary["rope_type"]
    assert _rotary_scaled_by_length(tiny_model("llama").config) is None
    per_kind = types.SimpleNamespace(rope_parameters={  # (as Gemma 3's: one rotary per layer kind)
        "full_attention": {"rope_type": "default"}, "sliding_attention": rotary})
    assert _rotary_scaled_by_length(per_kind) == rotary["rope_type"]
    with pytest.raises(ValueError, match=f"{rotary['rope_type']}' scaling"):
        OasisCache(model, token_budget=1024, cuda_graph=True)
    for inputs, chunk in (({"input_ids": prompt_ids(300)}, 64), ({"input_ids": prompt_ids(150)}, 8192)):
        dense = generate(model := fresh(), dense_cache(model), inputs, max_new_tokens=16, do_sample=False)
        cache = OasisCache(model := fresh(), token_budget=1024, 
                           prefill_chunk_tokens=chunk, advanced=dict(sink_tokens=16, recent_tokens=16))
        oasis = generate(model, cache, inputs, max_new_tokens=16, do_sample=False)
        assert torch.equal(dense.sequences, oasis.sequences)
        torch.testing.assert_close(torch.stack(oasis.logits), torch.stack(dense.logits), atol=1e-4, rtol=1e-4)


def test_a_model_changed_between_two_steps_of_a_loop_is_seen(monkeypatch):
    """In a decode loop of one's own (one-token forwards, no prefill between them) a rebound weight —
    `module.weight = nn.Parameter(...)`, `load_state_dict(assign=True)` —, a model moved and moved back
    (`model.to(...)`: new addresses) or a mode switched (`train()` / `eval()`) changes what a captured step depends on
    (`_model_as_run`, in the replay signature) at the next step, through the look at the model's own state before
    each step (`captured_step.ModelState`); a weight changed in place (its address kept, which a replay reads) does
    not, nor does a step itself; an attribute set by hand is seen once the cache is told (`cache.model_changed()`).
    Nothing of torch is patched for it. On CPU the steps run eagerly: a stand-in for `CapturedSteps` records what each
    step would have been checked against."""
    from oasis_cache.runtime import build as cache_module
    from oasis_cache.compat import generate_cache_argument

    class Steps:  # (route_forward hands each forward to it where steps are captured)
        replays = captures = completing_replays = 0

        def __init__(self):
            self.seen = []

        def forward(self, runner, cache, kwargs):
            self.seen.append(cache._model_as_run)
            return runner.eager_forward(**kwargs)

        def drop(self):
            pass

    monkeypatch.setattr(cache_module, "captured_steps_for", lambda *args: Steps())
    model = tiny_model("llama")
    cache = OasisCache(model, token_budget=1024)
    steps, argument = cache.captured_steps, generate_cache_argument(model)
    with torch.no_grad():
        token = model(input_ids=prompt_ids(40), **{argument: cache}).logits[:, -1:].argmax(-1)

        def step():
            nonlocal token
            token = model(input_ids=token, **{argument: cache}).logits[:, -1:].argmax(-1)
            return steps.seen[-1]

        first = steps.seen[0]
        assert step() == step() == first
        model.model.layers[0].mlp.up_proj.weight.mul_(1.0)  # (in place)
        assert step() == first
        projection = model.model.layers[1].self_attn.k_proj
        projection.weight = torch.nn.Parameter(projection.weight.detach().clone())
        rebound = step()
        assert rebound != first and step() == rebound
        model.load_state_dict({name: value.clone() for name, value in model.state_dict().items()}, assign=True)
        loaded = step()
        assert loaded not in (first, rebound)
        model.to(torch.float64).to(torch.float32)  # (moved and back: the same values at new addresses)
        moved = step()
        assert moved != loaded and step() == moved
        model.model.layers[0].self_attn.flag = True  # (an attribute set by hand: not seen until the cache is told)
        assert step() == moved
        cache.model_changed()
        flagged = step()
        assert flagged != moved
        del model.model.layers[0].self_attn.flag
        cache.model_changed()
        assert step() == moved
        model.model.layers[0].train()  # (a mode: the settings are read again)
        assert step() != moved
        model.eval()
        assert step() == moved
        assert torch.nn.Module._apply is torch.nn.modules.module.Module._apply  # (torch as it was)
        model.model.layers[0].mlp.added = torch.nn.Identity()  # (a module put in: seen, and its settings read)
        assert step() != moved
