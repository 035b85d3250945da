"""How long Triton takes to compile the package's top-k kernel for a GPU, measured on any machine (no GPU needed).

A first decode step's compilations are what a first `generate` waits for on a new machine (issue 21, docs/perf.md,
forty-second session: in worker processes on the H200 the top-k took 3.5-3.7 s, the seven other kernels 0.4-1.9 s).
This compiles the top-k's specializations for a 32K or 128K decode step (`--widths`: blocks per row; 2,176 is a
32K prompt's row from its 16th step, 8,704 a 128K prompt's, two stages) for `--arch` (sm_90: the H200) in this
process, with a driver that only names the target (`kernels/compile_workers._CompileOnlyDriver`), each in a new
kernel cache, after one other compilation has paid Triton's start-up. `--root`: the folder holding the `oasis_cache`
to measure (e.g. an older checkout: `git worktree add /tmp/old <commit>`), default this repository's.

    python bench/compile_times.py                      # this code
    python bench/compile_times.py --root /tmp/old      # another version of it, to compare in turn
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--widths", type=int, nargs="+", default=[2176, 8704])
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=3, help="each a new kernel cache; the median is printed")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from oasis_cache.kernels import compile_workers, recent_append, top_k

    driver.set_active(compile_workers._CompileOnlyDriver(GPUTarget("cuda", args.arch, 32)))
    for kernel in (recent_append._recent_append_kernel, top_k._top_k_kernel):  # (compiled, never run)
        kernel.run = lambda *a, grid, warmup, _kernel=kernel, **kw: type(_kernel).run(_kernel, *a, grid=grid,
                                                                                       warmup=True, **kw)

    def fresh_cache() -> None:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="oasis-compile-times-")
        for kernel in (recent_append._recent_append_kernel, top_k._top_k_kernel):
            kernel.device_caches.clear()

    fresh_cache()
    start = time.perf_counter()
    recent_append.recent_append(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64), torch.zeros(2, 1, 2, 32, 64),
                                torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.root}: start-up (another kernel) "
          f"{time.perf_counter() - start:.2f} s", flush=True)
    for width in args.widths:
        times = []
        for _ in range(args.repeats):
            fresh_cache()
            start = time.perf_counter()
            top_k.top_k(torch.randn(1, args.kv_heads, width), args.k)
            times.append(time.perf_counter() - start)
        print(f"top-k, {width} blocks a row, k = {args.k}: {statistics.median(times):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times)})", flush=True)


if __name__ == "__main__":
    main()
