"""A forward through an `OasisCache` is all or nothing: one that fails midway (an exception in a later layer, a
hook, an out-of-memory error, a KeyboardInterrupt) leaves every layer as it was before it, or, where that cannot be
done, leaves the cache refusing to serve until `cache.reset()`. Layers at different lengths would otherwise decode
the next call silently wrong (each layer's tokens at other positions).

`ForwardMarks(cache)` is taken before a forward writes anything; `undo()` after it failed:
- full-attention layers (`OasisLayer`) are cropped back to their marked length (host blocks brought back when the
  crop reaches into them), their slots forgotten (a failed step may have placed blocks whose gather never ran) and
  their prediction dropped;
- the batch's padding record and the block summaries' channel weights come back as marked;
- a draft head's ride-along starts over (its rows no longer follow the tokens);
- any other layer (a sliding window, a linear-attention or Mamba state) cannot be rolled back: if the forward
  changed one, or stopped inside a full-attention layer's own bookkeeping, the cache is marked broken instead.
"""

from __future__ import annotations

import torch


def _tensor_versions(layer) -> tuple:
    """What identifies the state of a layer transformers keeps: its tensors and their in-place version counters
    (every write moves one), its token count where it has one."""
    held = []
    for name, value in sorted(vars(layer).items()):
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for item in values:
            if isinstance(item, torch.Tensor):
                held.append((name, id(item), item._version))
            elif isinstance(item, (int, bool)):
                held.append((name, item))
    return tuple(held)


def _kinds(cache) -> tuple[list[int], dict]:
    """`(plain full-attention layers, {other layer: None})` of `cache`, found once per cache."""
    from .layer import OasisLayer

    kinds = cache.__dict__.get("_layer_kinds")
    if kinds is None or len(kinds[0]) + len(kinds[1]) != len(cache.layers):
        plain = [idx for idx, layer in enumerate(cache.layers) if type(layer) is OasisLayer]
        kinds = cache.__dict__["_layer_kinds"] = (plain, [i for i in range(len(cache.layers)) if i not in plain])
    return kinds[0], dict.fromkeys(kinds[1])


class ForwardMarks:
    """The state of `cache` before a forward (see the module's docstring)."""

    def __init__(self, cache, partial: bool = False):
        self.cache = cache
        self.partial = partial  # taken after the forward had run layers already (not routed by the model's forward)
        plain, self.others = _kinds(cache)
        # (every full-attention layer holds as many tokens as the first: checked before a forward, `_check_lengths`)
        length = cache.layers[plain[0]].get_seq_length() if plain else 0
        self.lengths = dict.fromkeys(plain, length)
        for idx in self.others:  # (a HybridLayer holds a state too: it is followed as any other stateful layer)
            self.others[idx] = _tensor_versions(cache.layers[idx])
        self.padding = cache.context.padding
        self.reshaped = cache.reshaped
        self.weights = {idx: cache.layers[idx].summaries.channel_weight for idx in plain
                        if cache.layers[idx].is_initialized}

    def changed_others(self) -> list[int]:
        """Layers other than plain full-attention ones that the forward changed."""
        return [idx for idx, mark in self.others.items() if _tensor_versions(self.cache.layers[idx]) != mark]

    def undo(self) -> str | None:
        """Roll the cache back to the marks; returns None, or why it cannot be (the cache is then left as it is,
        for the caller to mark broken)."""
        cache = self.cache
        if self.partial and any(idx < cache._first_oasis_layer for idx in self.others):
            return "layers before the first full-attention one had run already, which cannot be rolled back"
        changed = self.changed_others()
        if changed:
            return (f"the failed forward had changed layer {changed[0]} ({type(cache.layers[changed[0]]).__name__}), "
                    "whose state cannot be rolled back")
        for idx, length in self.lengths.items():
            layer = cache.layers[idx]
            if layer.is_initialized and layer.summaries.num_blocks != layer.pool.num_blocks:
                return f"the forward stopped inside layer {idx}'s own bookkeeping"
        if cache.streams is not None:
            cache.streams.synchronize()
            cache.transfer.wait_host_reads()
        touched = False
        for idx, length in self.lengths.items():
            layer = cache.layers[idx]
            if not layer.is_initialized:
                continue
            held = layer.get_seq_length()
            if length == 0:  # (made by the failed forward, or empty: made anew by the next)
                layer.reset()
                touched = True
                continue
            if held > length:
                layer.take_back(held - length)
                touched = True
            elif held < length:
                return f"layer {idx} holds fewer tokens ({held}) than before the forward ({length})"
            layer.slot_map.forget_blocks_from(0)  # (a placement whose gather never ran must not be read)
            layer.predicted = False
            layer.resident_kv = None
            if idx in self.weights:
                layer.summaries.channel_weight = self.weights[idx]
        cache.context.padding, cache.reshaped = self.padding, self.reshaped
        if cache.ride_along is not None and touched:
            cache.ride_along.reset()
        if cache.captured_steps is not None:
            cache.captured_steps.drop()
        return None
