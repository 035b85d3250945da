"""The cache's update and the "oasis" attention as two `torch.library` custom ops inside a compiled decode step
(`compile_decode`), so that dynamo traces each decoder layer as one graph instead of breaking at both calls.

With `torch.compiler.disable` on both (what a compile outside `compile_decode` still meets), every graph break
splits the layer into regions and makes dynamo restart each enclosing frame (transformers' wrappers included):
nine frames traced twice each for a Qwen3 layer (the H200's warm-cache first `generate` paid ~7 s over a later one,
earlier, this tracing part of it). As opaque ops dynamo records them as nodes and moves on: one frame,
one graph per layer.

- `oasis::update(key, value, layer_idx) -> token`: `OasisCache.update` for that layer (the new tokens appended;
  the layer left pending for its attention); returns an empty token tensor.
- `oasis::attend(query, key, value, mask, token, layer_idx, scale) -> out` `[B, Qn, Hq, D]`: the layer's
  attention. Taking the update's token orders it after the update (a data dependency: the graph keeps both, in
  that order), and its output feeds the rest of the layer.

The ops reach the cache through `active`, set by `CompiledDecode` around each compiled call (the cache is never
read while tracing, so no graph guards on which cache runs). They are used only where every layer of the cache is
an oasis layer: a model with sliding-window layers keeps the graph breaks (whether a layer is an oasis one would
depend on its index, a symbolic int in the graph).

The package's code asks `torch.compiler.is_dynamo_compiling()` (True only in code dynamo traces), not
`is_compiling()`: the latter reads a flag global to the process, True in every thread while any thread compiles (from
torch 2.13 for a whole compile session) — a cache decoding eagerly in another thread would take the traced path.
"""

import threading
from typing import Optional

import torch

# (no `from __future__ import annotations`: torch.library reads the ops' annotations as types)

_state = threading.local()  # .cache: the OasisCache of the compiled call running in this thread


class active:
    """`with active(cache):` the ops of compiled calls in this block act on `cache`."""

    def __init__(self, cache):
        self.cache = cache

    def __enter__(self):
        self.previous = getattr(_state, "cache", None)
        _state.cache = self.cache

    def __exit__(self, *exc):
        _state.cache = self.previous


# Read while tracing: a plain bool (dynamo guards on its value), True only inside `tracing_ops()`.
OPS_ON = False


class tracing_ops:
    """`with tracing_ops():` the update and the attention called in compiled code become the custom ops."""

    def __enter__(self):
        global OPS_ON
        self.previous, OPS_ON = OPS_ON, True

    def __exit__(self, *exc):
        global OPS_ON
        OPS_ON = self.previous


def _cache():
    cache = getattr(_state, "cache", None)
    if cache is None:
        raise RuntimeError("oasis::update / oasis::attend ran outside a compiled OasisCache decode step "
                           "(compile_decode): no cache is active in this thread.")
    return cache


@torch.library.custom_op("oasis::update", mutates_args=())
def update_op(key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> torch.Tensor:
    _cache().eager_update(key, value, layer_idx)
    return key.new_empty(0)


@update_op.register_fake
def _(key, value, layer_idx):
    return key.new_empty(0)


# the eager "oasis" attention the op runs, given by `compute/attention.py` when it is imported (it imports this
# module for the traced path)
EAGER_ATTENTION: list = []


@torch.library.custom_op("oasis::attend", mutates_args=())
def attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
              token: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    module = _cache()._modules[layer_idx]
    out, _ = EAGER_ATTENTION[0](module, query, key, value, mask, scaling=scale, check_given=False)
    return out


@attend_op.register_fake
def _(query, key, value, mask, token, layer_idx, scale):
    B, Hq, Qn, _ = query.shape
    return query.new_empty((B, Qn, Hq, value.shape[-1]))


# The update's token between the two calls of one layer while dynamo traces them: an item of a list (dynamo traces
# the write and the attention's read as one graph value; an attribute written on a class breaks the graph on torch
# 2.11, which cannot trace `setattr` on a type).
_TOKEN = [None]


def traced_update(key: torch.Tensor, value: torch.Tensor, layer_idx: int):
    _TOKEN[0] = torch.ops.oasis.update(key, value, layer_idx)
    return key, value


def traced_attention(module, query, key, value, attention_mask, scale: float):
    out = torch.ops.oasis.attend(query, key, value, attention_mask, _TOKEN[0], module.layer_idx, scale)
    return out, None
