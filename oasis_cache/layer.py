"""`OasisLayer`: one full-attention layer's cache. It owns its pools and runs one forward's attention top-down:

    update(k, v)   new tokens join the recent tokens (device); the layer is left pending for the attention call
    attend(q)      prefill / long extend -> dense causal attention over host blocks + recent tokens
                   decode               -> rank blocks by their summaries, place the top K in slots, fetch the
                                           missing ones (or, with lookahead, use what the previous step
                                           prefetched), attend over the selected slots + recent tokens
    then           complete blocks leave the recent tokens for the host pool and the summaries; with lookahead,
                   this step's query places the next step's blocks and their gather starts on the side stream

Shapes: keys/values `[B, Hkv, q, D]` in, attention output `[B, Hq, Qn, D]` out (see `config` for the names).
"""

from __future__ import annotations

import copy
import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from .compute.attention import leave_pending
from .compute.sinks import causal_attention
from .compute.sparse import sparse_attention
from .control import all_blocks, attended_blocks, marked_blocks, rank_blocks, top_blocks
from .kernels.decode_attention import decode_attention
from .memory.host_memory import use_fast_pinning
from .memory.representation import representation_for
from .pools import BlockSummaries, HostKVPool, RecentTokens, SlotMap, WorkingSet
from .pools.host_kv import fitted_chunk_blocks, measured_pool
from .pools.summaries import fp8_levels_for

HOST_GROWTH_SPREAD = 16  # blocks: layers take their host pool's next chunk at up to this many different block steps
MIN_SLOTS = 16  # slots a layer starts with (fewer when the budget needs fewer); it grows them with its context


def _without_autograd(step, *args):
    """`step(*args)` under `torch.no_grad()` where autograd records (a user's `model(...)` without it), as it is
    otherwise (one check, no context entered: `generate` and captured steps run without grad): the cache's state
    never records autograd, so such a forward may follow or precede `generate`'s on one cache."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return step(*args)
    return step(*args)


class OasisLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True
    is_compileable = False
    resident_kv = None  # the prompt's keys and values during a chunked prefill (`_attend_resident`)
    latent = None  # (R, rope) where the layer stores MLA's latent rows (`compute/latent.py`), set by its cache
    value_dim = None  # the values' head size where it is below the keys' (stored padded: `_as_wide_as_keys`)

    def __init__(self, cache, layer_idx: int):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.config = cache.config
        self.layer_idx = layer_idx
        self.device = None

    # ------------------------------------------------------------------------------------------------ lifecycle
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        B, H, _, D = key_states.shape
        self.device, dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_kv_heads, self.head_dim = B, H, D
        self.choose_kernels()
        for name in ("attention_kernel", "top_k_kernel"):
            if getattr(cfg, name) and not self.use_kernels:
                raise ValueError(f"{name}=True runs a Triton kernel, but this cache runs the torch backend on "
                                 f"{self.device}: leave {name} at its default here (or pass backend='triton').")
        T = cfg.block_size
        recent_capacity = T * -(-(T - 1 + cfg.max_decode_tokens) // T)  # partial block + one decode forward
        self.pool = HostKVPool(B, H, D, T, dtype, cfg.host_chunk_blocks, self.device.type == "cuda", cfg.host_dtype)
        if self.pool.pin_memory and cfg.fast_pinning:
            use_fast_pinning()  # (once per process: before the first chunk is pinned)
        fp8 = fp8_levels_for(cfg.fp8_levels, cfg.scorer, self.device, self.use_kernels)
        self.summaries = BlockSummaries(B, H, D, dtype, self.device, T, key_bits=cfg.scorer == "bits", fp8_levels=fp8,
                                        kept_channels=cfg.kept_channels(D))
        slots = min(cfg.slots, MIN_SLOTS)  # grown with the context (`reserve_slots`): memory follows it, not the budget
        self.working_set = WorkingSet(B, H, slots, T, recent_capacity, D, dtype, self.device)
        self.recent = RecentTokens(self.working_set.recent_region, self.use_kernels)
        self.slot_map = SlotMap(B, H, slots, self.device, use_kernel=self.use_kernels)
        self.predicted = False  # the working set holds a prediction for the next decode step
        self._draft_ranks = None  # (NB, `[B, Hkv, NB]`): the draft row's ranking, scored with the real rows'
        self.is_initialized = True

    def shaped_as(self, key_states: torch.Tensor | None) -> tuple:
        """(heads, head size, dtype, device) of `key_states` `[B, Hkv, q, D]`, or of this layer's pools (None)."""
        k = key_states
        return (self.num_kv_heads, self.head_dim, self.pool.dtype, self.device) if k is None else (
            k.shape[1], k.shape[3], k.dtype, k.device)

    def reserve_for_prompt(self, tokens: int) -> None:
        """Room for a prompt prefilled in chunks that ends at `tokens`: its blocks (and the next) in the summaries, the
        slot table and the working set's slots, at once (tensors of a new size at each chunk split the allocator)."""
        whole = tokens // self.config.block_size + 1
        self.summaries.reserve(whole)
        self.slot_map.reserve(whole)
        self.reserve_slots(whole)

    def choose_kernels(self) -> None:
        """Which Triton kernels this layer runs: its cache's backend on its device decides, with the config's
        toggles; the slot map and recent tokens, when made already (a cache admitted on another device), follow."""
        cfg = self.config
        self.use_kernels = self._cache.context.backend_for(self.device) == "triton"
        self.top_k_kernel = self.use_kernels and (cfg.fetch_ratio is None if cfg.top_k_kernel is None else
                                                  cfg.top_k_kernel)
        self.attention_kernel = self.use_kernels if cfg.attention_kernel is None else cfg.attention_kernel
        if self.latent is not None and cfg.attention_kernel is None:  # (MLA's rows: one KV head of R + rope channels
            self.attention_kernel = False  # for all query heads, not checked in the Triton decode kernel on a GPU)
        for part in (name for name in ("slot_map", "recent") if name in self.__dict__):
            self.__dict__[part].use_kernel = self.use_kernels

    def reset(self) -> None:
        """Forget everything (memory is released); the layer initializes again on its next update."""
        for name in ("pool", "summaries", "recent", "working_set", "slot_map", "resident_kv"):
            self.__dict__.pop(name, None)
        self.is_initialized = False
        self.device = None

    def __deepcopy__(self, memo):
        """Every pool copied (`OasisCache.__deepcopy__` binds the copy to the cache copy); the config is shared."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in ("_cache", "config") else copy.deepcopy(value, memo)
        return new

    # ------------------------------------------------------------------------------------------- Cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, Hkv, q, D]` new keys/values. Returns them unchanged: attention reads the cache itself.
        The cache's state never records autograd (`_without_autograd`)."""
        return _without_autograd(self._update, key_states, value_states)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        value_states = self._as_wide_as_keys(key_states, value_states)
        if self.is_initialized and self.get_seq_length() == 0 and self.shaped_as(key_states) != self.shaped_as(None):
            self.reset()  # (made ahead for keys of another shape, `ForwardContext.size_for_prompt`: made again)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size:
            raise ValueError(
                f"This OasisCache holds {self.get_seq_length()} tokens for a batch of {self.batch_size}, but got a "
                f"batch of {key_states.shape[0]}. Call `cache.reset()` (or make a new OasisCache) for a new batch."
            )
        elif self.shaped_as(key_states) != self.shaped_as(None):
            (h, d, dtype, device), (H, D, held_dtype, held_device) = self.shaped_as(key_states), self.shaped_as(None)
            raise ValueError(
                f"Layer {self.layer_idx} of this OasisCache holds keys of {H} KV heads x {D} channels ({held_dtype}, "
                f"{held_device}); this forward brings {h} x {d} ({dtype}, {device}): another model, or the model "
                f"cast or moved since. Make one OasisCache per model (OasisCache(model, token_budget=...)), or "
                f"cache.reset() after moving the model."
            )
        self.recent.append(key_states, value_states)
        leave_pending(self, key_states, value_states)
        return key_states, value_states

    def _as_wide_as_keys(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """`value_states` `[B, Hkv, q, Dv]` padded with zeros to the keys' head size D where Dv < D (MiMo-V2-Flash:
        keys of 192, values of 128): the pools, the gather and the attention kernels keep one head size for both,
        and the attention's output is cut back to Dv (`value_dim`). Costs (D - Dv) / (D + Dv) more host and transfer
        bytes (a fifth there)."""
        D, Dv = key_states.shape[-1], value_states.shape[-1]
        if Dv == D:
            return value_states
        if Dv > D:
            raise NotImplementedError(f"OasisCache stores keys and values at one head size: values of {Dv} channels "
                                      f"are wider than keys of {D} (only narrower values are padded). Use a "
                                      "DynamicCache.")
        self.value_dim = Dv
        return torch.nn.functional.pad(value_states, (0, D - Dv))

    def get_seq_length(self) -> int:
        return self.pool.num_blocks * self.config.block_size + self.recent.num_tokens if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):  # HF's whole-layer offloading does not apply: the full KV already lives on the host
        pass

    def prefetch(self):  # (nor its prefetch)
        pass

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a positive value is the legacy "keep this many")."""
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17 passes a 0-d tensor
        if not self.is_initialized or tokens_to_remove == 0:
            return
        self._cache.streams.wait(self.layer_idx)  # a prefetch in flight must land before slots are forgotten
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, length)
        if keep < 0:
            raise ValueError(f"cannot crop {-tokens_to_remove} tokens from a cache of {length}")
        T = self.config.block_size
        keep_blocks = keep // T
        if keep_blocks < self.pool.num_blocks:  # reach into complete blocks: bring their tokens back to the device
            engine = self._cache.transfer
            back = engine.load_range(self.pool, keep_blocks, self.pool.num_blocks)  # [2, B, H, n, T, D]
            two, B, H, n, _, D = back.shape
            self.recent.prepend(back.reshape(2, B, H, n * T, D))
            shared = bool(self.pool.shared)
            self.pool.truncate(keep_blocks)
            if shared:  # a fork's shared chunk may have become its own: the gathers' address table follows now
                engine.refresh_addresses(self.pool)
            self.summaries.truncate(keep_blocks)
            self.slot_map.forget_blocks_from(keep_blocks)
        self.recent.truncate(keep - keep_blocks * T)
        self.predicted = False

    def take_back(self, tokens: int) -> None:
        """The last `tokens` keys and values removed (a refused forward's, `compute/attention.py`): `crop` of this
        class, also in a subclass that keeps more (`HybridLayer`'s state records no past to roll back)."""
        OasisLayer.crop(self, -tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._index_batch(torch.as_tensor(indices, device=self.device))

    def _index_batch(self, indices: torch.Tensor) -> None:
        """Sequence i becomes old sequence `indices[i]` in every pool."""
        if not self.is_initialized:
            return
        self._cache.streams.synchronize()
        self._cache.transfer.wait_host_reads()
        recent = self.recent.kv.index_select(1, indices.to(self.device))
        for part in (self.pool, self.summaries, self.working_set, self.slot_map):
            part.index_batch(indices)
        self.recent = RecentTokens(self.working_set.recent_region, self.use_kernels)
        self.recent.prepend(recent)
        self.batch_size = int(indices.numel())

    # ------------------------------------------------------------------------------------------------ attention
    def check_module(self, module) -> None:
        self._cache.check_module(self.layer_idx, module)

    def decodes(self, query_length: int) -> bool:
        """Whether a forward of `query_length` new tokens (riding draft rows included) decodes sparsely: there are
        complete blocks to select from and the forward is short; otherwise it attends densely."""
        return self.is_initialized and self.pool.num_blocks > 0 and query_length <= self.config.max_decode_tokens

    def attend(self, query: torch.Tensor, visible: torch.Tensor | None, scale: float,
               sinks: torch.Tensor | None = None, pattern: torch.Tensor | None = None,
               softcap: float | None = None, dense=None) -> torch.Tensor:
        """Attention of this forward's queries `[B, Hq, Qn, D]` over the whole cache; `visible`: `[B, N]` or None;
        `pattern`: what each query sees where a 4D mask says more than `visible` (a multimodal prompt's image tokens
        see each other), `[B or 1, 1 or Hq, Qn, N]` bool, attended as given where the forward attends densely
        (`control/visibility.from_pattern` gave `visible` of it and checked it);
        `sinks`: the module's learned sink logits `[Hq]` (`compute/sinks.py`) or None; `dense`: the attention a dense
        forward computes instead of `dense_causal_attention` (same arguments: an MLA layer's expanded form,
        `latent.expanded_attention`). Without autograd (`_without_autograd`): no gradient flows through it."""
        return _without_autograd(self._attend, query, visible, scale, sinks, pattern, softcap, dense)

    def _attend(self, query: torch.Tensor, visible: torch.Tensor | None, scale: float,
                sinks: torch.Tensor | None = None, pattern: torch.Tensor | None = None,
                softcap: float | None = None, dense=None) -> torch.Tensor:
        cfg = self.config
        Qn = query.shape[2]
        if visible is not None and visible.shape[-1] != self.get_seq_length():
            raise ValueError(
                f"attention_mask covers {visible.shape[-1]} tokens but the cache holds {self.get_seq_length()} "
                "(past + new): pass the mask of the whole sequence."
            )
        is_decode = self.decodes(Qn)
        self._draft_ranks = None
        if is_decode:
            out = self._attend_sparse(query, visible, scale, sinks, softcap)
        else:
            out = self._attend_dense(query, visible, scale, sinks, pattern, softcap, dense)
            self._cache.streams.wait(self.layer_idx)  # a prefetch made for a decode step that will not come
            self.predicted = False
        if Qn - self._cache.draft_rows > 1 and self.layer_idx == self._cache.context.first_layer:
            self._cache.context.note_padding(visible,
                                             self)  # a multi-token forward: the one-token steps after it read this
        draft_rows = self._cache.draft_rows
        if draft_rows:  # the draft token rode along: it attended, but its keys and values are not kept
            self.recent.truncate(self.recent.num_tokens - draft_rows)
        many = Qn - draft_rows > 1  # (a one-token step reads no padding, and decides no pool's form: no host sync)
        self._offload_complete_blocks(padding=many or not self.summaries.channels_fixed,
                                      scored=(query[:, :, : Qn - draft_rows], scale) if many else None)
        chunked = self._cache.context.prefill_tokens  # (a prompt's chunk before its last is followed by no decode step)
        if cfg.lookahead != "none" and self.pool.num_blocks > 0 and not (
                chunked and not is_decode and self.get_seq_length() < chunked):
            # The next step's blocks: chosen by the draft row (eagle3) or by this forward's last real query.
            predictor = query[:, :, -1:] if (draft_rows or not is_decode) else query
            self._prefetch_next(predictor, visible, is_decode)
        if (cfg.ahead_at_prefill and not is_decode and self.layer_idx == self._cache.context.first_layer
                and not (chunked and self.get_seq_length() < chunked)):  # the whole prompt is in this layer
            self._cache.compile_ahead_at_prefill(self, query, visible, scale)
        return out

    def _attend_dense(self, query, visible, scale, sinks=None, pattern=None, softcap=None, dense=None):
        tokens = self._cache.context.prefill_resident
        if tokens:  # a prompt prefilled in chunks, whose keys and values stay on the device until its last chunk
            return self._attend_resident(query, visible, scale, tokens, sinks, pattern, softcap, dense)
        kv = self._whole_kv()
        return (dense or causal_attention)(query, kv[0], kv[1], visible, scale, sinks, pattern, softcap)

    def _past_kv(self, tokens: int, shared: bool = True) -> torch.Tensor:
        """`[2, B, Hkv, tokens, D]` on the device whose first `NB * T` positions hold the pool's blocks, read from host
        memory a host chunk at a time into it (`TransferEngine.load_range(out=)`); the rest unwritten. `shared`: the
        cache's buffer for a dense forward's past where it has one (`ForwardContext.past_buffer`), else a new tensor."""
        recent = self.recent.kv  # [2, B, Hkv, r, D]
        _, B, H, _, D = recent.shape
        NB, T = self.pool.num_blocks, self.pool.block_size
        if shared:
            kv = self._cache.context.past_buffer(recent, tokens)
        else:
            kv = torch.empty((2, B, H, tokens, D), dtype=recent.dtype, device=recent.device)
        self._cache.transfer.load_range(self.pool, 0, NB, out=kv[:, :, :, : NB * T].view(2, B, H, NB, T, D))
        return kv

    def _whole_kv(self, shared: bool = True) -> torch.Tensor:
        """Every cached token's keys and values, `[2, B, Hkv, N, D]`: the pool's blocks, then the recent tokens
        (`shared`: as `_past_kv`'s)."""
        start = self.pool.num_blocks * self.pool.block_size
        kv = self._past_kv(start + self.recent.kv.shape[3], shared)
        kv[:, :, :, start:] = self.recent.kv
        return kv

    def _attend_resident(self, query, visible, scale, tokens: int, sinks=None, pattern=None, softcap=None,
                         dense=None):
        """`_attend_dense` for a chunk of a prompt prefilled in chunks (`runtime/routing.py`): the prompt's keys
        and values so far are kept in `resident_kv` `[2, B, Hkv, tokens, D]` on the device (the pool's blocks read
        from the host once, at the first chunk), so a later chunk reads them there instead of bringing the whole past
        back from host memory; each chunk writes its recent tokens (those the pool will take included) at their
        positions. Dropped after the last chunk."""
        NB, T = self.pool.num_blocks, self.pool.block_size
        recent = self.recent.kv  # [2, B, Hkv, r, D], positions NB * T on
        if self.resident_kv is None:
            self.resident_kv = self._past_kv(tokens, shared=False)
        end = NB * T + recent.shape[3]
        self.resident_kv[:, :, :, NB * T : end] = recent
        return (dense or causal_attention)(query, self.resident_kv[0, :, :, :end],
                                           self.resident_kv[1, :, :, :end], visible, scale, sinks, pattern, softcap)

    def _select(self, query, view, k: int):
        """`(block_ids, ranks)`, `[B, H, k']`: the k best blocks for `query` `[B, Hq, Qn, D]` (all when NB <= k)."""
        H, NB = self.num_kv_heads, self.pool.num_blocks
        if NB <= k:
            return all_blocks(view.allowed[:, :NB], H)
        ranks = rank_blocks(query, self.summaries, view.forced, view.allowed, self.config.block_size,
                            use_kernel=self.use_kernels)
        return top_blocks(ranks, k, self.top_k_kernel)

    def _select_with_draft(self, query, view, k: int):
        """`_select` of the real rows (all but the last of `query`), when a draft rides along and will also choose
        the next step's `slots` blocks (exact mode): both rows are ranked in one pass over the summaries and the
        draft's ranking is kept for `_prefetch_next` (used there unless a block completes in between)."""
        NB, slots = self.pool.num_blocks, self.config.slots
        if NB <= slots:  # the draft's prefetch will not rank anything (all blocks fit): rank the real rows alone
            return self._select(query[:, :, :-1], view, k)
        ranks = rank_blocks(query, self.summaries, view.forced, view.allowed, self.config.block_size,
                            use_kernel=self.use_kernels, split_last=True)  # [B, H, 2, NB]
        real, draft = ranks.unbind(2)
        self._draft_ranks = (NB, draft)
        return top_blocks(real, k, self.top_k_kernel)

    def _attend_sparse(self, query, visible, scale, sinks=None, softcap=None):
        cache, cfg = self._cache, self.config
        B, Hq, Qn, D = query.shape
        H, T, S = self.num_kv_heads, cfg.block_size, self.working_set.num_slots
        NB, n = self.pool.num_blocks, self.recent.num_tokens
        view = cache.context.step_visibility(visible, self, decode=True)
        ws = self.working_set
        cache.streams.wait(self.layer_idx)  # the blocks prefetched for this step have landed

        real = query[:, :, : Qn - cache.draft_rows]  # a riding draft row attends, but does not choose this step
        if cache.measure and cfg.lookahead != "none" and self.predicted:
            self._measure_recall(real, view)  # the slots still hold the prediction made for this step
        approximate = cfg.lookahead != "none" and not cfg.exact and self.predicted
        if not approximate:  # select with the real query; what is not resident moves now, on the critical path
            # every block while the context of this forward's first new token fits the budget (a verification
            # forward of assisted / prompt-lookup decoding holds candidates past the final length: still dense there)
            k = cfg.blocks_for_step(NB, n - Qn + 1)  # (n and Qn both count a riding draft row)
            if cache.draft_rows == 1 and cfg.exact:  # the draft row is ranked in the same pass, for the prefetch
                block_ids, ranks = self._select_with_draft(query, view, k)
            else:
                block_ids, ranks = self._select(real, view, k)
            placed = self.slot_map.assign(block_ids, ranks, cache.context.device_clock(self.device), ws.visible,
                                          cache.counters.device_counts(self.device)[0], T, cfg.max_fetch(NB))
            cache.transfer.fetch(self.pool, ws, block_ids, placed.dest, placed.fetch)
            if cache.measure and cfg.lookahead == "none":  # a check of the measure: 1.0 unless a fetch cap bites
                self._measure_recall(real, view)

        # Compute: attend over the selected slots and the recent tokens (visibility: padding, causality).
        recent_visible = cache.context.recent_visibility(view, n, self.recent.count, ws.recent_capacity, self.device)
        kernel = self.attention_kernel and softcap is None  # (no kernel caps the scores: the torch attention)
        if not kernel:  # (the kernel reads the per-forward mask itself: no copy per layer)
            ws.set_recent_visible(recent_visible)
        if view.block_tokens is not None:  # padding inside selected blocks (left-padded batches)
            held = self.slot_map.slot_block[..., :S].clamp(min=0)
            batch = torch.arange(B, device=held.device)[:, None, None]
            ws.visible[:, :, : S * T] &= view.block_tokens[batch, held].reshape(B, H, S * T)
        if cache.record_selection:
            self.last_selection = attended_blocks(self.working_set, self.slot_map, T, NB)
            self.last_recent_tokens = n - cache.draft_rows  # the real rows' recent tokens, the new ones included
            if cache.selection_log is not None:  # `oasis_cache.plot.record` (analysis: copies to the host)
                cache.selection_log.append(dict(step=cache.decode_clock, layer=self.layer_idx,
                                                attended=self.last_selection.cpu(),
                                                predicted=getattr(self, "last_prediction", None)))
        keys, values, mask = ws.attendable()
        if kernel:  # the new tokens' causality computed in the kernel from the device count
            out = decode_attention(query, keys, values, mask, self.recent.count, S * T, scale,
                                   recent_visible=recent_visible, sinks=sinks)
        else:
            bias = cache.context.new_token_bias(Qn, Hq // H, keys.shape[2], S * T, self.recent.count, query.dtype,
                                        self.device)
            out = sparse_attention(query, keys, values, mask, scale, bias, sinks, softcap)
        cache.counters.record_layer_step(B * H, n)
        return out

    def _prefetch_next(self, query, visible, after_decode: bool) -> None:
        """Lookahead: `query` (this forward's, or the draft token's) selects the next step's blocks; their gather
        runs on the side stream while the rest of this step computes. With `exact`, all slots are filled (the next
        step repairs what is missing)."""
        cache, cfg = self._cache, self.config
        view = cache.context.step_visibility(visible, self, decode=after_decode)  # blocks completed here count too
        # (the next step attends what is placed here, without `exact`: its query sees one more token)
        k = cfg.slots if cfg.exact else cfg.blocks_for_step(self.pool.num_blocks, self.recent.num_tokens + 1)
        ranked, self._draft_ranks = self._draft_ranks, None
        if ranked is not None and ranked[0] == self.pool.num_blocks:  # ranked before attention, same blocks since
            block_ids, ranks = top_blocks(ranked[1], k, self.top_k_kernel)
        else:
            block_ids, ranks = self._select(query, view, k)
        max_fetch = cfg.max_fetch(self.pool.num_blocks) if after_decode else cfg.slots
        placed = self.slot_map.assign(block_ids, ranks, cache.context.device_clock(self.device),
                                      self.working_set.visible, cache.counters.device_counts(self.device)[2],
                                      cfg.block_size, max_fetch)
        if cache.selection_log is not None:  # what this prediction placed, for the next step's record
            NB = self.pool.num_blocks
            self.last_prediction = marked_blocks(block_ids, (ranks > -torch.inf) & (block_ids < NB), NB).cpu()
        pool, ws = self.pool, self.working_set
        cache.streams.launch(
            self.layer_idx,
            lambda: cache.transfer.fetch(pool, ws, block_ids, placed.dest, placed.fetch, prefetch=True),
            block_ids, placed.dest, placed.fetch,
        )
        self.predicted = True

    def _measure_recall(self, query, view) -> None:
        """Measurement mode: how many of the real query's top-K blocks (sink and recent excluded: always in both) the
        prediction made resident and attended."""
        block_ids, ranks = self._select(query, view, self.config.num_selected_blocks)
        real = (ranks > -torch.inf) & (ranks < torch.inf)
        # (ids past NB, picked at -inf when few blocks are allowed, are not real: clamped only to stay in range)
        NB = self.pool.num_blocks
        attended = attended_blocks(self.working_set, self.slot_map, self.config.block_size, NB)
        predicted = attended.gather(-1, block_ids.clamp(max=NB - 1))
        self._cache.counters.record_recall(self.layer_idx, (predicted & real).sum(), real.sum())

    def _offload_complete_blocks(self, padding: bool = True, scored: tuple | None = None) -> None:
        """Move the recent tokens' complete blocks to the host pool and summarize them; with `padding`, the batch's
        recorded padding among their tokens weighs in no summary (`_real_tokens`); `scored`: (the forward's
        queries, their scale) that decide a narrow pool's form at its first blocks."""
        blocks = self.recent.take_complete_blocks(self.config.block_size)  # [2, B, H, n, T, D]
        if blocks is None:
            return
        if scored is not None and not self.pool.num_blocks and self.pool.representation.narrow_form:
            self.pool, self.score_noise = measured_pool(self.pool, blocks, *scored, self.config.host_chunk_blocks)
        self._cache.transfer.offload(self.pool, blocks, self.summaries.count)  # (one block: at the device count)
        self.summaries.append(blocks[0], self._real_tokens(blocks.shape[3]) if padding else None)
        self._after_completed_blocks(blocks.shape[3])
        if self.pool.representation.narrow_form:  # (sink and newest blocks as made: `SlotMap.hold_newest`)
            context = self._cache.context
            self.slot_map.hold_newest(self.working_set, blocks, self.summaries.count, self.config.num_recent_blocks,
                                      context.device_clock(self.device), context.sink_blocks(self))
        if blocks.shape[3] > 1:  # a prompt's: room for the next block now, the growth a completing step would make
            self.summaries.reserve(self.pool.num_blocks + 1)
            self.slot_map.reserve(self.pool.num_blocks + 1)

    def _real_tokens(self, n: int) -> torch.Tensor | None:
        """`[B, n, T]` bool: which tokens of the `n` blocks just completed (after the pool's earlier ones) are real,
        from the batch's recorded padding (noted by this forward's first layer); None without padding there."""
        padding, T = self._cache.context.padding, self.config.block_size
        start = (self.pool.num_blocks - n) * T
        if padding is None or padding.tokens is None or padding.tokens.shape[1] < start + n * T:
            return None
        return padding.tokens[:, start : start + n * T].reshape(self.batch_size, n, T)

    def _after_completed_blocks(self, n: int) -> None:
        """The host side of completing `n` blocks, after their offload and summaries (an eager step, or the
        bookkeeping of a replayed one: `advance_replayed_completion`): room ahead, and the counters."""
        self.reserve_ahead()
        self.slot_map.reserve(self.pool.num_blocks)
        self.reserve_slots(self.pool.num_blocks)
        block_bytes = 2 * self.pool.representation.unit_nbytes  # (as the host holds them: what crosses the link)
        self._cache.counters.record_offload(n * self.batch_size * self.num_kv_heads * block_bytes)
        self._cache.counters.block_bytes = block_bytes

    def reserve_ahead(self, blocks_coming: int = 0) -> None:
        """Grow the host pool up to HOST_GROWTH_SPREAD blocks past the next one (after `blocks_coming` more), by an
        amount that depends on the layer: pinning a new chunk takes milliseconds per layer (7.5 ms for 16 MB on the
        H200's host), so the layers should not all pay for it in the same decode step."""
        ahead = self.pool.num_blocks + blocks_coming + 1 + self.layer_idx % HOST_GROWTH_SPREAD
        self._cache.transfer.reserve(self.pool, ahead)

    def host_bytes_for(self, new_tokens: int, like: torch.Tensor) -> int:
        """Host bytes this layer's pool would add to hold `new_tokens` more tokens (shaped like `like`, `[B, Hkv, q,
        D]`, before the layer initializes), the blocks it reserves ahead included."""
        chunk_nbytes, chunks = self.host_chunks_for(new_tokens, like)
        return chunks * chunk_nbytes

    def host_chunks_for(self, new_tokens: int, like: torch.Tensor) -> tuple[int, int]:
        """(bytes of one chunk, chunks) this layer's pool would add for `new_tokens` more tokens (`host_bytes_for`)."""
        T = self.config.block_size
        B, H, _, D = like.shape
        block_nbytes = 2 * B * H * representation_for(self.config.host_dtype, like.dtype, T, D).unit_nbytes
        C = fitted_chunk_blocks(self.config.host_chunk_blocks, block_nbytes, like.device.type == "cuda")
        blocks = (self.get_seq_length() + new_tokens) // T + 1 + HOST_GROWTH_SPREAD
        chunks = -(-blocks // C) - (len(self.pool.chunks) if self.is_initialized else 0)
        return C * block_nbytes, max(0, chunks)

    def reserve_slots(self, num_blocks: int) -> None:
        """Working-set slots for a context of `num_blocks` complete blocks: as many as a step may select from it, up
        to `config.slots` (grown by doubling; slot contents and their masks stay, the recent tokens move along)."""
        ws, most = self.working_set, self.config.slots
        if min(num_blocks, most) <= ws.num_slots:
            return
        if self._cache.streams is not None:  # a prefetch in flight writes the old slots: it lands before the copy
            self._cache.streams.wait(self.layer_idx)
        grown = ws.grown(min(most, max(num_blocks, 2 * ws.num_slots)))
        recent = self.recent.kv  # (a view of the old region, alive until `prepend` copies it into the new one)
        self.working_set = grown
        self.slot_map.grow_slots(grown.num_slots)
        self.recent = RecentTokens(grown.recent_region, self.use_kernels)
        self.recent.prepend(recent)

    def fits_budget(self, new_tokens: int) -> bool:
        """Whether the context after `new_tokens` more tokens fits the budget (every block attended)."""
        return self.get_seq_length() + new_tokens <= self.config.token_budget

    # ---------------------------------------------------------------------------------------- captured steps
    def completes_block(self, query_length: int = 1) -> bool:
        """Whether a decode forward of `query_length` new tokens completes a block (the recent tokens reach T)."""
        return self.recent.num_tokens + query_length >= self.config.block_size

    def prepare_completion(self) -> None:
        """Before a step that completes one block is captured or replayed (host only): the host pool (also for what
        the step reserves after the block), the summaries and the slot map already have room for it, so the step
        itself allocates nothing."""
        NB = self.pool.num_blocks
        self.reserve_ahead(blocks_coming=1)
        self.summaries.reserve(NB + 1)
        self.slot_map.reserve(NB + 1)
        self.reserve_slots(NB + 1)

    def advance_replayed_completion(self) -> None:
        """The host effects of a replayed step that completed one block (its device work: the offload at the device
        count, the summaries' append, the recent tokens' count set to 0)."""
        self.recent.num_tokens = 0
        self.pool.num_blocks += 1
        self.summaries.num_blocks += 1
        self._cache.transfer.forget_offload(self.pool)
        self._after_completed_blocks(1)

    # ------------------------------------------------------------------------------------------------- inspection
    def full_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token's keys and values, `[B, Hkv, N, D]` each, gathered from the host pool and the recent
        tokens (for tests and debugging; moves the whole layer; a new tensor, not a chunked prefill's buffer)."""
        kv = self._whole_kv(shared=False)
        return kv[0], kv[1]

    def device_nbytes(self) -> dict:
        """Bytes this layer holds on the compute device, by pool."""
        if not self.is_initialized:
            return {}
        overflow = 0 if self.recent.in_region else self.recent.kv.numel() * self.recent.kv.element_size()
        return {
            "summaries": self.summaries.nbytes,
            "slot_map": self.slot_map.nbytes,
            "working_set": self.working_set.nbytes,  # slots and the recent-token region
            "recent_overflow": overflow,
        }

    def state_stamps(self) -> tuple:
        """The stamps of the pools `state_tensors` reads (`pools/stamped.py`): equal stamps, same tensors."""
        return self.summaries.stamp, self.working_set.stamp, self.slot_map.stamp, self.recent.stamp

    def state_tensors(self) -> list[torch.Tensor]:
        """The device tensors this layer keeps between forwards (summaries, working set, slot map, recent tokens).
        A decode step that completes no block updates them in place — never rebinds one — which a captured step
        relies on (`tests/runtime/test_captured_step.py`)."""
        return [value for part in (self.summaries, self.working_set, self.slot_map, self.recent)
                for value in vars(part).values() if isinstance(value, torch.Tensor)]

    def __repr__(self):
        return f"OasisLayer(layer_idx={self.layer_idx}, tokens={self.get_seq_length()})"
