"""A dry first decode step, its kernels compiled in parallel (`OasisCache(compile_ahead=True)`, research).

On a machine without the package's kernels on disk, a cache's first decode step compiles each kernel
specialization it meets, one after another, as it launches them (H200, Qwen3-8B shape, lookahead "none": ~8 of
them, 0.3-2.6 s each; decode step 1 took 7.8 s on a new machine against 0.12 s later, docs/perf.md, thirty-fourth
and thirty-ninth sessions). Before that step runs, `dry_step` runs the same forward on a copy of the cache with
every kernel launch made a compilation (`kernels/ahead.py`: in a thread pool), waits for them, and drops the copy:
the real step then finds every kernel compiled. The copy holds the same shapes, so it meets the same
specializations; it shares the host pools' chunks (nothing it launches writes them; a host write from it raises)
and copies the device state (`OasisCache.device_nbytes`: ~0.44 GB at 32K x 1 for Qwen3-8B), which is skipped
where the device has less than twice that free. Once per process for each cache configuration and batch shape.
"""

from __future__ import annotations

import copy

import torch

from ..kernels.ahead import compile_only
from ..pools.host_kv import READ_ONLY_COPY

_DONE: set = set()  # what the dry steps of this process covered (`signature`)


def signature(cache, tokens: torch.Tensor) -> tuple:
    """What decides a decode step's kernel specializations: the cache's options, the batch and its new tokens, the
    layers' shapes and dtype, the device."""
    layer = cache.layers[cache._first_oasis_layer]
    return (cache.config, tuple(tokens.shape[:2]), layer.batch_size, layer.num_kv_heads, layer.head_dim,
            layer.pool.dtype, str(layer.device), cache.ride_along is not None)


def wanted(cache, tokens) -> bool:
    """Whether this forward should be preceded by a dry one: the option on (checked first: every forward asks), a
    decode step's tokens on a cache holding some, kernels launched (the Triton backend), a local cache (an admitted
    one's copy would fetch from its store), not yet done here."""
    if not cache.config.compile_ahead:
        return False
    transfer = cache._transfer
    return (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
            and tokens.shape[1] <= cache.config.max_decode_tokens
            and cache.get_seq_length(cache._first_oasis_layer) > 0
            and transfer is not None and transfer.backend == "triton" and cache.remote_tier is None
            and signature(cache, tokens) not in _DONE)


def dry_step(cache, runner, kwargs: dict, tokens: torch.Tensor) -> bool:
    """Run this decode forward once on a read-only copy of `cache`, every kernel compiled instead of launched, the
    compilations in parallel; returns whether it ran (False where the device lacks room for the copy, or the copy
    ran out of device memory: an optimization must not end a `generate` the real step can run)."""
    _DONE.add(signature(cache, tokens))
    name = next((key for key in ("cache", "past_key_values") if kwargs.get(key) is cache), None)
    if name is None:
        return False
    device = cache.layers[cache._first_oasis_layer].device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free < 2 * sum(cache.device_nbytes().values()):
            return False
    dry = None
    try:
        dry = copy.deepcopy(cache, {READ_ONLY_COPY: True})
        dry.captured_steps = None  # (eager: nothing is captured from a step whose launches do not run)
        dry._compile_later = False  # (not a step of the model's count)
        with compile_only():
            dry._forward_one(runner, {**kwargs, name: dry})
    except torch.OutOfMemoryError:  # (the copy did not fit after all: the real step compiles as it goes)
        return False
    finally:
        if dry is not None and dry.ride_along is not None:
            dry.ride_along.remove()
        if dry is not None and dry._streams is not None:
            dry._streams.synchronize()
    return True
