"""Host memory: how much the host pools may still take, and refusing a pool that cannot fit before anything is
written (an out-of-memory kill loses the whole process and says nothing).

Pinned memory freed by a dropped cache stays in torch's caching host allocator, reusable only by requests of a size
it holds; a process that makes caches of other shapes one after another piles it up (32K x 1, 32K x 4, 128K x 1 on the
H200 host). `release_cached_pinned` hands it back to the system: a cache does so when it is reset, and
before refusing a pool for lack of room.
"""

from __future__ import annotations

import os

import torch

# Room kept free for everything else in the process (activations staged on the host, the allocator's slack, Python):
# a pool is refused when it would leave less than this.
HEADROOM_BYTES = 1 << 30
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_host_bytes() -> int | None:
    """Bytes the process may still allocate: the kernel's MemAvailable, lowered to the room left under the memory
    cgroup's limit where one is set; None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            found.append(max(0, int(limit) - usage))
        break
    return min(found) if found else None


def pinned_bytes_held() -> int:
    """Pinned bytes torch's caching host allocator owns: blocks tensors hold and blocks it keeps for reuse (0 without
    CUDA). Its "active" counters are not a way to tell the two apart (torch 2.11 keeps a freed block active until its
    events are processed, and never counts it down on an empty-cache), so what is cached shows as the drop across
    `release_cached_pinned`."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (RuntimeError, AttributeError):
        return 0


def release_cached_pinned() -> None:
    """Hand the pinned memory torch's caching host allocator keeps (blocks no tensor holds) back to the system."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()  # a block an asynchronous copy still reads is freed only once its event has completed
    # ... and once the allocator has looked at that event, which it does when it allocates: one small allocation
    # first, so that no freed block still waits on an event when the cache is emptied
    torch.empty(1, dtype=torch.uint8, pin_memory=True)
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):  # torch 2.11 / 2.13
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return


# torch's pinning by malloc, the pages touched by 8 threads, then `cudaHostRegister` (its caching host allocator frees
# each block the way it was taken, whatever the settings are later): `use_fast_pinning`
FAST_PINNING = ("pinned_use_cuda_host_register:True", "pinned_num_register_threads:8")
_PINNING: dict = {}  # "on": whether this process pins that way (decided once)


def allocator_settings() -> str:
    """The process's allocator settings as torch last parsed them (its getter where torch has one, else the
    environment it read them from: on such a torch, settings changed at run time before the first CUDA cache give way
    to the environment's, plus `FAST_PINNING`; `OasisConfig(fast_pinning=False)` keeps them)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            return getter() or ""
        except RuntimeError:
            pass
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def use_fast_pinning() -> bool:
    """Once per process, before a CUDA cache pins its first host chunk (`OasisConfig.fast_pinning`): the settings
    extended with `FAST_PINNING`, every other setting kept (torch resets the ones a new settings string leaves out,
    so the string is the current one plus these). Left alone where the settings name `pinned_use_cuda_host_register`
    (the user chose) or torch cannot take them. Measured on the H200 host (a micro-benchmark): 5 GiB in 16 MiB
    chunks 1.9-2.2 s by `cudaHostAlloc`, 0.72 s this way; a 32K prompt of Qwen3-8B pins 4.5 GiB, 128K 18 GiB. Returns
    whether the process pins this way."""
    if "on" in _PINNING:
        return _PINNING["on"]
    current = allocator_settings().strip().strip(",")
    if "host_register" in current or torch.version.cuda is None:
        on = "host_register:True" in current.replace(" ", "")
    else:
        try:
            torch._C._accelerator_setAllocatorSettings(",".join(filter(None, (current, *FAST_PINNING))))
            on = True
        except (AttributeError, RuntimeError, ValueError):  # (an older torch, or settings it refuses now)
            on = False
    _PINNING["on"] = on
    return on


def check_host_room(nbytes: int, what: str) -> None:
    """Raise MemoryError, naming the sizes, when `nbytes` more host memory would leave less than `HEADROOM_BYTES`
    available (after releasing torch's cached pinned memory once). `what`: what needs it, for the message."""
    if os.environ.get("OASIS_SKIP_HOST_MEMORY_CHECK") == "1":
        return
    available = available_host_bytes()
    if available is None or nbytes + HEADROOM_BYTES <= available:
        return
    release_cached_pinned()
    available = available_host_bytes()
    if nbytes + HEADROOM_BYTES <= available:
        return
    raise MemoryError(
        f"OasisCache: {what} needs {nbytes / 2**30:.2f} GiB of host memory, but {available / 2**30:.2f} GiB are "
        f"available (keeping {HEADROOM_BYTES / 2**30:.0f} GiB for the rest of the process). Nothing was written to "
        f"the cache. Use a shorter prompt or a smaller batch, or free host memory: drop caches you no longer use "
        f"(del cache; gc.collect()) and call cache.reset() on one you will reuse. Set "
        f"OASIS_SKIP_HOST_MEMORY_CHECK=1 to skip this check."
    )
