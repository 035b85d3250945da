"""The package's kernels compiled instead of launched, in parallel: what a dry decode step runs under
(`compile_ahead`, `runtime/ahead.py`).

A new machine compiles each kernel specialization where a step first launches it, one after another: on the H200 (`tests/tools/launch_keys.py`) 0.3-2.6 s each, ~8 of them at a cache's first decode step with
lookahead "none". Inside `compile_only()` every launch of the package's kernels (`KERNELS`) is Triton's warm-up
instead (`JITFunction.run(..., warmup=True)`: the specialization is computed and compiled, nothing runs), and on a
Triton with `AsyncCompileMode` the compilations go to a thread pool: leaving the context waits for all of them, and
the kernels' caches then hold them for the real launches. Under Triton's interpreter a warm-up does nothing (the CPU
tests record what would compile).

Nothing a kernel would write is written inside: the tensors a dry step leaves are garbage (`runtime/ahead.py` runs it
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

    return [gather._gather_blocks_kernel, gather._gather_narrow_kernel, host_store._store_block_kernel,
            block_scores._block_scores_kernel, slot_assign._slot_assign_kernel, recent_append._recent_append_kernel,
            top_k._top_k_kernel, decode_attention._split_kernel, decode_attention._combine_kernel]


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
    cache (what Triton's `AsyncCompileMode` does when its context is left), then ends the pool's threads."""

    def __init__(self):
        self.mode = self.pool = None

    def finish(self) -> None:
        mode, pool, self.mode, self.pool = self.mode, self.pool, None, None
        if mode is not None:
            from concurrent.futures import as_completed

            for future in as_completed(mode.raw_futures):
                mode.future_kernels[future._key].result(mode.ignore_errors)
        if pool is not None:
            pool.shutdown(wait=True)


@contextlib.contextmanager
def compile_only(workers: int | None = None, wait: bool = True):
    """Inside: the package's kernel launches compile instead of running — on `workers` threads where Triton compiles
    asynchronously (None: the CPUs, at most 16); leaving waits for every compilation — or, with `wait=False`, leaves
    them compiling: the `Compilations` yielded must then be finished before the kernels' next launches need them
    (`runtime/ahead.at_prefill`; an error inside waits for them). Not for use beside launches from other threads (the
    kernels' `run` is swapped for the duration)."""
    swapped = kernels()
    for kernel in swapped:
        kernel.run = functools.partial(_warm_up, kernel)  # (an instance attribute: `kernel[grid](...)` finds it)
    compilations, active, token = Compilations(), None, None
    try:
        if os.environ.get("TRITON_INTERPRET") != "1":
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
        if token is not None:
            active.reset(token)
        if wait:
            compilations.finish()


class CompileOnlyDriver:
    """What `JITFunction.preload` asks of Triton's active driver, in a process that never touches the device (tests
    that compile for a target without one): that target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target
