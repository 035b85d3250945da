"""The Triton kernels (block gather, block scores, slot assignment) against their plain-PyTorch references over
grids of shapes and dtypes: on CPU through Triton's interpreter (raw host addresses for the gather, as on the GPU
through unified addressing), on CUDA for real."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasis_cache.kernels.gather import triton_available

from kernel_cases import CHECKS

HERE = Path(__file__).parent


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run([sys.executable, str(HERE / "kernel_cases.py"), "cpu"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("OK") == sum(len(cases) for _, cases, _ in CHECKS), run.stdout


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("part", ["dense", "sparse", "draft", "sinks"])
def test_decode_pipeline_with_kernels_in_triton_interpreter(part):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run([sys.executable, str(HERE / "pipeline_with_kernels.py"), part], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("setting", [[], ["--lookahead", "none", "--batch", "2", "--prefill-chunk", "256"],
                                     ["--ahead-at-prefill", "--lookahead", "none", "--batch", "2", "--prefill-chunk",
                                      "256"]],
                         ids=["previous", "none-batch2-chunked", "at-prefill-none-batch2-chunked"])
def test_no_kernel_meets_a_new_specialization_once_a_block_has_completed(setting):
    """`tests/tools/launch_keys.py --check --compile-ahead` under the interpreter: every specialization the package's
    kernels meet (what the GPU would compile: types, alignment, ints' divisibility by 16, constexprs) appears by the
    first decode step that completes a block; the 27 steps after it, across blocks numbering 32 and 33, meet none (a
    late one would be a compilation in the middle of a long generation on a machine without the kernels on disk).
    With `compile_ahead`, every kernel a decode step launches (the first step's, the first completing step's store)
    was met first by the dry copy (compiled, not run: `compute/ahead.py`; after a prefill whole or in chunks; with
    `ahead_at_prefill`, during the prefill's last chunk), and the greedy tokens equal a run without the option."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(HERE / "tools" / "launch_keys.py"), "--check", "--compile-ahead",
                          *setting], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "late specializations: none" in run.stdout, run.stdout
    assert ("dry step: ran at the prefill" if "--ahead-at-prefill" in setting else "dry step: ran") in run.stdout, \
        run.stdout
    assert "not compiled ahead, met by a decode step: none; tokens as without the option: True" in run.stdout, \
        run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("check, case", [(check, case) for _, cases, check in CHECKS for case in cases],
                         ids=[f"{name}-{'x'.join(map(str, case))}" for name, cases, _ in CHECKS for case in cases])
def test_kernel_on_cuda(check, case):
    """Each kernel check of `kernel_cases.CHECKS` (the gather, unit gather and store, block scores, slot assignment,
    recent append, top-k, decode attention, grouped linear) on CUDA."""
    assert check(*case, device=torch.device("cuda"))


# What still changes between two decode steps on the CUDA path (`tests/tools/capture_audit.py`), by (file, function): the
# work list of a captured decode step (docs/performance.md). Remove an entry when its cause moves to a device-side value;
# a new entry means a new per-step host value in the hot path, which a CUDA graph cannot replay.
STEP_VARYING = {
    ("tests/tools/op_count.py", "step"),  # the caller grows the 2D mask, as `generate` does
    ("transformers/masking_utils.py", "_preprocess_mask_arguments"),  # HF: the mask's length
    ("transformers/models/qwen3/modeling_qwen3.py", "forward"),  # HF: cache_position from the cache's length
    ("oasis_cache/compute/attention.py", "oasis_mask"),  # the mask cut to the cache's length
    ("oasis_cache/compute/attention.py", "_all_true_on_cpu"),  # CPU only (no check on CUDA)
    ("oasis_cache/draft/lookahead.py", "_before"),  # the draft row's mask column
}


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("mode", ["previous", "eagle3-exact", "previous-admitted"])
def test_decode_step_varies_only_where_known_and_syncs_only_on_cpu(tmp_path, mode):
    """Two consecutive decode steps on the CUDA path (Triton kernels, in the interpreter) — steady ones, and ones that
    each complete a block (what the completing step's graph replays: its offload and summary at the block number
    read on the device), from one decoding — run the same operators in the same order, make no host sync but the
    CPU-only mask check, and differ only at the known sites above. `previous` runs a left-padded batch of two whose
    steps are called as a captured step is (no mask: the padding recorded at the prefill), eagle3-exact an
    unpadded batch of one with `generate`'s growing mask; `previous-admitted` a cache admitted from a Mooncake Store
    (started by the audit) whose prefetches leave their store reads to after the step (recorded: the steps, not
    those reads). (Two layers where they suffice: the interpreter's cost is per layer; the eagle3 head reads three
    layers' states.)"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    out = tmp_path / "audit.json"
    mode, admitted = mode.removesuffix("-admitted"), mode.endswith("-admitted")
    run = subprocess.run([sys.executable, str(HERE / "tools" / "capture_audit.py"), "--backend", "triton",
                          *(["--admitted"] if admitted else []),
                          "--modes", mode, "--layers", "3" if mode.startswith("eagle3") else "2",
                          "--context", "300", "--budget", "128",
                          "--block-size", "8", "--completing", "--steady-too", "--json", str(out),
                          "--padded", "21" if mode == "previous" and not admitted else "0"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    import json

    found_modes = json.loads(out.read_text())["modes"]
    assert set(found_modes) == {mode, f"{mode} steady"}
    for name, found in found_modes.items():
        assert found["same_order"], name
        assert found["padding_recorded"] == (mode == "previous" and not admitted), name  # padded steps read it
        assert found["deferred_records"] == admitted, name
        assert all("_all_true_on_cpu" in site for site in found["syncs"]), (name, found["syncs"])
        sites = {(d["site"].split(":")[0], d["site"].split("(")[-1].rstrip(")")) for d in found["differing"]}
        assert sites <= STEP_VARYING, (name, sites - STEP_VARYING)
        assert found["differing"], name  # the audit sees what varies (the caller's mask at least)


def _compile_workers_or_skip():
    """Triton with what the compile workers use (its `jit_cache_hook`'s serialized specialization, `preload`, the
    CUDA backend's compiler), or a skip naming what is missing."""
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook") or not hasattr(knobs.compilation, "listener"):
        pytest.skip(f"Triton {triton.__version__} lacks knobs.runtime.jit_cache_hook: compile_only uses threads")
    from triton.backends.compiler import GPUTarget

    return knobs, GPUTarget("cuda", 90, 32)


def _recent_append_args():
    return (torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64), torch.zeros(2, 1, 2, 32, 64),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def _names_under(root):
    """The names of the files under `root`, walked with `os.walk` (which skips a folder removed mid-walk, where
    `Path.rglob` raised FileNotFoundError on a Triton temporary folder the other job's worker removed)."""
    return {name for _, _, files in os.walk(root) for name in files}


def test_compile_workers_compile_a_launch_that_the_main_process_then_finds_on_disk(tmp_path, monkeypatch):
    """`compile_only(processes=CompileWorkers(...))` (the dry step's compilations, `kernels/compile_workers.py`): a
    launch of the package's kernel inside it is sent to a worker process — which compiles it for sm_90 here, on the
    CPU, through Triton's own `preload` — and not compiled in this process; the same launch after it is a cache hit
    in this process (the key the worker wrote under is the one a real launch looks up). A job the workers cannot do
    fails without raising (the real launch would compile it); finishing the compilations closes the workers, and
    closed workers take no more jobs."""
    knobs, target = _compile_workers_or_skip()
    from triton.runtime import driver

    from oasis_cache.kernels import ahead, compile_workers
    from oasis_cache.kernels.recent_append import _recent_append_kernel, recent_append

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "_active", compile_workers._CompileOnlyDriver(target))  # (no device here)
    compiled = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kwargs: compiled.append(kwargs["cache_hit"]))
    workers = compile_workers.CompileWorkers(2, target, str(tmp_path))
    try:
        with ahead.compile_only(processes=workers) as compilations:
            recent_append(*_recent_append_args())
            bad = workers.submit("oasis_cache.kernels.recent_append", "_no_such_kernel", "{}")
        assert (compilations.sent, compilations.failed, compiled) == (1, 0, []), (workers.errors, compiled)
        assert list(compilations.seconds) == ["_recent_append_kernel"] and compilations.seconds[
            "_recent_append_kernel"] > 0
        names = _names_under(tmp_path)  # (a walk that tolerates the other worker's temporary files vanishing)
        assert "_recent_append_kernel.cubin" in names, sorted(names)
        answer = bad.result(timeout=120)  # (queued before the compilations closed the workers: still answered)
        assert answer["ok"] is False and "_no_such_kernel" in answer["error"]
    finally:
        workers.close()  # (again, where the block above failed before closing them)
    monkeypatch.setattr(_recent_append_kernel, "run", functools.partial(ahead._warm_up, _recent_append_kernel),
                        raising=False)  # (a warm-up here too: nothing runs on the CPU)
    recent_append(*_recent_append_args())
    assert compiled == [True]
    for thread in workers._threads:
        thread.join(timeout=60)
    assert not workers.alive and len(workers.ready_s) == 2 and workers.errors == []
    with pytest.raises(RuntimeError, match="no compile worker"):
        workers.submit("oasis_cache.kernels.recent_append", "_recent_append_kernel", "{}").result(timeout=5)


def test_compile_workers_option_is_checked():
    from oasis_cache import OasisConfig
    from oasis_cache.kernels.compile_workers import default_count

    assert OasisConfig(256, compile_workers=0).compile_workers == 0 and 0 <= default_count() <= 8
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="compile_workers must be"):
            OasisConfig(256, compile_workers=bad)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_prefill_starts_compile_workers_before_the_cache_has_its_transfer_engine(monkeypatch):
    """`compute/ahead.beside_prefill` runs as a cache's first prefill begins, before its transfer engine exists (it
    starts at the first layer's update): the option is judged from the prefill's device then (else no worker
    starts on a GPU). With `compile_workers=0`, the default, none start."""
    _, target = _compile_workers_or_skip()
    from triton.runtime import driver

    from conftest import tiny_model
    from oasis_cache import OasisCache
    from oasis_cache.compute import ahead
    from oasis_cache.kernels import compile_workers

    model = tiny_model("qwen3")
    started = []
    monkeypatch.setattr(compile_workers, "CompileWorkers", lambda *args: started.append(args) or "workers")
    monkeypatch.setattr(driver, "_active", compile_workers._CompileOnlyDriver(target))
    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setattr(ahead, "_WORKERS", None)
    monkeypatch.setattr(ahead, "_start_warming", lambda device=None: None)  # (the next test's)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cache = OasisCache(model, token_budget=128, compile_workers=2)
    assert cache._transfer is None and ahead.applies(cache, cuda) and not ahead.applies(cache, cpu)
    assert not ahead.applies(OasisCache(model, token_budget=128, compile_ahead=False), cuda)
    ahead.beside_prefill(cache, cpu)
    ahead.beside_prefill(OasisCache(model, token_budget=128), cuda)
    assert started == []
    ahead.beside_prefill(cache, cuda)
    assert started == [(2, target, triton_cache_dir())] and ahead._take_workers() == "workers"
    ahead._DONE.add("a dry step ran")
    ahead.beside_prefill(cache, cuda)
    assert len(started) == 1 and ahead._take_workers() is None


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_prefill_pays_tritons_start_up_beside_it(monkeypatch):
    """At a prefill where the option applies, a thread computes what a process's first kernel compilation would pay
    first (`compute/ahead.warm_triton`: Triton's own key, the kernels' source keys, its driver, ptxas's version for the
    device's architecture) — once a process, not where a dry step ran already, not on a device the option skips."""
    _, target = _compile_workers_or_skip()
    from triton.runtime import driver
    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    from conftest import tiny_model
    from oasis_cache import OasisCache
    from oasis_cache.compute import ahead
    from oasis_cache.kernels import compile_workers
    from oasis_cache.kernels.ahead import kernels

    monkeypatch.setattr(driver, "_active", compile_workers._CompileOnlyDriver(target))
    for name, value in (("_DONE", set()), ("_WORKERS", None), ("_WARMING", None), ("WARM", {})):
        monkeypatch.setattr(ahead, name, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # (an H200's, on the CPU)
    triton_key.cache_clear()
    get_ptxas_version.cache_clear()
    cache = OasisCache(tiny_model("qwen3"), token_budget=128)
    ahead.beside_prefill(cache, torch.device("cpu"))  # (a device the option skips)
    assert ahead._WARMING is None
    ahead._DONE.add("a dry step ran")
    ahead.beside_prefill(cache, torch.device("cuda"))
    assert ahead._WARMING is None
    ahead._DONE.clear()
    ahead.beside_prefill(cache, torch.device("cuda"))
    thread = ahead._WARMING
    thread.join(timeout=120)
    assert not thread.is_alive() and ahead.WARM["warm_triton_s"] > 0
    assert {"warm_key_s", "warm_driver_s", "warm_ptxas_s"} <= set(ahead.WARM), ahead.WARM
    assert triton_key.cache_info().currsize == 1  # (paid: the first compilation finds it)
    assert get_ptxas_version.cache_info().currsize == 1  # (sm_90's ptxas asked for its version)
    assert all(kernel.hash is not None for kernel in kernels())  # (the kernels' source keys made)
    ahead.beside_prefill(cache, torch.device("cuda"))
    assert ahead._WARMING is thread  # (once a process)


def triton_cache_dir():
    from triton import knobs

    return knobs.cache.dir
