"""The package's kernels compiled instead of launched, in parallel: what a dry decode step runs under
(`compile_ahead`, `compute/ahead.py`).

A new machine compiles each kernel specialization where a step first launches it, one after another: on the H200 (`tests/tools/launch_keys.py`) 0.3-2.6 s each, ~8 of them at a cache's first decode step with
lookahead "none". Inside `compile_only()` every launch of the package's kernels (`KERNELS`) is Triton's warm-up
instead (`JITFunction.run(..., warmup=True)`: the specialization is computed and compiled, nothing runs), and on a
Triton with `AsyncCompileMode` the compilations go to a thread pool: leaving the context waits for all of them, and
the kernels' caches then hold them for the real launches. Under Triton's interpreter a warm-up does nothing (the CPU
tests record what would compile).

Nothing a kernel would write is written inside: the tensors a dry step leaves are garbage (`compute/ahead.py` runs it
on a copy of the cache).
"""

from __future__ import annotations

import contextlib
import functools
import os

from .gather import triton


def kernels() -> list:
    """The package's Triton kernels (JITFunction, or InterpretedFunction under the interpreter)."""
    if triton is None:
        return []
    from . import block_scores, decode_attention, gather, host_store, recent_append, slot_assign, top_k

    return [gather._gather_blocks_kernel, host_store._store_block_kernel, block_scores._block_scores_kernel,
            slot_assign._slot_assign_kernel, recent_append._recent_append_kernel, top_k._top_k_kernel,
            decode_attention._split_kernel, decode_attention._combine_kernel]


def _compile_and_build_launcher(compile_fn):
    """A compilation in the pool, then its launcher: Triton builds a small C module per kernel signature with the
    host's compiler at the kernel's first real launch (kept on disk after), which a new machine would otherwise do
    one kernel after another in the step. Built here, the launch finds it on disk. A failure here is left to that
    launch to meet and raise."""
    kernel = compile_fn()
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - (the real launch builds it again and raises what is wrong)
        pass
    return kernel


def _warm_up(kernel, *args, grid, warmup, **kwargs):
    """A launch made a warm-up (the class's `run`, looked up now: a recorder patched onto it sees the call)."""
    return type(kernel).run(kernel, *args, grid=grid, warmup=True, **kwargs)


class Compilations:
    """What `compile_only` submitted, possibly still compiling: `finish()` waits for each and hands it to its kernel's
    cache (what Triton's `AsyncCompileMode` does when its context is left), then ends the pool's threads; or, where
    they went to worker processes, waits for their answers (`sent`, `failed`: the real launch compiles a failed one;
    `seconds`: each kernel's longest compilation there) and closes those workers."""

    def __init__(self):
        self.mode = self.pool = self.processes = None
        self.futures: list = []  # (kernel name, Future of a worker's answer)
        self.sent = self.failed = 0
        self.seconds: dict = {}  # kernel name: its longest compilation in a worker (s)

    def finish(self) -> None:
        futures, self.futures = self.futures, []
        for name, future in futures:
            try:
                answer = future.result()
            except Exception:  # noqa: BLE001 - (a worker gone: the real launch compiles it)
                answer = {}
            self.failed += not answer.get("ok", False)
            if "s" in answer:
                self.seconds[name] = max(self.seconds.get(name, 0.0), answer["s"])
        if self.processes is not None:
            self.processes.close()
        mode, pool, self.mode, self.pool = self.mode, self.pool, None, None
        if mode is not None:
            from concurrent.futures import as_completed

            for future in as_completed(mode.raw_futures):
                mode.future_kernels[future._key].result(mode.ignore_errors)
        if pool is not None:
            pool.shutdown(wait=True)


def _send_to(processes, compilations: Compilations, swapped: list, previous):
    """Triton's `jit_cache_hook` while `compile_only` sends to worker processes: a specialization of one of the
    package's kernels goes to them (Triton's serialized form) and is not compiled here; any other goes to the hook
    that was set before."""
    ours = {id(kernel) for kernel in swapped}

    def hook(*, fn, compile, **kwargs):
        if id(fn.jit_function) not in ours or "specialization_data" not in compile:
            return previous(fn=fn, compile=compile, **kwargs) if previous is not None else None
        compilations.futures.append((fn.name, processes.submit(fn.module, fn.name, compile["specialization_data"])))
        compilations.sent += 1
        return True

    return hook


@contextlib.contextmanager
def compile_only(workers: int | None = None, wait: bool = True, processes=None):
    """Inside: the package's kernel launches compile instead of running — in `processes` (`CompileWorkers`, while any
    of them runs; closed when the compilations are finished), else on `workers` threads where Triton compiles
    asynchronously (None: the CPUs, at most 16); leaving waits for every compilation — or, with `wait=False`, leaves
    them compiling: the `Compilations` yielded must then be finished before the kernels' next launches need them
    (`compute/ahead.at_prefill`; an error inside waits for them). Not for use beside launches from other threads (the
    kernels' `run` is swapped for the duration)."""
    swapped = kernels()
    for kernel in swapped:
        kernel.run = functools.partial(_warm_up, kernel)  # (an instance attribute: `kernel[grid](...)` finds it)
    compilations, active, token, knobs, previous = Compilations(), None, None, None, None
    compilations.processes = processes  # (closed by `finish`, used or not)
    try:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if not interpreted and processes is not None and processes.alive:
            try:
                from triton import knobs
            except ImportError:  # (a Triton without the hook: threads)
                knobs = None
            if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
                previous = knobs.runtime.jit_cache_hook
                knobs.runtime.jit_cache_hook = _send_to(processes, compilations, swapped, previous)
            else:
                knobs = None
        if not interpreted and knobs is None:
            try:
                from triton.runtime._async_compile import AsyncCompileMode, active_mode as active
            except ImportError:  # (an older Triton: the warm-ups compile one after another)
                AsyncCompileMode = None
            if AsyncCompileMode is not None:
                from concurrent.futures import ThreadPoolExecutor

                class Pool(ThreadPoolExecutor):  # (each compilation also builds its launcher)
                    def submit(self, fn, /, *args, **kwargs):
                        return super().submit(_compile_and_build_launcher, functools.partial(fn, *args, **kwargs))

                if active.get() is not None:
                    raise RuntimeError("compile_only inside another asynchronous compilation of Triton")
                compilations.pool = Pool(max_workers=workers or min(16, os.cpu_count() or 1))
                compilations.mode = AsyncCompileMode(compilations.pool, ignore_errors=True)  # (a failure raises at
                token = active.set(compilations.mode)  # the real launch instead)
        yield compilations
    except BaseException:
        wait = True
        raise
    finally:
        for kernel in swapped:
            kernel.__dict__.pop("run", None)
        if knobs is not None:
            knobs.runtime.jit_cache_hook = previous
        if token is not None:
            active.reset(token)
        if wait:
            compilations.finish()
