"""What a captured decode step needs to know of the cache, on the host: whether the next one-token forward may be
replayed ("steady": no block completes; "completing": one does), what a captured graph depends on beyond tensor
contents (`replay_signature`), and the host effects of a replayed step (`advance_replayed_step`)."""

from __future__ import annotations

from .. import compat
from ..layer import OasisLayer
from ..window import WindowLayer
from .compiled_layers import compiles_decode  # noqa: F401  (part of what a captured step asks)


def replayable_step(cache) -> str | None:
    """Which captured step the next one-token decode forward may replay on a CUDA cache (its batch's padding
    recorded and in complete blocks, `padding_covers`):
    "steady", "completing" (one block completes: with the Triton backend, whose offload reads the block number
    on the device), or None (the forward runs eagerly)."""
    layer = cache.layers[cache._first_oasis_layer]
    if not (layer.is_initialized and layer.device.type == "cuda"):
        return None
    kind = step_kind(cache)
    return None if kind == "completing" and not layer.use_kernels else kind


def step_kind(cache) -> str | None:
    """What `replayable_step` answers but for the device and backend (CPU tests ask it): "steady", "completing",
    or None (the next one-token decode forward must run eagerly)."""
    layer = cache.layers[cache._first_oasis_layer]
    # (summaries' channels are chosen at the first decode step, for every layer at once: it runs eagerly)
    if not (layer.is_initialized and _decode_step_of_fixed_shapes(cache) and layer.summaries.channels_fixed
            and cache.context.padding_covers(layer.pool.num_blocks)):
        return None
    if cache.remote_tier is not None and not all(  # admitted: only deferred prefetches keep the store out of it
            other.predicted and (other.pool.remote is None or other.pool.remote.deferred) for other in cache.layers):
        return None
    return "completing" if layer.completes_block() else "steady"


def steady_step(cache) -> bool:
    """Whether the next one-token decode forward is a steady step (host state only): it decodes sparsely and
    completes no block, on a cache of full-attention layers (and linear-attention ones, updated in place, and
    sliding windows in a steady step: `_replays`), outside measurement mode, with a riding draft
    only once the head's call runs on static buffers (`RideAlong.replayable`) — every shape, buffer and host
    decision is that of the step before."""
    return _decode_step_of_fixed_shapes(cache) and not cache.layers[cache._first_oasis_layer].completes_block()


def completing_step(cache) -> bool:
    """Whether the next one-token decode forward completes exactly one block in an otherwise steady step: its
    offload, summaries and recent tokens move by the same operators at every block (`prepare_step` makes room
    first); the block count advances on the device."""
    return _decode_step_of_fixed_shapes(cache) and cache.layers[cache._first_oasis_layer].completes_block()


def _decode_step_of_fixed_shapes(cache) -> bool:
    if cache.measure or cache.record_selection or cache.reshaped:
        return False  # (beam search and assisted decoding reshape the cache every step: each would recapture)
    layer = cache.layers[cache._first_oasis_layer]
    return (layer.is_initialized and layer.decodes(1) and layer.recent.in_region
            and layer.recent.num_tokens + 1 <= cache.config.block_size
            and all(not compat.records_state_history(other) if isinstance(other, OasisLayer) else
                    _replays(other) for other in cache.layers)
            and (cache.ride_along is None or cache.ride_along.replayable(layer.batch_size)))


def prepare_step(cache, kind: str) -> None:
    """Before a captured step of `kind` is captured or replayed (host only): a completing step finds room for its
    block in every pool (capacities that grow here change the replay signature: the step is captured anew)."""
    if kind == "completing":
        for layer in cache.layers:
            if isinstance(layer, OasisLayer):  # (a linear-attention layer's state has no blocks)
                layer.prepare_completion()


def replay_signature(cache) -> tuple:
    """What a captured step depends on beyond tensor contents: every layer's prediction flag, fetch cap and state
    tensors (their pools' stamps, `pools/stamped.py`: they change when a capacity grows), its block count while
    it is small enough to decide the selection's shapes (NB <= slots: every block selected), the cache's device
    counters and address tables, the padding record's tensors (addresses and shape), the state tensors' addresses
    of linear-attention layers (`compat.state_addresses`), for a layer admitted from a
    store whether its local pool holds blocks yet and its deferred records' tensors, whether the layers run
    compiled (`compiles_decode`), and the model's weights' addresses and modules' settings at the last prefill.
    Equal signatures: the graph captured under one is valid under the other — past `slots` blocks a completed
    block does not invalidate it (selection reads the block count on the device)."""
    cfg, of_length = cache.config, {}  # (what depends on the block count and length alone, once per value)

    def of(layer):  # (the fetch cap after a block completes too: a completing step's prefetch uses it)
        NB, pool, length = layer.pool.num_blocks, layer.pool, layer.get_seq_length()
        counted = of_length.get((NB, length))
        if counted is None:  # the step's and its prediction's blocks to attend: all of them or not
            counted = of_length[NB, length] = (NB if NB <= cfg.slots else None, cfg.max_fetch(NB),
                                               cfg.max_fetch(NB + 1), layer.fits_budget(1), layer.fits_budget(2))
        remote = () if pool.remote is None else (  # an admitted layer: its local pool read or not, its records
            NB > pool.first_block, tuple(t.data_ptr() for t in pool.remote.pending_tensors()))
        return counted, layer.predicted, layer.state_stamps(), remote
    layers = tuple(of(layer) for layer in cache.layers if isinstance(layer, OasisLayer) and layer.is_initialized)
    clocks = tuple(clock.data_ptr() for clock, _ in cache.context.device_clocks.values())
    counts = cache.counters.device_counts(cache.layers[cache._first_oasis_layer].device).data_ptr()
    riding = tuple(t.data_ptr() for t in cache.ride_along.state_tensors()) if cache.ride_along is not None else ()
    padding = cache.context.padding  # a step without a mask reads the record's tensors (a new prefill makes new ones)
    padded = () if padding is None or padding.tokens is None else (
        padding.tokens.data_ptr(), tuple(padding.tokens.shape), padding.first.data_ptr())
    kept = tuple(layer.state_addresses() if isinstance(layer, WindowLayer) else compat.state_addresses(layer)
                 for layer in cache.layers if not isinstance(layer, OasisLayer))
    return (layers, kept, clocks, counts, cache.context.transfer.address_tables() if cache.context.transfer else (), riding,
            padded, compiles_decode(cache), cache._model_as_run)


def prepare_capture(cache) -> None:
    """Before a step is captured: compute joins the side stream, so that the graph need not wait on events
    recorded outside it (pending prefetches, offloads)."""
    cache.context.streams.synchronize()
    cache.context.streams.forget_side_work()
    cache.context.transfer.prepare_capture([layer.pool for layer in cache.layers if isinstance(layer, OasisLayer)])


def advance_replayed_step(cache, kind: str = "steady") -> None:
    """The host effects of a one-token decode step (`kind`: "steady" or "completing", `replayable_step`), after
    its captured device work was replayed: what the eager step's Python does (`tests/runtime/test_captured_step.py`
    compares)."""
    for key, (clock, value) in cache.context.device_clocks.items():
        if value == cache.decode_clock:  # the captured step advanced this device clock by one
            cache.context.device_clocks[key] = (clock, value + 1)
    cache.decode_clock += 1
    counters = cache.counters
    counters.decode_steps += 1
    counters.decode_tokens += 1
    riding = 0 if cache.ride_along is None else 1  # the draft row's key stood in the recent region
    for layer in cache.layers:
        if isinstance(layer, WindowLayer):
            layer.advance_replayed_step()
        if not isinstance(layer, OasisLayer):  # (a linear-attention state: the replay updated it in place)
            continue
        layer.recent.num_tokens += 1
        counters.record_layer_step(layer.batch_size * layer.num_kv_heads, layer.recent.num_tokens + riding)
        if kind == "completing":
            layer.advance_replayed_completion()
    if cache.ride_along is not None:
        cache.ride_along.advance_replayed_step()
def _replays(layer) -> bool:
    """Whether a layer transformers keeps lets the next one-token step be captured: a window in a steady step, a
    linear-attention state updated in place, a layer holding nothing (`compat.state_addresses`)."""
    if isinstance(layer, WindowLayer):
        return layer.steady_step()
    return compat.state_addresses(layer) is not None


