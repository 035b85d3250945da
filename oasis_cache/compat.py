"""The only module that knows how transformers versions differ (5.17 ... newest).

- 5.17 returns one shared kwargs dict from `get_layer_types_and_kwargs`; 5.24 returns one dict per layer.
- 5.24 renamed the model/generate argument `past_key_values` to `cache` and passes `kwargs=` to `Cache.update`;
  `OasisLayer.update` accepts anything after the key/value states, so both calls land in the same place.
"""

from __future__ import annotations

import inspect

import torch
from transformers import cache_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "ALL_MASK_ATTENTION_FUNCTIONS",
    "causal_mask_function",
    "sdpa_mask",
    "layer_types_and_kwargs",
    "dynamic_layer_class",
    "holds_no_keys",
    "records_state_history",
    "generate_cache_argument",
]


def layer_types_and_kwargs(text_config) -> list[tuple[str, dict]]:
    """One `(layer_type, kwargs for the HF cache layer class)` per decoder layer that holds a cache."""
    layer_types, kwargs = cache_utils.get_layer_types_and_kwargs(text_config)
    if isinstance(kwargs, dict):  # <= 5.2x: one dict for all layers; keep only what each layer type takes
        per_layer = []
        for layer_type in layer_types:
            cls = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
            accepted = inspect.signature(cls.__init__).parameters if cls is not None else {}
            per_layer.append({k: v for k, v in kwargs.items() if k in accepted})
        kwargs = per_layer
    return list(zip(layer_types, kwargs))


def dynamic_layer_class(layer_type: str):
    """HF's own dynamic cache layer class for a layer type (sliding / chunked layers keep HF's layer)."""
    return cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)


# transformers' linear-attention cache layers (a fixed-size state, no keys); None where a version has none
_LINEAR_STATE = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)


def holds_no_keys(layer_type: str) -> bool:
    """Whether HF's layer for `layer_type` keeps no per-token keys and values: a linear-attention or convolution
    state of fixed size (Qwen3.5 / Qwen3-Next's gated delta nets, LFM's convolutions, Mamba layers), or no cache at
    all (a layer without attention: "dummy"). A layer holding both a state and keys ("hybrid") is not one."""
    cls = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
    if cls is None:
        return False
    if _LINEAR_STATE is not None and issubclass(cls, _LINEAR_STATE) and not issubclass(cls, cache_utils.DynamicLayer):
        return True
    return cls is getattr(cache_utils, "DummyLayer", object())


def records_state_history(layer) -> bool:
    """Whether `layer` is a linear-attention state recording its past for a rollback (`activate_past_recording`:
    assisted and prompt-lookup decoding). A prefill split into chunks then decoded otherwise than one forward for
    OLMo hybrid (logits 4e-2 apart): such a prefill runs whole, as transformers runs it."""
    return _LINEAR_STATE is not None and isinstance(layer, _LINEAR_STATE) and bool(getattr(layer, "record_past", False))


def state_addresses(layer) -> tuple | None:
    """What a captured decode step needs of a layer transformers keeps (not an `OasisLayer`): the addresses of a
    linear-attention layer's states, which its updates copy into (transformers marks them static for CUDA graphs; a
    new prefill of another shape makes new ones: part of the replay signature), `()` for a layer holding nothing
    ("dummy"), or None where no step can be captured: a sliding window's keys (a new tensor each step), a
    linear-attention state recording its past (assisted decoding), or a layer holding a state and keys both."""
    if isinstance(layer, getattr(cache_utils, "DummyLayer", ())):
        return ()
    if (_LINEAR_STATE is None or not isinstance(layer, _LINEAR_STATE) or isinstance(layer, cache_utils.DynamicLayer)
            or getattr(layer, "record_past", False)):
        return None
    states = (*layer.conv_states.values(), *layer.recurrent_states.values(),
              getattr(layer, "cumulative_length_linear", None))  # (5.24+: the layer's token count on the device)
    return tuple(t.data_ptr() for t in states if isinstance(t, torch.Tensor))


def generate_cache_argument(model) -> str:
    """The keyword under which `model(...)` takes a cache: `cache` (5.24+) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def positive_crop_error(tokens: int) -> Exception | None:
    """What the installed transformers' `DynamicLayer.crop(tokens)` raises for a positive `tokens` (newer versions: a
    ValueError; 5.17 keeps that many tokens, deprecated), so that an `OasisCache` answers as a `DynamicCache` would."""
    layer = cache_utils.DynamicLayer()
    layer.update(torch.zeros(1, 1, tokens + 1, 1), torch.zeros(1, 1, tokens + 1, 1))
    try:
        layer.crop(tokens)
    except (ValueError, RuntimeError) as error:
        return error
    return None
