"""Where a capped prefill runs out of device memory: `generate` of a few tokens on a random-weight model under a
per-process cap, once per variant of the package's prefill (its defaults; the chunk attention by SDPA's mask instead
of cuDNN's two parts; the dry step after the prefill instead of during it; no warm-up thread; no retry of a chunk in
smaller ones), in one process. A row lists the retries in smaller chunks the prefill made (`smaller_chunks`).

    python bench/prefill_peak.py --model qwen3-8b --context 32768 --batch 8 --cap-gib 24
    python bench/prefill_peak.py --model tiny --device cpu --context 600 --batch 2 --chunk-tokens 256   # smoke

Prints per variant: ok or the error (with the out-of-memory error under the package's MemoryError, the frames that
made the request, the bytes reserved but split unused and the allocator's retries; with `--history`, which
allocations hold the split segments), the peak allocated and reserved GiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("default", "masked", "dry-after", "no-warm", "no-retry")


def _made_by(frames: list) -> str:
    """The innermost frame of the package or transformers that made an allocation (else the innermost one)."""
    for frame in frames:
        name = frame.get("filename", "")
        if "oasis_cache" in name or "transformers" in name:
            return f"{Path(name).name}:{frame.get('line')} {frame.get('name')}"
    return f"{Path(frames[0].get('filename', '?')).name}:{frames[0].get('line')}" if frames else "?"


def split_segments(snapshot: dict, top: int = 10) -> dict:
    """From `torch.cuda.memory._snapshot()` (taken with history recorded): the bytes each stream's segments reserve
    and hold, and, in segments with 2 MiB or more free beside live blocks (what `inactive_split_bytes` counts),
    which allocations hold them there, by the frame that made them (the largest `top`)."""
    streams, holders, split = {}, {}, 0
    for segment in snapshot.get("segments", []):
        stream = str(segment.get("stream", "?"))
        reserved, held = streams.get(stream, (0, 0))
        streams[stream] = (reserved + segment["total_size"], held + segment.get("allocated_size", 0))
        blocks = segment.get("blocks", [])
        free = sum(b["size"] for b in blocks if b.get("state") == "inactive")
        live = [b for b in blocks if b.get("state", "").startswith("active")]
        if free < 2**21 or not live:
            continue
        split += free
        for block in live:
            where = _made_by(block.get("frames", []))
            n, size, beside = holders.get(where, (0, 0, 0))
            holders[where] = (n + 1, size + block["size"], beside + free // len(live))
    ranked = sorted(holders.items(), key=lambda item: -item[1][2])[:top]
    gib = 2**30
    return dict(
        streams={k: [round(v[0] / gib, 2), round(v[1] / gib, 2)] for k, v in streams.items()},  # reserved, allocated
        split_free_gib=round(split / gib, 2),
        holders=[dict(where=w, blocks=n, gib=round(size / gib, 3), free_beside_gib=round(beside / gib, 3))
                 for w, (n, size, beside) in ranked])


def run(model, ids, variant: str, budget: int, new_tokens: int, chunk_tokens: int | None = None,
        history: bool = False) -> dict:
    from oasis_cache import OasisCache
    from oasis_cache.compat import generate_cache_argument
    from oasis_cache.compute import dense, prefill

    split, warm, retries = dense.SPLIT_PAST, dense.SPLIT_WARM_QUERIES, prefill.SHRINK_RETRIES
    dense.SPLIT_PAST = variant != "masked"
    dense.SPLIT_WARM_QUERIES = 0 if variant == "no-warm" else warm
    prefill.SHRINK_RETRIES = 0 if variant == "no-retry" else retries
    options = {"ahead_at_prefill": False} if variant == "dry-after" else {}
    if chunk_tokens is not None:
        options["prefill_chunk_tokens"] = chunk_tokens
    cache = OasisCache(model, token_budget=budget, **options)
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        if history:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
    row = dict(variant=variant)
    try:
        with warnings.catch_warnings(record=True) as seen:  # (a chunk retried in smaller ones warns)
            warnings.simplefilter("always", RuntimeWarning)
            try:
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, **{generate_cache_argument(model): cache})
                if cuda:
                    torch.cuda.synchronize()
                row["ok"] = True
            finally:
                row["smaller_chunks"] = [str(w.message).split("; ")[1] for w in seen
                                         if "going on from token" in str(w.message)]
    except (torch.OutOfMemoryError, MemoryError) as error:
        row["ok"] = False
        row["error"] = str(error).splitlines()[0][:240]
        cause = error.__cause__ if error.__cause__ is not None else error
        if cause is not error:
            row["cause"] = str(cause).splitlines()[0][:400]
        frames = traceback.extract_tb(cause.__traceback__)  # where the request was made: the innermost frames
        row["where"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]
        if cuda:
            stats = torch.cuda.memory_stats()
            row["inactive_split_gib"] = round(stats.get("inactive_split_bytes.all.current", 0) / 2**30, 2)
            row["alloc_retries"] = stats.get("num_alloc_retries", 0)
            if history:
                row["segments"] = split_segments(torch.cuda.memory._snapshot())
    finally:
        dense.SPLIT_PAST, dense.SPLIT_WARM_QUERIES, prefill.SHRINK_RETRIES = split, warm, retries
        if cuda and history:
            torch.cuda.memory._record_memory_history(enabled=None)
    if cuda:
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    del cache
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="prefill_chunk_tokens (the cache's default)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--history", action="store_true",
                        help="record the allocator's history: an out-of-memory row names what holds split segments")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    from models import load_model

    cuda = torch.device(args.device).type == "cuda"
    if cuda and args.cap_gib:
        torch.cuda.set_per_process_memory_fraction(
            args.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    model, vocab = load_model(args.model, args.device, torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.context), device=args.device)
    rows = []
    for variant in args.variants:
        rows.append(run(model, ids, variant, args.budget, args.new_tokens, args.chunk_tokens, args.history))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
