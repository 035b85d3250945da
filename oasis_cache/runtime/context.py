"""What the layers of an OasisCache share during a forward, apart from the cache's own bookkeeping: the device
transfers (engine and streams, made at the first forward), the batch's padding record, values every layer of one
forward uses (built by the first that asks), the device clocks of the working sets' LRU, and a chunked prefill's
residency (the prompt's keys and values kept on the device, or one buffer for a chunk's past). A layer reaches it
as `cache.context`."""

from __future__ import annotations

import weakref

import torch

from ..compute.sparse import new_token_bias
from ..control import Padding, StepVisibility, sink_blocks, step_visibility
from ..layer import OasisLayer
from ..memory import TransferEngine
from ..memory.device_memory import device_room
from ..memory.host_memory import available_host_bytes, check_host_room
from ..memory.streams import PrefetchStreams
from ..memory.transfer import resolve_backend
from . import model_checks


class ForwardContext:
    """One cache's forward state shared by its layers (see the module's docstring); `first_layer`: the index of its
    first full-attention layer."""

    def __init__(self, cache, first_layer: int):
        self.cache = weakref.proxy(cache)  # (the cache owns its context: no cycle to wait on the collector for)
        # the batch's padding from the last multi-token forward's mask (`control.Padding`), which one-token decode
        # steps called without a mask (captured steps) read; None: unknown
        self.padding: Padding | None = None
        self.first_layer = first_layer  # the first full-attention layer: where a forward's bookkeeping happens
        self.transfer: TransferEngine | None = None
        self.streams: PrefetchStreams | None = None
        self.memo: dict[tuple, object] = {}  # what the layers of the current forward share, built once
        self.device_clocks: dict[str, tuple[torch.Tensor, int]] = {}  # device -> (clock `[1]`, value it holds)
        self.prefill_tokens = None  # tokens of the prompt being prefilled in chunks (`runtime/routing.py`)
        self.prefill_resident = None  # its tokens while its keys and values stay on the device, False: they do not
        self.prefill_past = None  # while they do not: one buffer for a chunk's past, every layer's (`past_buffer`)

    def new_forward(self) -> None:
        """At a forward's first full-attention layer: what the layers of the last one shared is dropped."""
        self.memo = {}

    def size_for_prompt(self, key_states: torch.Tensor) -> None:
        """At each chunk of a prompt prefilled in chunks, before the first full-attention layer runs (a no-op after the
        first): every full-attention layer made and sized for the whole prompt (`OasisLayer.reserve_for_prompt`) and,
        where the prompt's keys and values do not stay on the device, the buffer for a chunk's past
        (`past_buffer`) — all at once, before the chunk's activations: made layer by layer among them, these tensors
        left free memory split in the allocator's segments. A layer is made ahead only where its attention module's
        projections are on the keys' device and give their heads and head size (else it is made at its first update
        and sized at the next chunk's start); one made ahead for keys of another shape is made again at its update
        (`OasisLayer.update`)."""
        B, H, _, D = key_states.shape
        for idx, layer in enumerate(self.cache.layers):
            if not isinstance(layer, OasisLayer):
                continue
            if not layer.is_initialized and model_checks.projects(self.cache._modules.get(idx), H, D, key_states.device):
                layer.lazy_initialization(key_states[:, :, :0], key_states[:, :, :0])
            if layer.is_initialized:
                layer.reserve_for_prompt(self.prefill_tokens)
        if self.prefill_resident is False:
            self.past_buffer(key_states[None], 0)

    def resident_room(self, tokens: int, key_states: torch.Tensor) -> int | bool:
        """At the first chunk of a prompt prefilled in chunks: `tokens` (its keys and values stay on the device until
        the last chunk, `OasisLayer._attend_resident`: a chunk then reads the past there, not from host memory) when
        every full-attention layer's `[2, B, Hkv, tokens, D]` fits in half the device memory this process may still
        take; else False (each chunk reads the past back from the host pool, as any later dense forward does)."""
        if not self.cache.config.resident_prefill:
            return False
        B, H, _, D = key_states.shape
        layers = sum(isinstance(layer, OasisLayer) for layer in self.cache.layers)
        needed = layers * 2 * B * H * tokens * D * key_states.element_size()
        device = key_states.device
        if device.type == "cuda":
            room = device_room(device)
        else:
            room = available_host_bytes() or 0  # (the host pools are counted there too: they are in host memory)
        return tokens if needed <= room // 2 else False

    def past_buffer(self, like: torch.Tensor, tokens: int) -> torch.Tensor:
        """A device buffer `[2, B, Hkv, tokens, D]` (B, Hkv, D, dtype and device those of `like`, a layer's
        `[2, B, Hkv, r, D]`) for a dense forward's past read from host memory (`OasisLayer._past_kv`). While a prompt
        is prefilled in chunks whose keys and values do not stay on the device, the first `tokens` positions of one
        buffer sized for the whole prompt, shared by every layer and chunk (each layer's attention has read it before
        the next layer writes it: one stream): a new past of a larger size at each chunk and layer left the
        allocator's segments split (Qwen3-8B, 32K x 8 under a 24 GiB cap: 2.5 GiB free in split segments, out of
        memory). Else a new one."""
        _, B, H, _, D = like.shape
        if self.prefill_tokens and self.prefill_resident is False and tokens <= self.prefill_tokens:
            shape = (2, B, H, self.prefill_tokens, D)
            past = self.prefill_past
            if past is None or past.shape != shape or past.dtype != like.dtype or past.device != like.device:
                self.prefill_past = None  # (a layer of other heads: its own buffer, the first dropped first)
                past = self.prefill_past = torch.empty(shape, dtype=like.dtype, device=like.device)
            return past[:, :, :, :tokens]
        return torch.empty((2, B, H, tokens, D), dtype=like.dtype, device=like.device)

    def start_engine(self, device) -> None:
        self.streams = PrefetchStreams(device, measure=self.cache.measure)
        self.transfer = TransferEngine(self.cache.config.backend, device, self.streams, self.cache.config.gather_programs)

    def check_host_room(self, new_tokens: int, key_states: torch.Tensor) -> None:
        """Before a dense forward writes anything: refuse it (MemoryError with the sizes) when the host pools of all
        full-attention layers cannot grow to hold its tokens (`memory.host_memory`)."""
        layers = [layer for layer in self.cache.layers if isinstance(layer, OasisLayer)]
        needed = sum(layer.host_bytes_for(new_tokens, key_states) for layer in layers)
        if needed:
            B, H, _, D = key_states.shape
            tokens = self.cache.get_seq_length(self.cache._first_oasis_layer) + new_tokens
            held = self.cache.config.host_dtype
            check_host_room(needed, f"the host pool of {len(layers)} layers for {tokens} tokens x {B} sequences ({H} "
                                    f"KV heads of {D}, {key_states.dtype}"
                                    + (f" held as {held})" if held else "; host_dtype='fp8' or 'int4' would hold "
                                       "them in half or about a quarter of bf16's bytes)"))

    def backend_for(self, device: torch.device) -> str:
        return resolve_backend(self.cache.config.backend, device)

    def shared(self, key: tuple, build):
        """A value every layer of the current forward uses: built by the first layer that asks (`key` names it and
        includes the device: layers may sit on different devices)."""
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = build()
        return value

    def step_visibility(self, visible: torch.Tensor | None, layer: OasisLayer, decode: bool = False) -> StepVisibility:
        """Block visibility of the current forward, once per number of complete blocks (before and after this
        forward's offload), as wide as the summaries' capacity (the block count read on the device). A decode step
        (`decode`) called without a mask — a captured step is — reads the batch's recorded padding once every
        padding token is in a complete block (`padding_covers`): fixed shapes, what a captured step replays. A mask
        given is read, as HF reads it."""
        cfg, num_blocks, summaries = self.cache.config, layer.pool.num_blocks, layer.summaries
        width = summaries.capacity_blocks
        padding = self.padding if decode and visible is None and self.padding_covers(num_blocks) else None
        return self.shared(("visibility", num_blocks, width, padding is not None, str(layer.device)),
                            lambda: step_visibility(visible, layer.batch_size, num_blocks, summaries.count, width,
                                                    cfg.block_size, cfg.sink_tokens, cfg.num_recent_blocks,
                                                    layer.device, padding))

    def sink_blocks(self, layer: OasisLayer) -> torch.Tensor | None:
        """`control/visibility.sink_blocks` of the batch's recorded padding, once per forward."""
        cfg = self.cache.config
        return self.shared(("sinks", str(layer.device)), lambda: sink_blocks(
            self.padding, layer.batch_size, cfg.sink_tokens, cfg.block_size, layer.device))

    def note_padding(self, visible: torch.Tensor | None, layer: OasisLayer) -> None:
        """After a forward of several tokens (first full-attention layer; a prefill chunk, dense, or a short one that
        decodes sparsely, e.g. `prefill_chunk_size`'s last chunk or assisted decoding's check): keep its mask's padding
        for the one-token steps that follow (one host sync; not in a one-token step)."""
        self.padding = Padding.of(visible, layer.batch_size, layer.device)

    def padding_covers(self, num_blocks: int) -> bool:
        """Whether a decode step with `num_blocks` complete blocks may be called without its mask (a captured step
        is): the batch's padding is recorded and every padding token lies in a complete block. Its decode masks are
        then taken to extend the prompt's with ones, as `generate`'s do."""
        padding = self.padding
        return padding is not None and padding.clear_from <= num_blocks * self.cache.config.block_size

    def new_token_bias(self, num_queries: int, group: int, length: int, slot_tokens: int, count: torch.Tensor,
                       dtype: torch.dtype, device) -> torch.Tensor:
        """`compute.sparse.new_token_bias`, built once per forward for every layer (torch attention path)."""
        def build():
            return new_token_bias(num_queries, group, length, slot_tokens, count, dtype, device)
        return self.shared(("new-token bias", num_queries, group, length, slot_tokens, dtype, str(device)), build)

    def recent_visibility(self, view: StepVisibility, num_recent: int, count: torch.Tensor, capacity: int,
                          device) -> torch.Tensor:
        """`[B or 1, 1, R]` bool, the mask of the recent-token region (`R` = `capacity`): its first `num_recent`
        tokens (`count`: the same number, `[1]` int64 on the device, which the mask is computed from), and of those
        the ones `view.recent` `[B, num_recent]` marks, when given (padding)."""
        def build():
            row = torch.arange(capacity, device=device) < count
            if view.recent is None:
                return row[None, None]
            row = row.expand(view.recent.shape[0], capacity).clone()
            row[:, :num_recent] &= view.recent
            return row[:, None]
        return self.shared(("recent", view.num_blocks, num_recent, capacity, str(device)), build)

    def device_clock(self, device) -> torch.Tensor:
        """`decode_clock` as a `[1]` int64 on `device`, what the slot map's LRU reads: advanced on the device by the
        decode forwards since it was last read (1 in steady state: the same operator every step, as a captured step
        needs), never written from a host value that changes."""
        key = str(device)
        clock, value = self.device_clocks.get(key, (None, None))
        if clock is None:
            clock = torch.full((1,), self.cache.decode_clock, dtype=torch.long, device=device)
        elif value != self.cache.decode_clock:
            clock.add_(self.cache.decode_clock - value)
        self.device_clocks[key] = (clock, self.cache.decode_clock)
        return clock
