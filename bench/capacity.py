"""Throughput at equal GPU memory (issue 21): the largest batch each method runs at a context, under a memory cap and
uncapped, and its decode tokens per second, measured through `model.generate` as a user runs it.

    python bench/capacity.py --model qwen3-8b --contexts 32768 131072 --caps 24 0 \
        --methods dense dense-compiled offload oasis --batches 1 2 4 8 16 32
    python bench/capacity.py --model tiny --device cpu --contexts 256 --caps 0 --batches 1 2 --new-tokens 6   # smoke

For each (context, cap, method) the batches are tried in increasing order, each in a fresh child process (a cap is
per process, and an out-of-memory error can leave a process fragmented), until one fails or exceeds `--try-timeout`;
the row reports the largest that ran. A try: random prompt tokens, `model.generate(max_new_tokens=min_new_tokens=N,
do_sample=False)`; a stopping criterion stamps each new token (a CUDA event, no sync), and tokens per second =
batch × (N − 1) / the time from the first new token to the last (the decode alone, prefill excluded). Methods:
dense (`DynamicCache`), dense-compiled (a `StaticCache`, which `generate` compiles on its own), offload
(`DynamicCache(offloading=True)`), oasis (`OasisCache(model, token_budget=--budget)`, every other option the
package's default). Writes JSON (`--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(args) -> dict:
    """One try in this process: `{"ok": True, "tok_s", "step_ms", "peak_gib", "prefill_s"}` or `{"ok": False, "error"}`."""
    import torch
    from transformers import DynamicCache, StaticCache, StoppingCriteriaList

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from models import load_model
    from token_clock import TokenClock

    from oasis_cache import OasisCache
    from oasis_cache.compat import generate_cache_argument

    cuda = torch.device(args.device).type == "cuda"
    dtype = getattr(torch, args.dtype)
    if cuda and args.cap:
        torch.cuda.set_per_process_memory_fraction(args.cap * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    model, vocab = load_model(args.model, args.device, dtype)
    context, batch, n = args.context, args.batch, args.new_tokens
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, context), device=args.device)
    if args.method == "oasis":
        cache = OasisCache(model, token_budget=args.budget)
    else:
        model.set_attn_implementation("sdpa")
        if args.method == "dense-compiled":
            cache = StaticCache(config=model.config, max_cache_len=context + n)
        elif args.method == "offload":
            cache = DynamicCache(config=model.config, offloading=True)
        else:
            cache = DynamicCache(config=model.config)
    clock = TokenClock(cuda)
    keyword = generate_cache_argument(model)  # `cache` on transformers >= 5.24, else `past_key_values`
    t0 = time.perf_counter()
    try:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), **{keyword: cache})
        if cuda:
            torch.cuda.synchronize()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:  # RuntimeError: e.g. pinned allocation
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return {"ok": False, "error": f"{type(error).__name__}: {first[:300]}"}
    total = time.perf_counter() - t0
    if len(clock.stamps) < 2:
        return {"ok": False, "error": f"only {len(clock.stamps)} tokens stamped"}
    span = clock.span_s()
    step_s = span / (len(clock.stamps) - 1)
    return {"ok": True, "tok_s": batch / step_s, "step_ms": step_s * 1e3, "generate_s": total,
            "prefill_s": total - span, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}


def try_in_child(args, context, cap, method, batch) -> dict:
    command = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device, "--dtype",
               args.dtype, "--budget", str(args.budget), "--new-tokens", str(args.new_tokens), "--context",
               str(context), "--cap", str(cap), "--method", method, "--batch", str(batch)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.try_timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"over {args.try_timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"exit {done.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--caps", type=float, nargs="+", default=[24, 0], help="GiB of GPU memory; 0: uncapped")
    parser.add_argument("--methods", nargs="+", default=["dense", "dense-compiled", "offload", "oasis"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--try-timeout", type=float, default=300)
    parser.add_argument("--out", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--method", default="", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args)), flush=True)
        return
    unknown = set(args.methods) - {"dense", "dense-compiled", "offload", "oasis"}
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}: choose from dense, dense-compiled, offload, oasis")
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    header = (f"{args.model} {args.dtype} on {device}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}; "
              f"{args.new_tokens} new tokens per generate")
    print(header, flush=True)
    print(f"{'context':>8} {'cap GiB':>7} {'method':<15} {'max batch':>9} {'tok/s':>8} {'ms/step':>8} {'peak GiB':>8}  "
          f"stopped by", flush=True)
    rows = []
    for context in args.contexts:
        for cap in args.caps:
            for method in args.methods:
                best, stopped, tries = None, "the largest batch tried", []
                for batch in sorted(args.batches):
                    result = try_in_child(args, context, cap, method, batch)
                    tries.append(dict(batch=batch, **result))
                    if not result["ok"]:
                        stopped = f"batch {batch}: {result['error']}"
                        break
                    best = dict(batch=batch, **result)
                row = dict(context=context, cap_gib=cap, method=method, max_batch=best["batch"] if best else 0,
                           tok_s=best["tok_s"] if best else 0.0, step_ms=best["step_ms"] if best else 0.0,
                           peak_gib=best["peak_gib"] if best else 0.0, stopped_by=stopped, tries=tries)
                rows.append(row)
                print(f"{context:>8} {cap or '-':>7} {method:<15} {row['max_batch']:>9} {row['tok_s']:>8.1f} "
                      f"{row['step_ms']:>8.1f} {row['peak_gib']:>8.2f}  {stopped}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(header=header, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
