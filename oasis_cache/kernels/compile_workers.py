"""Kernel specializations compiled in other processes: where a dry decode step's compilations go
(`compute/ahead.py` through `kernels/ahead.compile_only(processes=...)`).

Why processes: Triton turns a kernel into its first IR in Python (its code generator walks the kernel's syntax tree)
before its native passes, so compilations in threads take turns on the process's interpreter lock, with each other
and with the step that submits them (H200, Qwen3-8B at 32K x 1 on a new machine: the eight
kernels of a first decode step took 2-3 s from the first to the last in 16 threads, and the main thread's trace beside
them 1.3-2.1 s). Processes compile side by side.

Each worker is this file run as a script (`python -u compile_workers.py`, not an import of the package: no
transformers in it). It imports torch and Triton, compiles a small kernel (a process's first compilation pays
Triton's start-up: ~1.3 s on the CI machine's CPU for sm_90), answers that it is ready, then compiles what it is
sent: a launch's specialization serialized by Triton (`jit_cache_hook`'s `specialization_data`), turned back into a
compilation by Triton's own `JITFunction.preload` under a driver that names the main process's target and touches no
device, into the kernel cache on disk; it also builds the kernel's launcher (a small C module, on disk too). The main
process's real launch then finds both on disk: the same key, the same folder.

Protocol (JSON lines): the first line to a worker is {"target": {...}, "sys_path": [...]}; it answers
{"ready": seconds}. Each further line {"module": ..., "name": ..., "data": ...} is answered {"ok": true, "s": ...} or
{"ok": false, "error": ...}. At the end of its input a worker exits; a worker left idle `IDLE_S` exits too.

Measured (H200, Qwen3-8B at 32K x 1 on a new kernel cache; `OasisConfig.compile_workers`,
research, off by default): the trace beside the compilations 1.3 -> 0.2-0.3 s, but eight workers took 3.8-4.8 s to
be ready and the top-k alone 3.5 s to compile, so the first `generate` was no faster (7.3-8.2 s against 7.2-7.9 with
threads). The top-k now compiles ~5x faster (its rounds a loop): to measure again (`gpu_run.sh firstcallworkers`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

try:
    import triton
    import triton.language as tl
except ImportError:  # (a CPU-only install: no workers)
    triton = None

IDLE_S = 300.0  # a worker no dry step asked for within this long exits (a prefill with no decode after it)


def default_count() -> int:
    """Workers by default: the CPUs this process may run on less one (the main thread), at most 8 (a first decode
    step compiles ~8 specializations); none below 3 CPUs (they would only take the main thread's)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    return min(8, cpus - 1) if cpus >= 3 else 0


class CompileWorkers:
    """`count` worker processes compiling for `target` (Triton's `GPUTarget`) into `cache_dir` (Triton's kernel
    cache: `triton.knobs.cache.dir`). `submit` queues a specialization and returns a Future of the worker's answer;
    `close` ends the workers. A worker that fails leaves its jobs failed, not lost: the real launch compiles them."""

    def __init__(self, count: int, target, cache_dir: str | None = None):
        import queue

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.ready_s: list[float] = []
        self.errors: list[str] = []
        env = dict(os.environ)
        if cache_dir:
            env["TRITON_CACHE_DIR"] = cache_dir
        hello = json.dumps({"target": dict(vars(target)), "sys_path": list(sys.path)})
        self._living = count
        self._threads = []
        for _ in range(count):
            process = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            thread = threading.Thread(target=self._serve, args=(process, hello), daemon=True,
                                      name="oasis-compile-worker")
            thread.start()
            self._threads.append(thread)

    @property
    def alive(self) -> bool:
        return self._living > 0

    def submit(self, module: str, name: str, data: str) -> Future:
        """Compile the kernel `name` of `module` for the specialization `data` (Triton's serialized form)."""
        future: Future = Future()
        if not self.alive:
            future.set_exception(RuntimeError("no compile worker is running"))
        else:
            self._jobs.put((future, json.dumps({"module": module, "name": name, "data": data})))
        return future

    def close(self) -> None:
        """End every worker once the jobs queued before are taken (returns at once)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _serve(self, process: subprocess.Popen, hello: str) -> None:
        """One worker's thread: hand it jobs one at a time until `close` or its end."""
        import queue

        try:
            self.ready_s.append(_ask(process, hello)["ready"])
            while True:
                try:
                    job = self._jobs.get(timeout=IDLE_S)
                except queue.Empty:
                    break
                if job is None:
                    break
                future, line = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(_ask(process, line))
                except BaseException as error:
                    future.set_exception(error)
                    raise
        except Exception as error:  # noqa: BLE001 - (its jobs fail; the real launches compile them)
            self.errors.append(f"{type(error).__name__}: {error}")
        finally:
            try:
                process.stdin.close()
                process.wait(timeout=30)
            except Exception:  # noqa: BLE001 - (a worker that will not end is killed)
                process.kill()
            with self._lock:
                self._living -= 1
                last = self._living == 0
            if last:  # (nobody is left to take what is queued: fail it instead of leaving it waiting)
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None and job[0].set_running_or_notify_cancel():
                        job[0].set_exception(RuntimeError("no compile worker is running"))


def _ask(process: subprocess.Popen, line: str) -> dict:
    """One line to a worker, its answer back."""
    process.stdin.write(line + "\n")
    process.stdin.flush()
    answer = process.stdout.readline()
    if not answer:
        raise RuntimeError(f"a compile worker exited (status {process.wait()})")
    return json.loads(answer)


if triton is not None:
    @triton.jit
    def _warm_up_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        values = tl.load(x_ptr + offsets, mask=offsets < n)
        tl.store(x_ptr + offsets, values + 1, mask=offsets < n)


class _CompileOnlyDriver:
    """What `JITFunction.preload` asks of Triton's active driver, in a process that never touches the device: the
    main process's target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _import_kernel_module(name: str):
    """The module of a kernel: the package's own (`oasis_cache.kernels.*`) without running the package's
    `__init__` (which imports transformers), any other as Python imports it."""
    import importlib
    import types

    if name.startswith("oasis_cache.kernels.") and "oasis_cache" not in sys.modules:
        here = os.path.dirname(os.path.abspath(__file__))
        for package, path in (("oasis_cache", os.path.dirname(here)), ("oasis_cache.kernels", here)):
            module = types.ModuleType(package)
            module.__path__ = [path]
            sys.modules[package] = module
    return importlib.import_module(name)


def _build_launcher(kernel, target) -> None:
    """The kernel's launcher, built (and kept on disk) here instead of at the main process's first launch; a failure
    is left to that launch (e.g. no CUDA driver library on this machine)."""
    if target.backend != "cuda":
        return
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001
        pass


def _compile(module: str, name: str, data: str, target):
    function = _import_kernel_module(module)
    for part in name.split("."):
        function = getattr(function, part)
    kernel = function.preload(data)
    _build_launcher(kernel, target)
    return kernel


def _serve_as_worker() -> None:
    """A worker's life (this file run as a script): see the module's docstring."""
    start = time.perf_counter()
    hello = json.loads(sys.stdin.readline())
    sys.path[:] = hello["sys_path"]
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime import driver

    target = GPUTarget(**hello["target"])
    driver.set_active(_CompileOnlyDriver(target))
    import torch  # noqa: F401 - (every kernel module imports it: paid before the first job, not in it)

    try:
        source = ASTSource(_warm_up_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {(2,): 16})
        _build_launcher(triton.compile(source, target=target), target)
    except Exception:  # noqa: BLE001 - (a warm-up only: the jobs say what fails)
        pass
    print(json.dumps({"ready": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        job, begun = json.loads(line), time.perf_counter()
        try:
            _compile(job["module"], job["name"], job["data"], target)
            answer = {"ok": True, "s": time.perf_counter() - begun}
        except Exception as error:  # noqa: BLE001 - (answered: the main process's launch compiles it instead)
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"[:1000]}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _serve_as_worker()
