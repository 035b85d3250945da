"""An OasisCache put together for a model: its options (the few named ones and `advanced=`), the lookahead chosen
where none was named, its layers (an `OasisLayer` per full-attention layer, transformers' own or the package's
window and hybrid layers for the others), its draft ride-along, and whether its decode steps are captured or
compiled."""

from __future__ import annotations

import dataclasses
import difflib
import weakref
from collections.abc import Mapping

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from .. import compat
from ..compute import latent
from ..compute.attention import names_a_layer
from ..config import CAPTURE_CHECKED_MODEL_TYPES, OasisConfig
from ..hybrid import HybridLayer, HybridWindowLayer
from ..layer import OasisLayer
from ..memory.transfer import resolve_backend
from ..window import WindowLayer
from . import model_checks

# the options OasisCache takes by name (with `draft`, which is no field of the config); every other field of
# `OasisConfig` is an advanced one, given as `advanced={...}`
NAMED_OPTIONS = ("token_budget", "lookahead", "exact", "prefill_chunk_tokens", "host_dtype", "cuda_graph",
                 "compile_decode")
ADVANCED_OPTIONS = tuple(f.name for f in dataclasses.fields(OasisConfig) if f.name not in NAMED_OPTIONS)
_HF_KEPT_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def misplaced_options(misplaced: dict) -> TypeError:
    """The error for keywords OasisCache does not take by name: advanced ones (the spelling to use) or unknown ones
    (the closest known name)."""
    advanced = {name: value for name, value in misplaced.items() if name in ADVANCED_OPTIONS}
    if advanced:
        spelled = ", ".join(f"{name!r}: {value!r}" for name, value in advanced.items())
        return TypeError(f"OasisCache takes {', '.join(sorted(advanced))} among its advanced options: "
                         f"OasisCache(model, token_budget=..., advanced={{{spelled}}}). docs/options.md lists them.")
    return unknown_option(next(iter(misplaced)))


def unknown_option(name: str) -> TypeError:
    close = difflib.get_close_matches(name, sorted(NAMED_OPTIONS + ADVANCED_OPTIONS + ("draft",)), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return TypeError(f"OasisCache got an unknown option {name!r}.{hint} Every option: docs/options.md.")


def config_from(named: dict, advanced) -> OasisConfig:
    """The cache's `OasisConfig` from the named options and the `advanced` mapping (None: none), validated once."""
    if advanced is None:
        advanced = {}
    if not isinstance(advanced, Mapping):
        raise TypeError(f"advanced must be a dict of advanced options (e.g. advanced={{'block_size': 32}}), got "
                        f"{type(advanced).__name__}.")
    for name in advanced:
        if name in NAMED_OPTIONS or name == "draft":
            raise TypeError(f"{name} is an option of its own: OasisCache(model, {name}=..., advanced=...), not "
                            f"inside advanced.")
        if name not in ADVANCED_OPTIONS:
            raise unknown_option(name)
    if named.get("exact") is None:
        named = {name: value for name, value in named.items() if name != "exact"}  # (the config's default)
    return OasisConfig(**named, **advanced)


def cache_kwargs(options: dict) -> dict:
    """`OasisCache(model, **cache_kwargs(options))` for a flat dict of options (a command line's, a stored config's):
    the advanced ones nested under `advanced`, merged with an `advanced` dict already there."""
    named = {name: value for name, value in options.items() if name not in ADVANCED_OPTIONS}
    advanced = {**(named.pop("advanced", None) or {}),
                **{name: value for name, value in options.items() if name in ADVANCED_OPTIONS}}
    return {**named, "advanced": advanced} if advanced else named


def choose_lookahead(model, text_config, lookahead, draft, exact, why: dict):
    """`(lookahead, draft, exact)` as the cache runs them: the named ones, else eagle3 with a head (given or shipped
    for the model; then `exact` unless named: quality first) or none; `why` gets the reason in words."""
    if lookahead is None:
        lookahead, draft = default_lookahead(model, text_config, draft)
        if lookahead == "eagle3":
            exact = True if exact is None else exact
            why["lookahead"] = "picked: a draft head for this model was given or ships with the package"
        elif not on_an_accelerator(model):
            why["lookahead"] = "picked: on the CPU no transfer is there to hide, and 'none' is the fastest exact way"
        else:
            why["lookahead"] = ("picked: no draft head ships for this model; "
                                "python -m oasis_cache.draft.train trains one")
    elif lookahead == "eagle3" and draft is None:  # the head shipped for this model, when there is one
        from ..draft.bundled import bundled_head_for

        draft = bundled_head_for(model)
        if draft is not None:
            why["lookahead"] = "yours, with the head shipped for this model"
    return lookahead, draft, exact


def make_layers(cache, model, text_config) -> list:
    """A layer per decoder layer (see the module's docstring), or a NotImplementedError naming an unknown kind."""
    layers = []
    for layer_idx, (layer_type, kwargs) in enumerate(compat.layer_types_and_kwargs(text_config)):
        if layer_type == "full_attention":
            layers.append(OasisLayer(cache, layer_idx))
        elif layer_type == "hybrid":  # (keys and a linear-attention state in one layer: Falcon-H1)
            layers.append(HybridLayer(cache, layer_idx, **kwargs))
        elif layer_type == "hybrid_sliding":  # (a sliding window and a linear-attention state: Inkling)
            layers.append(HybridWindowLayer(clear_from=padding_reader(cache), **kwargs))
        elif layer_type != "chunked_attention" and compat.dynamic_layer_class(
                layer_type) is DynamicSlidingWindowLayer:  # (its steady steps in place)
            layers.append(WindowLayer(clear_from=padding_reader(cache), **kwargs))
        elif layer_type in _HF_KEPT_LAYER_TYPES or compat.holds_no_keys(layer_type):
            layers.append(compat.dynamic_layer_class(layer_type)(**kwargs))
        else:
            raise NotImplementedError(
                f"OasisCache does not support layer type {layer_type!r} (layer {layer_idx} of "
                f"{type(model).__name__}); supported: full_attention, hybrid and hybrid_sliding (keys and a "
                f"linear-attention state), plus {', '.join(_HF_KEPT_LAYER_TYPES)} and layers without keys and "
                "values (linear attention, convolutions), which transformers keeps."
            )
    return layers


def check_attention(model, text_config, layers: list, modules: dict, config: OasisConfig) -> str | None:
    """Refuse a model whose full-attention layers OasisCache cannot serve (no such layer, attention modules not
    found, not causal); set each layer's latent form (MLA). Returns what the attention does that compiled decode
    steps do not carry (learned sinks, soft-capping, latent rows, a shared block), or None."""
    oasis_layers = [layer.layer_idx for layer in layers if isinstance(layer, OasisLayer)]
    if not oasis_layers:
        model_checks.refuse_windows_wider_than_the_context(model, text_config,
                                                           compat.layer_types_and_kwargs(text_config))
        raise ValueError(
            f"{type(model).__name__} has no full-attention layer (its layers are sliding-window, chunked or "
            "linear attention), so there is nothing for OasisCache to offload: its cache is already bounded. Use "
            "a DynamicCache."
        )
    missing = [i for i in oasis_layers if i not in modules]
    if missing:
        raise NotImplementedError(
            f"Could not find the attention modules of layers {missing} in {type(model).__name__} (a module whose "
            "`layer_idx` names the layer, or one without a layer the decoder layer holds); OasisCache serves "
            "decoder models whose attention modules are transformers' own. Use a DynamicCache."
        )
    if any(getattr(modules[i], "is_causal", True) is False for i in oasis_layers):
        raise NotImplementedError(
            f"{type(model).__name__}'s attention is not causal (each token sees the later ones: an encoder, or a "
            "BERT-like model made without `is_decoder=True`); OasisCache serves causal decoders. Load it with "
            "`is_decoder=True` if it is meant to generate, or use a DynamicCache."
        )
    for i in oasis_layers:  # multi-head latent attention: the latent rows stored, attended absorbed
        layers[i].latent = latent.latent_dims(modules[i])
        if layers[i].latent is not None:
            latent.check_latent(modules[i])
    sinks = any(isinstance(getattr(modules[i], "sinks", None), torch.Tensor) for i in oasis_layers)
    capped = getattr(text_config, "attn_logit_softcapping", None) is not None
    shared = not all(names_a_layer(modules[i]) for i in oasis_layers)
    what = ("adds learned sinks" if sinks else "caps its scores (soft-capping)" if capped else
            "attends latent rows (MLA)" if any(layers[i].latent for i in oasis_layers) else
            "is told its layer at each call (a shared block's)" if shared else None)
    if what and config.compile_decode:  # (the torch attention: `compute/sinks.py`, `compute/latent.py`)
        raise ValueError(
            f"compile_decode=True: {type(model).__name__}'s attention {what}, which the compiled decode step does "
            "not carry. Drop compile_decode (its steps then run as they are)."
        )
    return what


def compile_layers(cache, model, modules: dict) -> list:
    """Where decode steps compile (now or later): the decoder layers' decode-sized calls wrapped to run compiled, and
    with `fuse_projections` their projections fused; returns the fused groups."""
    from .compiled_layers import CompiledDecode, decoder_layers_of

    wrapped = decoder_layers_of(model, modules.values())
    cache._installation.wrap_layers(wrapped, CompiledDecode)
    if not cache.config.fuse_projections:
        return []
    from .fused_projections import fuse

    cache._installation.fused = True
    return fuse(model, wrapped)


def default_lookahead(model, text_config, draft):
    """`(lookahead, draft)` when the user named no lookahead: eagle3 with the given head, or with a matching bundled
    one (full-attention models on an accelerator: on the CPU a step's blocks come from the same memory, no transfer
    is hidden, and the draft's ride-along only adds work), else none."""
    if draft is not None:
        return "eagle3", draft
    if on_an_accelerator(model) and all(layer_type == "full_attention" for layer_type, _ in compat.layer_types_and_kwargs(text_config)):
        from ..draft.bundled import bundled_head_for

        head = bundled_head_for(model)
        if head is not None:
            return "eagle3", head
    return "none", None


def on_an_accelerator(model) -> bool:
    """Whether the model's weights are on a device other than the CPU (where blocks cross a link from host memory)."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type not in ("cpu", "meta")


def attach_draft(model, cache, draft):
    """The eagle3 ride-along for `model`, with `draft` (a head, or what `load_eagle3` reads)."""
    from ..draft import Eagle3Head, load_eagle3
    from ..draft.lookahead import RideAlong

    if draft is None:
        raise ValueError(
            f"lookahead='eagle3' needs a draft head, and none shipped with oasis-cache was trained for this model "
            f"({type(model).__name__}). Pass draft=<Eagle3Head, checkpoint directory or hub id> (EAGLE-3 heads in the "
            f"EAGLE or vLLM speculators format load), or train one: `python -m oasis_cache.draft.train --target "
            f"<your model directory or hub id> --out <directory>` (docs in oasis_cache/draft/train.py); "
            f"lookahead='previous' needs no head."
        )
    if any(not isinstance(layer, OasisLayer) or isinstance(layer, HybridLayer) for layer in cache.layers):
        raise NotImplementedError("lookahead='eagle3' does not support hybrid models (sliding-window, linear-attention "
                                  "or Mamba layers: the draft row would enter their state) yet; use "
                                  "lookahead='previous'.")
    head = draft if isinstance(draft, Eagle3Head) else load_eagle3(draft, target_model=model)
    param = next(model.parameters())
    return RideAlong(model, cache, head.to(device=param.device, dtype=param.dtype).eval())


def padding_reader(cache):
    """For a `WindowLayer` of `cache`: the position from which every sequence's tokens are real (its padding
    record), or None where not known."""
    ref = weakref.ref(cache)

    def clear_from():
        owner = ref()
        return None if owner is None or owner.context.padding is None else owner.context.padding.clear_from
    return clear_from


def captured_steps_for(model, text_config, config: OasisConfig, rotary: str | None):
    """The cache's `CapturedSteps` (after `model.forward` was made to route to it), or None: `config.cuda_graph`
    resolved for this model (None: on where it is checked; True: on, or an error naming why it cannot be). `rotary`:
    `model_checks.rotary_scaled_by_length(text_config)`."""
    from .captured_step import CapturedSteps

    if config.cuda_graph is False:
        return None
    if rotary is not None:  # (its forward picks frequencies by its length: on the host in transformers' "dynamic"
        if config.cuda_graph is None:  # scaling, and in "longrope" up to 5.17 — a capture fails, a replay skips it)
            return None
        raise ValueError(f"cuda_graph=True cannot capture {type(model).__name__}'s decode steps: its rotary embedding "
                         f"({rotary!r} scaling) picks its frequencies by the length each forward reaches, which "
                         "transformers decides on the host and a replayed graph would not redo. Drop cuda_graph "
                         "(its steps then run eagerly) or use a static scaling.")
    devices = {p.device for p in model.parameters()}  # a graph is captured on one device's stream
    device = next(iter(devices)) if len(devices) == 1 else None
    on_cuda = device is not None and device.type == "cuda"
    if config.cuda_graph is None:
        if not (on_cuda and getattr(text_config, "model_type", None) in CAPTURE_CHECKED_MODEL_TYPES
                and resolve_backend(config.backend, device) == "triton"):
            return None
    elif not on_cuda:
        raise ValueError(f"cuda_graph=True replays decode steps as CUDA graphs, which needs the whole model on one CUDA "
                         f"device (model.to('cuda')); its parameters are on {sorted(map(str, devices))}. Drop "
                         f"cuda_graph (every step then runs eagerly where it cannot be captured).")
    elif resolve_backend(config.backend, device) != "triton":
        raise ValueError("cuda_graph=True needs the Triton backend (its gathers read pinned host memory from the "
                         "device; backend='torch' stages blocks through host copies, which a graph cannot record): "
                         "use backend='auto' with triton installed, or cuda_graph=False.")
    return CapturedSteps()
