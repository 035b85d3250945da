"""Throughput at equal GPU memory: the largest batch each method runs at a context, under a memory cap and
uncapped, and its decode tokens per second, measured through `model.generate` as a user runs it.

    python bench/capacity.py --model qwen3-8b --contexts 32768 131072 --caps 24 0 \
        --methods dense dense-compiled offload oasis --batches 1 2 4 8 16 32
    python bench/capacity.py --model tiny --device cpu --contexts 256 --caps 0 --batches 1 2 --new-tokens 6   # smoke

For each (context, cap, method) a fresh child process (a cap is per process) loads the model once and tries the batches
in increasing order until one fails (an out-of-memory error can leave a process fragmented, so it stops there) or the
child exceeds `--try-timeout` seconds per batch; the row reports the largest that ran. A try: random prompt tokens
(`--prompt code` with a real model: the standard library's code, whose blocks a step selects as stably as a real
workload's; random weights select anew each step, the worst case for an oasis step's fetches — oasis rows carry the
hit rate and the megabytes per step fetched on the critical path),
`model.generate(max_new_tokens=min_new_tokens=N, do_sample=False)`; a stopping criterion stamps each new token (a CUDA
event, no sync), and tokens per second = batch / the median time between consecutive new tokens (steady decode: a
first step's compilation and graph captures excluded; the mean over the N − 1 steps is kept too). Methods: dense
(`DynamicCache`), dense-chunked (the same, `generate(prefill_chunk_size=8192)`: a dense prefill that fits a small
card), dense-compiled (a `StaticCache`, which `generate` compiles on its own), offload
(`DynamicCache(offloading=True)`), oasis (`OasisCache(model, token_budget=--budget)`, every other option the package's
default: lookahead "none" for a model without a shipped head), oasis-none / oasis-previous / oasis-previous-exact
(that lookahead set). Writes JSON (`--out`) and prints a table.
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
METHODS = ("dense", "dense-chunked", "dense-compiled", "offload", "oasis")
# oasis with a lookahead set (the default picks "none" for a model without a shipped head, as the random-weight
# shapes are): `generate` against `bench/decode.py`'s bare forwards of the same mode
OASIS_LOOKAHEADS = {"oasis-none": dict(lookahead="none"), "oasis-previous": dict(lookahead="previous"),
                    "oasis-previous-exact": dict(lookahead="previous", exact=True)}


def run_batches(args) -> None:
    """One (context, cap, method) in this process: the batches in increasing order, one JSON line per try
    (`{"batch", "ok": True, "tok_s", "step_ms", "peak_gib", "prefill_s", "generate_s"}` or `{"batch", "ok": False,
    "error"}`), stopping at the first failure (an out-of-memory error can leave the process fragmented). The model is
    loaded once; each try's cache is dropped and the allocators emptied before the next one."""
    import gc

    import torch
    from transformers import DynamicCache, StaticCache, StoppingCriteriaList

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from models import code_prompt, load_model
    from models import TokenClock

    from oasis_cache import OasisCache
    from oasis_cache.compat import generate_cache_argument
    from oasis_cache.memory.host_memory import available_host_bytes, release_cached_pinned

    cuda = torch.device(args.device).type == "cuda"
    dtype = getattr(torch, args.dtype)
    if cuda and args.cap:
        torch.cuda.set_per_process_memory_fraction(args.cap * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    model, vocab, tokenizer = load_model(args.model, args.device, dtype, tokenizer=True)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    if not args.method.startswith("oasis"):
        model.set_attn_implementation("sdpa")
    keyword = generate_cache_argument(model)  # `cache` on transformers >= 5.24, else `past_key_values`
    context, n = args.context, args.new_tokens
    for batch in args.try_batches:
        def report(**fields):
            print(json.dumps(dict(batch=batch, **fields)), flush=True)
            return fields.get("ok", False)

        host_kv = batch * (context + n) * kv_bytes_per_token
        available = available_host_bytes()
        if args.method == "offload" and available is not None and host_kv > 0.85 * available:
            # HF's offloaded cache does not check; the kernel's out-of-memory killer would end the whole process
            report(ok=False, error=f"host memory: the offloaded KV needs {host_kv / 2**30:.1f} GiB, "
                                   f"{available / 2**30:.1f} GiB available")
            return
        torch.manual_seed(1)
        if args.prompt == "code":
            ids = code_prompt(args.model, tokenizer, batch, context).to(args.device)
        else:
            ids = torch.randint(0, vocab, (batch, context), device=args.device)
        if args.method.startswith("oasis"):
            cache = OasisCache(model, token_budget=args.budget, **OASIS_LOOKAHEADS.get(args.method, {}))
        elif args.method == "dense-compiled":
            cache = StaticCache(config=config, max_cache_len=context + n)
        elif args.method == "offload":
            cache = DynamicCache(config=config, offloading=True)
        else:
            cache = DynamicCache(config=config)
        extra = dict(prefill_chunk_size=8192) if args.method == "dense-chunked" else {}
        clock = TokenClock(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        error = None
        try:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), **extra, **{keyword: cache})
            if cuda:
                torch.cuda.synchronize()
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as caught:  # RuntimeError: e.g. pinned allocation
            first = str(caught).strip().splitlines()[0] if str(caught).strip() else type(caught).__name__
            error = f"{type(caught).__name__}: {first[:300]}"
        total = time.perf_counter() - t0
        if error is None and len(clock.stamps) < 2:
            error = f"only {len(clock.stamps)} tokens stamped"
        if error is not None:
            report(ok=False, error=error)
            return
        span = clock.span_s()
        step_s, steps = clock.median_step_s(), len(clock.stamps) - 1
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        fetches = {}
        if isinstance(cache, OasisCache):  # what the steps fetched: random weights select anew each step
            stats = cache.stats()
            fetches = dict(hit_rate=stats["hit_rate"], fetched_mb_per_step=stats["bytes_fetched_per_step"] / 1e6,
                           critical_path_mb_per_step=stats["bytes_fetched_on_critical_path_per_step"] / 1e6)
        del cache, ids, clock
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            release_cached_pinned()
        report(ok=True, tok_s=batch / step_s, step_ms=step_s * 1e3, mean_step_ms=span * 1e3 / steps,
               generate_s=total, prefill_s=total - span, peak_gib=peak, **fetches)


def tries_in_child(args, context, cap, method, batches) -> list:
    """Run `run_batches` in a child process (a cap is per process); the tries it reported, the last one failed when the
    child died or ran past `--try-timeout` per batch."""
    command = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device, "--dtype",
               args.dtype, "--budget", str(args.budget), "--new-tokens", str(args.new_tokens), "--context",
               str(context), "--cap", str(cap), "--method", method, "--prompt", args.prompt, "--try-batches",
               *map(str, batches)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.try_timeout * len(batches))
        stdout, failure = done.stdout, None if done.returncode == 0 else \
            f"exit {done.returncode}: {((done.stderr or '').strip().splitlines() or ['no output'])[-1][:300]}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        stdout, failure = out.decode() if isinstance(out, bytes) else out, f"over {args.try_timeout * len(batches):.0f} s"
    tries = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if failure and (not tries or tries[-1]["ok"]):
        done_batches = {t["batch"] for t in tries}
        next_batch = next((b for b in batches if b not in done_batches), None)
        if next_batch is not None:
            tries.append(dict(batch=next_batch, ok=False, error=failure))
    return tries


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--caps", type=float, nargs="+", default=[24, 0], help="GiB of GPU memory; 0: uncapped")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--prompt", choices=["random", "code"], default="random",
                        help="random token ids, or (a real model: smollm2, qwen25-coder-0.5b) the standard library's "
                             "code, whose selection is as stable as a real workload's")
    parser.add_argument("--try-timeout", type=float, default=300)
    parser.add_argument("--out", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--method", default="", help=argparse.SUPPRESS)
    parser.add_argument("--try-batches", type=int, nargs="+", default=[1], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_batches(args)
        return
    sys.path.insert(0, str(HERE))
    from models import REAL

    if args.prompt == "code" and args.model not in REAL:
        parser.error(f"--prompt code needs a real model (--model {' or '.join(REAL)}), not {args.model}")
    unknown = set(args.methods) - set(METHODS) - set(OASIS_LOOKAHEADS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}: choose from {', '.join([*METHODS, *OASIS_LOOKAHEADS])}")
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    header = (f"{args.model} {args.dtype} on {device}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}; "
              f"{args.new_tokens} new tokens per generate")
    print(header, flush=True)
    print(f"{'context':>8} {'cap GiB':>7} {'method':<20} {'max batch':>9} {'tok/s':>8} {'ms/step':>8} {'peak GiB':>8} "
          f"{'hit':>5} {'crit MB':>7}  stopped by", flush=True)
    rows = []
    for context in args.contexts:
        for cap in args.caps:
            for method in args.methods:
                best, stopped = None, "the largest batch tried"
                tries = tries_in_child(args, context, cap, method, sorted(args.batches))
                for result in tries:
                    if not result["ok"]:
                        stopped = f"batch {result['batch']}: {result['error']}"
                        break
                    best = result
                row = dict(context=context, cap_gib=cap, method=method, max_batch=best["batch"] if best else 0,
                           tok_s=best["tok_s"] if best else 0.0, step_ms=best["step_ms"] if best else 0.0,
                           peak_gib=best["peak_gib"] if best else 0.0, stopped_by=stopped, tries=tries,
                           **{k: best[k] for k in ("hit_rate", "critical_path_mb_per_step") if best and k in best})
                rows.append(row)
                hit, crit = row.get("hit_rate"), row.get("critical_path_mb_per_step")
                print(f"{context:>8} {cap or '-':>7} {method:<20} {row['max_batch']:>9} {row['tok_s']:>8.1f} "
                      f"{row['step_ms']:>8.1f} {row['peak_gib']:>8.2f} {'-' if hit is None else f'{hit:.3f}':>5} "
                      f"{'-' if crit is None else f'{crit:.1f}':>7}  {stopped}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(header=header, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
