"""A dry first decode step, its kernels compiled in parallel (`compile_ahead`: None, the default, on with CUDA).

On a machine without the package's kernels on disk, a cache's first decode step compiles each kernel
specialization it meets, one after another, as it launches them (H200, Qwen3-8B shape, lookahead "none": ~8 of
them, 0.3-2.6 s each; decode step 1 took 7.8 s on a new machine against 0.12 s later, docs/performance.md).
Before that step runs, `dry_step` runs the same forward on a copy of the cache with
every kernel launch made a compilation (`kernels/ahead.py`: in a thread pool), waits for them, and drops the copy:
the real step then finds every kernel compiled. The copy holds the same shapes, so it meets the same
specializations; its forward ends at the first attention layer whose shapes an earlier one had
(`stop_after_distinct_layers`: one layer of a plain model). It shares the host pools' chunks (nothing it launches
writes them; a host write from it raises) and copies the device state (`OasisCache.device_nbytes`: ~0.44 GB at
32K x 1 for Qwen3-8B), which is skipped where the process may take less than twice that
(`memory.device_memory.device_room`: free, or under its cap). Once per process for each cache configuration and
batch shape.

Measured (H200, Qwen3-8B at 32K x 1, a new machine: docs/performance.md): decode step 1 9.4-10.1 ->
4.6-4.75 s, the first `generate` 14.1-16.1 -> 11.3-11.8 s; with the kernels on disk the dry step costs ~0.9 s that the
real step 1 then saves. Run instead right after the prefill (with a decode step's inputs made from
the prefill's), it gained nothing measurable from the device's queued prefill work, and the first token came its
whole 4.2 s later. With one layer traced: 0.93 -> 0.64 s with the kernels on disk; on a new
machine 3.2-4.4 s against 3.65-4.7 (the compilations, ~2-3 s, are now the whole of it: the trace's 1.3-2.1 s is the
kernels' submissions beside their threads and the process's first use of the model's own operations, not the 35
other layers). Of the trace's 0.9-1.6 s in threads, 0.4 s was Triton's once-a-process
start-up inside the first cache key (the hash of its own files), now paid by a thread beside the prefill
(`warm_triton`): the first call 1.93-2.26x -> 1.67-1.98x a later one (docs/performance.md).
"""

from __future__ import annotations

import copy
import os
import time

import torch

from ..kernels.ahead import compile_only
from ..kernels.gather import triton_available
from ..memory.device_memory import device_room
from ..pools.host_kv import READ_ONLY_COPY

_DONE: set = set()  # what the dry steps of this process covered (`signature`)
LAST: dict = {}  # the last dry step's phases (s): `bench/first_call.py` prints them
_WARMING = None  # the thread a prefill started for Triton's start-up (`warm_triton`)
WARM: dict = {}  # what it took, once it ended (`_start_warming`)


def signature(cache, tokens: torch.Tensor) -> tuple:
    """What decides a decode step's kernel specializations: the cache's options, the batch and its new tokens, the
    layers' shapes and dtype, the device."""
    layer = cache.layers[cache._first_oasis_layer]
    return (cache.config, tuple(tokens.shape[:2]), layer.batch_size, layer.num_kv_heads, layer.head_dim,
            layer.pool.dtype, str(layer.device), cache.ride_along is not None)


def wanted(cache, tokens) -> bool:
    """Whether this forward should be preceded by a dry one: the option not off (checked first: every forward asks),
    a decode step's tokens of a shape this cache has not asked about yet (then a set lookup per step), on a cache
    holding some, kernels launched (the Triton backend) on a CUDA device (or `compile_ahead=True`), a local cache (an
    admitted one's copy would fetch from its store), not yet done in this process."""
    setting = cache.config.compile_ahead
    if setting is False or not (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
                                and tokens.shape[1] <= cache.config.max_decode_tokens):
        return False
    shape = tuple(tokens.shape[:2])
    if shape in cache._ahead_asked or cache.get_seq_length(cache._first_oasis_layer) == 0:
        return False
    cache._ahead_asked.add(shape)
    return applies(cache) and signature(cache, tokens) not in _DONE


def applies(cache, device: torch.device | None = None) -> bool:
    """The option on for this cache: kernels launched (the Triton backend) on a CUDA device (or `compile_ahead=True`
    on any), a local cache (an admitted one's copy would fetch from its store). `device`: before the cache's first
    forward (which starts its transfer engine), the device that forward runs on."""
    from ..memory.transfer import resolve_backend

    setting, transfer = cache.config.compile_ahead, cache.context.transfer
    if setting is False or cache.remote_tier is not None:
        return False
    if transfer is not None:
        backend, device = transfer.backend, cache.layers[cache._first_oasis_layer].device
    elif device is None:
        return False
    else:
        try:
            backend = resolve_backend(cache.config.backend, device)
        except (ValueError, ImportError):  # (the forward itself says what is wrong)
            return False
    return backend == "triton" and (setting is True or device.type == "cuda")


def warm_block_store(cache) -> None:
    """The one kernel a decode step that completes a block launches beyond a plain step's: the host store of that
    block. `TransferEngine.offload` is called here as that step calls it (one block `[2, B, Hkv, 1, T, D]` at the
    summaries' device count) on `cache`'s first layer — inside `compile_only()` its launch is a compilation, so the
    first completing step (~16 steps in) does not compile it (+0.4 s at step 16 on a new H200
    machine). `cache` is the dry copy: the pool's count it moves on is the copy's."""
    transfer, layer = cache.context.transfer, cache.layers[cache._first_oasis_layer]
    if transfer is None or transfer.backend != "triton" or not layer.is_initialized:
        return
    block = torch.empty(2, layer.batch_size, layer.num_kv_heads, 1, cache.config.block_size, layer.head_dim,
                        dtype=layer.pool.dtype, device=layer.device)
    transfer.offload(layer.pool, block, layer.summaries.count)


def beside_prefill(cache, device: torch.device) -> None:
    """What a prefill on `device` starts beside it, where no dry step has run in this process yet and the option is
    on for `cache`: a thread paying Triton's once-a-process start-up (`warm_triton`), so that it is paid when the dry
    step after the prefill compiles. Nothing where Triton is interpreted or missing."""
    if (_DONE or not applies(cache, device) or os.environ.get("TRITON_INTERPRET") == "1"
            or not triton_available()):
        return
    if _WARMING is None:
        _start_warming(device)


WARM_PARTS = ("key", "driver", "ptxas")  # research: the parts `warm_triton` pays (bench/first_call.py --warm-parts)


def warm_triton(device: torch.device | None = None) -> dict:
    """What a process's first Triton compilation pays before its own work, paid now; returns the seconds of each part
    (`warm_<part>_s`) and their sum (`warm_triton_s`). Parts: the hash of Triton's own files (`key`: `triton_key`, in
    every kernel's cache key, 0.4-0.5 s on the H200's host and the CI machine's CPU) and the package's kernels' source
    keys; on a CUDA `device`, Triton's CUDA driver (`driver`: its first use builds and loads a small C module with the
    host's compiler, into the kernel cache, and asks `ldconfig` where libcuda is) and ptxas's version (`ptxas`: in the
    backend's key, a subprocess of a large process). Each part that fails is skipped (the first compilation pays it
    instead). Run in a thread beside a prefill (`beside_prefill`): the main thread mostly waits for the device there.
    Measured (H200, Qwen3-8B at 32K x 1, a new kernel cache), the key part alone: the dry
    step's trace 1.1-1.6 -> 0.75-1.14 s, the first call 1.93-2.26x -> 1.67-1.98x a later one; the driver part too
    (alternating with the key part alone): trace 1.15-1.34 -> 0.66-0.69 s, dry step 2.56-2.68 ->
    1.79-1.82 s, first call 1.90-2.37x -> 1.70-1.75x."""
    seconds: dict = {}

    def part(name: str, work) -> None:
        start = time.perf_counter()
        try:
            work()
        except Exception:  # noqa: BLE001 - (an optimization: the first compilation pays it instead)
            return
        seconds[f"warm_{name}_s"] = round(time.perf_counter() - start, 3)

    def key() -> None:
        from triton.runtime.cache import triton_key

        from ..kernels.ahead import kernels

        triton_key()
        for kernel in kernels():
            getattr(kernel, "cache_key", None)

    def driver() -> None:
        from triton.runtime import driver as drivers

        drivers.active.get_current_target()

    def ptxas() -> None:
        from triton.backends.nvidia.compiler import get_ptxas_version

        major, minor = torch.cuda.get_device_capability(device)
        get_ptxas_version(major * 10 + minor)

    parts = (("key", key), ("driver", driver), ("ptxas", ptxas))
    for name, work in parts if device is not None and device.type == "cuda" else parts[:1]:
        if name in WARM_PARTS:
            part(name, work)
    seconds["warm_triton_s"] = round(sum(seconds.values()), 3)
    return seconds


def _start_warming(device: torch.device | None = None) -> None:
    """`warm_triton(device)` in a daemon thread, once a process; its seconds go to `WARM`, which a dry step copies to
    `LAST` (the bench: absent there where it had not ended when the dry step began)."""
    global _WARMING
    import threading

    _WARMING = threading.Thread(target=lambda: WARM.update(warm_triton(device)), name="oasis-warm-triton",
                                daemon=True)  # (each part of `warm_triton` catches its own failure)
    _WARMING.start()


class DryStepDone(Exception):
    """Raised by the dry copy's first attention layer of a shape it has traced already: every kernel specialization
    of the step was met (`stop_after_distinct_layers`), so the rest of the forward is not run."""


def stop_after_distinct_layers(dry) -> int:
    """Make the dry copy's forward end at the first attention layer whose shapes an earlier layer had (the layers of a
    model share them: the dry forward then runs one layer's attention, not all of them); returns how many layers it
    traces. A layer's launches are decided by its shapes (`signature` holds the cache's options): a layer meeting
    nothing new need not run. Measured (H200, Qwen3-8B at 32K x 1): the dry step 0.93 -> 0.64 s
    with the kernels on disk; on a new machine its trace stays 1.3-2.1 s (the submissions, not the layers)."""
    seen = set()
    for layer in dry.layers:
        if not getattr(layer, "is_initialized", False) or not hasattr(layer, "attend"):
            continue
        shape = (layer.batch_size, layer.num_kv_heads, layer.head_dim, layer.pool.dtype, str(layer.device))
        if shape in seen:
            layer.attend = _done  # (an instance attribute on the copy's layer)
        seen.add(shape)
    return len(seen)


def _done(*args, **kwargs):
    raise DryStepDone


PENDING: list = []  # `kernels.ahead.Compilations` a prefill started (`at_prefill`), finished before the next decode


def at_prefill(cache, layer, query: torch.Tensor, visible: torch.Tensor | None, scale: float) -> bool:
    """`OasisConfig.ahead_at_prefill` (research): the dry step's compilations started during the prefill, so they
    run while its other layers do instead of before the first decode step. Called by the first attention layer once
    the whole prompt is in it (the last chunk of a chunked prefill): a read-only copy of the cache (without the
    prompt's device-resident keys and values) takes one decode token of zeros at that layer and runs its attention
    (the decode step's), its store warmed as in `dry_step`, every kernel launch a compilation left running;
    `finish_pending` (before the next decode forward) waits for them. One layer meets the step's specializations
    (`stop_after_distinct_layers`); `launch_keys --check --compile-ahead --ahead-at-prefill` checks that no decode
    step meets one first. Not with a ride-along draft (its step attends two rows: `dry_step` then runs as before).
    Returns whether it ran. Measured (H200, 32K x 1 on a new machine): the trace's 1.6 s moves
    into the prefill (the first token that much later), step 1 still waits 2.1-2.2 s; the first call unchanged."""
    from ..compute.attention import clear_pending

    B = query.shape[0]
    step = signature(cache, torch.empty((B, 1), device="meta"))
    if (cache.ride_along is not None or not layer.decodes(1) or not applies(cache)
            or step in _DONE):  # (no block in the pool yet: a step would attend densely)
        return False  # (a forward recording autograd may copy too: the cache's state never records it, `OasisLayer`)
    if not _room_for_copy(cache):  # (beside the prefill's activations: the dry step after it may find room)
        return False
    _DONE.add(step)
    cache._ahead_asked.add((B, 1))
    dry = None
    LAST.clear()
    LAST.update(WARM)
    start = time.perf_counter()
    try:
        dry = _read_only_copy(cache)
        LAST["copy_s"] = time.perf_counter() - start
        zeros = query.new_zeros(B, layer.num_kv_heads, 1, layer.head_dim)
        mask = None if visible is None else torch.cat((visible, visible[:, -1:]), dim=1)
        with compile_only(wait=False) as compilations:
            dry.eager_update(zeros, zeros.clone(), layer.layer_idx)
            clear_pending()
            dry.layers[layer.layer_idx].attend(query[:, :, -1:], mask, scale)
            warm_block_store(dry)
        PENDING.append(compilations)
        LAST["layers_traced"], LAST["trace_s"] = 1, time.perf_counter() - start - LAST["copy_s"]
    except torch.OutOfMemoryError:  # (the copy did not fit after all: the first decode step compiles as it goes)
        return False
    finally:
        clear_pending()  # (the real layer's pending handoff was taken before its attention ran)
        _drop(dry)
        LAST["total_s"] = time.perf_counter() - start
    return True


def finish_pending() -> None:
    """Wait for the compilations a prefill started (`at_prefill`); the kernels' caches then hold them."""
    start = time.perf_counter()
    while PENDING:
        compilations = PENDING.pop()
        compilations.finish()
    LAST["compile_wait_s"] = time.perf_counter() - start


def dry_step(cache, forward, kwargs: dict, tokens: torch.Tensor) -> bool:
    """Run this decode forward (`forward(cache, kwargs)`) once on a read-only copy of `cache`, every kernel compiled
    instead of launched, the compilations in parallel; returns whether it ran (False where the device lacks room for
    the copy, or the copy ran out of device memory: an optimization must not end a `generate` the real step can
    run)."""
    _DONE.add(signature(cache, tokens))
    name = next((key for key in ("cache", "past_key_values") if kwargs.get(key) is cache), None)
    if name is None:
        return False
    if not _room_for_copy(cache):
        return False
    dry = None
    LAST.clear()
    LAST.update(WARM)
    start = time.perf_counter()
    try:
        dry = _read_only_copy(cache)
        LAST["copy_s"] = time.perf_counter() - start
        LAST["layers_traced"] = stop_after_distinct_layers(dry)
        with compile_only():
            try:
                forward(dry, {**kwargs, name: dry})
            except DryStepDone:
                pass
            warm_block_store(dry)
            LAST["trace_s"] = time.perf_counter() - start - LAST["copy_s"]
        LAST["compile_wait_s"] = time.perf_counter() - start - LAST["copy_s"] - LAST["trace_s"]
    except torch.OutOfMemoryError:  # (the copy did not fit after all: the real step compiles as it goes)
        return False
    finally:
        _drop(dry)
        LAST["total_s"] = time.perf_counter() - start
    return True


def _room_for_copy(cache) -> bool:
    """Whether the process may take twice the cache's device state (under a per-process cap too: a copy past it
    would only run out of memory)."""
    device = cache.layers[cache._first_oasis_layer].device
    return device.type != "cuda" or device_room(device) >= 2 * sum(cache.device_nbytes().values())


def _read_only_copy(cache):
    """The dry steps' copy of `cache`: host chunks shared read-only, device state copied — not the prompt's keys and
    values a chunked prefill keeps on the device (`resident_kv`) nor its buffer for a chunk's past (`prefill_past`),
    a prefill's own —, eager (nothing is captured from a step whose launches do not run), not a step of the model's
    count, not inside a chunked prefill."""
    from ..layer import OasisLayer

    held = [(layer, layer.resident_kv) for layer in cache.layers if isinstance(layer, OasisLayer)]
    past = cache.context.prefill_past
    for layer, _ in held:
        layer.resident_kv = None
    cache.context.prefill_past = None
    try:
        dry = copy.deepcopy(cache, {READ_ONLY_COPY: True})
    finally:
        for layer, kept in held:
            layer.resident_kv = kept
        cache.context.prefill_past = past
    dry.captured_steps = None
    dry._compile_later = False
    dry.context.prefill_tokens = dry.context.prefill_resident = None
    dry._routed = True  # (copied mid-forward: its layers' lengths differ; nothing of it is undone or checked)
    return dry


def _drop(dry) -> None:
    """Let a dry copy go: its ride-along's hooks off the model, its streams' work done."""
    if dry is None:
        return
    if dry.ride_along is not None:
        dry.ride_along.remove()
    if dry.context.streams is not None:
        dry.context.streams.synchronize()
