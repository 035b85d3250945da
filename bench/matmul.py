"""A decode step's weight matmuls alone (issue 21: 5.4 ms of a replayed 32K x 1 step against a ~3.4 ms floor): each
projection of a Qwen3-8B layer at M = batch rows, as `F.linear` runs it (cuBLAS), its achieved bandwidth; then the
same with the projections that share an input concatenated (q/k/v, gate/up: one read of the input, one launch).
Each is captured as a CUDA graph of `--calls` calls over distinct weights (no L2 reuse), replayed; medians.

    python bench/matmul.py                  # Qwen3-8B shapes, bf16, M = 1
    python bench/matmul.py --rows 4         # 32K x 4's decode rows
    python bench/matmul.py --device cpu --calls 2 --repeats 1 --hidden 256 --intermediate 512   # smoke

Prints one line per matmul: microseconds, GB/s of weights read, and the layer's sum against its bytes at --peak-gbs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
    args = parser.parse_args()
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
        us = time_us(calls, args.repeats) / args.calls
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


if __name__ == "__main__":
    main()
