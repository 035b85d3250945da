"""How long Triton takes to compile the package's kernels for a GPU, measured on any machine (no GPU needed).

A first decode step's compilations are what a first `generate` waits for on a new machine. This compiles, for `--arch` (sm_90: the H200) in this
process with a driver that only names the target (`kernels/compile_workers._CompileOnlyDriver`), each in a new
kernel cache after one other compilation has paid Triton's start-up: the top-k's specializations for a decode step
(`--widths`: blocks per row; 2,176 is a 32K prompt's row from its 16th step, 8,704 a 128K prompt's, two stages), and
with `--kernels` the slot assignment, the bits block scores and the decode attention (split + combine) at a Qwen3-8B
decode step's shapes (8 KV heads of 4 query heads, 128 channels, summaries on 64 of them, bf16, 2,048 blocks, 128
chosen, ~120 slots, 18 splits). `--root`: the folder holding the `oasis_cache`
to measure (e.g. an older checkout: `git worktree add /tmp/old <commit>`), default this repository's.

    python bench/compile_times.py                      # this code
    python bench/compile_times.py --root /tmp/old      # another version of it, to compare in turn
    python bench/compile_times.py --kernels top_k slot_assign block_scores attention --widths 2176 --together

`--together`: then all of them one after another and all at once (a thread each), as a dry step compiles them: on
the CI machine's 2 CPUs 2.18 s -> 1.28 s, so Triton's compilations do run side by side in
threads for much of their time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
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
    parser.add_argument("--kernels", nargs="+", default=["top_k"],
                        choices=["top_k", "slot_assign", "block_scores", "attention"])
    parser.add_argument("--together", action="store_true",
                        help="then all of them one after another, and all at once in threads (one each): how much "
                             "of the compilations Python's GIL serializes, as in a dry step (`kernels/ahead.py`)")
    parser.add_argument("--stages", action="store_true",
                        help="also each compilation's stages (Triton's compilation listener): the front end "
                             "(`ir`: Python walks the kernel's syntax tree), then ttir, ttgir, llir, ptx, cubin "
                             "(ptxas, a subprocess); medians over the repeats, ms")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from oasis_cache.kernels import block_scores, compile_workers, decode_attention, recent_append, slot_assign, top_k

    driver.set_active(compile_workers._CompileOnlyDriver(GPUTarget("cuda", args.arch, 32)))
    kernels = (recent_append._recent_append_kernel, top_k._top_k_kernel, slot_assign._slot_assign_kernel,
               block_scores._block_scores_kernel, decode_attention._split_kernel, decode_attention._combine_kernel)
    for kernel in kernels:  # (compiled, never run)
        kernel.run = lambda *a, grid, warmup, _kernel=kernel, **kw: type(_kernel).run(_kernel, *a, grid=grid,
                                                                                       warmup=True, **kw)

    def fresh_cache() -> None:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="oasis-compile-times-")
        for kernel in kernels:
            kernel.device_caches.clear()

    stages: dict = {}  # kernel name: [{stage: ms}] per compilation (`--stages`)

    def listen(src, metadata, metadata_group, times, cache_hit) -> None:
        if not cache_hit:
            parts = {"ir": times.ir_initialization / 1e3, **{k: v / 1e3 for k, v in times.lowering_stages}}
            stages.setdefault(getattr(src, "name", "?"), []).append(parts)

    if args.stages:
        triton.knobs.compilation.listener = listen

    def timed(name: str, launch) -> None:
        times = []
        stages.clear()
        for _ in range(args.repeats):
            fresh_cache()
            start = time.perf_counter()
            launch()
            times.append(time.perf_counter() - start)
        print(f"{name}: {statistics.median(times):.2f} s ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
        for kernel, runs in stages.items():
            names = list(runs[0])
            print(f"   {kernel}: " + ", ".join(f"{n} {statistics.median(r.get(n, 0.0) for r in runs):.0f}"
                                              for n in names) + " ms", flush=True)

    fresh_cache()
    start = time.perf_counter()
    recent_append.recent_append(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64), torch.zeros(2, 1, 2, 32, 64),
                                torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.root}: start-up (another kernel) "
          f"{time.perf_counter() - start:.2f} s", flush=True)
    H, blocks, capacity, slots, T = args.kv_heads, 2048, 2176, 120, 16
    launches = {}
    for name in args.kernels:
        if name == "top_k":
            for width in args.widths:
                launches[f"top-k, {width} blocks a row, k = {args.k}"] = (
                    lambda width=width: top_k.top_k(torch.randn(1, H, width), args.k))
        elif name == "slot_assign":
            launches[f"slot assignment, {args.k} chosen, {slots} slots"] = lambda: slot_assign.slot_assign(
                torch.zeros(1, H, args.k, dtype=torch.long), torch.zeros(1, H, args.k),
                torch.zeros(H, capacity + 1, dtype=torch.long), torch.zeros(H, slots + 1, dtype=torch.long),
                torch.zeros(H, slots + 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.zeros(1, H, slots * T + 64, dtype=torch.bool), torch.zeros(4, dtype=torch.long), T, args.k)
        elif name == "attention":  # (the split and the combine, 18 splits as on the H200 at 32K x 1)
            length = slots * T + 256
            launches[f"decode attention (split + combine), {length} keys"] = lambda: decode_attention.decode_attention(
                torch.zeros(1, 4 * H, 1, 128, dtype=torch.bfloat16),
                torch.zeros(1, H, length, 128, dtype=torch.bfloat16),
                torch.zeros(1, H, length, 128, dtype=torch.bfloat16), torch.zeros(1, H, length, dtype=torch.bool),
                torch.zeros(1, dtype=torch.long), slots * T, 128 ** -0.5, splits=18,
                recent_visible=torch.zeros(1, 1, length - slots * T, dtype=torch.bool))
        else:
            launches[f"block scores (bits), {blocks} blocks"] = lambda: block_scores.block_scores(
                torch.zeros(1, 4 * H, 1, 128, dtype=torch.bfloat16),
                torch.zeros(2, 1, H, capacity, 64, dtype=torch.bfloat16), blocks,
                torch.zeros(1, blocks, dtype=torch.bool), torch.ones(1, blocks, dtype=torch.bool),
                codes=torch.zeros(1, H, capacity, 2, 64, dtype=torch.uint8), block_size=T,
                channels=torch.zeros(1, H, 64, dtype=torch.long))
    for name, launch in launches.items():
        timed(name, launch)
    if args.together:
        timed(f"all {len(launches)}, one after another", lambda: [launch() for launch in launches.values()])

        def in_threads() -> None:
            threads = [threading.Thread(target=launch) for launch in launches.values()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        timed(f"all {len(launches)} at once, a thread each ({os.cpu_count()} CPUs)", in_threads)


if __name__ == "__main__":
    main()
