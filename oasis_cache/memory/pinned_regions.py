"""Page-locked host memory the package maps and registers itself, for a prefill's host pools.

A prefill of 32K tokens of an 8B model fills 5 GiB of host pools (18 GiB at 128K). Through torch's caching host
allocator (`fast_pinning`: malloc, pages touched by threads, `cudaHostRegister` per 16 MiB chunk) that took 0.7-1.4 s
of the process's first prefill on the H200's host; one anonymous mapping on transparent huge pages, touched by torch's
threads and registered once, took 0.25-0.27 s for the same 5 GiB (a micro-benchmark, cases `runtime` and
`hugeone`). With `OasisConfig.pinned_regions` (research, off: the first `generate` gained nothing, its pinning
overlaps the prefill's device work; docs/performance.md) a prefill reserves, at its first
full-attention layer, every chunk its pools will take (`OasisCache._reserve_pinned`), as one region; the pools take
them from the stash of the forward that runs (`reserving`, `take`) and fall back to torch's allocator for anything
else (decode-time growth, forks, reordered batches).

Ownership: the allocator (`REGIONS`) owns every region and every chunk not handed out; a handed-out chunk is owned by
the tensor made for it (and its views), and comes back when that tensor's storage is freed (a finalizer on the buffer
it wraps). A chunk that came back may still be read or written by queued device work, so it is reused only after a
device synchronization, which `reserve` does once when there are such chunks (at a prefill, never in a decode
step). `release_unused` (a cache's `reset`, a host pool that would not fit otherwise) unregisters and unmaps the
regions none of whose chunks is handed out.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20  # transparent huge pages on x86-64 / most Linux builds
CHUNK_ALIGN = 4096  # each chunk starts on its own page (the gather reads 16-byte vectors)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class Region:
    """One anonymous mapping of `size` bytes at `start` (2 MiB-aligned, advised onto huge pages), touched, and
    registered with CUDA where `register`; cut into chunks of `chunk_nbytes` (`stride` apart)."""

    def __init__(self, libc, chunk_nbytes: int, count: int, register: bool):
        self.chunk_nbytes, self.count = chunk_nbytes, count
        self.stride = -(-chunk_nbytes // CHUNK_ALIGN) * CHUNK_ALIGN
        self.size = -(-self.stride * count // HUGE_PAGE) * HUGE_PAGE
        self.mapped = self.size + HUGE_PAGE  # (room to align the start)
        self._libc, self.registered = libc, False
        raw = libc.mmap(None, self.mapped, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                        -1, 0)
        if raw in (None, ctypes.c_void_p(-1).value):
            raise MemoryError(f"mmap of {self.mapped} bytes failed (errno {ctypes.get_errno()})")
        self.raw = raw
        self.start = raw + (-raw) % HUGE_PAGE
        advise = getattr(mmap, "MADV_HUGEPAGE", None)
        if advise is not None:
            libc.madvise(self.start, self.size, advise)  # (a kernel without transparent huge pages ignores it)
        torch.frombuffer((ctypes.c_uint8 * self.size).from_address(self.start), dtype=torch.uint8).zero_()  # touched
        if register:
            error = int(torch.cuda.cudart().cudaHostRegister(self.start, self.size, 0))
            if error != 0:
                self.unmap()
                raise MemoryError(f"cudaHostRegister of {self.size} bytes failed (CUDA error {error})")
            self.registered = True
        self.out = 0  # chunks handed out and not yet back

    def address(self, index: int) -> int:
        return self.start + index * self.stride

    def unmap(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.start)
            self.registered = False
        if self.raw is not None:
            self._libc.munmap(self.raw, self.mapped)
            self.raw = None


class PinnedRegions:
    """The process's regions and their free chunks (`REGIONS`)."""

    def __init__(self, register: bool | None = None):
        self._register = register  # None: register where CUDA is available (False: CPU tests of the bookkeeping)
        self._libc = _libc()
        self._lock = threading.RLock()  # (a finalizer may run inside a locked section, on a collection)
        self.regions: list[Region] = []
        self.free: dict[int, list[tuple[Region, int]]] = {}  # chunk bytes -> (region, address) free for reuse
        self.returned: list[tuple[Region, int]] = []  # came back; reused after a device synchronization
        self.mapped_total = 0  # bytes ever mapped (a measure of what was pinned anew)
        self.refused = None  # why a region could not be had (then none is tried again in this process)

    @property
    def available(self) -> bool:
        return self._libc is not None

    def reserve(self, chunk_nbytes: int, count: int) -> list[torch.Tensor]:
        """Up to `count` chunks of `chunk_nbytes` bytes (uint8 tensors, page-locked where registering): free ones
        first, the rest from one new region (fewer where a region was refused: `refused`). Not for a decode step:
        may synchronize the device (when chunks came back since the last reserve, before they are handed out
        again)."""
        if count <= 0:
            return []
        with self._lock:
            self._take_back()
            free = self.free.get(chunk_nbytes, [])
            taken = [free.pop() for _ in range(min(count, len(free)))]
            if len(taken) < count and self.refused is None:
                try:
                    region = Region(self._libc, chunk_nbytes, count - len(taken), self._registers())
                except MemoryError as error:  # (mapping or registering refused, e.g. a locked-memory limit: the
                    region, self.refused = None, str(error)  # pools take the rest from torch's allocator, and no
                    # later reservation of the process tries again)
                if region is not None:
                    self.regions.append(region)
                    self.mapped_total += region.size
                    taken += [(region, region.address(i)) for i in range(region.count)]
            return [self._hand_out(region, address, chunk_nbytes) for region, address in taken]

    def release_unused(self) -> int:
        """Unregister and unmap the regions none of whose chunks is handed out; returns the bytes released."""
        with self._lock:
            self._take_back()
            released = 0
            for region in [r for r in self.regions if r.out == 0]:
                self.regions.remove(region)
                self.free[region.chunk_nbytes] = [c for c in self.free.get(region.chunk_nbytes, ())
                                                  if c[0] is not region]
                released += region.size
                region.unmap()
            return released

    def held_bytes(self) -> int:
        """Bytes of the regions mapped now (handed out or free)."""
        return sum(region.size for region in self.regions)

    # ------------------------------------------------------------------------------------------------ internals
    def _registers(self) -> bool:
        if self._register is None:
            return torch.cuda.is_available()
        return self._register

    def _take_back(self) -> None:
        """Chunks that came back become free, after the device work that may use them has finished."""
        if not self.returned:
            return
        returned, self.returned = self.returned, []  # (a finalizer appending now lands in the new list)
        if self._registers() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for region, address in returned:
            region.out -= 1
            self.free.setdefault(region.chunk_nbytes, []).append((region, address))

    def _came_back(self, region: Region, address: int) -> None:
        with self._lock:
            self.returned.append((region, address))

    def _hand_out(self, region: Region, address: int, nbytes: int) -> torch.Tensor:
        buffer = (ctypes.c_uint8 * nbytes).from_address(address)
        chunk = torch.frombuffer(buffer, dtype=torch.uint8)  # (its storage holds `buffer` until the last view goes)
        region.out += 1
        finalizer = weakref.finalize(buffer, self._came_back, region, address)
        finalizer.atexit = False
        return chunk


REGIONS = PinnedRegions()

# ------------------------------------------------------------------------------------ a forward's reserved chunks
_ACTIVE = threading.local()  # .stash: chunk bytes -> chunks reserved for the forward running in this thread


@contextlib.contextmanager
def reserving():
    """A forward during which `reserve_for_forward` may set chunks aside and `take` hands them to host pools; those
    not taken go back when it ends."""
    outer = getattr(_ACTIVE, "stash", None)
    _ACTIVE.stash = {}
    try:
        yield
    finally:
        _ACTIVE.stash = outer


def reserve_for_forward(chunk_nbytes: int, count: int) -> None:
    """Set aside chunks for the running forward (`reserving`) so that it holds `count` of `chunk_nbytes` bytes not
    yet taken (no-op outside one, or where this platform cannot map memory)."""
    stash = getattr(_ACTIVE, "stash", None)
    if stash is None or not REGIONS.available:
        return
    have = stash.setdefault(chunk_nbytes, [])
    have += REGIONS.reserve(chunk_nbytes, count - len(have))


def take(nbytes: int) -> torch.Tensor | None:
    """A chunk of `nbytes` bytes set aside for the running forward (uint8), or None."""
    stash = getattr(_ACTIVE, "stash", None)
    chunks = stash.get(nbytes) if stash else None
    return chunks.pop() if chunks else None
