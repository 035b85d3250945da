"""A sliding-window layer whose decode steps can be captured: transformers' `DynamicSlidingWindowLayer` (gpt-oss,
Gemma 2-4, Cohere 2, ...: every other layer of many models; the cache keeps it on the device, bounded by its window)
with one change. Once its window is full, a one-token decode step writes in place into a ring of `window` tokens at a
fixed address — the oldest token shifted out, the new one written last — where transformers' layer makes a new
tensor each step (which no CUDA graph can replay). What the step returns and keeps is transformers' to the element:
the last `window` tokens in order, `keys` / `values` the last `window - 1` of them (views of the ring), the same
token count. Every other call (a prefill, several tokens, a reshaped batch, recording the past for assisted
decoding) is transformers' own update; the next steady step moves the window into a ring again.

A step is steady (`steady_step`) when one token comes, the window holds `window - 1` tokens in the ring's place,
and no padding token lies within it: the new token then sees every token of the window, so its attention needs no
mask (`attention.window_sees_all`), and a captured step replays with the window's new contents. (transformers' mask
for it reads the layer's token count on the host, which a replayed step would not advance.)
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from .compute.attention import window_sees_all


class WindowLayer(DynamicSlidingWindowLayer):
    """`DynamicSlidingWindowLayer` with steady decode steps in place. `ring`: `([2, B, Hkv, window, D],)` (keys,
    values), `([B, Hkv, window, Dk], [B, Hkv, window, Dv])` where their head sizes differ, or None; `keys` /
    `values` `[B, Hkv, window - 1, D]` are views of its last `window - 1` tokens while steady. `clear_from`: a
    callable giving the position from which every sequence's tokens are real (the owning cache's padding record,
    `control.Padding`), or None where not known."""

    not_recorded = ("ring", "_views", "clear_from")  # (the ring is made again at the next steady step)
    transformers_class = DynamicSlidingWindowLayer  # (what `as_transformers` makes)

    def __init__(self, sliding_window: int, clear_from=lambda: None, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.ring: torch.Tensor | None = None
        self._views = None  # (keys, values of the ring's last window - 1 tokens, the ring's whole keys and values)
        self.clear_from = clear_from

    @classmethod
    def of(cls, layer: DynamicSlidingWindowLayer, clear_from=lambda: None) -> "WindowLayer":
        """transformers' layer (its tokens, count and settings, copied) as a `WindowLayer`."""
        window = cls(sliding_window=layer.sliding_window, clear_from=clear_from)
        window.__dict__.update({k: copy.deepcopy(v) for k, v in vars(layer).items() if k not in cls.not_recorded})
        return window

    def reset(self) -> None:
        """Forget the window's tokens, its tensors released (made anew at the next update, for a batch of any size:
        transformers 5.17 zeroes them in place, and the next prefill appended to zeros of the old batch's size)."""
        super().reset()
        self.keys = self.values = self.ring = self._views = None
        self.is_initialized = False
        self.cumulative_length = 0

    def _full(self) -> bool:
        return self.is_initialized and not self.record_past and self.keys.shape[-2] == self.sliding_window - 1

    def _in_ring(self) -> bool:
        """`keys` / `values` are the ring's (no update of transformers' made them anew since)."""
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def _no_padding_after(self, length: int) -> bool:
        """No padding token among the window's tokens when the layer holds `length` tokens."""
        clear_from = self.clear_from()
        return clear_from is not None and clear_from <= length - self.sliding_window

    def steady_step(self) -> bool:
        """Whether the next one-token update is steady, so a captured step may replay it: the window full and in
        the ring, no padding token within it after the update."""
        return self._in_ring() and self._no_padding_after(self.cumulative_length + 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-2] != 1 or not self._full():
            return super().update(key_states, value_states, *args, **kwargs)
        if not self._in_ring():  # (a first steady step, or one after transformers' own update made new tensors)
            self._make_ring()
        for ring in self.ring:
            ring[..., :-1, :] = ring[..., 1:, :].clone()  # the oldest token out
        self._views[2][:, :, -1:] = key_states
        self._views[3][:, :, -1:] = value_states
        self.keys, self.values, keys, values = self._views
        self.cumulative_length += 1
        if self._no_padding_after(self.cumulative_length):
            window_sees_all(keys)  # (its attention: every token of the window, no mask)
        return keys, values

    def _make_ring(self) -> None:
        """The ring from the window's tokens: one `[2, B, Hkv, window, D]` tensor (shifted in one copy), or a keys'
        and a values' ring where their head sizes differ (MiMo-V2-Flash: 192 and 128)."""
        B, H, _, D = self.keys.shape
        shape, like = (B, H, self.sliding_window), dict(dtype=self.keys.dtype, device=self.keys.device)
        if self.values.shape[-1] == D:
            whole = torch.empty((2, *shape, D), **like)
            self.ring, key_ring, value_ring = (whole,), whole[0], whole[1]
        else:
            key_ring = torch.empty((*shape, D), **like)
            value_ring = torch.empty((*shape, self.values.shape[-1]), **like)
            self.ring = (key_ring, value_ring)
        key_ring[:, :, 1:] = self.keys
        value_ring[:, :, 1:] = self.values
        self._views = (key_ring[:, :, 1:], value_ring[:, :, 1:], key_ring, value_ring)

    def as_transformers(self) -> DynamicSlidingWindowLayer:
        """transformers' own layer (`transformers_class`) holding a copy of this one's tokens, count and settings
        (`OasisCache.to_dynamic_cache`)."""
        plain = self.transformers_class(sliding_window=self.sliding_window)
        plain.__dict__.update({k: copy.deepcopy(v) for k, v in vars(self).items()
                               if k not in (*self.not_recorded, "keys", "values")})
        if self.is_initialized:
            plain.keys, plain.values = self.keys.clone(), self.values.clone()
        return plain

    def advance_replayed_step(self) -> None:
        """The host effect of a steady update whose device work a captured step replayed."""
        self.cumulative_length += 1

    def state_addresses(self) -> tuple | None:
        """What a captured step reads and writes of this layer: the ring; None while the window is not in it."""
        return tuple(ring.data_ptr() for ring in self.ring) if self._in_ring() else None
