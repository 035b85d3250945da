"""`OasisCache`: a transformers `Cache` whose full KV lives in host memory and whose decode attends, per KV head, to
the blocks a cheap bound says matter, plus sink and recent tokens. Full-attention layers get an `OasisLayer`;
sliding-window / chunked and linear-attention layers of hybrid models keep HF's own layer.

    cache = OasisCache(model, token_budget=2048)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)
    cache.stats()
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, LinearAttentionLayer

from . import compat
from .compute import compiled_layers, compiled_ops, latent
from .compute.attention import clear_pending, names_a_layer, peek_pending
from .compute.sparse import new_token_bias
from .config import CAPTURE_CHECKED_MODEL_TYPES, OasisConfig
from .control import Padding, StepVisibility, step_visibility
from .hybrid import HybridLayer, HybridWindowLayer, forget_state
from .layer import OasisLayer
from .window import WindowLayer
from .memory import TransferEngine
from .memory.device_memory import device_room
from .memory.host_memory import available_host_bytes, check_host_room, release_cached_pinned
from .memory.streams import PrefetchStreams
from .memory.transfer import resolve_backend
from .runtime.install import install, release
from .stats import CacheStats

ATTENTION_NAME = "oasis"
_HF_KEPT_LAYER_TYPES = ("sliding_attention", "chunked_attention")
_HYBRID_SLIDING = compat.dynamic_layer_class("hybrid_sliding")  # (transformers' window + linear-attention state)


class OasisCache(Cache):
    """A KV cache larger than device memory, for `model.generate(..., past_key_values=cache)`.

    Args:
        model: the `PreTrainedModel` this cache serves. Its attention implementation is switched to "oasis" (which
            behaves like SDPA with any other cache).
        token_budget: tokens attended per decode step and KV head (sink, recent and selected blocks included).
            With `token_budget` >= context the result equals dense attention.
        lookahead: "none", "previous" or "eagle3" (see `OasisConfig`). Left out: "eagle3" with `exact=True` (the draft
            prefetches, the real query's top blocks are attended: the answers of "none") when `draft` is given or a
            head bundled with the package was trained for `model` (`oasis_cache/draft/bundled.py`), else "none".
        block_size, sink_tokens, recent_tokens, num_slots, max_decode_tokens, host_chunk_blocks, backend: see
            `OasisConfig`.
        fetch_ratio: cap on newly fetched blocks per step, as a fraction of the context's blocks (see `OasisConfig`).
        draft: the EAGLE-3 head for `lookahead="eagle3"` (an `Eagle3Head`, or a path / hub id for `load_eagle3`).
        measure: also time how long compute waits on prefetches and, for predictions, their recall against the real
            query's top-K (extra events and selections per layer: for analysis, not for speed).
        cuda_graph: replay one-token decode steps as CUDA graphs (`compute/captured_step.py`; every lookahead, the
            eagle3 ride-along included). None (default): on for CUDA models of the checked architectures with the
            Triton backend (see `OasisConfig`); True / False: on (an error where it cannot run) / off.
        scorer, fp8_levels, summary_channels, exact, gather_programs, chain_drafts, attention_kernel: see
            `OasisConfig` (by default the block summaries cover half of each head's key channels:
            `summary_channels`; decode attention runs a Triton kernel wherever the Triton backend does).
    """

    def __init__(
        self,
        model,
        *,
        token_budget: int,
        block_size: int = 16,
        sink_tokens: int = 16,
        recent_tokens: int = 64,
        lookahead: str | None = None,
        fetch_ratio: float | None = None,
        draft=None,
        measure: bool = False,
        **options,
    ):
        text_config = _check_supported(model)
        self.why: dict[str, str] = {}  # option -> how it was chosen, in words (`describe`)
        if lookahead is None:
            lookahead, draft = _default_lookahead(model, text_config, draft)
            if lookahead == "eagle3":  # picked for the user: the real query's choice is attended (quality first)
                options.setdefault("exact", True)
                self.why["lookahead"] = "picked: a draft head for this model was given or ships with the package"
            elif not _on_an_accelerator(model):
                self.why["lookahead"] = ("picked: on the CPU no transfer is there to hide, and 'none' is the fastest "
                                         "exact way")
            else:
                self.why["lookahead"] = ("picked: no draft head ships for this model; "
                                         "python -m oasis_cache.draft.train trains one")
        elif lookahead == "eagle3" and draft is None:  # the head shipped for this model, when there is one
            from .draft.bundled import bundled_head_for

            draft = bundled_head_for(model)
            if draft is not None:
                self.why["lookahead"] = "yours, with the head shipped for this model"
        _check_option_names(options)
        self.config = OasisConfig(
            token_budget=token_budget,
            block_size=block_size,
            sink_tokens=sink_tokens,
            recent_tokens=recent_tokens,
            lookahead=lookahead,
            fetch_ratio=fetch_ratio,
            **options,
        )
        layers = []
        kinds = compat.layer_types_and_kwargs(text_config)
        attention_modules = _attention_modules(model, len(kinds))
        for layer_idx, (layer_type, kwargs) in enumerate(kinds):
            if layer_type == "full_attention":
                layers.append(OasisLayer(self, layer_idx))
            elif layer_type == "hybrid":  # (keys and a linear-attention state in one layer: Falcon-H1)
                layers.append(HybridLayer(self, layer_idx, **kwargs))
            elif layer_type == "hybrid_sliding":  # (a sliding window and a linear-attention state: Inkling)
                layers.append(HybridWindowLayer(clear_from=_padding_reader(self), **kwargs))
            elif layer_type != "chunked_attention" and compat.dynamic_layer_class(
                    layer_type) is DynamicSlidingWindowLayer:  # (its steady steps in place)
                layers.append(WindowLayer(clear_from=_padding_reader(self), **kwargs))
            elif layer_type in _HF_KEPT_LAYER_TYPES or compat.holds_no_keys(layer_type):
                layers.append(compat.dynamic_layer_class(layer_type)(**kwargs))
            else:
                raise NotImplementedError(
                    f"OasisCache does not support layer type {layer_type!r} (layer {layer_idx} of "
                    f"{type(model).__name__}); supported: full_attention, hybrid and hybrid_sliding (keys and a "
                    f"linear-attention state), plus {', '.join(_HF_KEPT_LAYER_TYPES)} and layers without keys and "
                    "values (linear attention, convolutions), which transformers keeps."
                )
        oasis_layers = [layer.layer_idx for layer in layers if isinstance(layer, OasisLayer)]
        if not oasis_layers:
            _refuse_windows_wider_than_the_context(model, text_config, kinds)
            raise ValueError(
                f"{type(model).__name__} has no full-attention layer (its layers are sliding-window, chunked or "
                "linear attention), so there is nothing for OasisCache to offload: its cache is already bounded. Use "
                "a DynamicCache."
            )
        missing = [i for i in oasis_layers if i not in attention_modules]
        if missing:
            raise NotImplementedError(
                f"Could not find the attention modules of layers {missing} in {type(model).__name__} (a module whose "
                "`layer_idx` names the layer, or one without a layer the decoder layer holds); OasisCache serves "
                "decoder models whose attention modules are transformers' own. Use a DynamicCache."
            )
        if any(getattr(attention_modules[i], "is_causal", True) is False for i in oasis_layers):
            raise NotImplementedError(
                f"{type(model).__name__}'s attention is not causal (each token sees the later ones: an encoder, or a "
                "BERT-like model made without `is_decoder=True`); OasisCache serves causal decoders. Load it with "
                "`is_decoder=True` if it is meant to generate, or use a DynamicCache."
            )
        sinks = [i for i in oasis_layers if isinstance(getattr(attention_modules[i], "sinks", None), torch.Tensor)]
        capped = getattr(text_config, "attn_logit_softcapping", None) is not None
        for i in oasis_layers:  # multi-head latent attention: the latent rows stored, attended absorbed
            layers[i].latent = latent.latent_dims(attention_modules[i])
            if layers[i].latent is not None:
                latent.check_latent(attention_modules[i])
        shared = not all(names_a_layer(attention_modules[i]) for i in oasis_layers)
        what = ("adds learned sinks" if sinks else "caps its scores (soft-capping)" if capped else
                "attends latent rows (MLA)" if any(layers[i].latent for i in oasis_layers) else
                "is told its layer at each call (a shared block's)" if shared else None)
        if what and self.config.compile_decode:  # (the torch attention: `compute/sinks.py`, `compute/latent.py`)
            raise ValueError(
                f"compile_decode=True: {type(model).__name__}'s attention {what}, which the compiled decode step does "
                "not carry. Drop compile_decode (its steps then run as they are)."
            )
        super().__init__(layers=layers)

        self._model = weakref.ref(model)
        self._modules = weakref.WeakValueDictionary({i: attention_modules[i] for i in oasis_layers})
        self._first_oasis_layer = oasis_layers[0]
        # (compiled decode steps, `compute/compiled_ops.py`, and a prefill chunk retried smaller: no layer of the
        # model keeps a state of its own, which a chunk's forward would have moved already)
        self.all_oasis_layers = len(oasis_layers) == len(layers) and not any(isinstance(x, HybridLayer) for x in layers)
        self.measure = measure
        self._streams: PrefetchStreams | None = None
        self.draft_rows = 0  # draft tokens riding along in the current forward (set by the eagle3 ride-along)
        self.record_selection = False  # keep each layer's last selection (`OasisLayer.last_selection`), for tests
        self.selection_log: list | None = None  # every step's selections, while `oasis_cache.plot.record` runs
        self.counters = CacheStats(self.config.lookahead, self.config.exact)
        self.reshaped = False  # beams reordered, sequences selected or tokens cropped since the last dense forward
        # the batch's padding from the last multi-token forward's mask (`control.Padding`), which one-token decode
        # steps called without a mask (captured steps) read; None: unknown
        self.padding: Padding | None = None
        self.decode_clock = 0  # decode forwards so far: the LRU clock of the working sets
        self.remote_tier = None  # the store's request this cache was admitted from (`oasis_cache.remote.admit`)
        self._after_forward: list = []  # called after each forward through the cache (`remote.publishing`)
        self._device_clocks: dict[str, tuple[torch.Tensor, int]] = {}  # device -> (clock `[1]`, value it holds)
        self._forward_memo: dict[tuple, object] = {}  # what the layers of the current forward share, built once
        self._chunked_prefill = None  # tokens of the prompt being prefilled in chunks (`route_forward`)
        self.prefill_resident = None  # its tokens while its keys and values stay on the device, False: they do not
        self.prefill_past = None  # while they do not: one buffer for a chunk's past, every layer's (`past_buffer`)
        self._failed_chunk = None  # tokens a sequence of the last chunk that ran out of memory (`_run_chunks`)
        self._transfer: TransferEngine | None = None
        self._marks = None  # the state before the forward now running (`undo.ForwardMarks`), for its undo
        self._routed = False  # a forward routed by the model's forward (`route_forward`) is running
        self._broken: str | None = None  # why the cache refuses to serve until `reset()` (a forward failed midway)
        self._closed = False
        self._unchecked = True  # (the layers' lengths are checked before the next routed forward)
        # the model's "oasis" attention and routed forward, given back with its last cache (`runtime/install.py`)
        self._installation = install(model, self, ATTENTION_NAME)
        self._release = weakref.finalize(self, release, weakref.ref(model), id(self))
        self.ride_along = None
        if self.config.lookahead == "eagle3":
            self.ride_along = _attach_draft(model, self, draft)
            weakref.finalize(self, self.ride_along.remove)  # its hooks leave the model with the cache
        elif draft is not None:
            raise ValueError("a draft head is used by lookahead='eagle3' only; pass lookahead='eagle3' or drop draft.")
        # its captured decode steps, or None (every step eager): `compute/captured_step.py`
        self._length_scaled_rotary = _rotary_scaled_by_length(text_config)  # (prefilled whole, never captured)
        self.captured_steps = _captured_steps_for(model, text_config, self.config, self._length_scaled_rotary)
        self._model_state = None  # `captured_step.ModelState` when `_model_as_run` was taken
        self._model_as_run = None  # where the weights are and the modules' settings at the last prefill (captured
        # steps only: `captured_step.weights_where_they_are`, `module_settings`)
        self.fused_groups = []  # `compute/fused_projections.py` (fuse_projections)
        # compile_decode=None: compiled once the model has decoded `compile_after_steps` steps (`compiles_decode`)
        self._compile_later = (self.config.compile_decode is None and what is None  # (sinks, caps, MLA: not carried)
                               and compiled_layers.may_compile_automatically(self))
        self._ahead_asked: set = set()  # decode steps' token shapes `compute/ahead.wanted` has answered
        if self.config.compile_decode or self._compile_later:
            from .compute.compiled_layers import CompiledDecode, decoder_layers_of

            layers_wrapped = decoder_layers_of(model, attention_modules.values())
            self._installation.wrap_layers(layers_wrapped, CompiledDecode)  # decode-sized calls compiled
            if self.config.fuse_projections:
                from .compute.fused_projections import fuse

                self.fused_groups = fuse(model, layers_wrapped)
                self._installation.fused = True

    # ----------------------------------------------------------------------------------------------- forwarding
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling() and compiled_ops.OPS_ON:  # a compiled decode step: one op in its graph
            return compiled_ops.traced_update(key_states, value_states, layer_idx)
        return self.eager_update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable  # host state and the package's kernels: a compiled layer calls it as it is
    def eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """`update`, run as it is (also inside the `oasis::update` op of a compiled decode step). An error in it,
        in a forward the model's own forward does not route (`route_forward` undoes its own), undoes the forward's
        writes before it goes on."""
        if not self._routed and layer_idx <= self._first_oasis_layer:
            self._marks = None  # (a new forward, not routed: its marks are taken at its first full-attention layer)
        try:
            return self._update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            if not self._routed and self._marks is not None:
                self._undo_failed_forward()
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        given = None
        if isinstance(layer, OasisLayer) and layer.latent is not None and (key_states.shape[-1], value_states.shape[
                -1]) == layer.latent:  # an MLA layer's latent and rotary key: stored as one row (`compute/latent.py`)
            given = key_states, value_states
            key_states, value_states = latent.stored_form(key_states, value_states)
        if layer_idx == 0 or isinstance(layer, OasisLayer):
            self._refuse_if_broken()
            self._check_attention(layer_idx)  # before anything of this forward is written
        if isinstance(layer, OasisLayer):
            pending = peek_pending()
            if layer_idx == self._first_oasis_layer:
                clear_pending()  # a new forward: nothing from an interrupted one may linger
                self._start_forward(layer, key_states)
            elif pending is not None:
                clear_pending()
                undone = self._undo_failed_forward()
                model = self._model()
                raise RuntimeError(
                    f"Layer {pending.layer_idx}'s attention did not run through the '{ATTENTION_NAME}' attention "
                    f"function, which alone reads this cache: the model running it is not the one this cache was made "
                    f"for ({type(model).__name__ if model is not None else 'gone'}, whose attention is "
                    f"{getattr(getattr(model, 'config', None), '_attn_implementation', None)!r}), or its attention "
                    f"was switched. Make one OasisCache per model: OasisCache(model, token_budget=...). "
                    + ("Nothing of this forward was kept." if undone else
                       "This cache can no longer serve: cache.reset().")
                )
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return out if given is None else given  # (the model expands the new tokens' latents: not read)

    def _check_attention(self, layer_idx: int) -> None:
        """Every full-attention layer must run through the "oasis" attention (the only code that reads this cache's
        pools): at the forward's first layer all of them are checked, at each full-attention layer its own."""
        modules = self._modules.values() if layer_idx == 0 else (self._modules.get(layer_idx),)
        for module in modules:
            used = getattr(getattr(module, "config", None), "_attn_implementation", ATTENTION_NAME)
            if used != ATTENTION_NAME:
                clear_pending()
                raise RuntimeError(
                    f"{type(module).__name__} (layer {module.layer_idx if names_a_layer(module) else layer_idx}) "
                    f"would run the {used!r} attention, which cannot read an OasisCache "
                    f"(model.set_attn_implementation({used!r}) was called after the cache was made). Nothing of this "
                    f"forward was written to the cache. Call "
                    f"model.set_attn_implementation('{ATTENTION_NAME}') to go on with this cache (it is SDPA for every "
                    f"other cache), or use a DynamicCache with {used!r}."
                )

    def _refuse_if_broken(self) -> None:
        if self._closed:
            raise RuntimeError("This OasisCache was closed (cache.close()): make a new one for the model.")
        if self._broken is not None:
            raise RuntimeError(f"This OasisCache cannot serve: {self._broken}. Call cache.reset() (or make a new "
                               "cache) and run the prompt again.")

    def _check_lengths(self) -> None:
        """Every full-attention layer holds the same number of tokens before a forward (one that failed midway
        outside a forward this cache routes could leave them apart: the next would decode silently wrong)."""
        lengths = {each.get_seq_length() for each in self.layers if isinstance(each, OasisLayer)}
        self._unchecked = False
        if len(lengths) > 1:
            self._broken = (f"its layers hold different numbers of tokens ({sorted(lengths)}): a forward failed "
                            "midway")
            self._refuse_if_broken()

    def _undo_failed_forward(self) -> bool:
        """After a forward failed: the cache rolled back to its state before it (`undo.ForwardMarks`), or marked
        broken where it cannot be. Returns whether it was rolled back."""
        marks, self._marks = self._marks, None
        try:
            why = "no record of the state before it" if marks is None else marks.undo()
        except Exception as error:  # noqa: BLE001 - (the undo itself failed: a store gone, say; refuse to serve)
            why = f"its undo failed ({type(error).__name__}: {error})"
        if why is not None:
            self._broken = f"a forward failed midway and {why}"
        return why is None

    def _start_forward(self, layer: OasisLayer, key_states: torch.Tensor) -> None:
        """Per-forward bookkeeping, once, at the first full-attention layer."""
        if not self._routed:  # (a forward not routed by the model's: its state checked and marked here, for an undo)
            from .undo import ForwardMarks

            self._check_lengths()
            self._unchecked = True
            self._marks = ForwardMarks(self, partial=self._first_oasis_layer > 0)
        Qn = key_states.shape[2] - self.draft_rows
        self._forward_memo = {}
        decode = layer.decodes(key_states.shape[2])
        self.counters.consume_predictions(decode)
        if decode:
            if not layer.summaries.channels_fixed:  # the prompt's blocks choose the summaries' channels
                for each in self.layers:
                    if isinstance(each, OasisLayer) and each.is_initialized:
                        each.summaries.fix_channels()
            self.decode_clock += 1
            self.counters.decode_steps += 1
            self.counters.decode_tokens += Qn
        else:
            self._check_host_room(Qn, key_states)
            if self._chunked_prefill and self.prefill_resident is None:
                self.prefill_resident = self._resident_room(self._chunked_prefill, key_states)
            self.counters.dense_forwards += 1
            self.reshaped = False
            self.counters.prefill_tokens += Qn
        if self._transfer is None:
            self._start_engine(key_states.device)
        if not decode and self._chunked_prefill:
            self._size_for_prompt(key_states)

    def _size_for_prompt(self, key_states: torch.Tensor) -> None:
        """At each chunk of a prompt prefilled in chunks, before the first full-attention layer runs (a no-op after the
        first): every full-attention layer made and sized for the whole prompt (`OasisLayer.reserve_for_prompt`) and,
        where the prompt's keys and values do not stay on the device, the buffer for a chunk's past
        (`past_buffer`) — all at once, before the chunk's activations: made layer by layer among them, these tensors
        left free memory split in the allocator's segments. A layer is made ahead only where its attention module's
        projections are on the keys' device and give their heads and head size (else it is made at its first update
        and sized at the next chunk's start); one made ahead for keys of another shape is made again at its update
        (`OasisLayer.update`)."""
        B, H, _, D = key_states.shape
        for idx, layer in enumerate(self.layers):
            if not isinstance(layer, OasisLayer):
                continue
            if not layer.is_initialized and _projects(self._modules.get(idx), H, D, key_states.device):
                layer.lazy_initialization(key_states[:, :, :0], key_states[:, :, :0])
            if layer.is_initialized:
                layer.reserve_for_prompt(self._chunked_prefill)
        if self.prefill_resident is False:
            self.past_buffer(key_states[None], 0)

    def _resident_room(self, tokens: int, key_states: torch.Tensor) -> int | bool:
        """At the first chunk of a prompt prefilled in chunks: `tokens` (its keys and values stay on the device until
        the last chunk, `OasisLayer._attend_resident`: a chunk then reads the past there, not from host memory) when
        every full-attention layer's `[2, B, Hkv, tokens, D]` fits in half the device memory this process may still
        take; else False (each chunk reads the past back from the host pool, as any later dense forward does)."""
        if not self.config.resident_prefill:
            return False
        B, H, _, D = key_states.shape
        layers = sum(isinstance(layer, OasisLayer) for layer in self.layers)
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
        if self._chunked_prefill and self.prefill_resident is False and tokens <= self._chunked_prefill:
            shape = (2, B, H, self._chunked_prefill, D)
            past = self.prefill_past
            if past is None or past.shape != shape or past.dtype != like.dtype or past.device != like.device:
                self.prefill_past = None  # (a layer of other heads: its own buffer, the first dropped first)
                past = self.prefill_past = torch.empty(shape, dtype=like.dtype, device=like.device)
            return past[:, :, :, :tokens]
        return torch.empty((2, B, H, tokens, D), dtype=like.dtype, device=like.device)

    def _start_engine(self, device) -> None:
        self._streams = PrefetchStreams(device, measure=self.measure)
        self._transfer = TransferEngine(self.config.backend, device, self._streams, self.config.gather_programs,
                                        self.config.gather_warps, self.config.gather_entries)

    def _check_host_room(self, new_tokens: int, key_states: torch.Tensor) -> None:
        """Before a dense forward writes anything: refuse it (MemoryError with the sizes) when the host pools of all
        full-attention layers cannot grow to hold its tokens (`memory.host_memory`)."""
        layers = [layer for layer in self.layers if isinstance(layer, OasisLayer)]
        needed = sum(layer.host_bytes_for(new_tokens, key_states) for layer in layers)
        if needed:
            B, H, _, D = key_states.shape
            tokens = self.get_seq_length(self._first_oasis_layer) + new_tokens
            check_host_room(needed, f"the host pool of {len(layers)} layers for {tokens} tokens x {B} sequences ({H} "
                                    f"KV heads of {D}, {key_states.dtype})")

    @property
    def transfer(self) -> TransferEngine:
        return self._transfer

    @property
    def streams(self) -> PrefetchStreams:
        return self._streams

    def backend_for(self, device: torch.device) -> str:
        return resolve_backend(self.config.backend, device)

    def _shared(self, key: tuple, build):
        """A value every layer of the current forward uses: built by the first layer that asks (`key` names it and
        includes the device: layers may sit on different devices)."""
        value = self._forward_memo.get(key)
        if value is None:
            value = self._forward_memo[key] = build()
        return value

    def step_visibility(self, visible: torch.Tensor | None, layer: OasisLayer, decode: bool = False) -> StepVisibility:
        """Block visibility of the current forward, once per number of complete blocks (before and after this
        forward's offload), as wide as the summaries' capacity (the block count read on the device). A decode step
        (`decode`) called without a mask — a captured step is — reads the batch's recorded padding once every
        padding token is in a complete block (`padding_covers`): fixed shapes, what a captured step replays. A mask
        given is read, as HF reads it."""
        cfg, num_blocks, summaries = self.config, layer.pool.num_blocks, layer.summaries
        width = summaries.capacity_blocks
        padding = self.padding if decode and visible is None and self.padding_covers(num_blocks) else None
        return self._shared(("visibility", num_blocks, width, padding is not None, str(layer.device)),
                            lambda: step_visibility(visible, layer.batch_size, num_blocks, summaries.count, width,
                                                    cfg.block_size, cfg.sink_tokens, cfg.num_recent_blocks,
                                                    layer.device, padding))

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
        return padding is not None and padding.clear_from <= num_blocks * self.config.block_size

    def new_token_bias(self, num_queries: int, group: int, length: int, slot_tokens: int, count: torch.Tensor,
                       dtype: torch.dtype, device) -> torch.Tensor:
        """`compute.sparse.new_token_bias`, built once per forward for every layer (torch attention path)."""
        def build():
            return new_token_bias(num_queries, group, length, slot_tokens, count, dtype, device)
        return self._shared(("new-token bias", num_queries, group, length, slot_tokens, dtype, str(device)), build)

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
        return self._shared(("recent", view.num_blocks, num_recent, capacity, str(device)), build)

    def check_module(self, layer_idx: int, module) -> None:
        if self._modules.get(layer_idx) is not module:
            raise RuntimeError(
                f"This OasisCache was created for another model ({type(self._model()).__name__ if self._model() else 'gone'})"
                f"; make one OasisCache per model: OasisCache(model, token_budget=...)."
            )

    # --------------------------------------------------------------------------------------------------- public
    def stats(self) -> dict:
        """What the cache did so far, as a plain dict (reads the device counters once). Prefetches still running on
        the host thread (an admitted cache's store reads after `generate` returned) are finished first, so that
        their reads are counted; an error one of them met raises here."""
        if self._streams is not None:
            self._streams.settle()
        out = self.counters.as_dict()
        if self._streams is not None and self.measure:
            if self._streams.cuda:
                torch.cuda.synchronize(self._streams.device)
            wait_ms = self._streams.exposed_wait_ms()
            out.update(exposed_wait_ms_total=wait_ms,
                       exposed_wait_ms_per_step=wait_ms / max(1, self.counters.decode_steps))
        fp8_levels, summary_channels = self._summary_form()
        out.update(
            token_budget=self.config.token_budget,
            block_size=self.config.block_size,
            lookahead=self.config.lookahead,
            exact=self.config.exact,
            scorer=self.config.scorer,
            fp8_levels=fp8_levels,
            summary_channels=summary_channels,
            backend=self._transfer.backend if self._transfer else None,
            seq_length=self.get_seq_length(self._first_oasis_layer),
            device_bytes=sum(self.device_nbytes().values()),
            host_bytes=self.host_nbytes(),
        )
        out["why"] = dict(self.why)  # option -> how it was chosen (`describe` says it all in words)
        if self.ride_along is not None:
            out.update(self.ride_along.stats())
        if self.captured_steps is not None:
            steps = self.captured_steps
            out.update(captured_replays=steps.replays, completing_replays=steps.completing_replays,
                       captures=steps.captures)
        if self.remote_tier is not None:  # admitted from a store (`oasis_cache.remote.admit`)
            links = [layer.pool.remote for layer in self.layers
                     if isinstance(layer, OasisLayer) and layer.is_initialized and layer.pool.remote is not None]
            out.update(remote_request=self.remote_tier.request, remote_bytes_fetched=self.remote_tier.bytes_got,
                       remote_units_fetched=sum(link.units_fetched for link in links),
                       remote_units_evicted=sum(link.units_evicted for link in links),
                       remote_units_published=sum(link.published * link.batch_size * link.num_kv_heads
                                                  for link in links),
                       remote_local_cache_bytes=sum(link.nbytes for link in links),
                       remote_repair_ms_per_step=(1e3 * self.remote_tier.repair_seconds / self.remote_tier.repairs
                                                  if self.remote_tier.repairs else 0.0),
                       remote_repair_exposed_ms_per_step=(
                           1e3 * self.remote_tier.repair_exposed_seconds / self.remote_tier.repairs
                           if self.remote_tier.overlap and self.remote_tier.repairs else None),
                       remote_repair_phases_ms=dict(zip(
                           ("copy_back", "plan", "store_reads", "maps_and_gathers"),
                           (1e3 * self.remote_tier.repair_phases / max(1, self.remote_tier.repairs)).tolist())))
        return out

    def _summary_form(self) -> tuple[bool | None, float | None]:
        """`(fp8_levels, summary_channels)`: whether the bits levels are kept in fp8 and the share of key channels
        the summaries cover, as resolved when the layers initialize (per device; every layer in the same forward,
        so the first tells); `(None, None)` before."""
        layer = self.layers[self._first_oasis_layer]
        if not layer.is_initialized:
            return None, None
        summaries = layer.summaries
        return summaries.scales is not None, summaries.kept_channels / summaries.head_dim

    def device_nbytes(self) -> dict:
        """Bytes held on the compute device by all OasisLayers, by pool."""
        total: dict = {}
        for layer in self.layers:
            if isinstance(layer, OasisLayer):
                for name, n in layer.device_nbytes().items():
                    total[name] = total.get(name, 0) + n
        return total

    def host_nbytes(self) -> int:
        """Host bytes of the pools (and, admitted from a store, of the local caches in front of it)."""
        return sum(layer.pool.nbytes + (layer.pool.remote.nbytes if layer.pool.remote is not None else 0)
                   for layer in self.layers if isinstance(layer, OasisLayer) and layer.is_initialized)

    def to_dynamic_cache(self):
        """A transformers `DynamicCache` holding every cached token's keys and values (moved to the compute device:
        it takes the dense cache's memory). It pickles, and `from_dynamic_cache` makes an OasisCache of it again."""
        from transformers import DynamicCache

        model = self._model()
        if model is None:
            raise ReferenceError("The model this OasisCache served was deleted.")
        if self._streams is not None:
            self._streams.synchronize()
        dynamic = DynamicCache(config=model.config)
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OasisLayer):
                if layer.is_initialized:
                    kv = layer.full_kv()
                    if layer.value_dim is not None:  # (stored padded to the keys' head size)
                        kv = kv[0], kv[1][..., : layer.value_dim]
                    dynamic.layers[idx].update(*(kv if layer.latent is None else
                                                 latent.transformers_form(kv[0], layer.latent)))
                if isinstance(layer, HybridLayer):
                    layer.give_states_to(dynamic.layers[idx])
            else:
                window = isinstance(layer, WindowLayer)
                dynamic.layers[idx] = layer.as_transformers() if window else copy.deepcopy(layer)
        return dynamic

    @classmethod
    def from_dynamic_cache(cls, model, dynamic, attention_mask: torch.Tensor | None = None,
                           **options) -> "OasisCache":
        """An OasisCache for `model` (`options` as for the constructor) holding the tokens of a transformers
        `DynamicCache` (or any cache whose layers keep `keys` / `values` `[B, Hkv, N, D]`): complete blocks go to the
        host pool and the summaries, the rest to the recent tokens — as after a prefill of the same tokens, in the
        chunks such a prefill runs (`compute/prefill.py`), so a cache rebuilt so decodes as the one that prefilled
        them, at any budget. What a prefill's last query made — a lookahead's first prediction, the draft head's
        rows — comes with the next forward instead (a forward of several tokens, e.g. the prompt's last ones, makes
        both).

        `attention_mask` `[B, N]` (1 = a real token), for a left-padded batch: the mask its tokens were prefilled
        with, recorded as a prefill records it, so that the padding weighs in no summary (what the padding's keys
        hold — HF's, zeros — then does not matter: attention never reads them)."""
        from .compute.prefill import prefill_chunks

        if isinstance(dynamic, (tuple, list)):  # the legacy form: one (keys, values) pair per layer
            dynamic = _from_legacy(model, dynamic)
        if not hasattr(dynamic, "layers"):
            raise TypeError(f"from_dynamic_cache takes a transformers DynamicCache (or a tuple of (keys, values) per "
                            f"layer), got {type(dynamic).__name__}.")
        _check_layers_fit(model, dynamic)  # (before a cache is made: nothing written for a cache that cannot fit)
        cache = cls(model, **options)
        if len(dynamic.layers) != len(cache.layers):
            raise ValueError(f"the cache holds {len(dynamic.layers)} layers; {type(model).__name__} has "
                             f"{len(cache.layers)}.")
        cfg = cache.config
        if attention_mask is not None:
            first = next((source for source in dynamic.layers if getattr(source, "is_initialized", False)), None)
            shape = tuple(first.keys.shape[::2]) if first is not None else None  # (B, N)
            if shape is None or tuple(attention_mask.shape) != shape:
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; the cache holds "
                                 f"{'no tokens' if shape is None else f'{shape[0]} sequences of {shape[1]} tokens'}"
                                 f": pass the mask of exactly the tokens it holds (attention_mask[:, :N]).")
            cache.padding = Padding.of(attention_mask.to(first.keys.device).bool(), shape[0], first.keys.device)
        for idx, (source, layer) in enumerate(zip(dynamic.layers, cache.layers)):
            if not isinstance(layer, OasisLayer):  # (a linear-attention layer's state has no `is_initialized`)
                cache.layers[idx] = (type(layer).of(source, _padding_reader(cache)) if isinstance(layer, WindowLayer)
                                     and type(source) in (DynamicSlidingWindowLayer, _HYBRID_SLIDING)
                                     else copy.deepcopy(source))
                continue
            if isinstance(layer, HybridLayer):
                layer.take_states_from(source)
            if not getattr(source, "is_initialized", False):
                continue
            if cache._transfer is None:
                cache._start_engine(source.keys.device)
            keys, values = ((source.keys, source.values) if layer.latent is None else
                            latent.stored_form(source.keys, source.values))  # (an MLA layer's latent rows)
            B, _, N, _ = keys.shape
            tokens = torch.empty((B, N), dtype=torch.long, device="meta")  # (only its shape is read)
            spans = prefill_chunks(dict(input_ids=tokens, logits_to_keep=1), cfg.prefill_chunk_tokens,
                                   cfg.block_size, cfg.max_decode_tokens)
            if spans:  # (the pools sized for all of it at once, as a chunked prefill's: `_size_for_prompt`)
                layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
                layer.reserve_for_prompt(N)
            for start, end in spans or [(0, N)]:
                layer.update(keys[:, :, start:end], values[:, :, start:end])
                clear_pending()
                layer._offload_complete_blocks()
        return cache

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.reshaped = True
        self.padding = None
        super().reorder_cache(beam_idx)
        if self.ride_along is not None:
            self.ride_along.index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reshaped = True
        self.padding = None
        super().batch_select_indices(indices)
        if self.ride_along is not None:
            self.ride_along.index_batch(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reshaped = True
        self.padding = None
        super().batch_repeat_interleave(repeats)
        if self.ride_along is not None:
            self.ride_along.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if int(tokens_to_remove) > 0:  # (the legacy "keep this many": as the installed transformers' DynamicCache)
            refusal = compat.positive_crop_error(int(tokens_to_remove))
            if refusal is not None:
                raise refusal
        if self._streams is not None:
            self._streams.finish_held()  # (an admitted cache's overlapped store reads, before its maps change)
        self.reshaped = self.reshaped or int(tokens_to_remove) != 0
        if int(tokens_to_remove) != 0:
            self.padding = None
        super().crop(tokens_to_remove)
        if self.ride_along is not None and int(tokens_to_remove) != 0:
            self.ride_along.reset()  # its rows no longer line up with the tokens: it starts over

    def close(self) -> None:
        """Release what the cache holds — its memory, an admitted cache's keys in the store (`reset`), its draft
        head's hooks — and, if it is its model's last cache, give the model back as it was before (its attention
        implementation, forward, layers and weights: `runtime/install.py`). A closed cache serves no more forwards.
        Also at the end of `with OasisCache(...) as cache:`, and when the cache is collected."""
        if self._closed:
            return
        self.reset()
        if self.ride_along is not None:
            self.ride_along.remove()
        self._release()
        self._closed = True

    def __enter__(self) -> "OasisCache":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def reset(self) -> None:
        """Empty the cache (all memory released) so it can serve a new batch with the same model."""
        if self._streams is not None:
            self._streams.synchronize()
            self._streams.reset_measurements()
        super().reset()
        for layer in self.layers:  # (transformers' linear-attention layers: their states made anew, for any batch)
            if isinstance(layer, LinearAttentionLayer) and not isinstance(layer, (HybridLayer, HybridWindowLayer)):
                forget_state(layer)
        release_cached_pinned()  # the pools' pinned memory goes back to the system, not to torch's cache
        if self.remote_tier is not None:  # admitted from a store: the request's keys go with its tokens
            self.remote_tier.delete()
            self._remote_release.detach()
            self.remote_tier = None
        if self.ride_along is not None:
            self.ride_along.reset()
        self.counters = CacheStats(self.config.lookahead, self.config.exact)
        self.reshaped = False
        self.padding = None
        self.decode_clock = 0
        self._device_clocks = {}
        self._broken = self._marks = None
        self._unchecked = True
        self._forward_memo = {}
        if self.captured_steps is not None:
            self.captured_steps.drop()

    def __deepcopy__(self, memo):
        """`copy.deepcopy(cache)`: an independent cache for the same model holding the same tokens (as DynamicCache
        copies): every pool copied (the host pool pinned again), its own streams and transfer engine, no captured
        step yet, with eagle3 a ride-along with its own hooks and a copy of its state. The model's fused projection
        groups are shared, never copied (`compile_ahead`'s dry step copies the cache at a first decode step: a copy
        of `fused_groups` once held a second set of the fused weights). Nothing else of the model is reached from
        the fields copied (its modules are held through `_modules`, rebuilt; the memo is not touched: a deepcopy of
        a structure holding the model too copies it as usual)."""
        model = self._model()
        if model is None:
            raise ReferenceError("The model this OasisCache served was deleted: a copy would serve nothing.")
        if self._streams is not None:  # transfers in flight land before their buffers are copied
            self._streams.synchronize()
            self._transfer.wait_host_reads()
        new = object.__new__(type(self))
        memo[id(self)] = new
        # (an admitted cache's pools fetch every block for the copy, which is not linked to the store)
        rebuilt = ("_model", "_modules", "_streams", "_transfer", "_forward_memo", "_device_clocks", "ride_along", "_marks",
                   "_installation", "_release", "_model_state",
                   "captured_steps", "remote_tier", "_remote_release", "_after_forward", "fused_groups")
        for key, value in self.__dict__.items():
            if key not in rebuilt:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._model, new._modules = self._model, weakref.WeakValueDictionary(dict(self._modules))
        new._forward_memo, new._device_clocks, new._after_forward = {}, {}, []
        new._marks, new._routed, new._model_state = None, False, None
        new._installation = install(model, new, ATTENTION_NAME)
        new._release = weakref.finalize(new, release, weakref.ref(model), id(new))
        new.fused_groups = list(self.fused_groups)  # (the model's buffers, shared: a copy would double its weights)
        new._streams = new._transfer = new.remote_tier = None
        if self._streams is not None:
            new._start_engine(self._streams.device)
        for layer in new.layers:
            if isinstance(layer, OasisLayer):
                layer._cache = weakref.proxy(new)
            elif isinstance(layer, WindowLayer):
                layer.clear_from = _padding_reader(new)
        new.captured_steps = None
        if self.captured_steps is not None:
            from .compute.captured_step import CapturedSteps

            new.captured_steps = CapturedSteps()
        new.ride_along = self.ride_along.copy_for(model, new) if self.ride_along is not None else None
        if new.ride_along is not None:
            weakref.finalize(new, new.ride_along.remove)
        return new

    def model_changed(self) -> None:
        """Say that the model changed in a way this cache does not see by itself between two one-token forwards of a
        decode loop of one's own — an attribute set by hand (`layer.scaling = 0.5`, PEFT's `set_adapter` or
        `disable_adapter`): the next step looks at the model again and, where decode steps are replayed as CUDA
        graphs, captures them anew. What the cache holds stays. (A `generate` call sees such changes at its prefill;
        weights put in place, `model.to(...)` and `train()` / `eval()` are seen at the next step:
        `compute.captured_step.module_changes`.)"""
        self._model_state = None

    def fork(self, *, token_budget: int | None = None, lookahead: str | None = None,
             exact: bool | None = None) -> "OasisCache":
        """A copy of this cache, as `copy.deepcopy(cache)` makes, that shares the host pools' chunks of complete
        blocks with it instead of copying them (the largest part of a long prompt's cache): each fork then decodes on
        its own, and pinned host memory is allocated only for the blocks it completes. Shared blocks are never
        written (a crop into them copies them first), so neither cache sees the other's tokens.

        `token_budget`: the fork's budget from its next forward on, at least this cache's (the working set has grown
        to this budget's slots; a smaller one would leave more resident than it allows: fork from a cache made with
        the smallest budget). E.g. one prefill, several budgets: `generate` the prompt but its last tokens with a
        cache made with the smallest budget, then `generate` the whole prompt with `cache.fork(token_budget=b)` for
        each b: each runs the prompt's last tokens and decodes as a cache made with budget b would.

        `lookahead`, `exact`: the fork's, from its next forward on; "eagle3" only where this cache has a draft head
        (an eagle3 cache forks to "none" or "previous" too, without its head). Each cache's `stats()` counts the
        shared chunks among its host bytes."""
        from .pools.host_kv import SHARE_CHUNKS

        config, changes = self.config, {}
        if lookahead is not None and lookahead != config.lookahead:
            if lookahead == "eagle3":
                raise ValueError(f"fork(lookahead='eagle3') needs a cache with a draft head; this one runs "
                                 f"{config.lookahead!r}. Make the cache to fork from with lookahead='eagle3' (it can "
                                 f"fork to 'none' and 'previous').")
            changes["lookahead"] = lookahead
            if lookahead == "none" and exact is None:
                exact = False  # (nothing to repair without a prediction)
        if exact is not None and exact != config.exact:
            changes["exact"] = exact
        if changes:
            config = dataclasses.replace(config, **changes)  # (validated as the constructor does)
        if token_budget is not None:
            if isinstance(token_budget, int) and not isinstance(token_budget, bool) and \
                    token_budget < config.token_budget:
                raise ValueError(f"fork(token_budget={token_budget}) is below this cache's budget "
                                 f"({config.token_budget}): its working set may hold more than that. Fork from a "
                                 f"cache made with the smallest budget you want, OasisCache(model, "
                                 f"token_budget={token_budget}, ...).")
            config = dataclasses.replace(config, token_budget=token_budget)  # (validated as the constructor does)
        new = copy.deepcopy(self, {SHARE_CHUNKS: True})
        new.config = config
        for layer in new.layers:
            if isinstance(layer, OasisLayer):
                layer.config = config
                if layer.is_initialized and config.token_budget != self.config.token_budget:
                    # the working set and slot map as large as this budget takes of the blocks held now (a short
                    # next forward completes no block, which is where they grow otherwise); the next step selects
                    # with its real query (what was prefetched was chosen for the smaller budget)
                    layer.reserve_slots(layer.pool.num_blocks)
                    layer.predicted = False
        new.counters.attention_row = CacheStats(config.lookahead, config.exact).attention_row
        if new.ride_along is not None and config.lookahead != "eagle3":
            new.ride_along.remove()  # (its hooks leave the model: the fork drafts nothing)
            new.ride_along = None
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "An OasisCache cannot be pickled: it serves one model object in this process (its attention modules, "
            "device streams, pinned host memory). In this process, copy.deepcopy(cache) makes an independent copy; "
            "to keep or send the tokens' keys and values, take them out with cache.to_dynamic_cache() (a DynamicCache, "
            "which pickles) and rebuild with OasisCache.from_dynamic_cache(model, dynamic, token_budget=...)."
        )

    def device_clock(self, device) -> torch.Tensor:
        """`decode_clock` as a `[1]` int64 on `device`, what the slot map's LRU reads: advanced on the device by the
        decode forwards since it was last read (1 in steady state: the same operator every step, as a captured step
        needs), never written from a host value that changes."""
        key = str(device)
        clock, value = self._device_clocks.get(key, (None, None))
        if clock is None:
            clock = torch.full((1,), self.decode_clock, dtype=torch.long, device=device)
        elif value != self.decode_clock:
            clock.add_(self.decode_clock - value)
        self._device_clocks[key] = (clock, self.decode_clock)
        return clock

    # ------------------------------------------------------------------------------ the model's forward, routed
    def compile_ahead_at_prefill(self, layer: OasisLayer, query: torch.Tensor, visible, scale: float) -> bool:
        """`ahead_at_prefill`: called by the first attention layer once the whole prompt is in it
        (`compute/ahead.at_prefill`: the first decode step's kernels start compiling while the prefill goes on)."""
        from .compute import ahead

        return ahead.at_prefill(self, layer, query, visible, scale)

    def route_forward(self, runner, kwargs: dict):
        """`_route_forward`, all or nothing: a forward that fails midway leaves the cache as before it, or refusing to
        serve (`oasis_cache/undo.py`)."""
        from .undo import ForwardMarks

        self._refuse_if_broken()
        if self._routed:  # (a forward inside a routed one: a dry step's; the outer one's marks hold)
            return self._route_forward(runner, kwargs)
        if self._unchecked:  # (after a forward the model's forward did not route: the layers may disagree)
            self._check_lengths()
        self._marks, self._routed = ForwardMarks(self), True
        try:
            return self._route_forward(runner, kwargs)
        except BaseException:
            if self._marks is not None:  # (not undone already, by the error's own path)
                self._undo_failed_forward()
            raise
        finally:
            self._routed, self._marks = False, None

    def _route_forward(self, runner, kwargs: dict):
        """A call of the model's forward with this cache (`CapturedForward`): a long prefill in chunks of
        `config.prefill_chunk_tokens` tokens over the batch (`compute/prefill.py`), a decode step to the captured
        steps where there are any, else the model's own forward. Running out of device memory in a prefill raises a
        MemoryError that names the sizes and what to lower."""
        from .compute import ahead
        from .compute.prefill import prefill_chunks

        model, running = self._model(), getattr(getattr(runner, "eager_forward", None), "__self__", None)
        if running is not None and model is not None and running is not model:
            raise ValueError(f"This OasisCache was made for another model instance ({type(model).__name__} at "
                             f"{id(model):#x}) than the one running it: make one per model, OasisCache(model, ...).")
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[1] == 0:
            held = self.get_seq_length(self._first_oasis_layer)
            raise ValueError(f"This OasisCache holds {held} tokens and the forward brings no new one: generate was "
                             f"given a prompt no longer than what the cache holds. Pass the conversation so far "
                             f"followed by new tokens, or call cache.reset() (or make a new cache) for a new prompt.")
        first = self.layers[self._first_oasis_layer]
        if (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and first.is_initialized
                and first.get_seq_length() > 0 and tokens.shape[0] != first.batch_size):  # (before any layer or hook)
            raise ValueError(f"This OasisCache holds {first.get_seq_length()} tokens for a batch of "
                             f"{first.batch_size}, but got a batch of {tokens.shape[0]}. Call cache.reset() (or make "
                             f"a new OasisCache) for a new batch.")
        if (self.captured_steps is not None and model is not None and isinstance(tokens, torch.Tensor)
                and tokens.dim() >= 2):
            from .compute.captured_step import ModelState, module_settings, weights_where_they_are

            # (a prefill, or the model changed since: steps captured before a rebinding, or an adapter or flag
            # switched by then, capture anew)
            state = self._model_state
            if (tokens.shape[1] > max(compiled_layers.COMPILED_QUERY_LENGTHS) or state is None
                    or not state.unchanged()):
                self._model_state = ModelState(model)
                self._model_as_run = (weights_where_they_are(model), module_settings(model))
        if self._streams is not None:
            self._streams.finish_held()  # (an admitted cache's store reads of the step before: `remote.disaggregate`)
        spans = prefill_chunks(kwargs, self.config.prefill_chunk_tokens, self.config.block_size,
                               self.config.max_decode_tokens)
        if spans is not None and any(compat.records_state_history(layer) for layer in self.layers):
            spans = None  # (assisted decoding on a linear-attention hybrid: its layers' history wants whole forwards)
        if spans is not None and self._length_scaled_rotary:
            spans = None  # (a rotary scaled by the length a forward reaches: the prompt whole, as dense rotates it)
        past = self.get_seq_length(self._first_oasis_layer)
        if not (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
                and tokens.shape[1] > self.config.max_decode_tokens):
            return self._route(runner, kwargs, tokens, spans, past)
        ahead.beside_prefill(self, tokens.device)  # (a prefill: Triton's start-up, any compile workers, beside it)
        return self._route(runner, kwargs, tokens, spans, past)

    def _route(self, runner, kwargs, tokens, spans, past):
        """`route_forward`'s way: the prefill's chunks (`spans`), a dry step first where one is wanted, one forward."""
        from .compute import ahead
        from .compute.dense import chunks_follow

        try:
            if spans is not None:
                self._chunked_prefill = past + spans[-1][1]  # (tokens: `_start_forward` decides on residency)
                try:
                    with chunks_follow():  # (the first chunk warms the later ones' attention kernels)
                        return self._run_chunks(runner, kwargs, spans, past)
                finally:
                    self._chunked_prefill = self.prefill_resident = self.prefill_past = None
                    for layer in self.layers:
                        if isinstance(layer, OasisLayer):
                            layer.resident_kv = None
            if ahead.PENDING:  # (compilations a prefill started: done before a step launches their kernels)
                ahead.finish_pending()
            if ahead.wanted(self, tokens):  # a first decode step: its kernels compiled in parallel first
                ahead.dry_step(self, runner, kwargs, tokens)
            return self._forward_one(runner, kwargs)
        except torch.OutOfMemoryError as error:
            if tokens is None or tokens.shape[1] <= self.config.max_decode_tokens:
                raise
            from .compute import prefill

            B, N = tokens.shape[:2]
            device = tokens.device
            held = sum(self.device_nbytes().values()) / 2**30
            room = (f" ({device_room(device) / 2**30:.1f} GiB left to this process now; the cache holds {held:.1f} "
                    "GiB on the device)") if device.type == "cuda" else ""
            chunk = (spans[0][1] - spans[0][0]) if spans else N
            smaller = self._failed_chunk or chunk
            tried = f" (and of {B} x {smaller} after it)" if spans and smaller < chunk else ""
            least = prefill.least_span(self.config.block_size, self.config.max_decode_tokens)
            half = smaller // 2 // self.config.block_size * self.config.block_size
            holders = (f"the weights and the decode working set (token_budget {self.config.token_budget} x batch {B}) "
                       "hold the room")
            if self._length_scaled_rotary:  # (prefilled whole on purpose: chunks would rotate it otherwise)
                fix = (f"{type(self._model()).__name__}'s rotary scaling ({self._length_scaled_rotary!r}) follows the "
                       "length a forward reaches, so its prompt is prefilled whole, never in chunks: lower the batch "
                       "or the prompt's length")
            elif half < least:  # (no smaller chunk would prefill: what holds the room is not the chunk)
                fix = f"Even the least chunk did not fit: {holders}. Lower the batch or token_budget"
            elif smaller < chunk:  # (halved already: the chunk's activations were not what filled the room)
                fix = (f"Smaller chunks did not fit either: {holders}. Lower the batch or token_budget (or "
                       f"prefill_chunk_tokens further, e.g. {B * half})")
            else:
                fix = (f"Lower prefill_chunk_tokens (now {self.config.prefill_chunk_tokens}; e.g. OasisCache(model, "
                       f"token_budget=..., prefill_chunk_tokens={B * half})), the batch, or token_budget")
            raise MemoryError(
                f"OasisCache: the prefill of {B} x {N} tokens ran out of device memory in forwards of {B} x {chunk} "
                f"tokens{tried}{room}. {fix}. The cache keeps what it held before this call."
            ) from error

    def _run_chunks(self, runner, kwargs, spans, past):
        """The prefill's chunks (`compute/prefill.run_chunks`). A chunk that runs out of device memory is undone
        (`ChunkMarks`) and the prompt goes on from its start in chunks of half as many tokens, with a warning, up to
        `prefill.SHRINK_RETRIES` times; then the error goes on (to `_route`'s MemoryError). Models whose every layer
        is this cache's only: another layer (a sliding window's) cannot be cropped back."""
        import warnings

        from .compute import prefill

        marks, self._failed_chunk = prefill.ChunkMarks(self, past), None
        T, shortest, shrinks = self.config.block_size, self.config.max_decode_tokens, 0
        while True:
            try:
                return prefill.run_chunks(lambda **chunk: self._forward_one(runner, chunk), kwargs, spans, past,
                                          self.config.progress, before_chunk=marks)
            except torch.OutOfMemoryError:
                start, end = marks.span or (0, 0)
                length = (end - start) // 2 // T * T
                if (shrinks == prefill.SHRINK_RETRIES or not self.all_oasis_layers
                        or length < prefill.least_span(T, shortest) or not marks.undoable()):
                    self._failed_chunk = end - start  # (for `_route`'s message)
                    raise
            # (out of the except clause: the error's frames, which hold the chunk's activations, are gone)
            shrinks += 1
            marks.undo()
            device = self.layers[self._first_oasis_layer].device
            if device is not None and device.type == "cuda":
                torch.cuda.empty_cache()  # (what the failed chunk left cached goes back, whole segments)
            B = next(v for v in (kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if v is not None).shape[0]
            warnings.warn(f"OasisCache: a prefill chunk of {B} x {end - start} tokens ran out of device memory; "
                          f"going on from token {past + start} in chunks of {B} x {length} (set prefill_chunk_tokens="
                          f"{B * length} to start there).", RuntimeWarning, stacklevel=2)
            spans = prefill.spans_from(start, spans[-1][1], length, shortest)

    def _forward_one(self, runner, kwargs: dict):
        if self._compile_later:  # (counted before the step: its layers all run compiled or all not)
            tokens = kwargs.get("input_ids")
            tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
            if (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
                    and tokens.shape[1] in compiled_layers.COMPILED_QUERY_LENGTHS
                    and self.get_seq_length(self._first_oasis_layer) > 0):
                compiled_layers.count_decoded_step(self._model())
        if self.captured_steps is not None:
            out = self.captured_steps.forward(runner, self, kwargs)
        else:
            out = runner.eager_forward(**kwargs)
        for listener in tuple(self._after_forward):
            listener()
        return out

    # ------------------------------------------------------------------------------------- captured decode steps
    def replayable_step(self) -> str | None:
        """Which captured step the next one-token decode forward may replay on a CUDA cache (its batch's padding
        recorded and in complete blocks, `padding_covers`):
        "steady", "completing" (one block completes: with the Triton backend, whose offload reads the block number
        on the device), or None (the forward runs eagerly)."""
        layer = self.layers[self._first_oasis_layer]
        if not (layer.is_initialized and layer.device.type == "cuda"):
            return None
        kind = self.step_kind()
        return None if kind == "completing" and not layer.use_kernels else kind

    def step_kind(self) -> str | None:
        """What `replayable_step` answers but for the device and backend (CPU tests ask it): "steady", "completing",
        or None (the next one-token decode forward must run eagerly)."""
        layer = self.layers[self._first_oasis_layer]
        # (summaries' channels are chosen at the first decode step, for every layer at once: it runs eagerly)
        if not (layer.is_initialized and self._decode_step_of_fixed_shapes() and layer.summaries.channels_fixed
                and self.padding_covers(layer.pool.num_blocks)):
            return None
        if self.remote_tier is not None and not all(  # admitted: only deferred prefetches keep the store out of it
                other.predicted and (other.pool.remote is None or other.pool.remote.deferred) for other in self.layers):
            return None
        return "completing" if layer.completes_block() else "steady"

    def steady_step(self) -> bool:
        """Whether the next one-token decode forward is a steady step (host state only): it decodes sparsely and
        completes no block, on a cache of full-attention layers (and linear-attention ones, updated in place, and
        sliding windows in a steady step: `_replays`), outside measurement mode, with a riding draft
        only once the head's call runs on static buffers (`RideAlong.replayable`) — every shape, buffer and host
        decision is that of the step before."""
        return self._decode_step_of_fixed_shapes() and not self.layers[self._first_oasis_layer].completes_block()

    def completing_step(self) -> bool:
        """Whether the next one-token decode forward completes exactly one block in an otherwise steady step: its
        offload, summaries and recent tokens move by the same operators at every block (`prepare_step` makes room
        first); the block count advances on the device."""
        return self._decode_step_of_fixed_shapes() and self.layers[self._first_oasis_layer].completes_block()

    def _decode_step_of_fixed_shapes(self) -> bool:
        if self.measure or self.record_selection or self.reshaped:
            return False  # (beam search and assisted decoding reshape the cache every step: each would recapture)
        layer = self.layers[self._first_oasis_layer]
        return (layer.is_initialized and layer.decodes(1) and layer.recent.in_region
                and layer.recent.num_tokens + 1 <= self.config.block_size
                and all(not compat.records_state_history(other) if isinstance(other, OasisLayer) else
                        _replays(other) for other in self.layers)
                and (self.ride_along is None or self.ride_along.replayable(layer.batch_size)))

    def prepare_step(self, kind: str) -> None:
        """Before a captured step of `kind` is captured or replayed (host only): a completing step finds room for its
        block in every pool (capacities that grow here change the replay signature: the step is captured anew)."""
        if kind == "completing":
            for layer in self.layers:
                if isinstance(layer, OasisLayer):  # (a linear-attention layer's state has no blocks)
                    layer.prepare_completion()

    def replay_signature(self) -> tuple:
        """What a captured step depends on beyond tensor contents: every layer's prediction flag, fetch cap and state
        tensors (their pools' stamps, `pools/stamped.py`: they change when a capacity grows), its block count while
        it is small enough to decide the selection's shapes (NB <= slots: every block selected), the cache's device
        counters and address tables, the padding record's tensors (addresses and shape), the state tensors' addresses
        of linear-attention layers (`compat.state_addresses`), for a layer admitted from a
        store whether its local pool holds blocks yet and its deferred records' tensors, whether the layers run
        compiled (`compiles_decode`), and the model's weights' addresses and modules' settings at the last prefill.
        Equal signatures: the graph captured under one is valid under the other — past `slots` blocks a completed
        block does not invalidate it (selection reads the block count on the device)."""
        cfg, of_length = self.config, {}  # (what depends on the block count and length alone, once per value)

        def of(layer):  # (the fetch cap after a block completes too: a completing step's prefetch uses it)
            NB, pool, length = layer.pool.num_blocks, layer.pool, layer.get_seq_length()
            counted = of_length.get((NB, length))
            if counted is None:  # the step's and its prediction's blocks to attend: all of them or not
                counted = of_length[NB, length] = (NB if NB <= cfg.slots else None, cfg.max_fetch(NB),
                                                   cfg.max_fetch(NB + 1), layer.fits_budget(1), layer.fits_budget(2))
            remote = () if pool.remote is None else (  # an admitted layer: its local pool read or not, its records
                NB > pool.first_block, tuple(t.data_ptr() for t in pool.remote.pending_tensors()))
            return counted, layer.predicted, layer.state_stamps(), remote
        layers = tuple(of(layer) for layer in self.layers if isinstance(layer, OasisLayer) and layer.is_initialized)
        clocks = tuple(clock.data_ptr() for clock, _ in self._device_clocks.values())
        counts = self.counters.device_counts(self.layers[self._first_oasis_layer].device).data_ptr()
        riding = tuple(t.data_ptr() for t in self.ride_along.state_tensors()) if self.ride_along is not None else ()
        padding = self.padding  # a step without a mask reads the record's tensors (a new prefill makes new ones)
        padded = () if padding is None or padding.tokens is None else (
            padding.tokens.data_ptr(), tuple(padding.tokens.shape), padding.first.data_ptr())
        kept = tuple(layer.state_addresses() if isinstance(layer, WindowLayer) else compat.state_addresses(layer)
                     for layer in self.layers if not isinstance(layer, OasisLayer))
        return (layers, kept, clocks, counts, self._transfer.address_tables() if self._transfer else (), riding,
                padded, self.compiles_decode(), self._model_as_run)

    def compiles_decode(self) -> bool:
        """Whether this cache's decode-sized layer calls run compiled now (`compute/compiled_layers.py`):
        `compile_decode=True`, or None once the model has decoded `compile_after_steps` steps in this process (unless
        that compilation failed: then, with a warning, never). Part of the replay signature: a change captures the
        steps anew, after one eager step where the compiled layers meet their graphs (`captured_step.CapturedSteps`)."""
        if self._compile_later:
            model = self._model()
            return (model is not None and compiled_layers.decoded_steps(model) >= self.config.compile_after_steps
                    and not compiled_layers.compile_failed(model))
        return self.config.compile_decode is True

    def prepare_capture(self) -> None:
        """Before a step is captured: compute joins the side stream, so that the graph need not wait on events
        recorded outside it (pending prefetches, offloads)."""
        self._streams.synchronize()
        self._streams.forget_side_work()
        self._transfer.prepare_capture([layer.pool for layer in self.layers if isinstance(layer, OasisLayer)])

    def advance_replayed_step(self, kind: str = "steady") -> None:
        """The host effects of a one-token decode step (`kind`: "steady" or "completing", `replayable_step`), after
        its captured device work was replayed: what the eager step's Python does (`tests/test_captured_step.py`
        compares)."""
        for key, (clock, value) in self._device_clocks.items():
            if value == self.decode_clock:  # the captured step advanced this device clock by one
                self._device_clocks[key] = (clock, value + 1)
        self.decode_clock += 1
        counters = self.counters
        counters.decode_steps += 1
        counters.decode_tokens += 1
        riding = 0 if self.ride_along is None else 1  # the draft row's key stood in the recent region
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.advance_replayed_step()
            if not isinstance(layer, OasisLayer):  # (a linear-attention state: the replay updated it in place)
                continue
            layer.recent.num_tokens += 1
            counters.record_layer_step(layer.batch_size * layer.num_kv_heads, layer.recent.num_tokens + riding)
            if kind == "completing":
                layer.advance_replayed_completion()
        if self.ride_along is not None:
            self.ride_along.advance_replayed_step()

    def generate_kwargs(self) -> dict:
        """This cache under the keyword `generate` (and the model's forward) takes it by on the installed
        transformers: `{"cache": self}` from 5.24 on, `{"past_key_values": self}` before (5.24 still takes
        `past_key_values=`, with a FutureWarning). `model.generate(**inputs, **cache.generate_kwargs(),
        max_new_tokens=...)` runs warning-free on both."""
        model = self._model()
        if model is None:
            raise RuntimeError("OasisCache.generate_kwargs: the model this cache was made for has been deleted.")
        return {compat.generate_cache_argument(model): self}

    def describe(self) -> str:
        """What this cache runs and why, in words (`print(cache)`)."""
        cfg, model = self.config, self._model()
        name = type(model).__name__ if model is not None else "a deleted model"
        n_oasis = sum(isinstance(layer, OasisLayer) for layer in self.layers)
        tokens = self.get_seq_length(self._first_oasis_layer)
        lines = [f"OasisCache for {name}: {tokens} tokens cached; each decode step attends at most "
                 f"{cfg.token_budget} tokens per KV head (every token while the context fits)."]
        kept = sorted({type(layer).__name__ for layer in self.layers if not isinstance(layer, OasisLayer)})
        lines.append(f"- layers: {n_oasis} full-attention layers offloaded to host memory in blocks of "
                     f"{cfg.block_size} tokens" + (f"; {len(self.layers) - n_oasis} others kept by transformers "
                                                   f"({', '.join(kept)})" if kept else ""))
        modes = {"none": "the real query selects its blocks, fetched on the critical path",
                 "previous": "each step's query predicts the next step's blocks, fetched on a side stream",
                 "eagle3": "a draft token rides beside the real one and predicts the next step's blocks"}
        why = self.why.get("lookahead", "yours")
        lines.append(f"- lookahead {cfg.lookahead!r} ({why}): {modes[cfg.lookahead]}"
                     + ("; attended blocks chosen by the real query, misses repaired" if cfg.exact else ""))
        if self.ride_along is not None:
            lines.append(f"- draft: an EAGLE-3 head reading layers {self.ride_along.aux_ids}"
                         + ("; chained drafts (the target's own next token where the draft was right)"
                            if self.ride_along.lm_head is not None else ""))
        fp8, channels = self._summary_form()
        form = "key channels chosen at the first forward" if channels is None else \
            f"{channels:.0%} of the key channels{', fp8 levels' if fp8 else ''}"
        lines.append(f"- block summaries: {cfg.scorer!r} scorer on {form}")
        if self._transfer is None:
            lines.append(f"- transfers: backend {cfg.backend!r}, decided at the first forward (Triton kernels on CUDA)")
        else:
            engine = self._transfer
            programs = ("one per block" if engine.gather_programs == 0 else f"{engine.gather_programs}"
                        ) if engine.gather_programs is not None else (
                f"{engine.side_programs} for prefetches, one per block on the critical path"
                if engine.side_programs else "one per block")
            lines.append(f"- transfers: {engine.backend} backend; gather programs: {programs}")
        if self.captured_steps is not None:
            steps = self.captured_steps
            lines.append(f"- decode steps: replayed as CUDA graphs where the shapes allow ({steps.replays} replays, "
                         f"{steps.captures} captures so far)")
        elif "cuda_graph" in self.why:
            lines.append(f"- decode steps: eager ({self.why['cuda_graph']})")
        else:
            lines.append("- decode steps: eager (captured CUDA graphs need one CUDA device, a checked architecture and "
                         "the Triton backend, or cuda_graph=True)")
        if self.compiles_decode():
            lines.append("- the layers' own work in decode steps: torch.compile'd (compile_decode)")
        elif self._compile_later:
            model = self._model()
            done = compiled_layers.decoded_steps(model) if model is not None else 0
            lines.append(f"- the layers' own work in decode steps: eager; torch.compile'd once the model has decoded "
                         f"{self.config.compile_after_steps} steps in this process ({done} so far; compile_decode)")
        if self.get_seq_length(self._first_oasis_layer):
            lines.append(f"- memory: {sum(self.device_nbytes().values()) / 2**20:.1f} MiB on the device, "
                         f"{self.host_nbytes() / 2**20:.1f} MiB of host memory")
        return "\n".join(lines)

    def __str__(self):
        return self.describe()

    def __repr__(self):
        cfg = self.config
        return (
            f"OasisCache(token_budget={cfg.token_budget}, block_size={cfg.block_size}, lookahead={cfg.lookahead!r}, "
            f"layers={len(self.layers)}, tokens={self.get_seq_length(self._first_oasis_layer)})"
        )


def _check_option_names(options: dict) -> None:
    """A TypeError naming an option `OasisCache` does not know, and the closest one it does (a typo must not pass)."""
    import dataclasses
    import difflib

    known = {field.name for field in dataclasses.fields(OasisConfig)}
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known | {"draft", "measure"}), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"OasisCache got an unknown option {name!r}.{hint} Every option: docs/options.md.")


def _default_lookahead(model, text_config, draft):
    """`(lookahead, draft)` when the user named no lookahead: eagle3 with the given head, or with a matching bundled
    one (full-attention models on an accelerator: on the CPU a step's blocks come from the same memory, no transfer
    is hidden, and the draft's ride-along only adds work), else none."""
    if draft is not None:
        return "eagle3", draft
    if _on_an_accelerator(model) and all(layer_type == "full_attention" for layer_type, _ in compat.layer_types_and_kwargs(text_config)):
        from .draft.bundled import bundled_head_for

        head = bundled_head_for(model)
        if head is not None:
            return "eagle3", head
    return "none", None


def _on_an_accelerator(model) -> bool:
    """Whether the model's weights are on a device other than the CPU (where blocks cross a link from host memory)."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type not in ("cpu", "meta")


def _attach_draft(model, cache, draft):
    """The eagle3 ride-along for `model`, with `draft` (a head, or what `load_eagle3` reads)."""
    from .draft import Eagle3Head, load_eagle3
    from .draft.lookahead import RideAlong

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


def _padding_reader(cache):
    """For a `WindowLayer` of `cache`: the position from which every sequence's tokens are real (its padding
    record), or None where not known."""
    ref = weakref.ref(cache)

    def clear_from():
        owner = ref()
        return None if owner is None or owner.padding is None else owner.padding.clear_from
    return clear_from


def _replays(layer) -> bool:
    """Whether a layer transformers keeps lets the next one-token step be captured: a window in a steady step, a
    linear-attention state updated in place, a layer holding nothing (`compat.state_addresses`)."""
    if isinstance(layer, WindowLayer):
        return layer.steady_step()
    return compat.state_addresses(layer) is not None


def _captured_steps_for(model, text_config, config: OasisConfig, rotary: str | None):
    """The cache's `CapturedSteps` (after `model.forward` was made to route to it), or None: `config.cuda_graph`
    resolved for this model (None: on where it is checked; True: on, or an error naming why it cannot be). `rotary`:
    `_rotary_scaled_by_length(text_config)`."""
    from .compute.captured_step import CapturedSteps

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


def _rotary_scaled_by_length(text_config) -> str | None:
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


def _check_supported(model):
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


def _refuse_windows_wider_than_the_context(model, text_config, kinds: list[tuple[str, dict]]) -> None:
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


def _projects(module, heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether an attention `module`'s key and value projections are on `device` and give `heads` heads of
    `head_dim` (a layer may then be made ahead of its first update, `OasisCache._size_for_prompt`)."""
    if module is None or getattr(module, "head_dim", head_dim) != head_dim:
        return False
    projections = [getattr(module, name, None) for name in ("k_proj", "v_proj")]
    return all(isinstance(p, torch.nn.Linear) and p.weight.device == device and p.out_features == heads * head_dim
               for p in projections)


def _attention_modules(model, layer_count: int) -> dict:
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


def _from_legacy(model, pairs) -> "object":
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


def _check_layers_fit(model, dynamic) -> None:
    """A ValueError naming the first layer of `dynamic` whose keys the model's attention could not have written: its
    KV heads, head size, dtype or device; sequences and tokens differing between layers."""
    text_config = model.config.get_text_config(decoder=True)
    modules = _attention_modules(model, len(dynamic.layers))
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
