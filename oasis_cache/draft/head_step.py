"""The head's decode call on static buffers, replayable as one CUDA graph.

Once the head's ring of keys/values is full (`head_window.HeadKV`), a decode step's call has fixed shapes: features
`[B, 1, 3Ht]` and token `[B, 1]` are copied into buffers, the call reads the whole ring without a mask, writes its
own key/value into the ring at a slot kept on the device, advances that slot and its position on the device, and
leaves the draft (target ids) in `draft` `[B, 1]`. Every buffer is written in place, so a decode step captured
whole (`runtime/captured_step.py`) may run this call inside its own graph. On CUDA the call is captured once and
replayed (one launch instead of ~60; the default on CUDA, `RideAlong.static_head`); `use_graph=False` runs the same
function eagerly (CPU, tests, and inside a captured decode step). The capture (once, when the ring first fills)
does not synchronize the device.
"""

from __future__ import annotations

import torch

from ..memory.streams import capture_stream, no_collection_while_capturing
from .eagle3 import Eagle3Head
from .head_window import HeadKV


class StaticDraftStep:
    def __init__(self, head: Eagle3Head, embed, kv: HeadKV, position: int, use_graph: bool):
        """`position`: the head position of the next row (`RideAlong._rows`); `kv` must hold a full ring."""
        self.head, self.embed, self.kv = head, embed, kv
        B, device = kv.k.shape[-4], kv.k.device
        self.features = torch.zeros((B, 1, 3 * head.config.target_hidden_size), dtype=head.fc.weight.dtype,
                                    device=device)
        self.token = torch.zeros((B, 1), dtype=torch.long, device=device)
        self.position = torch.full((B, 1), position, dtype=torch.long, device=device)
        self.slot = torch.full((1,), kv.slot, dtype=torch.long, device=device)
        self.draft = torch.zeros((B, 1), dtype=torch.long, device=device)
        self.graph = None
        if use_graph:
            self._capture()

    @torch.no_grad()
    def _run(self, write: bool = True) -> None:
        logits, _, (k, v) = self.head(self.features, self.embed(self.token), self.position, (self.kv.k, self.kv.v))
        drafted = self.head.greedy_draft(logits[:, -1])
        if not write:
            return
        self.draft.copy_(drafted)
        # the new row replaces the oldest one; slot and position advance on the device
        self.kv.k.index_copy_(-2, self.slot, k)  # [L, B, Hkv, W - 1, Dh] <- [L, B, Hkv, 1, Dh]
        self.kv.v.index_copy_(-2, self.slot, v)
        self.slot.add_(1).remainder_(self.kv.k.shape[-2])
        self.position.add_(1)

    def _capture(self) -> None:
        """Warm up and capture on the process's capture stream (`memory.streams.capture_stream`), with
        `capture_begin`/`capture_end` rather than `torch.cuda.graph`: the latter synchronizes the device and empties
        torch's device and pinned host caches as it begins (each new cache pinned part of its host pools anew: the
        CUDA dropped-cache test), and a stream of its own would add a cuBLAS workspace per cache."""
        device = self.token.device
        stream, caller = capture_stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                self._run(write=False)  # warm-up (library handles, workspaces), the ring untouched
                with no_collection_while_capturing():
                    graph.capture_begin(capture_error_mode="relaxed")
                    try:
                        self._run()
                    finally:
                        graph.capture_end()
        except RuntimeError as error:
            raise RuntimeError(
                f"Capturing the draft head's decode step as a CUDA graph failed ({error}). Run it without a graph: "
                "`cache.ride_along.static_head = None` (or \"eager\")."
            ) from error
        finally:
            caller.wait_stream(stream)
        self.graph = graph

    def __call__(self, features: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """features `[B, 1, 3Ht]`, token `[B, 1]` -> the draft `[B, 1]` (a buffer the next call overwrites)."""
        self.features.copy_(features)
        self.token.copy_(token)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        self.kv.advance()  # the host's copy of the ring slot
        return self.draft
