"""Attention of a prompt's chunk over its past: SDPA with a lower-right causal mask (its flash kernel) against the
past without a mask and the chunk causally, both by cuDNN with log-sum-exps, merged (`compute/dense.py`,
`SPLIT_PAST`).

    python bench/chunk_attention.py --out bench/results/chunk-attention.json     # H200: `gpu_run.sh chunkattention`

Qwen3-8B's heads (32 query heads over 8 KV heads of 128, expanded as `dense_causal_attention` expands them), one
layer, a chunk of `--chunk` queries after pasts of `--pasts` tokens; each way timed with CUDA events (median of
`--repeats`, the two ways interleaved, each timed call after three untimed: `gather.timed`) and compared with
float32 attention of the same inputs (max abs error). The first call of each way at each shape is timed apart (wall
clock: what building cuDNN's plans for a new shape costs a process's first prefill). A third way, `gqa`: the split's
two cuDNN calls on the unexpanded keys and values (grouped query heads read by cuDNN itself: no `[B, Hq, L, D]`
copies; `null` where cuDNN refuses them) — whether the package can drop the expansion on this path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather import timed  # noqa: E402

from oasis_cache.compute import dense  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--pasts", default="8192,24576,57344,122880")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, gqa_default = [], dense.SPLIT_GQA
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; chunk {args.chunk}, {args.heads} heads over "
          f"{args.kv_heads} KV heads of {args.head_dim}, bf16; ms medians of {args.repeats}")
    for past in (int(p) for p in args.pasts.split(",")):
        L = past + args.chunk
        q = torch.randn(1, args.heads, args.chunk, args.head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, args.kv_heads, L, args.head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, args.kv_heads, L, args.head_dim, device="cuda", dtype=torch.bfloat16)
        scale = args.head_dim ** -0.5

        def way(split):
            if split == "gqa":
                return dense._past_then_chunk(q, k, v, scale)
            dense.SPLIT_PAST, dense.SPLIT_GQA = split, False  # (the mask, or the split on expanded heads)
            return dense.dense_causal_attention(q, k, v, None, scale)

        ways = [False, True, "gqa"]
        outs, first_ms = {}, {}
        for split in list(ways):  # the first call of each way at this shape: cuDNN builds its plans for it
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                outs[split] = way(split)
            except RuntimeError as error:  # (cuDNN refused unexpanded grouped heads)
                print(f"past {past}: gqa refused: {str(error).splitlines()[0][:200]}")
                ways.remove(split)
                continue
            torch.cuda.synchronize()
            first_ms[split] = (time.perf_counter() - start) * 1e3
        reference = dense.dense_causal_attention(q.float(), k.float(), v.float(), None, scale)
        times = {split: [] for split in ways}
        for _ in range(args.repeats):
            for split in ways:
                times[split].append(timed(lambda: way(split), repeats=1))  # (3 calls to warm, 1 timed)
        row = {"past": past, "keys": L,
               "mask_ms": statistics.median(times[False]), "split_ms": statistics.median(times[True]),
               "first_mask_ms": first_ms[False], "first_split_ms": first_ms[True],
               "mask_err": (outs[False].float() - reference).abs().max().item(),
               "split_err": (outs[True].float() - reference).abs().max().item(),
               "split_vs_mask": (outs[True].float() - outs[False].float()).abs().max().item(),
               "gqa_ms": statistics.median(times["gqa"]) if "gqa" in times else None,
               "first_gqa_ms": first_ms.get("gqa"),
               "gqa_err": (outs["gqa"].float() - reference).abs().max().item() if "gqa" in outs else None,
               "gqa_equals_split": torch.equal(outs["gqa"], outs[True]) if "gqa" in outs else None}
        rows.append(row)
        print(f"past {past:6d}: lower-right mask {row['mask_ms']:7.2f} ms, split {row['split_ms']:7.2f} ms "
              f"({row['mask_ms'] / row['split_ms']:.2f}x); max error against fp32 {row['mask_err']:.2e} / "
              f"{row['split_err']:.2e}; between them {row['split_vs_mask']:.2e}; first call at this shape "
              f"{row['first_mask_ms']:.1f} / {row['first_split_ms']:.1f} ms")
        if row["gqa_ms"] is not None:
            print(f"             gqa (unexpanded) {row['gqa_ms']:7.2f} ms, error {row['gqa_err']:.2e}, equal to the "
                  f"split bit for bit: {row['gqa_equals_split']}; first call {row['first_gqa_ms']:.1f} ms")
        del q, k, v, outs, reference
    dense.SPLIT_PAST, dense.SPLIT_GQA = True, gqa_default
    if args.out:
        header = {"command": " ".join(sys.argv), "machine": platform.node(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds")}
        Path(args.out).write_text(json.dumps(dict(header=header, rows=rows), indent=1))


if __name__ == "__main__":
    main()
