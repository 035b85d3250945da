"""Device memory: how much this process may still allocate on a CUDA device."""

from __future__ import annotations

import torch


def device_room(device) -> int:
    """Bytes this process may still allocate on CUDA `device`: what the device has free plus what torch's caching
    allocator holds unused, capped by the per-process fraction (`torch.cuda.set_per_process_memory_fraction`: a
    24 GiB cap on a larger card, as the capacity benchmarks run, leaves the device's free bytes far above it)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    return min(free + torch.cuda.memory_reserved(device) - allocated, int(fraction * total) - allocated)
