"""A stopping criterion that never stops `generate` and stamps each new token (a CUDA event on CUDA, no sync; the
host clock on CPU): the decode's time per token as a user's `generate` runs it, the prefill excluded."""

from __future__ import annotations

import time

import torch
from transformers import StoppingCriteria


class TokenClock(StoppingCriteria):
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stamps: list = []

    def __call__(self, input_ids, scores, **kwargs):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def span_s(self) -> float:
        """Seconds from the first new token to the last (call after a device sync on CUDA)."""
        if self.cuda:
            return self.stamps[0].elapsed_time(self.stamps[-1]) / 1e3
        return self.stamps[-1] - self.stamps[0]

    def step_s(self) -> list:
        """Seconds between consecutive new tokens (call after a device sync on CUDA)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.stamps, self.stamps[1:])]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def median_step_s(self) -> float:
        """The median time per token: steady decode, without a first step's compilation or a graph capture."""
        steps = sorted(self.step_s())
        return steps[len(steps) // 2] if len(steps) % 2 else (steps[len(steps) // 2 - 1] + steps[len(steps) // 2]) / 2

    def ms_per_step(self) -> float:
        return self.span_s() * 1e3 / (len(self.stamps) - 1)
