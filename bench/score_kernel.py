"""Block-scoring kernel timing: the `bits` and `bound` scorers at a decode step's shape, by blocks per program and
warps, against the plain-PyTorch scorer; medians of CUDA-event timings (`--calls` > 1: calls replayed as one CUDA
graph, as in a captured step).

    python bench/score_kernel.py                       # Qwen3-8B shape, 32K x 4: B 4, Hkv 8, G 4, D 128, NB 2048
    python bench/score_kernel.py --batch 1 --blocks 8704 --group 8 --kept-channels 64 --calls 36
                                                       # a captured 128K x 1 step's (rows: 4 heads x 2 tokens)
    python bench/score_kernel.py ... --beside-gather 32   # each call beside the gather, as in a step
    TRITON_INTERPRET=1 python bench/score_kernel.py --batch 1 --kv-heads 1 --blocks 64 --repeats 1   # CPU smoke

Prints one line per configuration (microseconds per call; per decode step multiply by the layers, e.g. 36).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.control import rank_blocks  # noqa: E402
from oasis_cache.kernels.block_scores import block_scores  # noqa: E402
from oasis_cache.pools import BlockSummaries  # noqa: E402


def time_us(fn, repeats: int, load=None) -> float:
    """Median microseconds of `fn` over `repeats` calls, CUDA events (the host clock on CPU). `load`: a
    `beside_gather.GatherLoad` — each timed call starts with gathers queued beside it for twice its time alone."""
    for _ in range(3):
        fn()
    alone = time_us(fn, max(3, repeats // 4)) if load is not None else 0.0
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():  # a CPU smoke run (Triton's interpreter): the host clock
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
            continue
        if load is not None:
            load.cover(2 * alone + 20)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
        if load is not None:
            load.drain()
    return statistics.median(times)


def main():
    import beside_gather

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query rows per KV head (G x query tokens)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--scorers", nargs="+", default=["bound", "bits"], choices=["bound", "bits", "bits-fp8"])
    parser.add_argument("--per-program", nargs="+", type=int, default=[16, 32, 64], help="blocks per program")
    parser.add_argument("--warps", nargs="+", type=int, default=[4], help="warps per program")
    parser.add_argument("--kept-channels", type=int, default=None,
                        help="summaries on this many of the query's channels (the package's default: half)")
    parser.add_argument("--calls", type=int, default=1, help="calls per timing (> 1: one CUDA graph of them)")
    beside_gather.add_option(parser)
    args = parser.parse_args()
    load = beside_gather.load_from(args)
    from attention_kernel import graphed  # (it imports this module: here, not at the top)

    B, H, R, D, NB, T = args.batch, args.kv_heads, args.group, args.head_dim, args.blocks, 16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1 smoke run
    torch.manual_seed(0)
    keys = torch.randn(B, H, NB, T, D, device=device, dtype=torch.bfloat16)
    query = torch.randn(B, H * R, 1, D, device=device, dtype=torch.bfloat16)  # one decode token, G = R
    forced = torch.zeros(B, NB, dtype=torch.bool, device=device)
    allowed = torch.ones(B, NB, dtype=torch.bool, device=device)
    print(f"B {B}, Hkv {H}, rows {R}, D {D}, blocks {NB}; microseconds per call, median of {args.repeats}")
    for scorer in args.scorers:
        s = BlockSummaries(B, H, D, torch.bfloat16, device, T, key_bits=scorer != "bound",
                           fp8_levels=scorer == "bits-fp8", kept_channels=args.kept_channels)
        s.append(keys)
        s.fix_channels()  # (kept channels: the heaviest, as at a first decode step)
        channels = s.channels
        reference = rank_blocks(query, s, forced, allowed, T)
        us = time_us(lambda: rank_blocks(query, s, forced, allowed, T), args.repeats, load)
        print(f"{scorer:8} torch                              {us:9.1f}")
        for per_program in args.per_program:
            for warps in args.warps:
                def call():
                    return block_scores(query, s.levels, NB, forced, allowed, s.codes, T, per_program, warps,
                                        scales=s.scales, channels=channels)
                label = f"{scorer:8} kernel    {per_program:3} blocks/program {warps} warps"
                try:  # a large tile may not compile (registers, shared memory): say so and go on
                    ok = torch.allclose(call(), reference, atol=1e-2, rtol=1e-3)
                    timed = call if args.calls == 1 else graphed(call, args.calls)
                    us = time_us(timed, args.repeats, load) / args.calls
                except Exception as e:  # noqa: BLE001
                    print(f"{label} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                print(f"{label} {us:9.1f}{'' if ok else '  MISMATCH'}", flush=True)


if __name__ == "__main__":
    main()
