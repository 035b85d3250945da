"""N-gram lookup beside the head: when the last `order` tokens occurred earlier within the window, the token that
followed them is the draft (prompt-lookup decoding's guess) instead of the head's.

Why: on documentation continued greedily, SmolLM2's next token repeats a trigram seen within the head's 256-token
window at 59% of the steps, and the shipped head gets only 68% of those right though the target is 80% sure there;
the lookup lifts the draft from 63% to 76% of steps there, and leaves chat answers as they were (67%)
(`eval/draft_misses.py`, docs/performance.md). Measured in recall it helps where the generation repeats
itself (CPU: +3 / +8 points) and not on the H200's trajectories (-1 point each): off by default
(`OasisConfig.draft_lookup = 0`; docs/performance.md).

Arbiter (`arbiter=True`; off in the package, `eval/recall.py --draft-lookup 2+arbiter` measures it): where the
lookup and the head disagree, which of them was right recently decides. Each step both candidates are kept
(`proposed`); at the next step the token that came scores them (`observe`): a running hit rate per sequence over the
steps where the lookup had a candidate (`scores`, decay `DECAY`). The lookup's candidate is drafted where its rate is
at least the head's (at first, and while the two agree), so a generation that repeats itself would get the lookup and
one where copying guesses wrong would keep the head (the H200's SmolLM2 trajectories: the lookup alone cost a point
of recall). On this CPU (Qwen2.5-Coder at 8K) it was no better than the lookup
alone: docs/performance.md.

State: `history` `[B, W]` int64, the last W tokens of each sequence, oldest first (-1 before the first token), shifted
by one per decode step; with the arbiter, `proposed` `[B, 2]` int64, the last step's candidates (lookup, -1 where
none; head), and `scores` `[B, 2]` float32, their hit rates: fixed shapes, updated in place, no host sync.
"""

from __future__ import annotations

import torch


DECAY = 0.9  # the arbiter's running hit rates: each observed step weighs 1 - DECAY


class NgramLookup:
    def __init__(self, order: int, window: int, arbiter: bool = False):
        if order < 1 or window < order + 1:
            raise ValueError(f"an n-gram lookup needs order >= 1 and a window above it, got {order} and {window}")
        self.order, self.window, self.arbiter = order, window, arbiter
        self.history: torch.Tensor | None = None  # [B, W]
        self._starts: torch.Tensor | None = None  # [W - order]: where an earlier occurrence may start
        self.proposed: torch.Tensor | None = None  # [B, 2]: the last candidates (lookup or -1, head)
        self.scores: torch.Tensor | None = None  # [B, 2] float32: their running hit rates where the lookup had one

    def reset(self) -> None:
        self.history = self.proposed = self.scores = None

    def extend(self, ids: torch.Tensor) -> None:
        """Append tokens `ids` `[B, q]` (a prompt, an extend, a decode step's token)."""
        if self.history is None or self.history.shape[0] != ids.shape[0]:
            self.history = torch.full((ids.shape[0], self.window), -1, dtype=torch.long, device=ids.device)
            self._starts = torch.arange(self.window - self.order, device=ids.device)
            self.scores = torch.full((ids.shape[0], 2), 0.5, dtype=torch.float32, device=ids.device)
            self.proposed = None
        if ids.shape[1] > 1:  # several tokens: the last candidates were for the first of them only
            self.proposed = None
        q = min(ids.shape[1], self.window)
        self.history.copy_(torch.cat((self.history[:, q:], ids[:, -q:].to(torch.long)), dim=1))

    def observe(self, token: torch.Tensor) -> None:
        """The token `[B, 1]` that came after the last `propose`: scores both candidates where the lookup had one
        (the arbiter's bookkeeping: nothing without it)."""
        if not self.arbiter or self.proposed is None or self.proposed.shape[0] != token.shape[0]:
            return
        hits = (self.proposed == token.to(self.proposed.device)).float()  # [B, 2]
        had = self.proposed[:, :1] >= 0  # [B, 1]
        self.scores.copy_(torch.where(had, DECAY * self.scores + (1 - DECAY) * hits, self.scores))

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.history is not None:
            indices = indices.to(self.history.device)
            self.history = self.history.index_select(0, indices)
            self.scores = self.scores.index_select(0, indices)
            self.proposed = None

    def propose(self, draft: torch.Tensor) -> torch.Tensor:
        """`draft` `[B, 1]` (the head's) -> `[B, 1]`: where the last `order` tokens of the history occurred earlier in
        it, the token that followed their latest earlier occurrence — with the arbiter, only where the lookup has been
        right at least as often as the head lately (`scores`); elsewhere `draft`."""
        n, W, history = self.order, self.window, self.history
        key = history[:, W - n :]  # [B, n]
        grams = history.unfold(1, n, 1)[:, : W - n]  # [B, W - n, n]: occurrences starting at 0 .. W-n-1
        match = (grams == key[:, None]).all(-1) & (grams[..., 0] >= 0)  # [B, W - n]
        latest = torch.where(match, self._starts, -1).amax(-1, keepdim=True)  # [B, 1]
        follower = history.gather(1, (latest + n).clamp(min=0))  # the token after it (<= W - 1)
        found = (latest >= 0) & (follower >= 0)  # [B, 1]
        use = found
        if self.arbiter:  # keep both candidates for `observe` (in place: a captured step writes the same memory)
            from .lookahead import kept_in_place  # (lookahead imports this module)

            candidates = torch.cat((torch.where(found, follower, -1), draft.to(follower.dtype)), dim=1)  # [B, 2]
            self.proposed = kept_in_place(self.proposed, candidates)
            use = found & (self.scores[:, :1] >= self.scores[:, 1:])
        return torch.where(use, follower.to(draft.dtype), draft)
