"""The draft head's training attention over one long text: the full causal-window mask (n × n scores) against
`eagle3.windowed_attention` (chunks of the window: n × 2·window), forward + backward, medians of interleaved repeats.

    python bench/head_attention.py                 # Qwen2.5-Coder-0.5B's head shape, one 4,352-row text, CPU
    python bench/head_attention.py --device cuda

Prints seconds per forward + backward and the largest output difference between the two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.draft.eagle3 import windowed_attention  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4352, help="rows of the text (a 4,096-token window + answer)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device, G = torch.device(args.device), args.heads // args.kv_heads
    torch.manual_seed(0)
    q = torch.randn(args.batch, args.heads, args.rows, args.head_dim, device=device, requires_grad=True)
    k, v = (torch.randn(args.batch, args.kv_heads, args.rows, args.head_dim, device=device, requires_grad=True)
            for _ in range(2))
    rows = torch.arange(args.rows, device=device)
    mask = (rows[None] <= rows[:, None]) & (rows[None] > rows[:, None] - args.window)

    def full():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)

    def chunked():
        return windowed_attention(q, k, v, args.window, G)

    times, outs = {"full mask": [], "by chunks": []}, {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, f in (("full mask", full), ("by chunks", chunked)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = f()
            out.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if repeat:
                times[name].append(time.perf_counter() - start)
            outs[name] = out.detach()
    print(f"{args.batch} x {args.rows} rows, window {args.window}, {args.heads} heads / {args.kv_heads} KV heads of "
          f"{args.head_dim}, {device.type}: forward + backward, medians of {args.repeats}")
    for name, t in times.items():
        print(f"  {name:10} {statistics.median(t):.3f} s")
    print(f"  largest output difference {float((outs['full mask'] - outs['by chunks']).abs().max()):.1e}")


if __name__ == "__main__":
    main()
