"""The `"oasis"` attention function and its mask function, registered with transformers by `import oasis_cache`.

transformers calls `cache.update(...)` and then the attention function, which does not receive the cache. The cache
hands the layer over: `OasisLayer.update` leaves itself as *pending* (thread-local), and the attention function of
the same module takes it. Without a pending layer (another cache, or no cache) the function is plain SDPA, so a model
switched to "oasis" keeps working with every other cache.

Mask: for full causal attention over keys that are exactly the past and the new tokens, the mask function returns
only the 2D visibility `[B, kv_length]` instead of a `[B, 1, q, kv]` mask, or None when nothing is padding (then
several new tokens after a past are aligned to the bottom right by the fallback: SDPA's `is_causal` aligns them to
the top left); sliding / chunked / custom patterns and static caches get SDPA's own mask.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..compat import causal_mask_function, sdpa_mask
from ..control.visibility import from_pattern
from . import compiled_ops, latent
from .dense import dense_causal_attention
from .sinks import attention_with_sinks, check_sinks, check_softcap

_handoff = threading.local()
_UNSUPPORTED_KWARGS = ("sinks", "position_bias")  # (learned sinks come as `s_aux`, soft-capping as `softcap`: served)


def leave_pending(layer, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> None:
    """Called by `OasisLayer.update`: the next attention call belongs to `layer`, and must be given the `key` and
    `value` the update returned (`_check_given`)."""
    _handoff.layer = layer
    _handoff.given = (key, value)


def window_sees_all(keys: torch.Tensor) -> None:
    """Called by `WindowLayer.update` on a steady step: the attention given `keys` (the whole window, no padding
    in it) has its one new token see every key, whatever mask transformers made (a replayed step's would be stale:
    it reads the layer's host-side count)."""
    _handoff.sees_all = keys


def peek_pending():
    return getattr(_handoff, "layer", None)


def clear_pending() -> None:
    _handoff.layer = None
    _handoff.given = None


def oasis_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function registered as "oasis": `[B, kv_length]` bool visibility for causal layers whose keys are
    exactly the past and the new tokens (an OasisCache, a DynamicCache), else SDPA's mask: other patterns, and caches
    whose keys run past the tokens written (a StaticCache's unwritten slots; its offset is a tensor)."""
    written = isinstance(q_offset, int) and q_offset + q_length == kv_length
    if mask_function is causal_mask_function:  # (a hybrid model's sliding mask leaves the full layers' note alone)
        # several new tokens after a past, nothing hidden: the mask is dropped below and a layer of another cache
        # must align them to the bottom right (`_sdpa_fallback`), which SDPA's `is_causal` does not
        _handoff.bottom_right = (q_length, kv_length) if written and q_length > 1 and q_offset > 0 else None
    if mask_function is not causal_mask_function or kv_offset != 0 or not written:
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    if attention_mask is None:
        return None
    visible = attention_mask.to(torch.bool)
    if visible.shape[-1] < kv_length:  # generate may pass a mask shorter than cache + new tokens
        visible = torch.nn.functional.pad(visible, (0, kv_length - visible.shape[-1]), value=True)
    visible = visible[:, :kv_length]
    return None if _all_true_on_cpu(visible) else visible


def _all_true_on_cpu(visible: torch.Tensor) -> bool:
    # Dropping an all-ones mask is only free of a host sync when the mask is on the CPU; on CUDA it is kept.
    return visible.device.type == "cpu" and bool(visible.all())


def oasis_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention interface "oasis". Shapes: query `[B, Hq, Qn, D]`, key/value `[B, Hkv, Qn(+past), D]`;
    returns `[B, Qn, Hq, D]` like every transformers attention function."""
    if torch.compiler.is_dynamo_compiling() and compiled_ops.OPS_ON:  # a compiled decode step: one op in its graph
        _check_call(module, attention_mask, dropout, kwargs)
        for name in ("s_aux", "softcap"):  # (OasisCache refuses compile_decode for such models first)
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"compile_decode does not carry `{name}` (attention sinks, soft-capping); "
                                          "OasisCache(..., compile_decode=False).")
        if attention_mask is not None and attention_mask.dim() == 4:
            raise NotImplementedError("compile_decode does not carry 4D attention masks (each step's mask pattern); "
                                      "OasisCache(..., compile_decode=False).")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return compiled_ops.traced_attention(module, query, key, value, attention_mask, scale)
    return oasis_attention_eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _check_call(module, attention_mask, dropout, kwargs) -> None:
    """What the oasis attention refuses, named (before anything is read)."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"OasisCache does not support attention with `{name}` ({type(module).__name__}); use a DynamicCache."
            )
    if kwargs.get("is_causal") is False:
        raise NotImplementedError(
            f"{type(module).__name__} asks for non-causal attention (`is_causal=False`); OasisCache serves causal "
            "decoders. Use a DynamicCache."
        )
    if kwargs.get("output_attentions"):
        _warn_no_weights()
    if dropout and module.training:
        raise ValueError("OasisCache is an inference cache: call model.eval() (attention dropout is active).")
    if attention_mask is not None and (attention_mask.dim() not in (2, 4) or (
            attention_mask.dim() == 4 and attention_mask.dtype != torch.bool)):
        raise NotImplementedError(
            f"OasisCache got a {attention_mask.dim()}D {str(attention_mask.dtype).removeprefix('torch.')} attention "
            f"mask for full-attention layer {module.layer_idx}; it takes 2D padding masks (what tokenizers and "
            "`generate` produce) and 4D boolean masks (True: seen), not additive ones. Pass `attention_mask` as "
            "[batch, tokens], or as a bool [batch, 1, queries, keys]."
        )


@functools.cache
def _warn_no_weights() -> None:
    """Once a process: `output_attentions=True` gets no weights from this attention (as from SDPA's)."""
    warnings.warn("OasisCache's attention returns no attention weights: with output_attentions=True the outputs' "
                  "`attentions` stay empty (a sparse step's weights are not dense attention's either). For the "
                  "weights, generate with a DynamicCache and attn_implementation='eager'.", UserWarning, stacklevel=4)


def _check_given(module, key, value, given) -> None:
    """The attention reads the keys and values the cache holds, not the tensors it is called with: those must be the
    ones `OasisLayer.update` returned. A model that attends something else made of them (DiffLlama's halves of the
    values, JetMoe's repeated heads) would get other numbers silently; it is refused instead, at its first
    full-attention layer's first attention (`oasis_attention_eager` takes that layer's new tokens back)."""
    if given is not None and not (_same_view(key, given[0]) and _same_view(value, given[1])):
        raise NotImplementedError(
            f"{type(module).__name__} (layer {module.layer_idx}) attends keys or values other than those it wrote into "
            "the cache (it transforms them after `cache.update`); OasisCache attends what it holds, so it cannot "
            "serve this model. Use a DynamicCache."
        )


def _same_view(tensor, given) -> bool:
    """The tensor `update` returned, or a view of the same memory with its shape and strides (a compiled region
    between the two calls may hand over another tensor object for it)."""
    return tensor is given or (isinstance(tensor, torch.Tensor) and isinstance(given, torch.Tensor)
                               and tensor.data_ptr() == given.data_ptr() and tensor.shape == given.shape
                               and tensor.stride() == given.stride() and tensor.dtype == given.dtype)


@torch.compiler.disable  # host state and the package's kernels: a compiled layer calls it as it is
def oasis_attention_eager(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                          check_given: bool = True, **kwargs) -> tuple[torch.Tensor, None]:
    """`oasis_attention_forward` run as it is (also inside the `oasis::attend` op of a compiled decode step, which
    is given other tensor objects than the update's: `check_given=False` there)."""
    layer = peek_pending()
    if layer is None or not _serves(layer, module):
        return _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    given = getattr(_handoff, "given", None)
    clear_pending()
    try:
        layer.check_module(module)
        _check_call(module, attention_mask, dropout, kwargs)
        if check_given and layer.latent is None:  # (MLA: the module's expansion of its new latents is not read)
            _check_given(module, key, value, given)
        sinks = kwargs.get("s_aux")  # learned sinks (gpt-oss): `compute/sinks.py`
        sinks = None if sinks is None else check_sinks(sinks, query, module)
        softcap = check_softcap(kwargs.get("softcap"), module)
        pattern = None
        if attention_mask is not None and attention_mask.dim() == 4:  # (a multimodal prompt's image tokens, ...)
            pattern, attention_mask = attention_mask, from_pattern(attention_mask, layer.batch_size,
                                                                   layer.get_seq_length(), query.shape[2],
                                                                   layer.decodes(query.shape[2]))
    except (NotImplementedError, ValueError, RuntimeError):
        if given is not None and given[0] is not None:  # the layer's new tokens taken back: as before the forward
            layer.take_back(given[0].shape[-2])
        raise
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dense = None
    if layer.latent is not None:  # queries over the latent rows the layer stores (`compute/latent.py`)
        if not layer.decodes(query.shape[2]):  # (a dense forward: expanded where it fits)
            dense = latent.expanded_attention(module, query, layer.get_seq_length())
        query = latent.absorbed_query(module, query)
    try:
        # (no `sinks` / `pattern` / `dense` argument unless given: wrappers of `attend` with its older signature fit)
        extra = {k: v for k, v in (("sinks", sinks), ("pattern", pattern), ("softcap", softcap), ("dense", dense))
                 if v is not None}
        out = layer.attend(query, attention_mask, scale, **extra)
        if layer.latent is not None and dense is None:
            out = latent.latent_output(module, out)
        elif layer.value_dim is not None:  # (values stored padded to the keys' head size: their own channels)
            out = out[..., : layer.value_dim]
    except BaseException:
        if layer._cache.streams is not None:
            layer._cache.streams.quiesce()  # no prefetch of this cache runs on past the error
        raise
    return out.transpose(1, 2).contiguous(), None


def names_a_layer(module) -> bool:
    """Whether an attention module's `layer_idx` names the one layer it serves (not None, not Zamba2's -1)."""
    idx = getattr(module, "layer_idx", None)
    return isinstance(idx, int) and idx >= 0


def _serves(layer, module) -> bool:
    """Whether `module`'s attention call is the one `layer`'s update was for: the module names that layer, or names
    none and is the one its cache found for it (a shared block's module, told the layer at each call: Zamba; the
    layer updated just before is the one it was told)."""
    if names_a_layer(module):
        return module.layer_idx == layer.layer_idx
    return layer._cache._modules.get(layer.layer_idx) is module


def _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """Plain SDPA for layers that do not belong to an OasisCache, with the compact 2D mask expanded; several new
    tokens after a past whose mask was dropped (nothing hidden: `oasis_mask` notes their sizes) aligned to the bottom
    right."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if getattr(_handoff, "sees_all", None) is not None:
        if _handoff.sees_all is key and query.shape[2] == 1:  # a steady window step (`window.WindowLayer`)
            attention_mask = None
        _handoff.sees_all = None
    sinks, softcap = kwargs.get("s_aux"), check_softcap(kwargs.get("softcap"), module)
    if sinks is not None or softcap is not None:  # (a sliding layer with learned sinks, gpt-oss; capped, Gemma 2)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        sinks = None if sinks is None else check_sinks(sinks, query, module)
        return _explicit_scores_fallback(module, query, key, value, attention_mask, scale, sinks, window, softcap)
    if attention_mask is not None and attention_mask.dim() == 2:
        out = dense_causal_attention(query, key, value, attention_mask[:, : key.shape[2]], scale)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None and getattr(_handoff, "bottom_right", None) == (query.shape[2], key.shape[2]):
        return dense_causal_attention(query, key, value, None, scale).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _explicit_scores_fallback(module, query, key, value, attention_mask, scale, sinks, window=None, softcap=None):
    """`_sdpa_fallback` for a layer with learned sinks or soft-capping (`compute/sinks.py`): the mask transformers
    made for SDPA (bool `[B, 1, Qn, L]`, True: seen; or additive float), the compact 2D one, or none (causal, bottom
    right).
    `window`: the layer's sliding window (transformers' mask hides keys `window` or more positions back), so each
    query's scores need only the keys of its window."""
    if attention_mask is None or attention_mask.dim() == 2:
        visible = None if attention_mask is None else attention_mask[:, : key.shape[2]].to(torch.bool)
        out = attention_with_sinks(query, key, value, scale, sinks, visible=visible, softcap=softcap)
    else:
        mask = attention_mask[..., : key.shape[2]]
        seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # (-inf or dtype's min)
        out = attention_with_sinks(query, key, value, scale, sinks, mask=seen,
                                   window=window if isinstance(window, int) and window > 0 else None, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


compiled_ops.EAGER_ATTENTION[:] = [oasis_attention_eager]
