"""Tiles that fit the device: a kernel whose tile of keys (or blocks) times the head width asks for more shared memory
than the card has (Gemma 4's 512-wide heads in float32 asked the H100 for 299,200 bytes, it has 232,448; a consumer
card ~100 KB) is launched again with half the tile, down to 16. Triton refuses such a launch when
it loads the compiled kernel, before anything runs, so the retry writes nothing twice. A tile that did not fit is not
tried again for the same key (device, dtypes, the kernel's shape constants): only a first call retries.
"""

from __future__ import annotations

from typing import Callable, TypeVar

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - CPU-only installs without triton never launch a kernel
    OutOfResources = None

T = TypeVar("T")
SMALLEST_TILE = 16  # tensor-core products need 16 rows

_fitted: dict[tuple, int] = {}


def launch_fitting(key: tuple, tile: int, launch: Callable[[int], T]) -> T:
    """`launch(tile)`'s result for the largest tile, from `tile` halving down to `SMALLEST_TILE`, whose kernel the
    device can hold; `key` names what decides the kernel's shared memory (its device, dtypes, shape constants)."""
    tile = min(tile, _fitted.get(key, tile))
    while True:
        try:
            return launch(tile)
        except Exception as e:
            if OutOfResources is None or not isinstance(e, OutOfResources) or tile // 2 < SMALLEST_TILE:
                raise
            tile //= 2
            _fitted[key] = tile  # (the largest a later call may try: the one above did not fit)
