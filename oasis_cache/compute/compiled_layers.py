"""Compiled decode steps (`OasisCache(..., compile_decode=True)`): the model's own per-layer work fused by
`torch.compile`.

A decode step of a 36-layer model launches ~60 small kernels per layer besides its matmuls and the cache's own work
(RMS norms as six kernels each, rotary embeddings, the MLP's activation, residual adds, dtype casts; docs/perf.md:
~2,200 kernels, 3.75 ms of an 11.8 ms captured step at 32K x 1 on the H200). Inside a CUDA graph each still costs
its launch tail. Here each decoder layer's `forward` (an instance attribute, like `captured_step.CapturedForward`)
runs a `torch.compile`d copy of itself for decode-sized calls (one token per sequence, or two with eagle3's riding
draft) of a cache that asks for it, and its own forward for everything else (prefill, other caches). The cache's
`update` and the "oasis" attention read host state and launch the package's kernels: dynamo does not trace them.
Where every layer of the cache is an oasis layer they enter the graph as two custom ops (`compiled_ops.py`), so a
layer is one graph and every layer runs the same one (one frame traced; before the thirty-first session nine, each
twice, at two graph breaks); elsewhere (sliding-window layers) they break the graph (`torch.compiler.disable`) and
each layer compiles into the regions around them. Inductor fuses the elementwise work (norms, rotary, activation,
residuals). A captured step records the compiled kernels like any others; the graphs are compiled at the first eager
step that meets them, before a capture. Where a cache's steps are captured, only the steps of the captured path run
compiled (the static eager steps before a capture, and the captures): its other decode steps (the first, which fixes
the summaries' channels; one that cannot be replayed) carry the caller's mask where those carry none, and would
compile a second graph for a step that is not the hot path (`_outside_captured_path`).

By default (`compile_decode=None`) a cache whose steps are captured compiles them only once its model has decoded
`compile_after_steps` steps in the process (`decoded_steps`, counted over every cache and call of the model): until
then `CompiledDecode` runs the layers' own forward; the replay signature holds whether the steps compile
(`OasisCache.compile_generation`), so at the switch the steps run once eagerly on the capture stream (where the graph
compiles, outside any capture) and are captured anew.

With `compile_in_background` (research) the compilation does not hold up the steps: the first decode-sized call of a
shape copies its arguments, and once the cache's steps are captured (where they are; `BackgroundCompile.poll`) a
thread calls the compiled forward once on them with the cache's ops dry (`compiled_ops.dry`: nothing written, zeros
attended), which compiles the graph every layer shares; until it ends, the layers run their own forward (replayed as
before, no new capture: the thread may synchronize the device). Its end bumps `READY`, part of the replay signature,
so the steps are captured anew with the compiled kernels (after one eager step that meets them outside a capture). A
failed compilation raises at the next call. What compiling does to the whole process (an fx trace patches
`nn.Module.__call__`; RNG states set back) is kept from the decoding thread by `compile_gate.GATE`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
import weakref

import torch

from . import compiled_ops, fused_projections
from .compile_gate import GATE

# Decode-sized calls that run compiled: one token per sequence, or two (the real one and eagle3's riding draft).
COMPILED_QUERY_LENGTHS = (1, 2)

# The layers share their forward's code, and dynamo keys a code object's graphs by its guards: an `int` attribute
# of a module (`self.layer_idx`, read for the cache's update) is a constant by default, so every layer would compile
# its own graphs until the recompile limit (8), and the layers past it would run eager, silently (the thirtieth
# session's H200 profile: 8 of 36 layers compiled). As a symbolic int it is one input more: one set of graphs serves
# every layer, and the first step compiles once, not once per layer. Patched around each compiled call only (a
# recompilation, e.g. for a riding draft's two query rows, traces under it too); a user's own compiles are untouched.
_ONE_GRAPH_FOR_ALL_LAYERS = torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)
# ... and symbolic from the first compile, else the first layer's graphs hold `layer_idx == 0` and the second layer
# compiles them again ("automatic dynamic"): the attention module's index as dynamo names it (two spellings across
# torch versions), added to `torch.compiler.config.dynamic_sources` where this torch has it.
_LAYER_INDEX_SOURCES = ("L['self']._modules['self_attn'].layer_idx", "self._modules['self_attn'].layer_idx")


def _layer_index_symbolic():
    config = torch.compiler.config
    if "dynamic_sources" not in getattr(config, "_config", {}):
        return contextlib.nullcontext()
    return config.patch(dynamic_sources=",".join(filter(None, (config.dynamic_sources, *_LAYER_INDEX_SOURCES))))


# Decode steps each model has run in this process (counted where `compile_decode=None` may compile them).
_DECODED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def count_decoded_step(model) -> None:
    """One more decode step of `model` (host arithmetic: no device work)."""
    _DECODED[model] = _DECODED.get(model, 0) + 1


def decoded_steps(model) -> int:
    """Decode steps `model` has run in this process (where counted: caches with `compile_decode=None`)."""
    return _DECODED.get(model, 0)


# Models whose automatic compilation failed (`compile_decode=None`): their steps go on uncompiled, with a warning.
_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compile_failed(model) -> bool:
    """Whether `compile_decode=None` gave up compiling `model`'s steps (its compilation raised)."""
    return model in _FAILED


def give_up(model, error: BaseException) -> None:
    """The automatic compilation of `model`'s steps raised: warn once; its steps run uncompiled from now on."""
    if model is None or model in _FAILED:
        return
    _FAILED[model] = repr(error)
    said = " ".join(str(error).split())[:400]  # (dynamo's message spans lines)
    warnings.warn(f"OasisCache: compiling the decode steps failed ({type(error).__name__}: {said}); they go on "
                  "uncompiled, with the same tokens. OasisCache(..., compile_decode=False) skips the attempt; "
                  "compile_decode=True raises instead.", RuntimeWarning, stacklevel=3)


def may_compile_automatically(cache) -> bool:
    """Whether `compile_decode=None` compiles this cache's steps once its model has decoded enough: where its steps
    are captured (CUDA, the Triton backend, a checked architecture) and every attention layer is an oasis layer (one
    graph for all layers, the path the CUDA suite checks)."""
    return cache.captured_steps is not None and cache.all_oasis_layers


# Bumped when a compilation in a thread ends (`OasisCache.replay_signature` reads it: steps are captured anew).
READY = [0]
_THREADS: list = []  # compilations in flight (threads)
_ONE_THREAD = threading.Lock()  # held around a compiled call (`CompiledDecode.run_compiled`)


def compiling() -> bool:
    """Whether a compilation runs in a thread now (then no step is captured: it may synchronize the device)."""
    return any(thread.is_alive() for thread in _THREADS)


def wait_for_compilations(timeout: float | None = None) -> None:
    """Wait for the compilations running in threads (benchmarks, tests), with the gate open (`compile_gate`)."""

    def join():
        for thread in list(_THREADS):
            thread.join(timeout)

    GATE.open_while(join)


def _copied(value):
    """`value` with its tensors copied (same shape, strides, dtype, device: the same guards), containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


class BackgroundCompile:
    """One model's compilations in threads (`compile_in_background`), by the shape of the calls they serve:
    `state[key]` is "pending" (the call's arguments copied, `pending[key]`), "compiling", "ready" or the exception
    that ended it. A pending compilation starts (`poll`) once no capture can meet it: at once without captured
    steps, else once the cache's two kinds of step are captured (then steps are replays, which call no layer: the
    captured path polls after each)."""

    def __init__(self):
        self.state: dict = {}
        self.pending: dict = {}
        self.timeline: list = []  # (event, `time.perf_counter()`): "start" and "end" of each thread (benchmarks)

    def request(self, layer: "CompiledDecode", cache, key, args, kwargs) -> None:
        """Copy the call's arguments (its buffers change before the thread runs; the cache itself is held weakly:
        a pending compilation must not keep a deleted cache's memory) and start when allowed."""
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # (copies made inside a capture would be the graph's: asked again at an eager call)
        name = "cache" if kwargs.get("cache") is cache else "past_key_values"
        copies = _copied({k: v for k, v in kwargs.items() if k != name})
        made = None
        if hidden.is_cuda:
            made = torch.cuda.Event()
            made.record()
        self.pending[key] = (layer, weakref.ref(cache), _copied(args), copies, name, made, hidden.device,
                             torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self.state[key] = "pending"
        self.poll(cache)

    def owned_by(self, key, cache) -> bool:
        """Whether the pending compilation of `key` waits on `cache` (its steps to be captured)."""
        entry = self.pending.get(key)
        return entry is not None and entry[1]() is cache

    def poll(self, cache) -> None:
        """Start the pending compilations of `cache` that may start now (`_may_start`); forget those whose cache
        was deleted."""
        for key, (layer, owner, args, kwargs, name, made, device, grad, inference) in list(self.pending.items()):
            owner = owner()
            if owner is None:
                del self.pending[key], self.state[key]
            elif owner is cache and _may_start(cache, device) and GATE.may_hold():
                del self.pending[key]
                self._start(key, layer, cache, args, kwargs, name, made, device, grad, inference)

    def _start(self, key, layer, cache, args, kwargs, name, made, device, grad, inference) -> None:
        kwargs = {**kwargs, name: cache}
        stream = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_event(made)  # the copies are made
        self.state[key] = "compiling"
        self.timeline.append(("start", time.perf_counter()))
        _first_fake_mode_here()
        GATE.hold()  # (from now on this thread opens it only where it calls no module: `compile_gate`)
        GATE.started()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.0005))  # the caller's steps wait on the device, then on the GIL

        def run():
            try:
                with contextlib.ExitStack() as scope:
                    scope.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
                    if stream is not None:
                        scope.enter_context(torch.cuda.device(device))
                        scope.enter_context(torch.cuda.stream(stream))
                    scope.enter_context(compiled_ops.dry())
                    scope.enter_context(GATE.compiling())
                    layer.run_compiled(cache, args, kwargs, wait=True)
                if stream is not None:
                    stream.synchronize()
                self.state[key] = "ready"
            except BaseException as error:  # (raised at the next call that needs it)
                self.state[key] = error
            finally:
                if sys.getswitchinterval() == min(switch, 0.0005):
                    sys.setswitchinterval(switch)
                READY[0] += 1
                GATE.ended()
                self.timeline.append(("end", time.perf_counter()))

        # (not a daemon: a script that ends while it compiles waits for it instead of tearing the compiler down)
        thread = threading.Thread(target=run, name="oasis-compile", daemon=False)
        _THREADS[:] = [t for t in _THREADS if t.is_alive()] + [thread]
        try:
            thread.start()
        except RuntimeError as error:  # (no thread: nothing to guard; the next call raises, naming the option)
            sys.setswitchinterval(switch)
            GATE.ended()
            self.state[key] = error


def _first_fake_mode_here() -> None:
    """Without a CUDA device, a fake tensor mode's first entry registers a no-op CUDA device guard for the process
    (`torch._C._ensureCUDADeviceGuardSet`); on torch 2.11, made first in a thread, the next compilation in the main
    thread then crashes there (segmentation fault; CPU, torch 2.11; fixed by 2.13). Done here first, in the thread
    that starts the compilation."""
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and not torch.cuda.is_available():
        ensure()


_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its BackgroundCompile


def poll(cache) -> None:
    """After a replayed step (`captured_step.CapturedSteps`): start what waited for the steps to be captured."""
    background = _BY_MODEL.get(cache._model())
    if background is not None and background.pending:
        background.poll(cache)


def _may_start(cache, device) -> bool:
    """Whether a compilation may start in a thread now: not inside a capture, and once the cache's steps are
    captured (both kinds) or enough steps went by without (steps that are never replayed)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    steps = cache.captured_steps
    if steps is None or {"steady", "completing"} <= {k for k, g in steps.graphs.items() if g.graph is not None}:
        return True
    return cache.decode_clock >= 2 * cache.config.block_size + 4


def _outside_captured_path(cache) -> bool:
    """Whether this is a decode step of a cache with captured steps that runs eagerly outside them (its first step,
    which fixes the summaries' channels; a step that cannot be replayed): called with the caller's mask, where static
    steps and captures pass none, it would compile a second graph (`attention_mask is None` guarded: 1.4-2.4 s at a
    later call's first step on the H200, thirty-sixth session) for a step that is not the hot path. It runs the
    layer's own forward."""
    steps = cache.captured_steps
    return steps is not None and not steps.in_static_step


class CompiledDecode:
    """Installed once per decoder layer as its `forward` (same signature): a decode-sized call with an OasisCache
    whose config asks for it runs the layer's forward compiled; any other call runs it as it is."""

    def __init__(self, layer: torch.nn.Module):
        self.eager_forward = layer.forward
        self.__signature__ = getattr(self.eager_forward, "__signature__", None)
        self.__doc__ = self.eager_forward.__doc__
        self.compiled = None  # made at the first call that needs it (torch.compile is lazy anyway)
        self.fused_groups = []  # this layer's fused projections (`fused_projections.fuse`), if a cache asked for them
        self.background = None  # the model's `BackgroundCompile`, shared by its layers (`install`)

    @classmethod
    def install(cls, model, attention_modules) -> list[torch.nn.Module]:
        """Wrap the forward of each module that holds one of `attention_modules` as a direct child (the decoder
        layers), once per model; returns those layers."""
        wanted = {id(module) for module in attention_modules}
        layers = []
        for module in model.modules():
            if any(id(child) in wanted for child in module.children()):
                if not isinstance(module.__dict__.get("forward"), cls):
                    module.forward = cls(module)
                layers.append(module)
        background = _BY_MODEL.get(model) or BackgroundCompile()
        _BY_MODEL[model] = background
        for layer in layers:
            layer.forward.background = background
        return layers

    def __call__(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        config = getattr(cache, "config", None)
        compiles = getattr(cache, "compiles_decode", None)
        if (compiles is None or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3
                or hidden.shape[1] not in COMPILED_QUERY_LENGTHS or not compiles() or _outside_captured_path(cache)):
            return self.eager_forward(*args, **kwargs)
        # (with sliding-window layers the update and the attention run between graphs, not as ops: they cannot run
        # dry in a thread, so those caches compile here)
        if config.compile_in_background and cache.all_oasis_layers:
            key = (tuple(hidden.shape), hidden.dtype, str(hidden.device), config.fuse_projections)
            state = self.background.state.get(key)
            if isinstance(state, BaseException):
                raise RuntimeError(f"The decode step's compilation in a thread failed ({state!r}). Decode without it: "
                                   "OasisCache(..., compile_in_background=False), or compile_decode=False.") from state
            if state != "ready":
                if state is None or state == "pending" and not self.background.owned_by(key, cache):
                    self.background.request(self, cache, key, args, kwargs)  # (another cache's wait: this one's now)
                elif state == "pending":
                    self.background.poll(cache)
                out = self.eager_forward(*args, **kwargs)
                GATE.let_through()  # (a compiling thread waiting to trace goes first: this thread calls no module now)
                return out
        try:
            return self.run_compiled(cache, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            if not cache._compile_later:
                raise
            # (automatic: a compilation that fails must not end a long generation; it raises before the graph runs)
            give_up(cache._model(), error)
            return self.eager_forward(*args, **kwargs)

    def run_compiled(self, cache, args, kwargs, wait: bool = False):
        """The layer's forward compiled, under what its graphs assume (its contexts). The contexts set flags that
        dynamo reads as globals while tracing: one thread at a time (`_ONE_THREAD`); a caller that would wait for a
        compilation in a thread runs the layer's own forward instead, unless `wait`."""
        if not _ONE_THREAD.acquire(blocking=wait):
            return self.eager_forward(*args, **kwargs)
        config = cache.config
        with contextlib.ExitStack() as scope:
            scope.callback(_ONE_THREAD.release)
            if self.compiled is None:  # (here, not before: `torch.compile` imports inductor, ~1 s, in a thread too)
                self.compiled = torch.compile(self.eager_forward)
            scope.enter_context(_ONE_GRAPH_FOR_ALL_LAYERS)
            scope.enter_context(_layer_index_symbolic())
            if config.fuse_projections:  # (a group whose parameters moved computes unfused from now: checked here)
                scope.enter_context(fused_projections.fusing(self.fused_groups))
            if cache.all_oasis_layers:  # (else sliding-window layers too: the update and the attention break the graph)
                scope.enter_context(compiled_ops.tracing_ops())
                scope.enter_context(compiled_ops.active(cache))
            return self.compiled(*args, **kwargs)
