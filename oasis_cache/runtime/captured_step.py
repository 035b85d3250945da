"""The captured decode step: one-token decode forwards replayed as a CUDA graph (`OasisCache(..., cuda_graph=...)`: on by
default for CUDA models of the checked architectures with the Triton backend, `cache._captured_steps_for`).

HF's eager decode is launch-bound (~80 launches per layer, 36 layers); replaying the step removes the host from the
loop. `generate` owns the loop, so the step is taken over where `generate` calls the model: `CapturedForward` replaces
the model instance's `forward` (same signature) and hands each call of a cache with captured steps to that
cache's `CapturedSteps`, which, for a call that

    - decodes one token per sequence (input_ids `[B, 1]`) on a CUDA cache that already holds complete blocks,
    - completes no block ("steady": no offload, every shape stays fixed) or exactly one ("completing", with the
      Triton backend: the block is offloaded at the block number read on the device, its summary written at it, the
      count advanced on the device; `replay.prepare_step` first makes room in every pool, on the host),
    - belongs to a batch whose padding the cache recorded at the last prefill and which lies in complete blocks
      (`ForwardContext.padding_covers`: the step is called without its mask and reads that record; decode masks are
      taken to extend the prompt's with ones, as `generate`'s do), with no measurement mode and no outputs beyond
      the logits,

copies the token and its position (the caller's `position_ids`: a left-padded sequence's own; else the cache's
length) into static buffers and replays the graph of its kind captured for the cache's
current layout (`replay.replay_signature`: buffers, predictions, and the block count only while it is at most the
slots).
Any other call runs the eager forward. Selection ranks blocks over the summaries' capacity and reads the block count
on the device, so a completed block does not change the layout; a new one (a capacity grew: summaries by a sixteenth
on fixed steps, the slot map by half, the gather's address table by double) is captured at its first step of each
kind:

    capture   the compute stream joins the side stream and pending prefetch events are forgotten (a graph may not
              wait on work outside it); the forward runs once under capture, its side-stream gathers forking from
              the capture stream and joined back at its end (the prefetch for step t+1 still overlaps step t's later
              layers); the Python code's host effects (counters, token counts) happen once, as in an eager step
    replay    the recorded device work runs; `replay.advance_replayed_step` applies the host effects the skipped
              Python would have had (`tests/runtime/test_captured_step.py` checks they equal an eager step's)

Every decode step must update persistent state in place (a replay writes where the capture wrote): the same test
checks that an eager step rebinds no state tensor. With eagle3 the ride-along's hooks run inside the captured forward
(the head's call on static buffers, without a graph of its own); its kept tensors join the signature
(`RideAlong.state_tensors`) and a step stays eager until the head's window has filled (`RideAlong.replayable`).
"""

from __future__ import annotations

import contextlib
import itertools
import operator

import torch

from ..memory.streams import capture_stream, no_collection_while_capturing
from . import replay


# Keyword arguments a replayed step accepts (anything else set runs the eager forward); their values are ignored
# except the token and its positions: the step reads the cache's recorded padding, not the caller's mask.
_REPLAY_KWARGS = {"input_ids", "attention_mask", "position_ids", "cache_position", "past_key_values", "cache",
                  "use_cache", "return_dict", "logits_to_keep"}


def weights_where_they_are(model) -> int:
    """A number for where `model`'s parameters and buffers are now (their addresses): a captured step reads them at
    the addresses it was captured with, so a rebinding (`model.to("cpu")` and back, `load_state_dict(assign=True)`,
    a module replaced) must make the steps capture anew. Taken at each prefill and at a step after the model changed
    (`ModelState`; `runtime/routing.py`), not at every step."""
    return hash(tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers())))


class ModelState:
    """What a replayed step depends on in the model, taken when its steps are (re)captured, and `unchanged()`: a
    cheap look at the model's own state before each step of a cache with captured steps — its module tree (each
    child still in its parent's place, none added or removed), each parameter and buffer (the same tensor in its
    module, at the same address: `model.to(...)` and back, a parameter, buffer or module put in place,
    `load_state_dict(assign=True)`) and each module's mode (`train()` / `eval()`). References compared in C loops
    (`map`), no device work. Other settings (an attribute set by hand, as PEFT's `set_adapter` sets them) are read at
    each prefill (`module_settings`) or after `cache.model_changed()`."""

    def __init__(self, model):
        modules = list(model.modules())
        edges = [(parent._modules, name, child) for parent in modules for name, child in parent._modules.items()]
        held = [(store, name, tensor) for module in modules for store in (module._parameters, module._buffers)
                for name, tensor in store.items() if tensor is not None]
        self.children_of = [module._modules for module in modules]
        self.sizes = [len(children) for children in self.children_of]
        self.stores, self.names, self.objects = (list(x) for x in zip(*(edges + held))) if edges or held else ([],) * 3
        self.tensors = [tensor for _, _, tensor in held]
        self.addresses = list(map(_data_ptr, self.tensors))
        self.modules = modules
        self.modes = list(map(_training, modules))

    def unchanged(self) -> bool:
        return (list(map(len, self.children_of)) == self.sizes
                and all(map(operator.is_, map(dict.get, self.stores, self.names), self.objects))
                and list(map(_data_ptr, self.tensors)) == self.addresses
                and list(map(_training, self.modules)) == self.modes)


_data_ptr = torch.Tensor.data_ptr
_training = operator.attrgetter("training")


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_NOT_A_SETTING = object()
_BOOKKEEPING = frozenset(torch.nn.Module().__dict__) - {"training"}  # (every module's parameters, hooks, children)


def _setting(value):
    """`value` as a hashable setting (a flag, a number, a name, or tuples, lists, sets and dicts of those), or
    `_NOT_A_SETTING` (a tensor, a module, a function, a hook, or a container holding one: checked item by item,
    the first such item stops the walk)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            key, item = _setting(key), _setting(item)
            if key is _NOT_A_SETTING or item is _NOT_A_SETTING:
                return _NOT_A_SETTING
            items.append((key, item))
        return ("dict", tuple(items))
    if isinstance(value, (tuple, list, set, frozenset)):
        items = []
        for item in value:
            item = _setting(item)
            if item is _NOT_A_SETTING:
                return _NOT_A_SETTING
            items.append(item)
        if isinstance(value, (set, frozenset)):
            items.sort(key=repr)
        return (type(value).__name__, tuple(items))
    return _NOT_A_SETTING


def module_settings(model) -> int:
    """A number for the settings of `model`'s modules: each module's plain attributes (`training`, flags, numbers,
    names, and their lists and dicts — a PEFT LoRA layer's active adapters, `disable_adapters`, merged adapters and
    scales). A captured step replays the computation the settings at its capture made, so switching an adapter or a
    flag must make the steps capture anew, as a rebinding of weights does (`weights_where_they_are`); tensors,
    modules and functions are not settings. 2 ms for Qwen3-8B's 547 modules on a 2-core CPU machine (the weights'
    addresses: 1 ms there): taken once per prefill, with the weights' addresses (`runtime/routing.py`)."""
    settings = []
    for name, module in model.named_modules():
        for key, value in module.__dict__.items():
            if key in _BOOKKEEPING:
                continue
            value = _setting(value)
            if value is not _NOT_A_SETTING:
                settings.append((name, key, value))
    return hash(tuple(settings))



class _Graph:
    """One kind of captured step: its graph, the signature it was captured under, its output and memory pool."""

    def __init__(self):
        self.graph = None  # torch.cuda.CUDAGraph
        self.signature = None  # `replay.replay_signature(cache)` at its capture
        self.output = None  # the captured forward's output without the cache (`_Graph.keep`): (class, items, names
        # of the items that were the cache); its logits are the graph's buffer
        self.pool = None  # its memory pool, shared by its successive captures (no new device allocations)

    def keep(self, output, cache) -> None:
        """Keep a capture's `output` without `cache`: a kept output holding its cache (`past_key_values`) made the
        cycle cache -> graphs -> output -> cache, so a dropped cache and its pinned host pools (5 GiB at 32K for an
        8B model) lived on until Python's garbage collector ran, and each new cache pinned its own anew (H200,
        measured: 1.7-2.0 s of every later 32K `generate`, the pinned pool growing by 5 GiB a call)."""
        items = {name: value for name, value in output.items() if value is not cache}
        self.output = (type(output), items, tuple(name for name, value in output.items() if value is cache))

    def result(self, cache):
        """The kept output with its logits copied out of the graph's buffer (the next replay overwrites it) and
        `cache` where the capture's output had it."""
        kind, items, cache_names = self.output
        out = kind(**items)
        out["logits"] = items["logits"].clone()
        for name in cache_names:
            out[name] = cache
        return out


class CapturedSteps:
    """One cache's captured decode steps: a graph per kind of step ("steady", "completing": one block completes),
    for the cache's current layout; the static input buffers they share; the counts."""

    def __init__(self):
        self.graphs: dict[str, _Graph] = {}
        self.stream = None  # the stream steps are captured on (`capture_stream`), once a first step ran eagerly on it
        self.compiled_seen = None  # `replay.compiles_decode(cache)` when a step last ran eagerly before a capture
        self.in_static_step = False  # inside a static eager step or a capture (`_on_capture_stream`)
        self.input_ids = self.position_ids = None  # [B, 1] each: what every captured step reads
        self.captures = 0
        self.replays = 0
        self.completing_replays = 0  # replays of steps that completed a block (also in `replays`)

    def drop(self) -> None:
        """Forget the graphs and their memory (the cache was reset)."""
        self.graphs = {}

    def forward(self, runner, cache, kwargs):  # (runner: the model's `routing.CapturedForward`)
        input_ids = kwargs.get("input_ids")
        kind = self._replayable(cache, input_ids, kwargs)
        if kind is None:
            return runner.eager_forward(**kwargs)
        if self.stream is None:  # a first eager step on the capture stream sets up per-stream state (cuBLAS)
            self.stream = capture_stream(input_ids.device)
            self.compiled_seen = replay.compiles_decode(cache)
            return self._static_eager_step(runner, cache, input_ids, kwargs)
        replay.prepare_step(cache, kind)
        slot = self.graphs.setdefault(kind, _Graph())
        if replay.replay_signature(cache) != slot.signature:
            compiles = replay.compiles_decode(cache)
            if self.compiled_seen != compiles:  # (the layers compile now: their graphs are met once before any
                self.compiled_seen = compiles  # capture)
                return self._static_eager_step(runner, cache, input_ids, kwargs)
            return self._capture(runner, cache, input_ids, slot, kwargs)
        return self._replay(cache, input_ids, kind, slot, kwargs)

    def _static_eager_step(self, runner, cache, input_ids, kwargs):
        """An eager step on the capture stream, called as a capture calls it: compiled layers meet their graphs
        here (a compilation is never first met inside a capture)."""
        with self._on_capture_stream(input_ids.device):
            out = runner.eager_forward(**self._static_call(runner, cache, input_ids, kwargs))
            logits = out.logits.clone()
        out["logits"] = logits
        return out

    def _replayable(self, cache, input_ids, kwargs) -> str | None:
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            return None
        positions = kwargs.get("position_ids")
        if positions is not None and tuple(positions.shape) != tuple(input_ids.shape):
            return None
        if any(v is not None and v is not False and k not in _REPLAY_KWARGS for k, v in kwargs.items()):
            return None
        return replay.replayable_step(cache)

    # --------------------------------------------------------------------------------------------- capture, replay
    @contextlib.contextmanager
    def _on_capture_stream(self, device):
        """Work inside runs on the capture stream, ordered after and before the caller's stream."""
        caller = torch.cuda.current_stream(device)
        self.stream.wait_stream(caller)
        self.in_static_step = True
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.in_static_step = False
        caller.wait_stream(self.stream)

    def _static_call(self, runner, cache, input_ids, kwargs, keep=None) -> dict:
        """The keyword arguments of a captured step's forward: the static token and positions (set to this step's,
        `_set_inputs`), the cache, logits of the last position; no mask (the cache reads its padding record).
        Buffers of a new shape invalidate the graphs other than `keep`, which read the old ones."""
        if self.input_ids is None or self.input_ids.shape != input_ids.shape:
            self.input_ids = input_ids.clone()  # [B, 1]
            self.position_ids = torch.empty_like(input_ids)  # [B, 1]
            for other in self.graphs.values():
                if other is not keep:
                    other.graph = other.signature = other.output = None
        self._set_inputs(cache, input_ids, kwargs)
        call = {"input_ids": self.input_ids, "position_ids": self.position_ids, runner.cache_argument: cache,
                "use_cache": True, "return_dict": True}
        if "logits_to_keep" in runner.__signature__.parameters:
            call["logits_to_keep"] = 1
        return call

    def _set_inputs(self, cache, input_ids, kwargs) -> None:
        """The step's token and positions into the static buffers: the caller's `position_ids` (`generate` passes a
        left-padded sequence's own), else the cache's length (what the model computes without them)."""
        self.input_ids.copy_(input_ids)
        positions = kwargs.get("position_ids")
        if positions is None:
            self.position_ids.fill_(cache.get_seq_length())
        else:
            self.position_ids.copy_(positions)

    def _capture(self, runner, cache, input_ids, slot: _Graph, kwargs):
        """Record this step's forward for the current layout, then replay it (the capture itself runs nothing)."""
        previous = slot.graph  # kept until the new graph holds the pool: what its capture freed is reused
        slot.graph = slot.signature = slot.output = None
        if slot.pool is None:
            slot.pool = torch.cuda.graph_pool_handle()
        device = input_ids.device
        call = self._static_call(runner, cache, input_ids, kwargs, keep=slot)
        replay.prepare_capture(cache)  # compute has joined the side stream; no event from outside the graph is waited on
        signature = replay.replay_signature(cache)  # the layout the step starts from (a completing step moves the count)
        graph = torch.cuda.CUDAGraph()
        try:
            with self._on_capture_stream(device), no_collection_while_capturing():
                # relaxed: Triton may load a kernel for the new layout during the capture
                graph.capture_begin(pool=slot.pool, capture_error_mode="relaxed")
                try:
                    output = runner.eager_forward(**call)
                    cache.streams.join()  # the prefetches for the next step end inside the graph
                finally:
                    graph.capture_end()
        except RuntimeError as error:
            self.drop()
            raise RuntimeError(
                f"Capturing a decode step as a CUDA graph failed ({error}). Decode without captured steps: "
                "OasisCache(..., cuda_graph=False). This cache's state is undefined after the failed step: start "
                "again from the prompt (cache.reset() or a new cache)."
            ) from error
        slot.graph, slot.signature = graph, signature
        slot.keep(output, cache)
        del previous, output
        self.captures += 1
        graph.replay()
        return slot.result(cache)

    def _replay(self, cache, input_ids, kind: str, slot: _Graph, kwargs):
        cache.streams.synchronize()  # an eager step's prefetches (none in steady state) land before the graph reads
        self._set_inputs(cache, input_ids, kwargs)
        slot.graph.replay()
        replay.advance_replayed_step(cache, kind)
        self.replays += 1
        self.completing_replays += kind == "completing"
        return slot.result(cache)
