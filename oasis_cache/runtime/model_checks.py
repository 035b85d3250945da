"""What a model must be for an OasisCache to serve it, read from the model and refused by name where it is not:
decoder-only, attention through transformers' interface, attention modules found per layer, causal; and the checks
a `DynamicCache` passes before it becomes an OasisCache."""

from __future__ import annotations

import torch

from ..compute.attention import names_a_layer

ATTENTION_NAME = "oasis"


def rotary_scaled_by_length(text_config) -> str | None:
    """The rotary scaling type (any layer kind's) whose frequencies follow the length a forward reaches, or None:
    transformers' "dynamic" ones (`dynamic_rope_update`: `if seq_len > max_seq_len_cached` on the host, then a new
    `inv_freq` buffer) and "longrope" (short or long factors by the forward's last position; on the host with a new
    buffer up to transformers 5.17, in place on the device later). Their decode steps are not captured, and a prompt
    in chunks would rotate its early chunks by a shorter length than one whole forward does, so such a model's
    prompt is prefilled whole."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return None
    for kind in (params, *(value for value in params.values() if isinstance(value, dict))):  # (or per layer kind)
        rope_type = kind.get("rope_type", kind.get("type"))
        if isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope"):
            return rope_type
    return None


def check_supported(model):
    """The text config, after refusing what OasisCache cannot serve (with the reason)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"OasisCache needs a transformers PreTrainedModel, got {type(model).__name__}.")
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError("OasisCache supports decoder-only models; encoder-decoder models are not supported.")
    text_config = config.get_text_config(decoder=True)
    # ("store": a layer keeps what its cache update returned for later layers or an assistant to read; "reuse": a
    # layer attends another layer's keys and values — that one is refused. Gemma 4 without shared layers stores only.)
    if getattr(text_config, "num_kv_shared_layers", 0) or any(
            mode not in (None, "store") for mode in (getattr(text_config, "kv_sharing_modes", None) or ())):
        raise NotImplementedError(
            f"{type(model).__name__} shares KV caches between layers, which OasisCache does not support."
        )
    if getattr(text_config, "cross_attention_layers", None):
        raise NotImplementedError(
            f"{type(model).__name__} has cross-attention layers (to an image's states), which OasisCache does not "
            "hold; use a DynamicCache."
        )
    if not model._can_set_attn_implementation():
        raise NotImplementedError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so the "
            f"'{ATTENTION_NAME}' attention cannot be installed."
        )
    return text_config


def refuse_windows_wider_than_the_context(model, text_config, kinds: list[tuple[str, dict]]) -> None:
    """A model whose sliding windows cover its whole context (Phi-3 / Phi-3.5's 128K variants: a window of 262,144
    tokens, 131,072 positions) attends every token: unbounded in fact, so it is refused with the way to full
    attention, not as a bounded cache. (Only where the layer kinds follow `sliding_window`: no `layer_types`.)
    `kinds`: `compat.layer_types_and_kwargs(text_config)`."""
    if getattr(text_config, "layer_types", None) is not None:
        return
    windows = [kwargs.get("sliding_window") for kind, kwargs in kinds if kind == "sliding_attention"]
    positions = getattr(text_config, "max_position_embeddings", None)
    if not windows or not isinstance(positions, int) or not all(isinstance(w, int) for w in windows):
        return
    if min(windows) >= positions:
        raise ValueError(
            f"{type(model).__name__}'s sliding windows ({min(windows)} tokens) cover its whole context "
            f"({positions} positions), so its layers attend every token: set `model.config.sliding_window = None` "
            "(the same outputs, as full attention) before making the OasisCache."
        )


def projects(module, heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether an attention `module`'s key and value projections are on `device` and give `heads` heads of
    `head_dim` (a layer may then be made ahead of its first update, `ForwardContext.size_for_prompt`)."""
    if module is None or getattr(module, "head_dim", head_dim) != head_dim:
        return False
    projections = [getattr(module, name, None) for name in ("k_proj", "v_proj")]
    return all(isinstance(p, torch.nn.Linear) and p.weight.device == device and p.out_features == heads * head_dim
               for p in projections)


def attention_modules(model, layer_count: int) -> dict:
    """`{layer_idx: attention module}` of the decoder: the module naming its layer (`layer_idx`), else for decoder
    layer i (of `layer_count`, in the model's list of them) an attention module it holds that names none (None, or
    Zamba2's -1): a shared block's, told the layer at each call (Zamba / Zamba2: one set of weights, tied, in a
    module object per layer or one object for several)."""
    found = {}
    for module in model.modules():
        if names_a_layer(module) and type(module).__name__.endswith("Attention") and module.layer_idx not in found:
            found[module.layer_idx] = module
    for blocks in model.modules():
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) == layer_count:
            for idx, block in enumerate(blocks):
                shared = next((m for m in block.modules() if type(m).__name__.endswith("Attention")
                               and hasattr(m, "layer_idx") and not names_a_layer(m)), None)
                if shared is not None and idx not in found:
                    found[idx] = shared
    return found


def from_legacy(model, pairs) -> "object":
    """A `DynamicCache` for `model` holding the legacy form's `(keys, values)` per layer."""
    from transformers import DynamicCache

    dynamic = DynamicCache(config=model.config)
    if len(pairs) != len(dynamic.layers):
        raise ValueError(f"the legacy cache holds {len(pairs)} layers; {type(model).__name__} has "
                         f"{len(dynamic.layers)}.")
    for idx, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) >= 2 and all(isinstance(t, torch.Tensor)
                                                                           for t in pair[:2])):
            raise TypeError(f"the legacy cache's layer {idx} is not a (keys, values) pair of tensors.")
        dynamic.layers[idx].update(pair[0], pair[1])
    return dynamic


def check_layers_fit(model, dynamic) -> None:
    """A ValueError naming the first layer of `dynamic` whose keys the model's attention could not have written: its
    KV heads, head size, dtype or device; sequences and tokens differing between layers."""
    text_config = model.config.get_text_config(decoder=True)
    modules = attention_modules(model, len(dynamic.layers))
    seen = None
    for idx, layer in enumerate(dynamic.layers):
        keys = getattr(layer, "keys", None)
        if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            continue
        module = modules.get(idx)
        param = next(module.parameters(), None) if module is not None else next(model.parameters())
        heads = getattr(module, "num_key_value_heads", None) or (
            getattr(text_config, "num_key_value_heads", None) if getattr(text_config, "kv_lora_rank", None) is None
            else None)
        head_dim = getattr(module, "head_dim", None) if getattr(text_config, "kv_lora_rank", None) is None else None
        found = (keys.shape[1], keys.shape[3], keys.dtype, keys.device)
        wanted = (heads or found[0], head_dim or found[1], param.dtype if param is not None else found[2],
                  param.device if param is not None else found[3])
        if found != wanted:
            raise ValueError(
                f"The cache's layer {idx} holds keys of {found[0]} KV heads x {found[1]} channels ({found[2]}, "
                f"{found[3]}), where {type(model).__name__}'s layer {idx} makes {wanted[0]} x {wanted[1]} "
                f"({wanted[2]}, {wanted[3]}): it was made by another model, or moved or cast since. Build it with "
                f"this model (or .to() the model or the cache's tensors first).")
        size = (keys.shape[0], layer.get_seq_length() if hasattr(layer, "get_seq_length") else keys.shape[2])
        if getattr(layer, "is_sliding", False):
            size = (size[0], None)  # (a window keeps its last tokens only)
        if seen is not None and (size[0] != seen[1][0] or (size[1] is not None and seen[1][1] is not None
                                                           and size[1] != seen[1][1])):
            raise ValueError(f"The cache's layers disagree: layer {seen[0]} holds {seen[1][0]} sequences x "
                             f"{seen[1][1]} tokens, layer {idx} {size[0]} x {size[1]}.")
        if seen is None or seen[1][1] is None:
            seen = (idx, size)
