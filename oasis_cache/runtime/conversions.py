"""An OasisCache to and from transformers' `DynamicCache` (`OasisCache.to_dynamic_cache`, `from_dynamic_cache`)."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from .. import compat
from ..compute import latent
from ..compute.attention import clear_pending
from ..control import Padding
from ..hybrid import HybridLayer
from ..layer import OasisLayer
from ..window import WindowLayer
from . import build, model_checks
from .prefill import prefill_chunks

_HYBRID_SLIDING = compat.dynamic_layer_class("hybrid_sliding")  # (transformers' window + linear-attention state)


def to_dynamic(cache):
    """`OasisCache.to_dynamic_cache`."""
    model = cache._model()
    if model is None:
        raise ReferenceError("The model this OasisCache served was deleted.")
    if cache.streams is not None:
        cache.streams.synchronize()
    dynamic = DynamicCache(config=model.config)
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, OasisLayer):
            if layer.is_initialized:
                kv = layer.full_kv()
                if layer.value_dim is not None:  # (stored padded to the keys' head size)
                    kv = kv[0], kv[1][..., : layer.value_dim]
                dynamic.layers[idx].update(*(kv if layer.latent is None else
                                             latent.transformers_form(kv[0], layer.latent)))
            if isinstance(layer, HybridLayer):
                layer.give_states_to(dynamic.layers[idx])
        else:
            window = isinstance(layer, WindowLayer)
            dynamic.layers[idx] = layer.as_transformers() if window else copy.deepcopy(layer)
    return dynamic


def from_dynamic(cls, model, dynamic, attention_mask: torch.Tensor | None, options: dict):
    """`OasisCache.from_dynamic_cache` (`cls`: the class to make)."""
    if isinstance(dynamic, (tuple, list)):  # the legacy form: one (keys, values) pair per layer
        dynamic = model_checks.from_legacy(model, dynamic)
    if not hasattr(dynamic, "layers"):
        raise TypeError(f"from_dynamic_cache takes a transformers DynamicCache (or a tuple of (keys, values) per "
                        f"layer), got {type(dynamic).__name__}.")
    model_checks.check_layers_fit(model,
                                  dynamic)  # (before a cache is made: nothing written for a cache that cannot fit)
    cache = cls(model, **options)
    if len(dynamic.layers) != len(cache.layers):
        raise ValueError(f"the cache holds {len(dynamic.layers)} layers; {type(model).__name__} has "
                         f"{len(cache.layers)}.")
    cfg = cache.config
    if attention_mask is not None:
        first = next((source for source in dynamic.layers if getattr(source, "is_initialized", False)), None)
        shape = tuple(first.keys.shape[::2]) if first is not None else None  # (B, N)
        if shape is None or tuple(attention_mask.shape) != shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; the cache holds "
                             f"{'no tokens' if shape is None else f'{shape[0]} sequences of {shape[1]} tokens'}"
                             f": pass the mask of exactly the tokens it holds (attention_mask[:, :N]).")
        cache.context.padding = Padding.of(attention_mask.to(first.keys.device).bool(), shape[0], first.keys.device)
    for idx, (source, layer) in enumerate(zip(dynamic.layers, cache.layers)):
        if not isinstance(layer, OasisLayer):  # (a linear-attention layer's state has no `is_initialized`)
            cache.layers[idx] = (type(layer).of(source, build.padding_reader(cache)) if isinstance(layer,
                                                                                                   WindowLayer)
                                 and type(source) in (DynamicSlidingWindowLayer, _HYBRID_SLIDING)
                                 else copy.deepcopy(source))
            continue
        if isinstance(layer, HybridLayer):
            layer.take_states_from(source)
        if not getattr(source, "is_initialized", False):
            continue
        if cache.transfer is None:
            cache.context.start_engine(source.keys.device)
        keys, values = ((source.keys, source.values) if layer.latent is None else
                        latent.stored_form(source.keys, source.values))  # (an MLA layer's latent rows)
        B, _, N, _ = keys.shape
        tokens = torch.empty((B, N), dtype=torch.long, device="meta")  # (only its shape is read)
        spans = prefill_chunks(dict(input_ids=tokens, logits_to_keep=1), cfg.prefill_chunk_tokens,
                               cfg.block_size, cfg.max_decode_tokens)
        if spans:  # (the pools sized for all of it at once, as a chunked prefill's: `_size_for_prompt`)
            layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
            layer.reserve_for_prompt(N)
        for start, end in spans or [(0, N)]:
            layer.update(keys[:, :, start:end], values[:, :, start:end])
            clear_pending()
            layer._offload_complete_blocks()
    return cache
