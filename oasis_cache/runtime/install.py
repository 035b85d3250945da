"""What OasisCaches install on a model, in one place, and give back when the model's last cache is closed or
collected — the model then runs as it did before it had one:

- the attention implementation "oasis" on every config of the model (plain SDPA with any other cache; the previous
  implementations are set back);
- `model.forward`: an instance attribute routing calls that carry an OasisCache (`compute/captured_step.
  CapturedForward`; removed, or the instance attribute that was there put back);
- the decoder layers' `forward` wrappers of compiled decode steps (`compute/compiled_layers.CompiledDecode`) and the
  fused projection weights (`compute/fused_projections`: the same parameter objects, their own storage again).

Nothing of torch is changed; a draft head's hooks are its cache's own (`draft/lookahead.RideAlong.remove`).
"""

from __future__ import annotations

import weakref

_MISSING = object()
_INSTALLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> Installation


def _configs(model) -> list:
    """Every distinct config object the model's modules hold (a multimodal model's towers hold their own)."""
    seen, found = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            found.append(config)
    return found


class Installation:
    """What is on one model and what was there before (see the module's docstring)."""

    def __init__(self, model, attention: str):
        self.attention_before = [(config, config._attn_implementation) for config in _configs(model)]
        self.forward_before = model.__dict__.get("forward", _MISSING)
        self.layers_before: list = []  # (layer, its `forward` instance attribute before, or _MISSING)
        self.fused = False
        self.users: set[int] = set()  # ids of the live caches that use it
        model.set_attn_implementation(attention)

    def wrap_layers(self, layers, wrapper) -> None:
        """Give each of `layers` its `wrapper(layer)` as `forward` (once)."""
        for layer in layers:
            if not isinstance(layer.__dict__.get("forward"), wrapper):
                self.layers_before.append((layer, layer.__dict__.get("forward", _MISSING)))
                layer.forward = wrapper(layer)

    def remove(self, model) -> None:
        from .fused_projections import unfuse

        if self.fused:
            unfuse(model)
        for layer, before in reversed(self.layers_before):
            _put_back(layer, "forward", before)
        _put_back(model, "forward", self.forward_before)
        for config, before in self.attention_before:
            config._attn_implementation = before


def _put_back(obj, name: str, before) -> None:
    if before is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = before


def install(model, cache, attention: str) -> Installation:
    """The model's installation (made at its first cache: the attention set, the forward routed), `cache` counted
    among its users until `release(model, id(cache))` — at `cache.close()`, or when the cache is collected."""
    from .routing import CapturedForward

    installed = _INSTALLED.get(model)
    if installed is None:
        installed = _INSTALLED[model] = Installation(model, attention)
        if not isinstance(model.__dict__.get("forward"), CapturedForward):
            model.forward = CapturedForward(model)
    elif model.config._attn_implementation != attention:
        model.set_attn_implementation(attention)  # (switched back by its user while a cache lived: as a new cache does)
    installed.users.add(id(cache))
    return installed


def release(model_ref, cache_id: int) -> None:
    """`cache_id` no longer uses its model's installation; the last user's release gives the model back."""
    model = model_ref()
    installed = _INSTALLED.get(model) if model is not None else None
    if installed is None:
        return
    installed.users.discard(cache_id)
    if not installed.users:
        del _INSTALLED[model]
        installed.remove(model)


def installed_on(model) -> Installation | None:
    return _INSTALLED.get(model)
