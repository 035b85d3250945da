"""A decode step's weight matmuls alone: each
projection of a Qwen3-8B layer at M = batch rows, as `F.linear` runs it (cuBLAS), its achieved bandwidth; then the
same with the projections that share an input concatenated (q/k/v, gate/up: one read of the input, one launch).
Each is captured as a CUDA graph of `--calls` calls over distinct weights (no L2 reuse), replayed; medians.

    python bench/matmul.py                  # Qwen3-8B shapes, bf16, M = 1
    python bench/matmul.py --rows 4         # 32K x 4's decode rows
    python bench/matmul.py --device cpu --calls 2 --repeats 1 --hidden 256 --intermediate 512   # smoke
    python bench/matmul.py --grouped        # + q/k/v and gate/up by `kernels/grouped_linear.py`, weights in place
    python bench/matmul.py --grouped --beside-gather 32   # each beside the gather, as in a step (beside_gather.py)

Prints one line per matmul: microseconds, GB/s of weights read, and the layer's sum against its bytes at --peak-gbs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import beside_gather  # noqa: E402
from attention_kernel import graphed  # noqa: E402
from score_kernel import time_us  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1, help="M: decode rows (batch x tokens)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=8, help="distinct weights per graph (more than L2 holds)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM bandwidth for the floor (H200: 4.8 TB/s)")
    parser.add_argument("--grouped", action="store_true",
                        help="also q/k/v and gate/up through the grouped kernel (one launch, each weight read in "
                             "place), over its tuning grid: block_n x block_k x warps x stages")
    beside_gather.add_option(parser)
    args = parser.parse_args()
    args.load = beside_gather.load_from(args)
    cuda = torch.device(args.device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    h, i, q, kv = args.hidden, args.intermediate, args.q_heads * args.head_dim, args.kv_heads * args.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "qkv (fused)": (q + 2 * kv, h), "gate_up (fused)": (2 * i, h)}
    results = {}
    for name, (out_features, in_features) in shapes.items():
        weights = [torch.randn(out_features, in_features, device=args.device, dtype=dtype) * 0.02
                   for _ in range(args.calls)]
        x = torch.randn(args.rows, in_features, device=args.device, dtype=dtype)
        turn = iter(range(10**9))  # (the graph's calls cycle through the distinct weights)
        calls = graphed(lambda: F.linear(x, weights[next(turn) % args.calls]), args.calls)
        us = time_us(calls, args.repeats, args.load) / args.calls
        nbytes = out_features * in_features * weights[0].element_size()
        results[name] = (us, nbytes)
        print(f"{name:16s} [{args.rows} x {in_features}] x [{in_features} x {out_features}]: {us:8.2f} us, "
              f"{nbytes / us / 1e3:7.0f} GB/s", flush=True)
        del weights
    separate = sum(results[n][0] for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"))
    fused = results["qkv (fused)"][0] + results["o_proj"][0] + results["gate_up (fused)"][0] + results["down_proj"][0]
    layer_bytes = sum(results[n][1] for n in ("qkv (fused)", "o_proj", "gate_up (fused)", "down_proj"))
    floor = layer_bytes / (args.peak_gbs * 1e3)
    print(f"a layer: {separate:.1f} us as seven matmuls, {fused:.1f} us with q/k/v and gate/up fused; "
          f"its weights at {args.peak_gbs:.0f} GB/s: {floor:.1f} us", flush=True)
    if args.grouped:
        grouped = {}
        for name, members in (("qkv (grouped)", ("q_proj", "k_proj", "v_proj")),
                              ("gate_up (grouped)", ("gate_proj", "up_proj"))):
            grouped[name] = grouped_best(args, [shapes[m] for m in members], dtype)
        best = grouped["qkv (grouped)"][0] + results["o_proj"][0] + grouped["gate_up (grouped)"][0]
        best += results["down_proj"][0]
        print(f"a layer with the grouped kernel's best for q/k/v and gate/up (cuBLAS for o, down): {best:.1f} us",
              flush=True)


def grouped_best(args, shapes, dtype) -> tuple[float, str]:
    """The grouped kernel on one group's weights (`args.calls` distinct sets, as above) over its tuning grid; prints
    each setting, returns the fastest (us, setting)."""
    from triton.runtime.errors import OutOfResources

    from oasis_cache.kernels.grouped_linear import grouped_linear

    sets = [[torch.randn(n, k, device=args.device, dtype=dtype) * 0.02 for n, k in shapes] for _ in range(args.calls)]
    x = torch.randn(args.rows, shapes[0][1], device=args.device, dtype=dtype)
    expected = [F.linear(x, w) for w in sets[0]]
    nbytes = sum(n * k for n, k in shapes) * sets[0][0].element_size()
    grid = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4, 8) for st in (3, 4)]
    if torch.device(args.device).type != "cuda":
        grid = grid[:1]
    best = (float("inf"), "")
    for bn, bk, warps, stages in grid:
        knobs = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        try:
            got = grouped_linear(x, sets[0], **knobs)
        except OutOfResources as error:  # (shared memory, for large tiles)
            print(f"   grouped {knobs}: does not fit ({str(error).splitlines()[0][:80]})", flush=True)
            continue
        if not all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in zip(got, expected)):
            print(f"   grouped {knobs}: differs from F.linear", flush=True)
            continue
        turn = iter(range(10**9))
        calls = graphed(lambda: grouped_linear(x, sets[next(turn) % args.calls], **knobs), args.calls)
        us = time_us(calls, args.repeats, args.load) / args.calls
        setting = f"block_n {bn}, block_k {bk}, warps {warps}, stages {stages}"
        print(f"   grouped {[n for n, _ in shapes]} ({setting}): {us:8.2f} us, {nbytes / us / 1e3:7.0f} GB/s",
              flush=True)
        best = min(best, (us, setting))
    print(f"grouped {[n for n, _ in shapes]} best: {best[0]:.2f} us ({best[1]})", flush=True)
    return best


if __name__ == "__main__":
    main()
