"""N-gram lookup beside the head: when the last `order` tokens occurred earlier within the window, the token that
followed them is the draft (prompt-lookup decoding's guess) instead of the head's.

Why: on documentation continued greedily, SmolLM2's next token repeats a trigram seen within the head's 256-token
window at 59% of the steps, and the shipped head gets only 68% of those right though the target is 80% sure there;
the lookup lifts the draft from 63% to 76% of steps there, and leaves chat answers as they were (67%)
(`eval/draft_misses.py`, docs/perf.md, eighth session). Measured in recall it helps where the generation repeats
itself (CPU: +3 / +8 points) and not on the H200's trajectories (-1 point each): off by default
(`OasisConfig.draft_lookup = 0`; docs/perf.md, ninth session).

State: `history` `[B, W]` int64, the last W tokens of each sequence, oldest first (-1 before the first token), shifted
by one per decode step: fixed shapes, no host sync.
"""

from __future__ import annotations

import torch


class NgramLookup:
    def __init__(self, order: int, window: int):
        if order < 1 or window < order + 1:
            raise ValueError(f"an n-gram lookup needs order >= 1 and a window above it, got {order} and {window}")
        self.order, self.window = order, window
        self.history: torch.Tensor | None = None  # [B, W]
        self._starts: torch.Tensor | None = None  # [W - order]: where an earlier occurrence may start

    def reset(self) -> None:
        self.history = None

    def extend(self, ids: torch.Tensor) -> None:
        """Append tokens `ids` `[B, q]` (a prompt, an extend, a decode step's token)."""
        if self.history is None or self.history.shape[0] != ids.shape[0]:
            self.history = torch.full((ids.shape[0], self.window), -1, dtype=torch.long, device=ids.device)
            self._starts = torch.arange(self.window - self.order, device=ids.device)
        q = min(ids.shape[1], self.window)
        self.history.copy_(torch.cat((self.history[:, q:], ids[:, -q:].to(torch.long)), dim=1))

    def index_batch(self, indices: torch.Tensor) -> None:
        if self.history is not None:
            self.history = self.history.index_select(0, indices.to(self.history.device))

    def propose(self, draft: torch.Tensor) -> torch.Tensor:
        """`draft` `[B, 1]` (the head's) -> `[B, 1]`: where the last `order` tokens of the history occurred earlier in
        it, the token that followed their latest earlier occurrence; elsewhere `draft`."""
        n, W, history = self.order, self.window, self.history
        key = history[:, W - n :]  # [B, n]
        grams = history.unfold(1, n, 1)[:, : W - n]  # [B, W - n, n]: occurrences starting at 0 .. W-n-1
        match = (grams == key[:, None]).all(-1) & (grams[..., 0] >= 0)  # [B, W - n]
        latest = torch.where(match, self._starts, -1).amax(-1, keepdim=True)  # [B, 1]
        follower = history.gather(1, (latest + n).clamp(min=0))  # the token after it (<= W - 1)
        return torch.where((latest >= 0) & (follower >= 0), follower, draft)
