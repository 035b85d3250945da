"""The first `generate` of a process against a later one (issue 21: at most ~2x at 32K x 1).

    python bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32
    python bench/first_call.py --model tiny --device cpu --context 256 --new-tokens 8   # smoke
    python bench/first_call.py --model qwen3-8b --context 32768 --compile-decode   # with OasisConfig.compile_decode

Runs `--processes` fresh child processes one after another (the first one starts with empty Triton and inductor
kernel caches when `--fresh-kernel-cache` is given: what a new machine pays; the later ones find the kernels on disk,
as every later process on that machine does). Each child loads the model, then calls `model.generate` `--calls`
times, each with a fresh `OasisCache(model, token_budget=--budget)` on the same random prompt, and reports each call's
wall time. Prints a table (ratio = a call's time / the child's last call) and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from models import load_model

    from oasis_cache import OasisCache

    cuda = torch.device(args.device).type == "cuda"
    t0 = time.perf_counter()
    model, vocab = load_model(args.model, args.device, getattr(torch, args.dtype))
    load_s = time.perf_counter() - t0
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, args.context), device=args.device)
    times = []
    for _ in range(args.calls):
        cache = OasisCache(model, token_budget=args.budget, **({"compile_decode": True} if args.compile_decode else {}))
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, **cache.generate_kwargs())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del cache
    return {"load_s": load_s, "generate_s": times}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--fresh-kernel-cache", action="store_true",
                        help="the first child starts with an empty Triton cache (TRITON_CACHE_DIR in a new folder)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="OasisCache(..., compile_decode=True): the layers' own work compiled (its first call)")
    parser.add_argument("--out", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    header = (f"{args.model} {args.dtype} on {device}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}; context "
              f"{args.context} x 1, {args.new_tokens} new tokens, budget {args.budget}"
              + (", compile_decode" if args.compile_decode else ""))
    print(header, flush=True)
    kernel_cache = tempfile.mkdtemp(prefix="oasis-triton-") if args.fresh_kernel_cache else None
    rows = []
    for index in range(args.processes):
        env = dict(os.environ)
        if kernel_cache:
            env["TRITON_CACHE_DIR"] = kernel_cache  # empty for the first child, filled by it for the later ones
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(kernel_cache, "inductor")  # (compile_decode's kernels)
        command = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device, "--dtype",
                   args.dtype, "--context", str(args.context), "--budget", str(args.budget), "--new-tokens",
                   str(args.new_tokens), "--calls", str(args.calls)]
        command += ["--compile-decode"] if args.compile_decode else []
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise SystemExit(f"child {index} failed (exit {done.returncode}): {done.stderr[-2000:]}")
        result = json.loads(lines[-1])
        times = result["generate_s"]
        row = dict(process=index, fresh_kernel_cache=bool(kernel_cache) and index == 0, load_s=result["load_s"],
                   generate_s=times, first_over_last=times[0] / times[-1])
        rows.append(row)
        print(f"process {index}{' (empty kernel cache)' if row['fresh_kernel_cache'] else ''}: load "
              f"{row['load_s']:.1f} s; generate " + " / ".join(f"{t:.2f}" for t in times)
              + f" s; first / last {row['first_over_last']:.2f}x", flush=True)
    if kernel_cache:
        shutil.rmtree(kernel_cache, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(header=header, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
