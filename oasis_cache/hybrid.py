"""Layers that also hold a linear-attention state (transformers' layer types "hybrid": Falcon-H1, Zaya, Inkling's
full-attention layers; "hybrid_sliding": Inkling's sliding ones): each decoder layer runs attention and a Mamba or
linear-attention mixer side by side and caches both in one layer object.

`HybridLayer` is an `OasisLayer` for the keys and values (host pool, summaries, sparse decode) and transformers'
`LinearAttentionLayer` for the state (convolution and recurrent states of fixed size, on the device), as
transformers' own `LinearAttentionAndFullAttentionLayer` is a `DynamicLayer` and a `LinearAttentionLayer`. The
cache's linear-attention calls (`update_conv_state`, `has_previous_state`, `activate_past_recording`, ...) find it
as the linear-attention layer they ask for; every call that reshapes the cache (beam search, several returned
sequences, a crop, a reset) reshapes both halves; copies, forks and conversions carry the state with the keys.
`HybridWindowLayer` is the same for a sliding-window layer: a `WindowLayer` (`window.py`) and the state, as
transformers' `LinearAttentionAndSlidingWindowAttentionLayer`.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer

from .layer import OasisLayer
from .window import WindowLayer


def state_fields(layer: LinearAttentionLayer) -> dict:
    """What the linear-attention half of `layer` holds (its states, flags, token count, past-recording settings),
    by attribute name: the fields transformers' `LinearAttentionLayer` sets, never the attention half's."""
    names = set(vars(LinearAttentionLayer(number_of_states=layer.number_of_states))) - {"device", "dtype"}
    names |= {"recurrent_states_to_keep", "recurrent_states_history"}  # (set by `activate_past_recording`)
    return {name: value for name, value in vars(layer).items() if name in names}


def forget_state(layer: LinearAttentionLayer) -> None:
    """`layer`'s linear-attention state forgotten, its tensors released (made anew at the next update, at the size of
    the batch that comes: transformers' `reset` zeroes them in place, and a batch of another size then fails); a
    past being recorded for assisted decoding is still recorded."""
    recording = {k: v for k, v in vars(layer).items() if k in ("record_past", "recurrent_states_to_keep")}
    LinearAttentionLayer.__init__(layer, number_of_states=layer.number_of_states)
    layer.__dict__.update(recording)
    if layer.record_past:
        layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}


class _StateBeside:
    """What a layer holding keys (its class `_keys`: `OasisLayer` or `WindowLayer`) and transformers'
    linear-attention state does with both halves: first in the subclasses' bases, before the keys' class and
    `LinearAttentionLayer` (whose methods of the same names serve one half each)."""

    _keys: type = OasisLayer

    @property
    def is_croppable(self) -> bool:
        """transformers' answer for the state (5.17: not once a recurrent state is held; later: always), the keys
        being croppable."""
        linear = getattr(LinearAttentionLayer, "is_croppable", True)
        return bool(linear.fget(self) if isinstance(linear, property) else linear)

    def lazy_initialization(self, *args, **kwargs) -> None:
        """The keys' storage (called with keys and values) or a state (called by keyword, as transformers' linear
        layer calls it)."""
        if args:
            self._keys.lazy_initialization(self, *args, **kwargs)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        """Forget the keys and the state (memory released: a new batch may have another size); a cache recording
        its past for assisted decoding keeps recording."""
        self._keys.reset(self)
        forget_state(self)

    def crop(self, tokens_to_remove: int) -> None:
        """As transformers' hybrid layers: the state rolls back through its recorded past (assisted decoding), the
        keys as the keys' class crops them."""
        tokens_to_remove = int(tokens_to_remove)
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._keys.crop(self, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_states(beam_idx)
        self._keys.reorder_cache(self, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = next((t.shape[0] for t in self._states()), None)
        if batch is not None:
            self._index_states(torch.arange(batch).repeat_interleave(repeats))
        self._keys.batch_repeat_interleave(self, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_states(torch.as_tensor(indices))
        self._keys.batch_select_indices(self, indices)

    def _index_states(self, indices: torch.Tensor) -> None:
        """Sequence i's state becomes old sequence `indices[i]`'s (new tensors: a batch of another size)."""
        for states in (self.conv_states, self.recurrent_states):
            for i, state in states.items():
                if isinstance(state, torch.Tensor):
                    states[i] = state.index_select(0, indices.to(state.device))

    def _states(self) -> list[torch.Tensor]:
        states = (*self.conv_states.values(), *self.recurrent_states.values())
        return [t for t in states if isinstance(t, torch.Tensor)]

    def _state_addresses(self) -> tuple[tuple, int | None]:
        """The state tensors' addresses and the token count's (5.24+: a tensor; else None): what a captured step
        writes of the state."""
        length = getattr(self, "cumulative_length_linear", None)
        return tuple(t.data_ptr() for t in self._states()), (length.data_ptr() if isinstance(length, torch.Tensor)
                                                               else None)


class HybridLayer(_StateBeside, OasisLayer, LinearAttentionLayer):
    """An `OasisLayer` whose layer also keeps transformers' linear-attention state (`conv_states`,
    `recurrent_states`: dicts of `number_of_states` tensors, `[B, ...]`, updated in place by the model's mixer)."""

    def __init__(self, cache, layer_idx: int, number_of_states: int = 1, **kwargs):
        OasisLayer.__init__(self, cache, layer_idx)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def take_states_from(self, layer: LinearAttentionLayer) -> None:
        """The state of transformers' `layer` (a `LinearAttentionAndFullAttentionLayer`, say), copied."""
        self.__dict__.update(copy.deepcopy(state_fields(layer)))

    def give_states_to(self, layer: LinearAttentionLayer) -> None:
        """This layer's state copied into transformers' `layer`."""
        layer.__dict__.update(copy.deepcopy(state_fields(self)))

    def device_nbytes(self) -> dict:
        held = OasisLayer.device_nbytes(self)
        if held:
            held["linear_state"] = sum(t.numel() * t.element_size() for t in self._states())
        return held

    def state_stamps(self) -> tuple:
        """The pools' stamps and the state tensors' addresses: the state is updated in place (a new prefill of
        another shape makes new tensors)."""
        return (*OasisLayer.state_stamps(self), *self._state_addresses())

    def state_tensors(self) -> list[torch.Tensor]:
        return OasisLayer.state_tensors(self) + self._states()

    def __repr__(self):
        return f"HybridLayer(layer_idx={self.layer_idx}, tokens={self.get_seq_length()})"


class HybridWindowLayer(_StateBeside, WindowLayer, LinearAttentionLayer):
    """A `WindowLayer` (transformers' sliding-window layer, its steady steps in a ring) whose layer also keeps a
    linear-attention state, as `HybridLayer` for full attention. Both halves share transformers' `record_past`."""

    _keys = WindowLayer
    transformers_class = LinearAttentionAndSlidingWindowAttentionLayer  # (`WindowLayer.of` / `as_transformers`: the
    # state's fields travel with the window's; made with one state, then given the source's `number_of_states`)

    def __init__(self, sliding_window: int, clear_from=lambda: None, number_of_states: int = 1, **kwargs):
        WindowLayer.__init__(self, sliding_window=sliding_window, clear_from=clear_from)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def state_addresses(self) -> tuple | None:
        """The ring's address and the state's (updated in place); None while the window is not in its ring or the
        state records its past."""
        ring = WindowLayer.state_addresses(self)
        if ring is None or self.record_past:
            return None
        states, length = self._state_addresses()
        return (*ring, *states, length)
