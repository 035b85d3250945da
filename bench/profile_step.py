"""Where a decode step's time goes: torch profiler over a few decode steps, dense vs an OasisCache mode, one process.
Prints the wall time per step (without the profiler), the top CUDA kernels by total device time and the CPU-side
totals per step: a wall time far above the device time means the step is bound by Python and launches.

Two walls: `pipelined` (steps queued back to back, one sync at the end: the host prepares a step while the device
runs the one before) and `synced` (a sync after each step, as `generate` has one: it reads `unfinished_sequences`
every token, so its host work and the device's do not overlap across steps), with the host's own time per step
(`host`: from the call until the step is queued). `--host-profile` adds cProfile's table of the synced steps' Python.

    python bench/profile_step.py --model qwen3-8b --context 32768 --batch 4 --method oasis-previous
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode import make_cache, needs_head, sync, untrained_head  # noqa: E402
from models import load_model  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402


KERNEL_GROUPS = (  # (group, substrings of a kernel's name), first match wins
    ("host->device gather", ("_gather_blocks", "memcpy", "Memcpy")),
    ("matmuls (weights)", ("nvjet", "gemm", "Gemm", "cublas", "cutlass", "splitKreduce", "sm90_xmma")),
    ("attention", ("flash", "fmha", "sdpa", "_split_kernel", "_combine_kernel", "attention")),
    ("block selection", ("_block_scores", "topk", "_top_k", "TopK", "radixSort", "sort", "_slot_assign", "_bits")),
)


def kernel_groups(events, steps: int) -> list:
    """`[(group, ms per step, kernels per step)]` over the device kernels of `events`, largest first."""
    totals: dict = {}
    for event in events:
        if event.device_type.name != "CUDA" or not event.self_device_time_total:
            continue
        group = next((g for g, keys in KERNEL_GROUPS if any(k in event.key for k in keys)), "other (elementwise, norms, "
                     "rotary, copies)")
        ms, count = totals.get(group, (0.0, 0))
        totals[group] = (ms + event.self_device_time_total / 1e3 / steps, count + event.count / steps)
    return sorted(((g, ms, n) for g, (ms, n) in totals.items()), key=lambda row: -row[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=["dense", "oasis-previous"])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=24)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens")
    parser.add_argument("--out", default=None, help="directory for the tables")
    parser.add_argument("--host-profile", action="store_true", help="cProfile the synced steps' host work")
    args = parser.parse_args()
    args.gather_programs, args.exact_slots = 0, 0
    model, vocab = load_model(args.model, args.device, torch.bfloat16)
    args.head = untrained_head(model) if needs_head(args.methods) else None
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    for method in args.methods:
        cache = make_cache(method, model, args)
        kw = {generate_cache_argument(model): cache, "use_cache": True}
        with torch.no_grad():
            chunk = args.prefill_chunk or args.context
            for start in range(0, args.context, chunk):
                out = model(input_ids=ids[:, start:start + chunk].to(args.device), logits_to_keep=1, **kw)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(args.warmup):  # warm-up: compilation, and both captured steps (one completes a block)
                token = model(input_ids=token, **kw).logits[:, -1:].argmax(-1)
            sync(args.device)
            start = time.perf_counter()  # wall time per step, outside the profiler
            for _ in range(args.steps):
                token = model(input_ids=token, **kw).logits[:, -1:].argmax(-1)
            sync(args.device)
            wall_ms = (time.perf_counter() - start) * 1000 / args.steps
            host, synced = [], []
            for _ in range(args.steps):
                start = time.perf_counter()
                out = model(input_ids=token, **kw)
                queued = time.perf_counter()
                token = out.logits[:, -1:].argmax(-1)
                sync(args.device)
                host.append(queued - start)
                synced.append(time.perf_counter() - start)
            profiler = cProfile.Profile() if args.host_profile else None
            for _ in range(args.steps if profiler else 0):
                profiler.enable()
                out = model(input_ids=token, **kw)
                profiler.disable()
                token = out.logits[:, -1:].argmax(-1)
                sync(args.device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    token = model(input_ids=token, **kw).logits[:, -1:].argmax(-1)
                sync(args.device)
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events) / args.steps
        cpu_us = sum(e.self_cpu_time_total for e in events) / args.steps
        table = events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60)
        summary = (f"== {method}, {args.context} x {args.batch}: wall {wall_ms:.1f} ms/step pipelined, "
                   f"{1000 * statistics.median(synced):.1f} synced (host {1000 * statistics.median(host):.2f}), "
                   f"device time {device_us / 1000:.1f} ms/step, "
                   f"CPU time {cpu_us / 1000:.1f} ms/step, "
                   f"kernel launches {sum(e.count for e in events if e.device_type.name == 'CUDA') // args.steps}"
                   f"/step")
        cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60)
        groups = "\n".join(f"   {g:<42} {ms:7.2f} ms/step {n:7.0f} kernels/step" for g, ms, n in
                            kernel_groups(events, args.steps))
        summary += "\n" + groups
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
            cpu_table += "\n" + text.getvalue()
        print(summary)
        print(table)
        print(cpu_table)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9._-]", "-", method)  # (the device tool brings back plain names only)
            text = summary + "\n" + table + "\n" + cpu_table
            (Path(args.out) / f"profile-{name}-{args.context}x{args.batch}.txt").write_text(text)
        del cache, out


if __name__ == "__main__":
    main()
