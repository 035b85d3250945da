"""The gather alone: one layer's selected blocks copied from pinned host memory into a working set by the Triton kernel
(`kernels/gather.py`), for each `host_dtype`, in the shapes the package launches (the side stream's few programs, as
many again and more, and one program per block as on the critical path), optionally beside a matmul load on another
stream (a step's compute). Reports the gather's time, host bytes a second and device bytes a second; medians of
interleaved repeats. No model: a Qwen3-8B layer's shape by default (8 KV heads of 128 channels, 16-token blocks).

    python bench/gather.py --context 32768 --batch 4 --budget 2048 --out gather.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from oasis_cache.kernels.gather import gather_blocks  # noqa: E402
from oasis_cache.memory.transfer import SIDE_ENTRIES, SIDE_WARPS, launch_shape, side_stream_programs  # noqa: E402
from oasis_cache.pools import HostKVPool  # noqa: E402

DTYPES = (None, "fp8", "int4")


def build(args, host_dtype, device):
    T, H, D, B = 16, args.kv_heads, args.head_dim, args.batch
    NB = args.context // T
    pool = HostKVPool(B, H, D, T, torch.bfloat16, 256, True, host_dtype)
    pool.reserve(NB)
    rep = pool.representation
    for chunk, lo, hi, _ in pool.spans(0, NB):  # random keys and values, narrowed as the offload narrows them
        wide = torch.randn((hi - lo, 2, B, H, T, D), dtype=torch.bfloat16, device=device)
        chunk[lo:hi].copy_(rep.narrow(wide).cpu() if rep.narrow_form else wide.cpu())
    pool.num_blocks = NB
    table = torch.tensor([c.data_ptr() for c in pool.chunks], dtype=torch.int64, device=device)
    return pool, table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--entries", default="1,2,4", help="side-stream shapes: multiples of the package's entries")
    parser.add_argument("--programs", default="1,2,4", help="... and of its side-stream programs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    T, H, D, B = 16, args.kv_heads, args.head_dim, args.batch
    NB, K = args.context // T, args.budget // T
    gen = torch.Generator(device="cpu").manual_seed(0)
    block_ids = torch.stack([torch.randperm(NB, generator=gen)[:K] for _ in range(B * H)]).view(B, H, K).to(device)
    dest = torch.arange(K, device=device).expand(B, H, K).contiguous()
    fetch = torch.ones((B, H, K), dtype=torch.int8, device=device)
    out = torch.zeros((2, B, H, K * T, D), dtype=torch.bfloat16, device=device)
    side, load = torch.cuda.Stream(device), torch.cuda.Stream(device)
    a = torch.randn((4096, 4096), dtype=torch.bfloat16, device=device)
    programs = side_stream_programs(device)
    pools = {d: build(args, d, device) for d in DTYPES}
    shapes = [("per block", None, {})]
    for p in (int(x) for x in args.programs.split(",")):
        for m in (int(x) for x in args.entries.split(",")):
            shapes.append((f"{programs * p}x{SIDE_WARPS}w, entries x{m}", programs * p,
                           dict(num_warps=SIDE_WARPS, entries=m)))
    times = {}

    def run(host_dtype, name, progs, shape, busy):
        pool, table = pools[host_dtype]
        rep = pool.representation
        if shape:  # (the package's rule for the side stream's shape, its entries times `m`)
            shape = launch_shape(dict(shape, entries=shape["entries"] * SIDE_ENTRIES), rep)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if busy:
            with torch.cuda.stream(load):
                for _ in range(40):
                    a @ a
        with torch.cuda.stream(side):
            start.record()
            gather_blocks(table, pool.chunk_blocks, block_ids, dest, fetch, out, T, progs,
                          representation=rep, **shape)
            end.record()
        torch.cuda.synchronize()
        times.setdefault((host_dtype, name, busy), []).append(start.elapsed_time(end))

    for _ in range(3):  # compile and warm
        for busy in (False, True):
            for d in DTYPES:
                for name, progs, shape in shapes:
                    run(d, name, progs, shape, busy)
    times.clear()
    for _ in range(args.repeats):
        for busy in (False, True):
            for d in DTYPES:
                for name, progs, shape in shapes:
                    run(d, name, progs, shape, busy)
    rows = []
    wide_bytes = 2 * B * H * K * T * D * 2
    for (d, name, busy), ms in times.items():
        unit = pools[d][0].representation.unit_nbytes
        host = 2 * B * H * K * unit
        med = statistics.median(ms)
        rows.append(dict(host_dtype=d or "bf16", shape=name, beside_matmuls=busy, ms=med, host_mb=host / 1e6,
                         host_gb_s=host / med / 1e6, device_gb_s=wide_bytes / med / 1e6))
        print(f"{d or 'bf16':5} {name:26} {'busy' if busy else 'idle'}  {med:7.3f} ms  host {host / 1e6:6.1f} MB "
              f"{host / med / 1e6:6.1f} GB/s")
    result = dict(bench="gather", args=vars(args), rows=rows, device=torch.cuda.get_device_name(device),
                  torch=torch.__version__, host=platform.node(), date=datetime.date.today().isoformat())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
