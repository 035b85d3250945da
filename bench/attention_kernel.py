"""Decode attention over the working set: the Triton kernel (`kernels/decode_attention.py`, by key ranges per KV
head; in two launches, and in one where its last split combines: "onelaunch") against SDPA with the additive mask
(`compute/sparse.py`, plus the output copy the attention function makes when Qn > 1), at a decode step's shape.
Each variant runs `--layers` times inside one CUDA graph (as in a replayed decode step: no launch gaps counted);
medians of CUDA-event timings, microseconds per call.

    python bench/attention_kernel.py                    # Qwen3-8B shape, budget 2048: B 1 and 4, Qn 1 and 2
    TRITON_INTERPRET=1 python bench/attention_kernel.py --batches 1 --kv-heads 1 --slot-tokens 128 --repeats 1
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.compute.sparse import new_token_bias, sparse_attention  # noqa: E402
from oasis_cache.kernels.decode_attention import decode_attention  # noqa: E402
from score_kernel import time_us  # noqa: E402


def graphed(fn, calls: int):
    """`fn` run `calls` times, as one CUDA graph replay on CUDA (else a plain loop)."""
    if not torch.cuda.is_available():
        return lambda: [fn() for _ in range(calls)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--queries", nargs="+", type=int, default=[1, 2], help="new tokens (2: a riding draft)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--slot-tokens", type=int, default=2032, help="S*T: 127 slots of 16 at budget 2048")
    parser.add_argument("--recent", type=int, default=32, help="the recent region R")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--splits", nargs="+", type=int, default=[0, 8, 16, 32, 64], help="0: the kernel's choice")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--compare", metavar="MODULE",
                        help="another version's kernels, e.g. the previous commit's file copied to "
                             "oasis_cache/kernels/MODULE.py (not committed): timed beside the package's, alternating")
    args = parser.parse_args()
    versions = {"kernel": decode_attention, "onelaunch": decode_attention}  # two launches, then one (`tickets`)
    if args.compare:
        versions[args.compare] = importlib.import_module(f"oasis_cache.kernels.{args.compare}").decode_attention
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    H, G, D, ST, R = args.kv_heads, args.group, args.head_dim, args.slot_tokens, args.recent
    L = ST + R
    g = torch.Generator().manual_seed(0)
    print(f"Hkv {H}, G {G}, D {D}, L {L} (slots {ST} + recent {R}), {args.layers} calls per graph; us per call")
    for B in args.batches:
        kv = torch.randn(2, B, H, L, D, generator=g).to(device, torch.bfloat16)
        tickets = torch.zeros(B * H, dtype=torch.int32, device=device)  # ("onelaunch": its last split combines)
        for Qn in args.queries:
            count = torch.tensor([9 + Qn], device=device)
            visible = torch.zeros(B, H, L, dtype=torch.bool, device=device)
            visible[:, :, : ST + 9 + Qn] = True
            query = torch.randn(B, Qn, H * G, D, generator=g).to(device, torch.bfloat16).transpose(1, 2)
            bias = new_token_bias(Qn, G, L, ST, count, torch.bfloat16, device)
            scale = D ** -0.5

            def sdpa():  # what the attention function returns: [B, Qn, Hq, D] contiguous
                sparse_attention(query, kv[0], kv[1], visible, scale, bias).transpose(1, 2).contiguous()

            row = {"sdpa": time_us(graphed(sdpa, args.layers), args.repeats) / args.layers}
            for splits in args.splits:
                runs = {}
                for name, attend in versions.items():
                    extra = dict(tickets=tickets) if name == "onelaunch" else {}

                    def kernel(splits=splits or None, attend=attend, extra=extra):
                        out = attend(query, kv[0], kv[1], visible, count, ST, scale, splits, **extra)
                        out.transpose(1, 2).contiguous()
                    runs[name] = graphed(kernel, args.layers)
                    if name != "kernel":  # the same output as the package's two launches
                        same = torch.allclose(attend(query, kv[0], kv[1], visible, count, ST, scale, splits or None,
                                                     **extra),
                                              decode_attention(query, kv[0], kv[1], visible, count, ST, scale,
                                                               splits or None), atol=2e-2, rtol=2e-2)
                        print(f"  {name} agrees with the package's kernel: {same}")
                for _ in range(2):  # alternating: A B A B, each a median of its repeats; the last pair kept
                    for name, replay in runs.items():
                        row[f"{name}/{splits or 'auto'}"] = time_us(replay, args.repeats) / args.layers
            print(f"B {B} Qn {Qn}: " + "  ".join(f"{name} {us:.1f}" for name, us in row.items()), flush=True)


if __name__ == "__main__":
    main()
