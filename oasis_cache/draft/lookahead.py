"""The eagle3 ride-along: the draft token travels through the model beside the real one.

Per decode forward (hooks on the model's decoder, active only for the OasisCache they belong to):
1. before: the head drafts x̂(t+1) from the features the previous forward captured (the real row's hidden states at
   the three aux layers) and the embedding of the real token x(t); the forward's input becomes [x(t), x̂(t+1)]
   (positions and 2D mask extended by one);
2. in every full-attention layer the draft row attends like the real one (causally after it), its keys/values are
   dropped after the layer, and its query selects the blocks the next step needs (`OasisLayer.attend`);
3. after: the draft row is cut from the decoder's output, sliding layers drop its keys/values, and the real row's
   aux hidden states are kept for the next draft;
4. chained drafts (`OasisConfig.chain_drafts`): the LM head takes the draft row back as one more row of its product
   (weights read once), its most likely token x̃(t+2) is kept and the row is cut from the logits. At the next step,
   where x̂(t+1) was right, x̃(t+2) is the whole target's prediction of the token after it: it is drafted instead of
   the head's guess (the head still runs: its keys/values need every row, and it drafts where x̂ was wrong).
After a prefill the head reads the prompt's aux hidden states once, filling its own keys/values.

Shapes: aux features `[B, n, 3H]`; drafts `[B, 1]` (target ids); the head's keys/values: `head_window.HeadKV`.
"""

from __future__ import annotations

import weakref

import torch

from ..layer import OasisLayer
from .eagle3 import Eagle3Head
from .head_step import StaticDraftStep
from .head_window import HeadKV


def kept_in_place(kept: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`value` written into the kept buffer when it fits (shape, dtype, device: in place, so a captured decode step
    reads and writes the same memory), else a copy of its own (never a view that would keep a forward's tensors
    alive). Returns the buffer to keep."""
    if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype and kept.device == value.device:
        return kept.copy_(value)
    return value.clone()


class RideAlong:
    """The head's attention window (`Eagle3Config.attention_window`, as it was trained) also bounds its keys/values,
    whatever the context; without one (published heads) they grow with the context."""

    def __init__(self, model, cache, head: Eagle3Head):
        self.head = head
        self.window = head.config.attention_window
        self.cache = weakref.ref(cache)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.decoder = decoder
        self.embed = model.get_input_embeddings()
        layers = decoder.layers
        self.aux_ids = head.config.aux_hidden_state_ids
        if max(self.aux_ids) >= len(layers):
            raise ValueError(f"the head reads hidden states {self.aux_ids}; the model has {len(layers)} layers")
        self._aux: dict[int, torch.Tensor] = {}
        self._last_features: torch.Tensor | None = None  # [B, 3H]: the previous forward's last real row
        self._head_kv = HeadKV(self.window)  # the head's keys/values (a ring of window - 1 rows)
        # "graph" replays a full ring's decode call as one CUDA graph, "eager" runs the same static-buffer call
        # eagerly (tests); None: the plain call; "auto" (default): "graph" on CUDA ("eager" when the cache captures
        # whole decode steps: the step's graph holds the call), else None. Beam search (reordered rows) always takes
        # the plain call.
        self.static_head: str | None = "auto"
        self._static: StaticDraftStep | None = None
        self._reordered = False
        self._rows = 0  # head rows so far (its positions)
        self._active = False  # this forward carries a draft row
        self._ours = False  # this forward uses our cache
        self._input_ids: torch.Tensor | None = None
        self.oracle = None  # analysis: callable(position) -> [B, 1] target ids that replace the head's draft
        self.draft_hits = [0, 0]  # analysis with an oracle: drafts equal to the oracle's token, drafts made
        # The head's accuracy in use: each one-token decode step checks the draft made at the step before against
        # the token that came (device counter, read by `stats()`).
        self._made: torch.Tensor | None = None  # [B, 1]: the draft that rode in the last one-token step
        self._hits: torch.Tensor | None = None  # int64 scalar on the device
        self._checked = 0  # drafts checked
        # Chained drafts: the LM head also scores the draft row of the forward just run.
        lm_head = model.get_output_embeddings() if cache.config.chain_drafts else None
        self.lm_head = lm_head if isinstance(lm_head, torch.nn.Module) else None
        self._draft_hidden: torch.Tensor | None = None  # [B, 1, H]: the draft row's last hidden state, for the LM head
        self._chained: torch.Tensor | None = None  # [B, 1]: the target's next token after the last draft row
        self._chain_ready = False  # the last forward left `_chained` (its LM head scored the draft row)
        self.handles = [
            decoder.register_forward_pre_hook(self._before, with_kwargs=True),
            decoder.register_forward_hook(self._after, with_kwargs=True),
        ]
        if self.lm_head is not None:
            self.handles += [self.lm_head.register_forward_pre_hook(self._lm_head_before),
                             self.lm_head.register_forward_hook(self._lm_head_after)]
        for i in sorted(set(self.aux_ids)):
            self.handles.append(layers[i].register_forward_pre_hook(self._capture(i), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def copy_for(self, model, cache) -> "RideAlong":
        """The ride-along of `cache`, a deep copy of this one's cache: its own hooks, a copy of every piece of state
        (the head's keys/values, features, drafts, counters), the head's weights shared."""
        import copy

        new = RideAlong(model, cache, self.head)
        new.__dict__.update(copy.deepcopy(self.state(), {}))
        return new  # (its static call is built again from the copied ring at its next step)

    # what a new RideAlong builds for its own model and cache (hooks, modules, the static call)
    REBUILT = ("head", "cache", "decoder", "embed", "lm_head", "handles", "_static", "window", "aux_ids")

    def state(self) -> dict:
        """Every piece of state a copy or an admitted cache carries over (the head's keys/values, features, drafts,
        counters, options), by reference: not the attributes in `REBUILT`."""
        return {key: value for key, value in self.__dict__.items() if key not in self.REBUILT}

    def reset(self) -> None:
        self._last_features, self._rows, self._made = None, 0, None
        self._draft_hidden, self._chain_ready = None, False
        self._head_kv.reset()
        self._static, self._reordered = None, False

    def index_batch(self, indices: torch.Tensor) -> None:
        """Sequence i becomes old sequence `indices[i]` (beam search)."""
        if self._last_features is not None:
            indices = indices.to(self._last_features.device)
            self._last_features = self._last_features.index_select(0, indices)
        self._head_kv.index_batch(indices)
        self._static, self._reordered, self._made, self._chain_ready = None, True, None, False

    def repeat_interleave(self, repeats: int) -> None:
        if self._last_features is not None:
            self.index_batch(torch.arange(self._last_features.shape[0]).repeat_interleave(repeats))

    # ---------------------------------------------------------------------------------------------------- hooks
    def _before(self, module, args, kwargs):
        cache = self.cache()
        if cache is None:
            self.remove()
            return None
        used = kwargs.get("cache", kwargs.get("past_key_values"))
        self._ours = used is cache
        self._active = False
        self._draft_hidden = None  # a draft row the LM head was not called for (a decoder called alone) is dropped
        if not self._ours:  # another cache's forward: this one's chained token stays for its next step
            return None
        chain_ready, self._chain_ready = self._chain_ready, False
        if len(args) > 1:  # called positionally beyond input_ids: leave such a forward alone
            self._input_ids = None
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self._input_ids = input_ids
        if input_ids is None:  # embeddings given directly: no token to draft from
            return None
        q = input_ids.shape[1]
        decoding = self._last_features is not None and cache.get_seq_length() > 0 and \
            q + 1 <= cache.config.max_decode_tokens
        made, self._made = self._made, None
        if not decoding:
            return None
        token = input_ids[:, -1:]
        if made is not None and q == 1 and self.oracle is None:
            self._count_hit(made, token)
        # the token the last draft row predicted holds where that draft was right (one token came: the one it drafted)
        rode = made if chain_ready and q == 1 and made is not None and self._chained.shape == made.shape else None
        draft = self._draft(token, rode)  # [B, 1]
        if q == 1:  # the draft that rides, kept in one buffer (a captured step compares where it wrote)
            self._made = kept_in_place(made, draft)
        kwargs = dict(kwargs)
        if args:
            args = ()
        kwargs["input_ids"] = torch.cat((input_ids, draft), dim=1)
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            kwargs["position_ids"] = torch.cat((position_ids, position_ids[:, -1:] + 1), dim=1)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            kwargs["attention_mask"] = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        self._active = True
        cache.draft_rows = 1
        return args, kwargs

    def _count_hit(self, made: torch.Tensor, token: torch.Tensor) -> None:
        if self._hits is None or self._hits.device != made.device:
            self._hits = torch.zeros((), dtype=torch.long, device=made.device)
        self._hits.add_((made == token).sum())
        self._checked += made.numel()

    def stats(self) -> dict:
        """`draft_accuracy`: the share of one-token decode steps (per sequence) whose draft, made at the step before,
        equals the token that came — what the prefetch's recall follows (`eval/recall.py`); None before any."""
        hits = 0 if self._hits is None else int(self._hits)
        return {"draft_accuracy": hits / self._checked if self._checked else None, "drafts_checked": self._checked}

    def _capture(self, index: int):
        def hook(module, args, kwargs):
            if self._ours:
                self._aux[index] = kwargs.get("hidden_states", args[0] if args else None)
        return hook

    def _after(self, module, args, kwargs, output):
        if not self._ours:
            return None
        cache = self.cache()
        features = torch.cat([self._aux[i] for i in self.aux_ids], dim=-1)  # [B, q(+1), 3H]
        self._aux.clear()
        if self._active:
            cache.draft_rows = 0
            for layer in cache.layers:  # HF's own (sliding) layers stored the draft row: drop it
                if not isinstance(layer, OasisLayer) and getattr(layer, "is_initialized", False):
                    layer.crop(-1)
            if self.lm_head is not None:  # the LM head scores it beside the real rows (`_lm_head_before`)
                self._draft_hidden = output.last_hidden_state[:, -1:]
            output.last_hidden_state = output.last_hidden_state[:, :-1]
            self._last_features = kept_in_place(self._last_features, features[:, -2])  # [B, 3H]
            self._input_ids = None
            return output
        # A prefill or a long extend: the head reads it, row j = (features j, token j+1).
        ids = self._input_ids
        if ids is None:  # no token ids to pair with: the head starts over at the next forward
            self.reset()
            return None
        if self._last_features is not None and ids.shape[1] >= 1:  # the first new token pairs with the old row
            self._head_rows(self._last_features[:, None], ids[:, :1])
        if ids.shape[1] > 1:  # only the last `window` rows can matter later
            start = 0 if self.window is None else max(0, ids.shape[1] - 1 - self.window)
            self._rows += start
            self._head_rows(features[:, start:-1], ids[:, start + 1 :])
        self._last_features = kept_in_place(self._last_features, features[:, -1])  # [B, 3H]
        return None

    def _lm_head_before(self, module, args):
        """The LM head's input `[B, n, H]` (the real rows asked for) gets the draft row appended: `[B, n + 1, H]`."""
        hidden = self._draft_hidden
        if hidden is None or not args or args[0].dim() != 3 or args[0].shape[0] != hidden.shape[0]:
            self._draft_hidden = None
            return None
        return (torch.cat((args[0], hidden.to(args[0].dtype)), dim=1),) + args[1:]

    def _lm_head_after(self, module, args, output):
        """Keeps the draft row's most likely next token `[B, 1]` (in place, as a captured step needs) and returns the
        real rows' logits `[B, n, V]`."""
        if self._draft_hidden is None:
            return None
        self._draft_hidden = None
        # [B, 1], where the drafts are made (a model spread over devices may keep its LM head elsewhere)
        chained = output[:, -1].argmax(-1, keepdim=True).to(self.embed.weight.device)
        self._chained = kept_in_place(self._chained, chained)
        self._chain_ready = True
        return output[:, :-1]

    # ------------------------------------------------------------------------------------------- captured steps
    def replayable(self, batch: int) -> bool:
        """Whether the next one-token decode step's ride-along does only in-place device work that a captured step
        can replay: the head's ring is full (its call on static buffers, without a graph of its own: a graph is not
        replayed inside another's capture), the previous step left a draft to check, no oracle (analysis) and no
        reordered rows."""
        kv = self._head_kv
        return (self.oracle is None and not self._reordered and self._static is not None
                and self._static.graph is None and kv.full and kv.k.shape[-4] == batch and self._made is not None
                and self._hits is not None and self._last_features is not None
                and (self.lm_head is None or self._chain_ready))

    def state_tensors(self) -> list[torch.Tensor]:
        """The device tensors a replayed step reads or writes (their addresses are part of the replay signature)."""
        static = self._static
        tensors = [self._last_features, self._made, self._hits, self._chained, self._head_kv.k, self._head_kv.v]
        if static is not None:
            tensors += [static.features, static.token, static.position, static.slot, static.draft]
        return [t for t in tensors if t is not None]

    def advance_replayed_step(self) -> None:
        """The host effects of a replayed one-token step (`_before` / `_after` and the static call skipped)."""
        self._checked += self._made.numel()
        self._rows += 1
        self._head_kv.advance()
        self._chain_ready = self.lm_head is not None  # the replayed LM head wrote `_chained`

    # ------------------------------------------------------------------------------------------------ the head
    @torch.no_grad()
    def _head_rows(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Run the head over rows (features `[B, n, 3H]`, next tokens `[B, n]`), keeping its keys/values; returns
        the last row's draft-vocab logits `[B, Vd]`."""
        self._static = None  # its device-side position and slot would go stale
        n = features.shape[1]
        positions = torch.arange(self._rows, self._rows + n, device=features.device).expand(features.shape[0], n)
        rows = features.to(self.head.fc.weight.dtype), self.embed(next_ids), positions
        kv = self._head_kv
        if n == 1 and kv.has_ring and kv.k.shape[-4] == features.shape[0]:  # a decode step: static shapes
            ring_k, ring_v, valid = kv.ring()
            logits, _, (k, v) = self.head(*rows, (ring_k, ring_v), past_mask=valid)
            kv.write_one(k, v)
        else:
            logits, _, (k, v) = self.head(*rows, kv.past())
            kv.store(k, v)
        self._rows += n
        return logits[:, -1]

    def _draft(self, token: torch.Tensor, rode: torch.Tensor | None) -> torch.Tensor:
        """x̂(t+1) `[B, 1]` (target ids) from the previous features and x(t) `[B, 1]`; with `rode` (the draft that rode
        in the last forward, `[B, 1]`), the chained token where it equals x(t)."""
        kv, B = self._head_kv, token.shape[0]
        static = self.static_head
        if static == "auto":
            static = None if token.device.type != "cuda" else "eager" if self.cache().captured_steps else "graph"
        if static and kv.full and kv.k.shape[-4] == B and not self._reordered:
            if self._static is None:
                self._static = StaticDraftStep(self.head, self.embed, kv, self._rows, static == "graph")
            draft = self._static(self._last_features[:, None], token)
            self._rows += 1
        else:
            logits = self._head_rows(self._last_features[:, None], token)
            draft = self.head.greedy_draft(logits)
        if rode is not None:
            draft = torch.where(rode == token, self._chained, draft)
        if self.oracle is None:
            return draft
        true = self.oracle(self.cache().get_seq_length() + 1).to(draft.device)  # analysis only: syncs below
        self.draft_hits[0] += int((draft == true).sum())
        self.draft_hits[1] += draft.numel()
        return true
