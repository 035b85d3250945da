"""Prefill time: dense (`DynamicCache`, one forward) against OasisCache's chunked prefill with the prompt's keys and
values kept on the device between chunks (`resident_prefill`, the default) and read back from the host pool at every
chunk (`resident_prefill=False`); `oasis-masked`: resident, with a chunk's attention over its past by SDPA's
lower-right causal mask (`compute/dense.SPLIT_PAST` off).

    python bench/prefill.py --model qwen3-8b --device cuda --context 32768 --batch 4     # the H200 figure
    python bench/prefill.py --model qwen25-coder-0.5b --context 8192 --chunk-tokens 1024 # real weights, CPU

Each repeat runs every method once, in turn (interleaved), as `generate` runs a prefill: one call of the model on the
prompt with `logits_to_keep=1`; the time is wall clock around the call (device synchronized). `--generate` times
what a user runs instead: `model.generate(..., max_new_tokens=1)` with its all-ones attention mask (the prefill and
generate's own work around it; `dense-chunked` has no such call). Prints medians and writes JSON (command, machine,
date) with `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import load_model  # noqa: E402

from oasis_cache import OasisCache  # noqa: E402

METHODS = ("dense", "dense-chunked", "oasis-resident", "oasis-host", "oasis-masked")


def build(model, method: str, args):
    if method.startswith("dense"):
        return DynamicCache()
    from oasis_cache.compute import dense

    dense.SPLIT_PAST = method != "oasis-masked"  # (oasis-masked: a chunk over its past by SDPA's lower-right mask,
    # as; the others merge cuDNN's past and chunk)
    return OasisCache(model, token_budget=args.budget, prefill_chunk_tokens=args.chunk_tokens,
                      advanced=dict(resident_prefill=method in ("oasis-resident", "oasis-masked")))


def prefill(model, ids, cache, device, chunk_tokens: int = 0,
            generate: bool = False) -> tuple[float, torch.Tensor, dict]:
    """One prefill, timed. `chunk_tokens`: feed the prompt in the chunks OasisCache would cut (`dense-chunked`: what
    chunking alone costs, without offload or summaries). `generate`: through `model.generate` (one new token)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        if generate:
            given = cache.generate_kwargs() if isinstance(cache, OasisCache) else {"past_key_values": cache}
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                 **given)
            logits = out.logits[0][:, None]  # [B, 1, V]: the prefill's last row
        elif chunk_tokens:
            step = max(16, chunk_tokens // ids.shape[0] // 16 * 16)
            for lo in range(0, ids.shape[1], step):
                logits = model(input_ids=ids[:, lo : lo + step], past_key_values=cache, use_cache=True,
                               logits_to_keep=1).logits
        else:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    loads = cache.stats() if isinstance(cache, OasisCache) else {}
    return seconds, logits[:, -1].float().cpu(), loads


def main(argv=None):
    from oasis_cache.compute import dense

    try:
        run(argv)
    finally:
        dense.SPLIT_PAST = True  # (`oasis-masked` turns it off for its calls; the process's default again)


def run(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="qwen3-8b, llama-3.1-8b, tiny (random weights), "
                                                            "smollm2 or qwen25-coder-0.5b (real weights)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="prefill_chunk_tokens (the default 8192)")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after the timing, one more prefill per method under torch.profiler: its top ROWS ops by "
                             "device time (CUDA) or CPU time, written beside --out (printed without --out)")
    parser.add_argument("--generate", action="store_true",
                        help="time model.generate(max_new_tokens=1) instead of the model's forward (what users run)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.generate and "dense-chunked" in args.methods:
        if args.methods != list(METHODS):
            parser.error("--generate: dense-chunked is not a generate call; leave it out of --methods")
        args.methods = [m for m in args.methods if m != "dense-chunked"]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.model == "qwen25-coder-0.5b":
        from oasis_cache.loaders import load_qwen25_coder_05b

        model, _ = load_qwen25_coder_05b(device=args.device, dtype=dtype)
        vocab = model.config.vocab_size
    else:
        model, vocab = load_model(args.model, args.device, dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=generator).to(device)
    times = {method: [] for method in args.methods}
    last = {}
    for repeat in range(args.repeats + 1):  # the first round warms up (kernels, allocator), not counted
        for method in args.methods:
            cache = build(model, method, args)
            seconds, logits, stats = prefill(model, ids, cache, device, args.chunk_tokens * (method == "dense-chunked"),
                                             args.generate)
            if repeat:
                times[method].append(seconds)
            last[method] = (logits, stats)
            del cache
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows = {method: dict(median_s=statistics.median(t), runs_s=t) for method, t in times.items()}
    reference = last[args.methods[0]][0]
    for method in args.methods:
        rows[method]["max_logit_diff_to_" + args.methods[0]] = float((last[method][0] - reference).abs().max())
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    print(f"prefill{' through generate' if args.generate else ''} of {args.batch} x {args.context} tokens, "
          f"{args.model} ({args.dtype}), {machine}, chunks of "
          f"{args.chunk_tokens} tokens over the batch, medians of {args.repeats} interleaved repeats:")
    for method in args.methods:
        ratio = rows[method]["median_s"] / rows["dense"]["median_s"] if "dense" in rows else float("nan")
        print(f"  {method:15} {rows[method]['median_s']:8.2f} s  ({ratio:.2f}x dense)  last logits within "
              f"{rows[method]['max_logit_diff_to_' + args.methods[0]]:.2e} of {args.methods[0]}")
    profiles = {method: profiled(model, ids, method, args, device) for method in args.methods} if args.profile else {}
    for method, table in profiles.items():  # (to files beside --out, else printed)
        if args.out:
            Path(args.out).with_suffix(f".{method}.profile.txt").write_text(table)
        else:
            print(f"== {method}: top {args.profile} ops\n{table}")
    if args.out:
        record = dict(command="python " + " ".join(sys.argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
                      machine=machine, torch=torch.__version__, args=vars(args), rows=rows)
        Path(args.out).write_text(json.dumps(record, indent=1))
        print("wrote", args.out)


def profiled(model, ids, method: str, args, device) -> str:
    """One more prefill of `method` under torch.profiler: its top `args.profile` ops by self device time (CUDA) or
    self CPU time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    cache = build(model, method, args)
    with profile(activities=activities) as prof:
        seconds, _, _ = prefill(model, ids, cache, device, args.chunk_tokens * (method == "dense-chunked"),
                                args.generate)
    del cache
    gc.collect()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.profile, max_name_column_width=60)
    return f"{seconds:.2f} s under the profiler\n{table}"


if __name__ == "__main__":
    main()
