"""Counters of what a cache did. Per-layer counts accumulate in one small device tensor (written by the slot
assignment itself, no extra launch and no host sync in decode); `as_dict` reads it once."""

from __future__ import annotations

import torch

# Entries of the device counters (see `SlotMap.assign`).
_FIELDS = ("blocks_selected", "blocks_hit", "blocks_fetched", "slot_tokens_attended")


class CacheStats:
    """Device counters `[3, 4]`: row 0 placements made with the real query (their fetches are on the critical
    path), row 1 placements made by predictions that a decode step then used, row 2 those of the last forward's
    predictions, not yet used (moved to row 1 when the next decode step starts, `consume_predictions`; dropped by a
    dense forward: a prediction made after the last step counts its fetches but no step); columns `_FIELDS`."""

    def __init__(self, lookahead: str = "none", exact: bool = False):
        self.attention_row = 1 if lookahead != "none" and not exact else 0  # which placements attention used
        self._counts: torch.Tensor | None = None  # int64 [2, len(_FIELDS)], on the compute device
        self._recall: dict[int, torch.Tensor] = {}  # layer -> int64 [2]: predicted & real, real (measurement mode)
        self.decode_steps = 0  # forwards of <= max_decode_tokens tokens on a cache with complete blocks
        self.dense_forwards = 0  # forwards attended densely (prefill, long extends)
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.layer_steps = 0  # (layer, decode forward) pairs
        self.head_steps = 0  # (layer, decode forward, sequence, KV head) tuples, for per-head means
        self.recent_tokens_attended = 0  # summed over head_steps
        self.block_bytes = 0  # keys + values of one block, one sequence, one KV head
        self.bytes_offloaded = 0

    def device_counts(self, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros((3, len(_FIELDS)), dtype=torch.int64, device=device)
        return self._counts

    def consume_predictions(self, decode: bool) -> None:
        """At the start of a forward (device ops, no sync): the predictions of the forward before are used by this
        one (a decode step) or not (a dense forward); either way row 2 starts empty."""
        if self._counts is None:
            return
        if decode:
            self._counts[1] += self._counts[2]
        else:  # unused predictions still moved their blocks
            self._counts[1, 2] += self._counts[2, 2]
        self._counts[2].zero_()

    def record_recall(self, layer: int, found: torch.Tensor, real: torch.Tensor) -> None:
        if layer not in self._recall:
            self._recall[layer] = torch.zeros(2, dtype=torch.int64, device=found.device)
        self._recall[layer] += torch.stack((found, real))

    def record_layer_step(self, heads: int, recent_tokens: int) -> None:
        self.layer_steps += 1
        self.head_steps += heads
        self.recent_tokens_attended += heads * recent_tokens

    def record_offload(self, nbytes: int) -> None:
        self.bytes_offloaded += nbytes

    def as_dict(self) -> dict:
        rows = self._counts.tolist() if self._counts is not None else [[0] * len(_FIELDS)] * 3
        counts = dict(zip(_FIELDS, rows[self.attention_row]))
        critical, prefetched = rows[0][2], rows[1][2] + rows[2][2]  # every prefetch moved its blocks
        per_head = max(1, self.head_steps)
        steps = max(1, self.decode_steps)
        fetched_bytes = (critical + prefetched) * self.block_bytes
        recall, by_layer = None, None
        if self._recall:
            pairs = {layer: pair.tolist() for layer, pair in sorted(self._recall.items())}  # {layer: [found, real]}
            by_layer = {layer: found / real if real else None for layer, (found, real) in pairs.items()}
            found, real = (sum(pair[i] for pair in pairs.values()) for i in (0, 1))
            recall = found / real if real else None
        return {
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "dense_forwards": self.dense_forwards,
            "prefill_tokens": self.prefill_tokens,
            # means per (layer, step, sequence, KV head):
            "tokens_attended_per_step": (counts["slot_tokens_attended"] + self.recent_tokens_attended) / per_head,
            "blocks_selected_per_step": counts["blocks_selected"] / per_head,
            "blocks_fetched_per_step": (critical + prefetched) / per_head,
            "blocks_selected": counts["blocks_selected"],
            "blocks_fetched": critical + prefetched,
            "blocks_fetched_on_critical_path": critical,
            "blocks_prefetched": prefetched,
            "bytes_fetched": fetched_bytes,
            "bytes_fetched_per_step": fetched_bytes / steps,  # all layers and heads of one step
            "bytes_fetched_on_critical_path_per_step": critical * self.block_bytes / steps,
            "prediction_recall": recall,  # measurement mode: the real top-K's share resident before the step
            # (lookahead "none": after its fetch — 1.0 unless a fetch cap drops blocks, a check of the measure),
            # pooled over layers; per layer: {layer index: recall}
            "prediction_recall_per_layer": by_layer,
            "bytes_offloaded": self.bytes_offloaded,
            "hit_rate": counts["blocks_hit"] / counts["blocks_selected"] if counts["blocks_selected"] else 0.0,
        }
