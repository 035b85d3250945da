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
from transformers.cache_utils import Cache, LinearAttentionLayer

from . import compat
from .compute import compiled_ops, latent
from .compute.attention import clear_pending, names_a_layer, peek_pending
from .hybrid import HybridLayer, HybridWindowLayer, forget_state
from .layer import OasisLayer
from .memory import TransferEngine
from .memory.host_memory import release_cached_pinned
from .memory.streams import PrefetchStreams
from .runtime import build, compiled_layers, conversions, model_checks, routing
from .runtime.describe import describe, host_bytes_per_token, layers_kept_wide, remote_stats, summary_form
from .runtime.context import ForwardContext
from .runtime.install import install, release
from .runtime.model_checks import ATTENTION_NAME
from .stats import CacheStats
from .window import WindowLayer

_HYBRID_SLIDING = compat.dynamic_layer_class("hybrid_sliding")  # (transformers' window + linear-attention state)


class OasisCache(Cache):
    """A KV cache larger than device memory, for `model.generate(**inputs, **cache.generate_kwargs())`.

    Args:
        model: the `PreTrainedModel` this cache serves. Its attention implementation is "oasis" while the cache
            lives (SDPA with any other cache); `close()`, `with` or collection give the model back as it was.
        token_budget: tokens attended per decode step and KV head (sink, recent and selected blocks included).
            With `token_budget` >= context the result equals dense attention.
        lookahead: "none", "previous" or "eagle3": how the next step's blocks are predicted and prefetched. Left
            out: "eagle3" with `exact=True` when `draft` is given or a head shipped with the package was trained for
            `model` and the model is on an accelerator, else "none".
        draft: the EAGLE-3 head for `lookahead="eagle3"` (an `Eagle3Head`, or a path / hub id for `load_eagle3`).
        exact: with a predictor, attend the real query's top blocks anyway (the prediction only prefetches).
        prefill_chunk_tokens: a long prompt runs as forwards of at most this many tokens over the batch (0: whole).
        host_dtype: None (the model's dtype), "fp8" or "int4": how the host pool holds keys and values — half or
            about a quarter of bf16's bytes, moved and held; a step attends them widened back.
        cuda_graph: replay one-token decode steps as CUDA graphs. None: where the architecture is checked.
        compile_decode: run the decoder layers' own work `torch.compile`d in decode steps. None: automatic, after
            a model's first `compile_after_steps` decode steps in a process.
        advanced: a dict of the other options (`OasisConfig`; docs/options.md), e.g. `{"block_size": 32}`.
    """

    def __init__(
        self,
        model,
        *,
        token_budget: int,
        lookahead: str | None = None,
        draft=None,
        exact: bool | None = None,
        prefill_chunk_tokens: int = 8192,
        host_dtype: str | None = None,
        cuda_graph: bool | None = None,
        compile_decode: bool | None = None,
        advanced: dict | None = None,
        **misplaced,
    ):
        if misplaced:
            raise build.misplaced_options(misplaced)
        text_config = model_checks.check_supported(model)
        self.why: dict[str, str] = {}  # option -> how it was chosen, in words (`describe`)
        lookahead, draft, exact = build.choose_lookahead(model, text_config, lookahead, draft, exact, self.why)
        self.config = build.config_from(dict(token_budget=token_budget, lookahead=lookahead, exact=exact,
                                             prefill_chunk_tokens=prefill_chunk_tokens, host_dtype=host_dtype,
                                             cuda_graph=cuda_graph,
                                             compile_decode=compile_decode), advanced)
        layers = build.make_layers(self, model, text_config)
        attention_modules = model_checks.attention_modules(model, len(layers))
        what = build.check_attention(model, text_config, layers, attention_modules, self.config)
        oasis_layers = [layer.layer_idx for layer in layers if isinstance(layer, OasisLayer)]
        super().__init__(layers=layers)

        self._model = weakref.ref(model)
        self._modules = weakref.WeakValueDictionary({i: attention_modules[i] for i in oasis_layers})
        self._first_oasis_layer = oasis_layers[0]
        # (compiled decode steps, `compute/compiled_ops.py`, and a prefill chunk retried smaller: no layer of the
        # model keeps a state of its own, which a chunk's forward would have moved already)
        self.all_oasis_layers = len(oasis_layers) == len(layers) and not any(isinstance(x, HybridLayer) for x in layers)
        self.measure = self.config.measure
        self.context = ForwardContext(self, self._first_oasis_layer)  # what a forward's layers share
        self.draft_rows = 0  # draft tokens riding along in the current forward (set by the eagle3 ride-along)
        self.record_selection = False  # keep each layer's last selection (`OasisLayer.last_selection`), for tests
        self.selection_log: list | None = None  # every step's selections, while `oasis_cache.plot.record` runs
        self.counters = CacheStats(self.config.lookahead, self.config.exact)
        self.reshaped = False  # beams reordered, sequences selected or tokens cropped since the last dense forward
        self.decode_clock = 0  # decode forwards so far: the LRU clock of the working sets
        self.remote_tier = None  # the store's request this cache was admitted from (`oasis_cache.remote.admit`)
        self._after_forward: list = []  # called after each forward through the cache (`remote.publishing`)
        self._failed_chunk = None  # tokens a sequence of the last chunk that ran out of memory (`_run_chunks`)
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
            self.ride_along = build.attach_draft(model, self, draft)
            weakref.finalize(self, self.ride_along.remove)  # its hooks leave the model with the cache
        elif draft is not None:
            raise ValueError("a draft head is used by lookahead='eagle3' only; pass lookahead='eagle3' or drop draft.")
        # its captured decode steps, or None (every step eager): `runtime/captured_step.py`
        self._length_scaled_rotary = model_checks.rotary_scaled_by_length(text_config)  # (prefilled whole)
        self.captured_steps = build.captured_steps_for(model, text_config, self.config, self._length_scaled_rotary)
        self._model_state = None  # `captured_step.ModelState` when `_model_as_run` was taken
        self._model_as_run = None  # where the weights are and the modules' settings at the last prefill (captured
        # steps only: `captured_step.weights_where_they_are`, `module_settings`)
        # compile_decode=None: compiled once the model has decoded `compile_after_steps` steps (`compiles_decode`)
        self._compile_later = (self.config.compile_decode is None and what is None  # (sinks, caps, MLA: not carried)
                               and compiled_layers.may_compile_automatically(self))
        self._ahead_asked: set = set()  # decode steps' token shapes `compute/ahead.wanted` has answered
        self.fused_groups = []  # `runtime/fused_projections.py` (fuse_projections)
        if self.config.compile_decode or self._compile_later:
            self.fused_groups = build.compile_layers(self, model, attention_modules)

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
        context = self.context
        context.new_forward()
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
            context.check_host_room(Qn, key_states)
            if context.prefill_tokens and context.prefill_resident is None:
                context.prefill_resident = context.resident_room(context.prefill_tokens, key_states)
            self.counters.dense_forwards += 1
            self.reshaped = False
            self.counters.prefill_tokens += Qn
        if context.transfer is None:
            context.start_engine(key_states.device)
        if not decode and context.prefill_tokens:
            context.size_for_prompt(key_states)

    @property
    def transfer(self) -> TransferEngine:
        return self.context.transfer

    @property
    def streams(self) -> PrefetchStreams:
        return self.context.streams

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
        if self.streams is not None:
            self.streams.settle()
        out = self.counters.as_dict()
        if self.streams is not None and self.measure:
            if self.streams.cuda:
                torch.cuda.synchronize(self.streams.device)
            wait_ms = self.streams.exposed_wait_ms()
            out.update(exposed_wait_ms_total=wait_ms,
                       exposed_wait_ms_per_step=wait_ms / max(1, self.counters.decode_steps))
        fp8_levels, summary_channels = summary_form(self)
        out.update(
            token_budget=self.config.token_budget,
            block_size=self.config.block_size,
            lookahead=self.config.lookahead,
            exact=self.config.exact,
            scorer=self.config.scorer,
            fp8_levels=fp8_levels,
            summary_channels=summary_channels,
            backend=self.transfer.backend if self.transfer else None,
            seq_length=self.get_seq_length(self._first_oasis_layer),
            device_bytes=sum(self.device_nbytes().values()),
            host_bytes=self.host_nbytes(),
            host_dtype=self.config.host_dtype,
            host_bytes_per_token=host_bytes_per_token(self),
            layers_in_model_dtype=sorted(layers_kept_wide(self)),
        )
        out["why"] = dict(self.why)  # option -> how it was chosen (`describe` says it all in words)
        if self.ride_along is not None:
            out.update(self.ride_along.stats())
        if self.captured_steps is not None:
            steps = self.captured_steps
            out.update(captured_replays=steps.replays, completing_replays=steps.completing_replays,
                       captures=steps.captures)
        if self.remote_tier is not None:  # admitted from a store (`oasis_cache.remote.admit`)
            out.update(remote_stats(self))
        return out

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
        return conversions.to_dynamic(self)

    @classmethod
    def from_dynamic_cache(cls, model, dynamic, attention_mask: torch.Tensor | None = None,
                           **options) -> "OasisCache":
        """An OasisCache for `model` (`options` as for the constructor) holding the tokens of a transformers
        `DynamicCache` (or any cache whose layers keep `keys` / `values` `[B, Hkv, N, D]`): complete blocks go to the
        host pool and the summaries, the rest to the recent tokens — as after a prefill of the same tokens, in the
        chunks such a prefill runs (`runtime/prefill.py`), so a cache rebuilt so decodes as the one that prefilled
        them, at any budget. What a prefill's last query made — a lookahead's first prediction, the draft head's
        rows — comes with the next forward instead (a forward of several tokens, e.g. the prompt's last ones, makes
        both).

        `attention_mask` `[B, N]` (1 = a real token), for a left-padded batch: the mask its tokens were prefilled
        with, recorded as a prefill records it, so that the padding weighs in no summary (what the padding's keys
        hold — HF's, zeros — then does not matter: attention never reads them)."""
        return conversions.from_dynamic(cls, model, dynamic, attention_mask, options)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.reshaped = True
        self.context.padding = None
        super().reorder_cache(beam_idx)
        if self.ride_along is not None:
            self.ride_along.index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reshaped = True
        self.context.padding = None
        super().batch_select_indices(indices)
        if self.ride_along is not None:
            self.ride_along.index_batch(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reshaped = True
        self.context.padding = None
        super().batch_repeat_interleave(repeats)
        if self.ride_along is not None:
            self.ride_along.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if int(tokens_to_remove) > 0:  # (the legacy "keep this many": as the installed transformers' DynamicCache)
            refusal = compat.positive_crop_error(int(tokens_to_remove))
            if refusal is not None:
                raise refusal
        if self.streams is not None:
            self.streams.finish_held()  # (an admitted cache's overlapped store reads, before its maps change)
        self.reshaped = self.reshaped or int(tokens_to_remove) != 0
        if int(tokens_to_remove) != 0:
            self.context.padding = None
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
        if self.streams is not None:
            self.streams.synchronize()
            self.streams.reset_measurements()
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
        self.context.padding = None
        self.decode_clock = 0
        self.context.device_clocks = {}
        self._broken = self._marks = None
        self._unchecked = True
        self.context.new_forward()
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
        if self.streams is not None:  # transfers in flight land before their buffers are copied
            self.streams.synchronize()
            self.transfer.wait_host_reads()
        new = object.__new__(type(self))
        memo[id(self)] = new
        # (an admitted cache's pools fetch every block for the copy, which is not linked to the store)
        rebuilt = ("_model", "_modules", "context", "ride_along", "_marks",
                   "_installation", "_release", "_model_state",
                   "captured_steps", "remote_tier", "_remote_release", "_after_forward", "fused_groups")
        for key, value in self.__dict__.items():
            if key not in rebuilt:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._model, new._modules = self._model, weakref.WeakValueDictionary(dict(self._modules))
        new._after_forward = []
        new._marks, new._routed, new._model_state = None, False, None
        new._installation = install(model, new, ATTENTION_NAME)
        new._release = weakref.finalize(new, release, weakref.ref(model), id(new))
        new.fused_groups = list(self.fused_groups)  # (the model's buffers, shared: a copy would double its weights)
        new.remote_tier = None
        new.context = ForwardContext(new, self._first_oasis_layer)
        new.context.padding = copy.deepcopy(self.context.padding, memo)
        if self.streams is not None:
            new.context.start_engine(self.streams.device)
        for layer in new.layers:
            if isinstance(layer, OasisLayer):
                layer._cache = weakref.proxy(new)
            elif isinstance(layer, WindowLayer):
                layer.clear_from = build.padding_reader(new)
        new.captured_steps = None
        if self.captured_steps is not None:
            from .runtime.captured_step import CapturedSteps

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
        `runtime.captured_step.module_changes`.)"""
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

    # ------------------------------------------------------------------------------ the model's forward, routed
    def route_forward(self, runner, kwargs: dict):
        """The model's forward with this cache, as `runtime/routing.py` runs it (the installed forward calls it)."""
        return routing.route_forward(self, runner, kwargs)

    def compile_ahead_at_prefill(self, layer: OasisLayer, query: torch.Tensor, visible, scale: float) -> bool:
        """`ahead_at_prefill`: called by the first attention layer once the whole prompt is in it
        (`compute/ahead.at_prefill`: the first decode step's kernels start compiling while the prefill goes on)."""
        from .runtime import ahead

        return ahead.at_prefill(self, layer, query, visible, scale)

    # ------------------------------------------------------------------------------------- captured decode steps
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
        return describe(self)

    def __str__(self):
        return self.describe()

    def __repr__(self):
        cfg = self.config
        return (
            f"OasisCache(token_budget={cfg.token_budget}, block_size={cfg.block_size}, lookahead={cfg.lookahead!r}, "
            f"layers={len(self.layers)}, tokens={self.get_seq_length(self._first_oasis_layer)})"
        )


