"""The gate between a compilation in a thread (`compile_in_background`) and the thread that decodes.

Compiling does not stay inside the compiling thread:

- an fx trace (`torch.fx.Tracer.trace`: AOTAutograd's, some of inductor's) patches `nn.Module.__call__` and
  `nn.Module.__getattr__` for the whole process while it runs, so a module called from another thread meanwhile goes
  through the tracer (on the H200, thirty-fourth session: the decoding thread's `o_proj` raised "module is not
  installed as a submodule" in the next prompt's prefill);
- dynamo, when a frame's compilation ends, and AOTAutograd and inductor around parts of theirs, set back the RNG
  states (Python's, torch's, CUDA's) they found: numbers the decoding thread drew meanwhile (sampling) would be drawn
  again (the CPU test saw thousands);
- from torch 2.13 dynamo holds `torch.compiler.is_compiling()` True for the whole process during a compile session:
  the decoding thread's eager code takes its compiled-only paths meanwhile (the `kernels` package's context variable
  then changed under the compiler's guards: "Guard failed on the same frame it was created", CI of the
  thirty-fourth session).

So the thread that starts a compilation (the caller's, `BackgroundCompile._start`) holds the gate from then on, and
opens it only at points of its own where it calls no module (`Gate.let_through`: while it waits on a replayed step's
device work; after an eager layer call); the compiling thread takes it around each fx trace (`install` wraps
`torch.fx.Tracer.trace`), and, where torch has the process-wide compile session (2.13 on), around the whole session
(`torch.compiler._compile_session_context`). The caller may thus wait at such a point for a trace to end (AOTAutograd's:
once a compilation, none when its graph is on disk; with the session gated, for the whole compilation: there the
thread keeps it safe but saves no time); elsewhere the rest of a compilation (dynamo's bytecode tracing, inductor's
lowering and code generation, Triton's compiles in worker processes) runs beside it. And in a compiling thread of ours
the RNG setters (`torch.set_rng_state`, `torch.cuda.set_rng_state`, `random.setstate`) do nothing: a number the
compiler drew (none in a decode step's graph) is then skipped by the caller's stream, never drawn twice.

One gate for the process: what it guards is process-wide. Other threads of a user's program that call modules while a
compilation runs are not covered (the option is for the thread that decodes).
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time

import torch

_local = threading.local()  # .gate: the gate this thread compiles under; .depth: gated sections it holds


class Gate:
    """`owner` is "caller", "compiler" or None; `caller` the thread that holds it for the caller side."""

    def __init__(self):
        self._cv = threading.Condition()
        self.owner = None
        self.caller = None
        self.waiting = 0  # compiling threads waiting for it
        self.passes = 0  # gated sections ended (a caller that opened waits for one)
        self.compilers = 0  # compiling threads alive
        self.blocked_s = 0.0  # how long callers waited at `let_through` for a section to end (benchmarks)

    # ---------------------------------------------------------------------------------------------------- caller
    def holds(self) -> bool:
        return self.owner == "caller" and self.caller is threading.current_thread()

    def may_hold(self) -> bool:
        """Whether the current thread may start a compilation (no other thread holds the caller's side)."""
        return self.owner != "caller" or self.caller is threading.current_thread()

    def hold(self) -> None:
        """The current thread holds the gate (it starts a compilation); waits for a compiler's section to end."""
        with self._cv:
            if self.holds():
                return
            self._cv.wait_for(lambda: self.owner is None)
            self.owner, self.caller = "caller", threading.current_thread()

    def let_through(self, wait=None) -> None:
        """Open the gate for a compiling thread that waits on it and take it back once its section has ended; with
        `wait`, call it meanwhile (the device work the caller would wait for anyway). Nothing when no compiling
        thread waits, or the current thread does not hold the gate."""
        if not (self.waiting and self.holds()):
            return
        with self._cv:
            before, self.owner = self.passes, None
            self._cv.notify_all()
        try:
            if wait is not None:
                wait()
        finally:
            with self._cv:
                start = time.perf_counter()
                self._cv.wait_for(lambda: self.owner is None and (self.passes != before or not self.waiting))
                self.blocked_s += time.perf_counter() - start
                if self.compilers:  # (else the last one ended meanwhile: nothing left to guard)
                    self.owner, self.caller = "caller", threading.current_thread()
                else:
                    self.caller = None

    def open_while(self, wait) -> None:
        """Call `wait` (joining the compiling threads) with the gate open; the current thread holds it again after
        if a compilation still runs."""
        held = self.holds()
        if held:
            self._release()
        try:
            wait()
        finally:
            if held and self.compilers:
                self.hold()

    def _release(self) -> None:
        with self._cv:
            self.owner = self.caller = None
            self._cv.notify_all()

    # -------------------------------------------------------------------------------------------------- compiler
    def started(self) -> None:
        """A compiling thread is about to start (the caller holds the gate)."""
        with self._cv:
            self.compilers += 1

    def ended(self) -> None:
        """A compiling thread ends: the last one frees the caller's side (nothing left to guard)."""
        with self._cv:  # (re-entrant: `_release` takes it again)
            self.compilers -= 1
            if not self.compilers and self.owner == "caller":
                self._release()

    def enter(self) -> None:
        """The compiling thread takes the gate (nested sections count). A caller's side held by a thread that has
        ended (it started the compilation and returned for good; the process exits) is taken over: it calls nothing."""
        depth = getattr(_local, "depth", 0)
        if depth:
            _local.depth = depth + 1
            return
        with self._cv:
            self.waiting += 1
            try:
                while self.owner is not None:
                    if self.owner == "caller" and not self.caller.is_alive():
                        self.caller = None
                        break
                    self._cv.wait(0.25)
                self.owner = "compiler"
            finally:
                self.waiting -= 1
        _local.depth = 1

    def leave(self) -> None:
        _local.depth -= 1
        if _local.depth:
            return
        with self._cv:
            self.owner = None
            self.passes += 1
            self._cv.notify_all()

    @contextlib.contextmanager
    def compiling(self):
        """Around the compiling thread's call: its fx traces are gated and its RNG setters do nothing (`install`)."""
        install()
        _local.gate, _local.depth = self, 0
        try:
            yield
        finally:
            _local.gate = None


GATE = Gate()


_INSTALLED = []


def install() -> None:
    """Gate `torch.fx.Tracer.trace` (every fx trace; subclasses reach it through `super()`) and make the RNG setters
    no-ops in compiling threads of ours; other threads' calls run as before. Once per process."""
    if _INSTALLED:
        return
    original = torch.fx.Tracer.trace

    @functools.wraps(original)
    def trace(self, *args, **kwargs):
        gate = getattr(_local, "gate", None)
        if gate is None:
            return original(self, *args, **kwargs)
        gate.enter()
        try:
            return original(self, *args, **kwargs)
        finally:
            gate.leave()

    torch.fx.Tracer.trace = trace
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        torch.compiler._compile_session_context = _gated(session)
    for owner, name in ((torch, "set_rng_state"), (torch.random, "set_rng_state"), (torch.cuda, "set_rng_state"),
                        (torch.cuda.random, "set_rng_state"), (random, "setstate")):
        setattr(owner, name, _outside_compilers(getattr(owner, name)))
    _INSTALLED.append(original)


def _gated(session):
    """dynamo's compile session (torch 2.13 on) holds `torch.compiler.is_compiling()` True for the whole process
    while it runs: in a compiling thread of ours the whole session is one gated section."""

    @contextlib.contextmanager
    @functools.wraps(session)
    def gated_session(*args, **kwargs):
        gate = getattr(_local, "gate", None)
        if gate is not None:
            gate.enter()
        try:
            with session(*args, **kwargs):
                yield
        finally:
            if gate is not None:
                gate.leave()

    return gated_session


def _outside_compilers(setter):
    @functools.wraps(setter)
    def set_unless_compiling(*args, **kwargs):
        if getattr(_local, "gate", None) is None:
            return setter(*args, **kwargs)

    return set_unless_compiling
