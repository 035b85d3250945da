"""Compiled decode steps (`OasisCache(..., compile_decode=True)`): the model's own per-layer work fused by
`torch.compile`.

A decode step of a 36-layer model launches ~60 small kernels per layer besides its matmuls and the cache's own work
(RMS norms as six kernels each, rotary embeddings, the MLP's activation, residual adds, dtype casts; docs/performance.md:
~2,200 kernels, 3.75 ms of an 11.8 ms captured step at 32K x 1 on the H200). Inside a CUDA graph each still costs
its launch tail. Here each decoder layer's `forward` (an instance attribute, like `routing.CapturedForward`)
runs a `torch.compile`d copy of itself for decode-sized calls (one token per sequence, or two with eagle3's riding
draft) of a cache that asks for it, and its own forward for everything else (prefill, other caches). The cache's
`update` and the "oasis" attention read host state and launch the package's kernels: dynamo does not trace them.
Where every layer of the cache is an oasis layer they enter the graph as two custom ops (`compiled_ops.py`), so a
layer is one graph and every layer runs the same one (one frame traced; nine, each
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
(`compiles_decode`), so at the switch the steps run once eagerly on the capture stream (where the graph
compiles, outside any capture) and are captured anew.

A compilation in a thread of its own was tried and removed: it moved the compilation's cost into the next call rather
than hiding it (docs/performance.md), and it needed a gate against what compiling does to the whole process.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import torch

from ..compute import compiled_ops
from ..config import OasisConfig
from . import fused_projections

# Decode-sized calls that run compiled: one token per sequence, or two (the real one and eagle3's riding draft).
COMPILED_QUERY_LENGTHS = (1, 2)

# The layers share their forward's code, and dynamo keys a code object's graphs by its guards: an `int` attribute
# of a module (`self.layer_idx`, read for the cache's update) is a constant by default, so every layer would compile
# its own graphs until the recompile limit (8), and the layers past it would run eager, silently (an H200 profile
# showed 8 of 36 layers compiled). As a symbolic int it is one input more: one set of graphs serves
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


_ONE_THREAD = threading.Lock()  # held around a compiled call (`CompiledDecode.run_compiled`)


def _outside_captured_path(cache) -> bool:
    """Whether this is a decode step of a cache with captured steps that runs eagerly outside them (its first step,
    which fixes the summaries' channels; a step that cannot be replayed): called with the caller's mask, where static
    steps and captures pass none, it would compile a second graph (`attention_mask is None` guarded: 1.4-2.4 s at a
    later call's first step on the H200) for a step that is not the hot path. It runs the
    layer's own forward."""
    steps = cache.captured_steps
    return steps is not None and not steps.in_static_step


def decoder_layers_of(model, attention_modules) -> list[torch.nn.Module]:
    """The modules of `model` that hold one of `attention_modules` as a direct child (the decoder layers)."""
    wanted = {id(module) for module in attention_modules}
    return [module for module in model.modules() if any(id(child) in wanted for child in module.children())]


class CompiledDecode:
    """Installed once per decoder layer as its `forward` (same signature; `runtime/install.py`, given back with the
    model's last cache): a decode-sized call with an OasisCache whose config asks for it runs the layer's forward
    compiled; any other call runs it as it is."""

    def __init__(self, layer: torch.nn.Module):
        self.eager_forward = layer.forward
        self.__signature__ = getattr(self.eager_forward, "__signature__", None)
        self.__doc__ = self.eager_forward.__doc__
        self.compiled = None  # made at the first call that needs it (torch.compile is lazy anyway)
        self.fused_groups = []  # this layer's fused projections (`fused_projections.fuse`), if a cache asked for them

    def __call__(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if (not isinstance(getattr(cache, "config", None), OasisConfig) or not isinstance(hidden, torch.Tensor)
                or hidden.dim() != 3 or hidden.shape[1] not in COMPILED_QUERY_LENGTHS or not compiles_decode(cache)
                or _outside_captured_path(cache)):
            return self.eager_forward(*args, **kwargs)
        try:
            return self.run_compiled(cache, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            if not cache._compile_later:
                raise
            # (automatic: a compilation that fails must not end a long generation; it raises before the graph runs)
            give_up(cache._model(), error)
            return self.eager_forward(*args, **kwargs)

    def run_compiled(self, cache, args, kwargs):
        """The layer's forward compiled, under what its graphs assume (its contexts). The contexts set flags that
        dynamo reads as globals while tracing: one thread at a time (`_ONE_THREAD`); a thread that finds another in
        a compiled call (two caches decoding in two threads) runs the layer's own forward instead."""
        if not _ONE_THREAD.acquire(blocking=False):
            return self.eager_forward(*args, **kwargs)
        config = cache.config
        with contextlib.ExitStack() as scope:
            scope.callback(_ONE_THREAD.release)
            if self.compiled is None:  # (here, not before: `torch.compile` imports inductor, ~1 s)
                self.compiled = torch.compile(self.eager_forward)
            scope.enter_context(_ONE_GRAPH_FOR_ALL_LAYERS)
            scope.enter_context(_layer_index_symbolic())
            if config.fuse_projections:  # (a group whose parameters moved computes unfused from now: checked here)
                scope.enter_context(fused_projections.fusing(self.fused_groups))
            if cache.all_oasis_layers:  # (else sliding-window layers too: the update and the attention break the graph)
                scope.enter_context(compiled_ops.tracing_ops())
                scope.enter_context(compiled_ops.active(cache))
            return self.compiled(*args, **kwargs)


def compiles_decode(cache) -> bool:
    """Whether this cache's decode-sized layer calls run compiled now (`runtime/compiled_layers.py`):
    `compile_decode=True`, or None once the model has decoded `compile_after_steps` steps in this process (unless
    that compilation failed: then, with a warning, never). Part of the replay signature: a change captures the
    steps anew, after one eager step where the compiled layers meet their graphs (`captured_step.CapturedSteps`)."""
    if cache._compile_later:
        model = cache._model()
        return (model is not None and decoded_steps(model) >= cache.config.compile_after_steps
                and not compile_failed(model))
    return cache.config.compile_decode is True
