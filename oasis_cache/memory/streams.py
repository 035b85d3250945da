"""The side stream and per-layer events of the prefetch: the only code that creates streams.

At step t, layer l launches the gather of step t+1's blocks on the side stream, after an event on the compute
stream (so it never overwrites slots that step t's attention still reads). At step t+1, layer l's compute waits on
that layer's event only — never a device-wide synchronize. Offloads (device -> host) run on the same side stream,
so a gather never reads a host block before its offload has landed, and the offload of layer l overlaps the
compute of layer l+1. On CPU there are no streams: the work runs inline.

A cache admitted from a remote store (`remote/admission.py`) also hands its prefetches to a host thread
(`use_host_worker`): a prefetch there first reads the selected blocks on the host and fetches the ones not yet local
from the store, which would block the step's host thread (a sync, then network time). The worker runs the prefetches
in launch order (one thread), each on the side stream after the compute event recorded when it was launched;
`wait(layer)` joins that layer's prefetch (its errors surface there) before the compute stream waits on its event.
Mooncake's calls release the GIL, so the store's time overlaps the rest of the step.

Such a cache whose prefetches are deferred to after the step may also read the store while the step still runs
(`admit(..., overlap=True)`): a host thread (`hold`) plans and reads layer by layer as each layer's record lands, and
what must run on this thread (the slot maps, the gathers into the working set) is finished before the next forward
(`finish_held`) or at any `settle`.

In measurement mode each wait on a prefetch, and each fetch made on the compute stream (critical path), records
timing events, so `exposed_wait_ms` tells how long compute stalled on transfers (read once, at `stats()` time).
"""

from __future__ import annotations

import contextlib
import gc
import threading

import torch


class PrefetchStreams:
    def __init__(self, device: torch.device, measure: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.measure = measure
        self._done: dict[int, torch.cuda.Event] = {}  # layer -> event after its pending prefetch
        self._timings: list[tuple] = []  # (arrive, done) event pairs, measurement mode
        self._forked = False  # side-stream work was queued since the last join
        self._worker = None  # a one-thread executor for prefetches that read a remote store (`use_host_worker`)
        self._futures: dict = {}  # layer -> the worker's future for its pending prefetch
        self._held_worker = None  # a one-thread executor for work held across a step's end (`hold`)
        self._held = None  # (future, finish): that work, and what finishes it on this thread

    def use_host_worker(self) -> None:
        """Run `launch`ed prefetches on a host thread from now on (see the module's docstring)."""
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oasis-prefetch")

    def hold(self, work, finish) -> None:
        """Run `work()` on a host thread now; `finish(future, abandon)` runs on this thread at the next
        `finish_held` or `settle` (`abandon` after an error elsewhere: its results are to be dropped)."""
        self.finish_held()
        if self._held_worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._held_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oasis-prefetch-held")
        self._held = (self._held_worker.submit(work), finish)

    def finish_held(self, abandon: bool = False) -> None:
        """Finish the held work, if any (its errors raise here unless `abandon`)."""
        if self._held is None or threading.current_thread().name.startswith("oasis-prefetch"):
            return
        (future, finish), self._held = self._held, None
        finish(future, abandon)

    def settle(self) -> None:
        """Join every prefetch the host worker holds (their side-stream work is then queued; errors raise here)."""
        self.finish_held()
        if not self._futures or threading.current_thread().name.startswith("oasis-prefetch"):
            return  # (a prefetch running on the worker never waits for itself)
        futures, self._futures = self._futures, {}
        error = None
        for layer_idx, future in futures.items():  # every one joined, so none runs on after an error leaves
            try:
                self._joined(layer_idx, future)
            except BaseException as raised:
                error = error or raised
        if error is not None:
            raise error

    def quiesce(self) -> None:
        """Wait out every prefetch the host worker holds, dropping their results and errors: an error leaves the
        step, and none of this cache's store reads may still run after it (the caller may close the store next)."""
        if threading.current_thread().name.startswith("oasis-prefetch"):
            return
        self.finish_held(abandon=True)
        futures, self._futures = self._futures, {}
        for future in futures.values():
            try:
                future.result()
            except BaseException:
                pass

    def _joined(self, layer_idx: int, future) -> None:
        """The worker's prefetch for `layer_idx` has run (its error raises here); its end event is the layer's."""
        done = future.result()
        if done is not None:
            self._done[layer_idx] = (done, self.measure)

    def run_after_compute(self, work, *tensors: torch.Tensor) -> None:
        """Run `work()` on the side stream after everything queued so far on the compute stream. `tensors` are
        compute-stream tensors the work reads (their memory is not reused before it has run)."""
        if not self.cuda:
            work()
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        self._forked = True
        with torch.cuda.stream(self.side):
            work()
        for t in tensors:
            t.record_stream(self.side)

    def capturing(self) -> bool:
        """Whether the compute stream is being captured into a CUDA graph."""
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def side_event(self):
        """An event at the current end of the side stream (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def compute_waits(self, event) -> None:
        if event is not None and torch.cuda.current_stream(self.device) != self.side:
            torch.cuda.current_stream(self.device).wait_event(event)

    def launch(self, layer_idx: int, work, *tensors: torch.Tensor) -> None:
        """`run_after_compute`, and remember an event that `wait(layer_idx)` will make compute wait on."""
        if self._worker is not None:
            self._launch_on_worker(layer_idx, work, tensors)
            return
        self.run_after_compute(work, *tensors)
        if self.cuda:
            done = torch.cuda.Event(enable_timing=self.measure)
            done.record(self.side)
            self._done[layer_idx] = (done, self.measure)

    def _launch_on_worker(self, layer_idx: int, work, tensors) -> None:
        start = None
        if self.cuda:
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(self.device))
            for t in tensors:
                t.record_stream(self.side)
            self._forked = True

        def task():
            if not self.cuda:
                work()
                return None
            with torch.cuda.device(self.device), torch.cuda.stream(self.side):
                self.side.wait_event(start)
                work()
                done = torch.cuda.Event(enable_timing=self.measure)
                done.record(self.side)
            return done

        if layer_idx in self._futures:  # a layer's earlier prefetch not waited for: joined first
            self.settle()
        self._futures[layer_idx] = self._worker.submit(task)

    def wait(self, layer_idx: int) -> None:
        """Make the compute stream wait for `layer_idx`'s pending prefetch, if any."""
        future = self._futures.pop(layer_idx, None)
        if future is not None:
            try:
                self._joined(layer_idx, future)
            except BaseException:
                self.quiesce()
                raise
        pending = self._done.pop(layer_idx, None)
        if pending is None:
            return
        done, timed = pending
        compute = torch.cuda.current_stream(self.device)
        if self.measure and timed:
            arrive = torch.cuda.Event(enable_timing=True)
            arrive.record(compute)
            self._timings.append((arrive, done))
        compute.wait_event(done)

    def time_on_compute(self):
        """Measurement mode, on the compute stream: start timing a transfer that compute waits for (a fetch on the
        critical path). Returns the end event to record after it, or None when not measuring."""
        if not (self.measure and self.cuda) or torch.cuda.current_stream(self.device) == self.side:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        self._timings.append((start, end))
        return end

    def compute_waits_for_side(self) -> None:
        """Before compute reads what the side stream writes outside the per-layer protocol (host blocks)."""
        self.settle()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def synchronize(self) -> None:
        """Let every pending side-stream transfer finish before compute goes on (batch reorder, reset)."""
        self.settle()
        self._done.clear()
        self.compute_waits_for_side()

    def forget_side_work(self) -> None:
        """After `synchronize`, before a capture: no side-stream work is pending for `join`."""
        self._forked = False

    def join(self) -> None:
        """End of a captured step: compute waits for the side-stream work forked since `forget_side_work` (a graph
        must join every stream it forked; waiting on a side stream that did not fork from it would be an error)."""
        self.settle()
        self._done.clear()
        if self.cuda and self._forked:
            self.compute_waits_for_side()
        self._forked = False

    def exposed_wait_ms(self) -> float:
        """Total time compute waited on prefetches, over the waits recorded in measurement mode (syncs once)."""
        if not self._timings:
            return 0.0
        self._timings[-1][1].synchronize()
        total = sum(max(0.0, arrive.elapsed_time(done)) for arrive, done in self._timings)
        return total

    def reset_measurements(self) -> None:
        self._timings.clear()


@contextlib.contextmanager
def no_collection_while_capturing():
    """Python's automatic garbage collection paused for a capture. A pinned host block last used on a stream and
    freed while that stream is being captured makes torch's caching host allocator record its release event into the
    graph; the next pinned allocation or `.item()` then fails to query it ("CUDA error: invalid argument", once per
    such block; a micro-benchmark shows it on an H200). A collection during a capture frees
    exactly such blocks: an earlier cache left in a reference cycle, whose side stream (streams come from torch's
    pool of 32) may be the capturing cache's."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream decode steps are captured on, one per device for the process: libraries keep state per stream
    (cuBLAS a workspace of ~32 MiB on Hopper, never freed), so a stream per cache would add one for every cache."""
    device = torch.device(device)
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream
