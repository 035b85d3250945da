"""The Triton kernels (block gather, block scores, slot assignment) against their plain-PyTorch references over
grids of shapes and dtypes: on CPU through Triton's interpreter (raw host addresses for the gather, as on the GPU
through unified addressing), on CUDA for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasis_cache.kernels.gather import triton_available

from kernel_cases import CHECKS

HERE = Path(__file__).resolve().parents[1]  # tests/
PATHS = os.pathsep.join([str(HERE.parent), str(HERE), str(HERE / "integration")])  # (the scripts' imports)


@pytest.mark.audit  # (every kernel case: ~100 s on 2 cores; the sparse pipeline below stays in the default run)
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": PATHS}
    run = subprocess.run([sys.executable, str(HERE / "kernel_cases.py"), "cpu"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("OK") == sum(len(cases) for _, cases, _ in CHECKS), run.stdout


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("part", [pytest.param("dense", marks=pytest.mark.audit), "sparse",
                                  pytest.param("draft", marks=pytest.mark.audit),
                                  pytest.param("sinks", marks=pytest.mark.audit)])
def test_decode_pipeline_with_kernels_in_triton_interpreter(part):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": PATHS}
    run = subprocess.run([sys.executable, str(HERE / "pipeline_with_kernels.py"), part], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


@pytest.mark.audit
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
    was met first by the dry copy (compiled, not run: `runtime/ahead.py`; after a prefill whole or in chunks; with
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


@pytest.mark.audit
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
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": PATHS}
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


def _cuda_target_or_skip():
    """Triton with a CUDA backend's target to compile for without a device, or a skip naming what is missing."""
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.compilation, "listener"):
        pytest.skip(f"Triton {triton.__version__} lacks knobs.compilation.listener")
    from triton.backends.compiler import GPUTarget

    return knobs, GPUTarget("cuda", 90, 32)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_prefill_starts_tritons_warm_up_before_the_cache_has_its_transfer_engine(monkeypatch):
    """`runtime/ahead.beside_prefill` runs as a cache's first prefill begins, before its transfer engine exists (it
    starts at the first layer's update): the option is judged from the prefill's device then (else nothing starts on
    a GPU); not on a device the option skips, nor once a dry step ran."""
    _, target = _cuda_target_or_skip()
    from triton.runtime import driver

    from conftest import tiny_model
    from oasis_cache import OasisCache
    from oasis_cache.kernels.ahead import CompileOnlyDriver
    from oasis_cache.runtime import ahead

    model = tiny_model("qwen3")
    started = []
    monkeypatch.setattr(driver, "_active", CompileOnlyDriver(target))
    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setattr(ahead, "_WARMING", None)
    monkeypatch.setattr(ahead, "_start_warming", lambda device=None: started.append(device))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cache = OasisCache(model, token_budget=128)
    assert cache.context.transfer is None and ahead.applies(cache, cuda) and not ahead.applies(cache, cpu)
    assert not ahead.applies(OasisCache(model, token_budget=128, advanced=dict(compile_ahead=False)), cuda)
    ahead.beside_prefill(cache, cpu)
    assert started == []
    ahead.beside_prefill(cache, cuda)
    assert started == [cuda]
    ahead._DONE.add("a dry step ran")
    ahead.beside_prefill(cache, cuda)
    assert started == [cuda]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_prefill_pays_tritons_start_up_beside_it(monkeypatch):
    """At a prefill where the option applies, a thread computes what a process's first kernel compilation would pay
    first (`compute/ahead.warm_triton`: Triton's own key, the kernels' source keys, its driver, ptxas's version for the
    device's architecture) — once a process, not where a dry step ran already, not on a device the option skips."""
    _, target = _cuda_target_or_skip()
    from triton.runtime import driver
    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    from conftest import tiny_model
    from oasis_cache import OasisCache
    from oasis_cache.runtime import ahead
    from oasis_cache.kernels.ahead import CompileOnlyDriver, kernels

    monkeypatch.setattr(driver, "_active", CompileOnlyDriver(target))
    for name, value in (("_DONE", set()), ("_WARMING", None), ("WARM", {})):
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


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_every_kernel_the_package_launches_compiles_instead_in_a_dry_step():
    """`kernels/ahead.kernels()` lists every launched kernel of the package: a kernel missing there would run for real
    in a dry step (`runtime/ahead.py`), over the copy's garbage indices (an illegal address on a GPU)."""
    import importlib
    import pkgutil

    import oasis_cache.kernels as package
    from oasis_cache.kernels.ahead import kernels

    launched = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"oasis_cache.kernels.{info.name}")
        launched |= {value for name, value in vars(module).items() if name.endswith("_kernel")
                     and type(value).__name__ in ("JITFunction", "InterpretedFunction")}
    assert launched and launched <= set(kernels()), launched - set(kernels())
