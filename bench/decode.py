"""Decode benchmark: TPOT, peak memory and KV bytes held on the device, for dense `DynamicCache`, HF's
`DynamicCache(offloading=True)` and OasisCache, in one process, medians over decode steps.

    python bench/decode.py --model qwen3-8b --contexts 32768 --batches 1 4 --budget 2048
    python bench/decode.py --model qwen3-8b --contexts 65536 --batches 1 --memory-cap-gib 24 --prefill-chunk 8192
    python bench/decode.py --model tiny --device cpu --contexts 512 --batches 1 --steps 4   # smoke run

Each (context, batch, method): a fresh cache, one prefill of random tokens (in chunks with --prefill-chunk),
`--warmup` untimed decode steps, `--steps` timed decode steps (host clock around each `model(...)` call, the device
synchronized before and after: the harness syncs, the cache does not), then for OasisCache `--measure-steps` more
steps in measurement mode (exposed transfer wait, prediction recall). With `--interleave` every method is prefilled
first and their decode steps then take turns, so that the machine's drift over a run (measured on the H200: the same
method 20-40% apart at the start and the end of one process) does not favour one method. Writes JSON under
bench/results/ and prints a table. Methods: dense, offload (HF `DynamicCache(offloading=True)`), oasis-none, oasis-previous, oasis-exact
(previous + miss repair, with `--exact-slots` slots), oasis-eagle3 (the draft token rides along: `--head DIR`, or
else an untrained head of the real shape, 32K draft vocabulary as in published EAGLE-3 heads — speed does not
depend on its weights, its recall does; the package's default: on CUDA the head's decode call is replayed as a CUDA
graph), oasis-eagle3-plain (the head's call run op by op, as before 2026-11-30), oasis-eagle3-graph (the graph
forced; = oasis-eagle3 on CUDA, the name of 2026-11-30's results), oasis-eagle3-exact (with miss repair: what
`OasisCache(model)` picks with a head; compare with oasis-exact). The suffix `-captured` (oasis-none, -previous,
-exact, -eagle3, -eagle3-exact; the ride-along inside the graph) replays decode steps as CUDA graphs
(`cuda_graph=True`, the package's default on CUDA); without it every step runs eagerly (`cuda_graph=False`). Its
cost sits in the steps that capture, so compare means (`--statistic mean`, `--steps` a multiple of 16). An oasis method with the suffix `@bound` or `@bits` uses that block scorer
(default: the package's, bits), e.g. `oasis-previous@bound`; `@full` keeps the bits summaries on every key channel
(`summary_channels=1.0`; the default keeps half), e.g. `oasis-previous-captured@full` (`OPTION_VARIANTS` in
eval/variants.py). The oasis methods run uncompiled decode steps (`compile_decode=False`) unless a variant
compiles them (`@compiled`, `@compiledfused`): the package's default compiles a model's steps only
after its 2,048th decode step in a process, which a run of many methods and repeats could cross midway — each row
measures one kind of step. dense-compiled: HF's fastest dense decode, a
`StaticCache` of the context + the steps and `torch.compile(model.forward, mode="reduce-overhead")` (on CUDA the step
is replayed as CUDA graphs): what a captured decode step gives without any offload, the ceiling for a captured oasis
step. Its first steps compile (`--warmup` ≥ 3 for it); it cannot share a process with oasis methods (switching the
attention implementation makes the compiled step recompile), only with dense and offload.

    python bench/decode.py --model qwen3-8b --contexts 32768 --batches 1 --methods dense oasis-previous oasis-eagle3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import oasis_cache  # noqa: E402,F401
from oasis_cache import OasisCache  # noqa: E402
from eval.variants import variant_options  # noqa: E402
from oasis_cache.runtime.build import cache_kwargs  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402
from models import dense_attention, load_model  # noqa: E402

METHODS = ("dense", "offload", "oasis-none", "oasis-previous", "oasis-exact")  # default; oasis-eagle3 on request
SDPA_METHODS = ("dense", "offload", "dense-compiled")  # HF's attention, no OasisCache


def make_cache(method: str, model, args, capacity: int = 0):
    """The method's cache; `capacity`: the tokens a static cache holds (dense-compiled)."""
    if method == "dense-compiled":
        model.set_attn_implementation(dense_attention(model))
        return StaticCache(config=model.config, max_cache_len=capacity)
    if method == "dense":
        model.set_attn_implementation(dense_attention(model))
        return DynamicCache(config=model.config)
    if method == "offload":
        model.set_attn_implementation(dense_attention(model))
        return DynamicCache(config=model.config, offloading=True)
    method, _, variant = method.partition("@")
    # (uncompiled unless the variant compiles: the default would compile after 2,048 steps of the model, midway)
    options = dict(token_budget=args.budget, gather_programs=args.gather_programs or None, compile_decode=False)
    options.update(variant_options(variant))  # a variant overrides the command line
    # -captured: decode steps replayed as CUDA graphs (runtime/captured_step.py); without it every step runs eagerly
    options["cuda_graph"] = method.endswith("-captured")
    method = method.removesuffix("-captured")
    if method in ("oasis-eagle3", "oasis-eagle3-graph", "oasis-eagle3-plain", "oasis-eagle3-exact"):
        cache = OasisCache(model, **cache_kwargs(dict(options, lookahead="eagle3", draft=args.head,
                                                      exact=method.endswith("-exact"))))
        if method.endswith("-graph"):  # the head's decode call replayed as a CUDA graph (draft/head_step.py)
            cache.ride_along.static_head = "graph" if torch.device(args.device).type == "cuda" else "eager"
        if method.endswith("-plain"):
            cache.ride_along.static_head = None
        return cache
    if method == "oasis-exact":
        return OasisCache(model, **cache_kwargs(dict(options, lookahead="previous", exact=True,
                                                     num_slots=args.exact_slots or None)))
    if method.startswith("oasis-"):
        return OasisCache(model, **cache_kwargs(dict(options, lookahead=method.split("-", 1)[1])))
    raise ValueError(method)


def needs_head(methods) -> bool:
    """Whether a method rides a draft along (oasis-eagle3 and its -plain / -graph / -exact forms)."""
    return any(m.startswith("oasis-eagle3") for m in methods)


def untrained_head(model):
    """An EAGLE-3 head shaped for `model` with random weights and a 32K draft vocabulary (as published heads have)."""
    from oasis_cache.draft import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    config = Eagle3Config.for_target(model.config, draft_vocab_size=min(32000, model.config.vocab_size))
    head = Eagle3Head(config)
    head.set_vocab_map(torch.randperm(model.config.vocab_size)[: config.draft_vocab_size].sort().values)
    return head


def kv_bytes_on_device(cache, device) -> int:
    if isinstance(cache, OasisCache):
        return sum(cache.device_nbytes().values())
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.device.type == torch.device(device).type:
                total += t.numel() * t.element_size()
    return total


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class MethodRun:
    """One method's cache for one (context, batch): prefilled once, then decoded step by step (`step`), alone or
    taking turns with other methods' runs (`--interleave`); `row()` gives the table row. Peak memory is this run's
    own: the model's bytes + what this cache holds after its prefill + the largest rise within one of its calls,
    so other runs alive in the process do not count."""

    def __init__(self, model, vocab, method, context, batch, args, weight_bytes):
        self.model, self.method, self.context, self.batch, self.args = model, method, context, batch, args
        self.cuda = torch.device(args.device).type == "cuda"
        self.weight_bytes = weight_bytes
        g = torch.Generator().manual_seed(context + batch)
        ids = torch.randint(0, vocab, (batch, context), generator=g).to(args.device)
        if self.cuda:
            torch.cuda.empty_cache()
        sync(args.device)
        base = self._allocated()  # the model and other runs' caches
        self._reset_peak()
        self.compiled = method == "dense-compiled"
        self.cache = make_cache(method, model, args, capacity=context + args.warmup + args.steps + 8)
        self.attention = model.config._attn_implementation  # "sdpa" for HF's caches, "oasis" for OasisCache
        self.kw = {generate_cache_argument(model): self.cache, "use_cache": True}
        self.forward = compiled_forward(model) if self.compiled else model
        t0 = time.perf_counter()
        chunk = args.prefill_chunk or context
        with torch.no_grad():
            for start in range(0, context, chunk):
                end = min(context, start + chunk)
                where = dict(cache_position=torch.arange(start, end, device=args.device)) if self.compiled else {}
                out = model(input_ids=ids[:, start:end], logits_to_keep=1, **where, **self.kw)
        sync(args.device)
        self.prefill_s = time.perf_counter() - t0
        self.prefill_peak = weight_bytes + self._peak() - base
        self.token = out.logits[:, -1:].argmax(-1)
        self.position = context  # the next token's (a static cache is told where to write)
        del out
        self.own_bytes = self._allocated() - base  # what this cache holds on the device after its prefill
        self.step_rise = 0
        self.steps_done = 0
        self.times: list[float] = []

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def _peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def _reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def _use_own_attention(self) -> None:
        """Runs take turns on one model: each keeps its own attention path (HF's sdpa, or "oasis")."""
        if self.model.config._attn_implementation != self.attention:
            self.model.set_attn_implementation(self.attention)

    def step(self) -> None:
        """One decode step, timed after `--warmup` steps (the device synchronized before and after)."""
        self._use_own_attention()
        sync(self.args.device)
        before = self._allocated()
        self._reset_peak()
        where = {}
        if self.compiled:  # a fresh tensor each step: the compiled step copies it into its own input buffer
            where = dict(cache_position=torch.tensor([self.position], device=self.args.device))
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.forward(input_ids=self.token, **where, **self.kw)
        sync(self.args.device)
        elapsed = time.perf_counter() - t0
        self.position += 1
        self.step_rise = max(self.step_rise, self._peak() - before)
        if self.steps_done >= self.args.warmup:
            self.times.append(elapsed)
        self.steps_done += 1
        self.token = out.logits[:, -1:].argmax(-1).clone()  # (a compiled step's output buffer is reused)

    def row(self) -> dict:
        """The table row; for OasisCache, `--measure-steps` more steps in measurement mode first."""
        cache, args = self.cache, self.args
        measured = {}
        self._use_own_attention()
        if isinstance(cache, OasisCache) and args.measure_steps:
            timed_stats = cache.stats()
            cache.measure = cache.streams.measure = True
            before = cache.counters.decode_steps
            with torch.no_grad():
                for _ in range(args.measure_steps):
                    out = self.model(input_ids=self.token, **self.kw)
                    self.token = out.logits[:, -1:].argmax(-1)
            stats = cache.stats()
            steps = cache.counters.decode_steps - before
            measured = dict(
                exposed_wait_ms_per_step=stats.get("exposed_wait_ms_total", 0.0) / max(1, steps),
                prediction_recall=stats["prediction_recall"],
            )
        times = self.times
        row = dict(
            method=self.method,
            context=self.context,
            batch=self.batch,
            tpot_ms=1000 * statistics.median(times),
            tpot_ms_mean=1000 * statistics.mean(times),
            tpot_ms_min=1000 * min(times),
            step_ms=[round(1000 * t, 2) for t in times],
            tok_per_s=self.batch / statistics.median(times),
            prefill_s=self.prefill_s,
            prefill_peak_gib=self.prefill_peak / 2**30,
            decode_peak_gib=(self.weight_bytes + self.own_bytes + self.step_rise) / 2**30 if self.cuda else 0.0,
            kv_device_gib=kv_bytes_on_device(cache, args.device) / 2**30,
        )
        if isinstance(cache, OasisCache):
            stats = timed_stats if measured else cache.stats()
            row.update(
                bytes_fetched_per_step=stats["bytes_fetched_per_step"],
                bytes_on_critical_path_per_step=stats["bytes_fetched_on_critical_path_per_step"],
                hit_rate=stats["hit_rate"],
                tokens_attended_per_step=stats["tokens_attended_per_step"],
                backend=stats["backend"],
                host_gib=stats["host_bytes"] / 2**30,
                host_dtype=stats["host_dtype"],
                host_bytes_per_token=stats["host_bytes_per_token"],
                **(dict(captures=stats["captures"], replays=stats["captured_replays"],
                        completing_replays=stats["completing_replays"]) if "captures" in stats else {}),
                **measured,
            )
            row["exposed_wait_pct"] = 100 * row.get("exposed_wait_ms_per_step", 0.0) / row["tpot_ms"]
        return row

    def close(self) -> None:
        del self.cache, self.kw


_COMPILED = {}


def compiled_forward(model):
    """`model.forward` compiled once per process (mode "reduce-overhead": CUDA graphs on CUDA)."""
    if id(model) not in _COMPILED:
        _COMPILED[id(model)] = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    return _COMPILED[id(model)]


def run_setting(model, vocab, context, batch, args, weight_bytes) -> list[dict]:
    """Every method at one (context, batch). Without `--interleave`: one method after the other (one cache alive at
    a time). With it: every method is prefilled, then their decode steps take turns (A B C, C B A, ...), so a drift of
    the machine over time (clocks, host memory, other tenants) falls on all methods alike."""
    rows, runs = [], []

    def failed(method, e):
        torch.cuda.empty_cache()
        return dict(method=method, context=context, batch=batch, error=f"OOM: {str(e)[:120]}")

    total = args.warmup + args.steps
    for method in args.methods:
        try:
            run = MethodRun(model, vocab, method, context, batch, args, weight_bytes)
            if not args.interleave:
                for _ in range(total):
                    run.step()
                rows.append(run.row())
                run.close()
                print(json.dumps(rows[-1]), flush=True)
            else:
                runs.append(run)
        except torch.OutOfMemoryError as e:
            rows.append(failed(method, e))
            print(json.dumps(rows[-1]), flush=True)
    if args.interleave:
        for round_ in range(total):
            for run in (runs if round_ % 2 == 0 else runs[::-1]):  # A B C, C B A, ...: no method always follows one
                run.step()
        for run in runs:
            rows.append(run.row())
            run.close()
            print(json.dumps(rows[-1]), flush=True)
        order = {m: i for i, m in enumerate(args.methods)}
        rows.sort(key=lambda r: order[r["method"]])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--head", default=None, help="EAGLE-3 head directory for oasis-eagle3 (default: untrained)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measure-steps", type=int, default=6, help="extra steps in measurement mode (oasis)")
    parser.add_argument("--exact-slots", type=int, default=0, help="slots for oasis-exact (0: 2x the budget blocks)")
    parser.add_argument("--gather-programs", type=int, default=0, help="programs of the gather kernel (0: one per block)")
    parser.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens")
    parser.add_argument("--memory-cap-gib", type=float, default=0, help="cap this process's GPU memory (a smaller card)")
    parser.add_argument("--interleave", action="store_true",
                        help="prefill every method, then alternate their decode steps (needs room for all caches)")
    parser.add_argument("--statistic", choices=["median", "mean"], default="median",
                        help="TPOT over the timed steps in the table (mean: what a captured method's recaptures cost, "
                             "with --steps a multiple of 16)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/decode-<model>-<date>.json)")
    args = parser.parse_args()

    if "dense-compiled" in args.methods and not set(args.methods) <= set(SDPA_METHODS):
        parser.error("dense-compiled runs only beside dense and offload (an oasis method switches the attention "
                     "implementation, which makes the compiled step recompile): run oasis methods in another process")
    if not args.exact_slots:
        args.exact_slots = 2 * (args.budget // 16 - 1)
    if args.memory_cap_gib and torch.device(args.device).type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / total)
    model, vocab = load_model(args.model, args.device, getattr(torch, args.dtype))
    weight_bytes = torch.cuda.memory_allocated() if torch.device(args.device).type == "cuda" else 0
    head_meta = args.head or "untrained"
    if needs_head(args.methods) and not args.head:
        args.head = untrained_head(model)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            rows += run_setting(model, vocab, context, batch, args, weight_bytes)

    meta = dict(
        command=" ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=(torch.cuda.get_device_name() if torch.device(args.device).type == "cuda"
                 else f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"),
        torch=torch.__version__,
        transformers=transformers.__version__,
        model=args.model,
        dtype=args.dtype,
        budget=args.budget,
        head=head_meta if needs_head(args.methods) else None,
        gather_programs=args.gather_programs,
        memory_cap_gib=args.memory_cap_gib,
        interleave=args.interleave,
        statistic=args.statistic,
    )
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"decode-{args.model}-{meta['date'][:10]}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print_table(rows, meta)


def print_table(rows, meta):
    key = "tpot_ms_mean" if meta.get("statistic") == "mean" else "tpot_ms"
    print(f"\n{meta['model']} {meta['dtype']} on {meta['machine']}, torch {meta['torch']}, "
          f"transformers {meta['transformers']}, {meta['date']}; TPOT: {meta.get('statistic', 'median')} of the timed steps")
    header = (f"{'context':>8} {'batch':>5} {'method':<23} {'TPOT ms':>9} {'x dense':>8} {'x offload':>9} "
              f"{'peak GiB':>9} {'KV GiB dev':>10} {'MB/step':>8} {'wait %':>7} {'recall':>7}")
    print(header)
    dense = {(r["context"], r["batch"]): r.get(key) for r in rows if r["method"] == "dense"}
    offload = {(r["context"], r["batch"]): r.get(key) for r in rows if r["method"] == "offload"}
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>8} {r['batch']:>5} {r['method']:<23} {r['error'][:60]}")
            continue
        base, off = dense.get((r["context"], r["batch"])), offload.get((r["context"], r["batch"]))
        tpot = r[key]
        ratio = f"{tpot / base:8.2f}" if base else f"{'-':>8}"
        speedup = f"{off / tpot:9.2f}" if off else f"{'-':>9}"
        peak = max(r["prefill_peak_gib"], r["decode_peak_gib"])
        mb = f"{r['bytes_fetched_per_step'] / 1e6:8.1f}" if "bytes_fetched_per_step" in r else f"{'':>8}"
        wait = f"{r['exposed_wait_pct']:7.2f}" if "exposed_wait_pct" in r else f"{'':>7}"
        recall = f"{r['prediction_recall']:7.3f}" if r.get("prediction_recall") is not None else f"{'':>7}"
        print(f"{r['context']:>8} {r['batch']:>5} {r['method']:<23} {tpot:9.1f} {ratio} {speedup} {peak:9.2f} "
              f"{r['kv_device_gib']:10.3f} {mb} {wait} {recall}")


if __name__ == "__main__":
    main()
