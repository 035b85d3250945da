"""Counters of what a cache did. Per-layer counts accumulate in one small device tensor (no host sync in decode);
`as_dict` reads it once."""

from __future__ import annotations

import torch

# Order of the device accumulator's entries.
_FIELDS = ("blocks_selected", "blocks_hit", "blocks_fetched", "tokens_attended")


class CacheStats:
    def __init__(self):
        self._acc: torch.Tensor | None = None  # int64 [len(_FIELDS)], on the compute device
        self.decode_steps = 0  # forwards that decoded sparsely-eligible tokens (q <= max_decode_tokens, past > 0)
        self.dense_forwards = 0  # forwards attended densely (prefill, long extends)
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.layer_steps = 0  # (layer, decode forward) pairs, for per-layer means
        self.heads = 0  # B * Hkv of the last decode step, for per-head means
        self.block_bytes = 0  # bytes of one block's keys + values (one sequence, one KV head)
        self.bytes_offloaded = 0

    def record_decode(self, selected, hit, fetched, tokens_attended, block_bytes: int) -> None:
        """Tensors `[B, Hkv, ...]` of one layer's decode step (bool masks, and tokens attended per head)."""
        B, H = selected.shape[:2]
        self.layer_steps += 1
        self.heads = B * H
        self.block_bytes = block_bytes
        counts = torch.stack((selected.sum(), hit.sum(), fetched.sum(), tokens_attended.sum()))
        if self._acc is None:
            self._acc = torch.zeros(len(_FIELDS), dtype=torch.int64, device=counts.device)
        self._acc += counts

    def record_offload(self, nbytes: int) -> None:
        self.bytes_offloaded += nbytes

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict:
        acc = dict(zip(_FIELDS, self._acc.tolist() if self._acc is not None else [0] * len(_FIELDS)))
        per = max(1, self.layer_steps * max(self.heads, 1))
        steps = max(1, self.decode_steps)
        return {
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "dense_forwards": self.dense_forwards,
            "prefill_tokens": self.prefill_tokens,
            "tokens_attended_per_step": acc["tokens_attended"] / per,  # per layer and KV head
            "blocks_selected_per_step": acc["blocks_selected"] / per,
            "blocks_fetched_per_step": acc["blocks_fetched"] / per,
            "blocks_selected": acc["blocks_selected"],
            "blocks_fetched": acc["blocks_fetched"],
            "bytes_fetched": acc["blocks_fetched"] * self.block_bytes,
            "bytes_fetched_per_step": acc["blocks_fetched"] * self.block_bytes / steps,  # all layers and heads
            "bytes_offloaded": self.bytes_offloaded,
            "hit_rate": acc["blocks_hit"] / acc["blocks_selected"] if acc["blocks_selected"] else 0.0,
        }
