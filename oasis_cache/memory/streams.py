"""The side stream and per-layer events of the prefetch: the only code that creates streams.

At step t, layer l launches the gather of step t+1's blocks on the side stream, after an event on the compute
stream (so it neither overwrites slots that step t's attention still reads, nor reads host blocks whose offload has
not landed). At step t+1, layer l's compute waits on that layer's event only — never a device-wide synchronize.
On CPU there are no streams: the work runs inline.

In measurement mode each wait also records timing events, so `exposed_wait_ms` can tell how long compute stalled on
transfers (read once, at `stats()` time).
"""

from __future__ import annotations

import torch


class PrefetchStreams:
    def __init__(self, device: torch.device, measure: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.measure = measure
        self._done: dict[int, torch.cuda.Event] = {}  # layer -> event after its pending prefetch
        self._timings: list[tuple] = []  # (arrive, done) event pairs, measurement mode

    def launch(self, layer_idx: int, work, *tensors: torch.Tensor) -> None:
        """Run `work()` on the side stream after everything queued so far on the compute stream. `tensors` are
        compute-stream tensors the work reads (kept alive until it has run)."""
        if not self.cuda:
            work()
            return
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            work()
        for t in tensors:
            t.record_stream(self.side)
        done = torch.cuda.Event(enable_timing=self.measure)
        done.record(self.side)
        self._done[layer_idx] = done

    def wait(self, layer_idx: int) -> None:
        """Make the compute stream wait for `layer_idx`'s pending prefetch, if any."""
        done = self._done.pop(layer_idx, None)
        if done is None:
            return
        compute = torch.cuda.current_stream(self.device)
        if self.measure:
            arrive = torch.cuda.Event(enable_timing=True)
            arrive.record(compute)
            self._timings.append((arrive, done))
        compute.wait_event(done)

    def synchronize(self) -> None:
        """Let every pending prefetch finish (before buffers are reallocated: batch reorder, reset)."""
        for layer_idx in list(self._done):
            self.wait(layer_idx)

    def exposed_wait_ms(self) -> float:
        """Total time compute waited on prefetches, over the waits recorded in measurement mode (syncs once)."""
        if not self._timings:
            return 0.0
        self._timings[-1][1].synchronize()
        total = sum(max(0.0, arrive.elapsed_time(done)) for arrive, done in self._timings)
        return total

    def reset_measurements(self) -> None:
        self._timings.clear()
