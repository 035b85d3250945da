"""Prefill / decode disaggregation through a Mooncake Store: what admission moves against a full KV
transfer, what the decode side holds, what it fetches per step, and its time per token against the same cache
decoding from its local host pool.

    python bench/disagg.py --context 32768 --budget 2048 --steps 16 --out bench/results/disagg-cpu.json
    python bench/disagg.py --device cuda --context 32768 ... [--measure: exposed wait per step] [--pipelined]
    python bench/disagg.py --model qwen25-coder-0.5b --device cuda --context 32768 --budget 2048 --steps 64

The default model has Qwen3-8B's KV geometry (8 KV heads of 128, bf16) on `--layers` layers with small other
dimensions (random weights): bytes per layer are those of the 8B model, and the ratios do not depend on the layer
count; its selection changes almost entirely from step to step, the worst case for a local cache. `--model
qwen25-coder-0.5b` decodes with real weights after Python's documentation, whose selections persist. One
process plays both roles one after the other (a store started here, `oasis_cache.remote.local_store`): prefill all
but the last prompt token with `lookahead="previous"`, `publish`; `admit` from the store and `generate` `--steps`
tokens (the remote run); then the prefill's own cache generates the same tokens from its local pool (the local run).
That two processes give the same tokens is in `tests/remote/test_remote.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402
from oasis_cache.layer import OasisLayer  # noqa: E402
from oasis_cache.remote import admit, connect, local_store, publish, publishing  # noqa: E402


def model_with_8b_kv(layers: int, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=140000,
                         rope_theta=1e6)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def units_fetched(cache) -> int:
    """Units an admitted cache has read from the store so far (0 for a local one)."""
    return sum(layer.pool.remote.units_fetched for layer in cache.layers
               if isinstance(layer, OasisLayer) and layer.is_initialized and layer.pool.remote is not None)


def timed_generate(model, ids, cache, steps, cuda):
    """`(sequences, ms per decode step, warm)`, the first token excluded (`models.TokenClock`); `warm`: over the
    second half of the steps, once the local cache has met most of what the selections come back to —
    `{"tpot_ms": median ms per step, "units_per_step": units read from the store per step}`."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from models import TokenClock

    class Units(StoppingCriteria):  # the store reads so far, after each token (never stops)
        def __init__(self):
            self.counts = []

        def __call__(self, input_ids, scores, **kwargs):
            self.counts.append(units_fetched(cache))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    clock, units = TokenClock(cuda), Units()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, stopping_criteria=StoppingCriteriaList([clock, units]),
                         **cache.generate_kwargs())
    if cuda:
        torch.cuda.synchronize()
    half = len(units.counts) // 2
    late = sorted(clock.step_s()[half:])
    warm = dict(tpot_ms=1e3 * late[len(late) // 2] if late else float("nan"),
                units_per_step=(units.counts[-1] - units.counts[half]) / max(1, len(units.counts) - 1 - half))
    return out, clock.ms_per_step(), warm


def runs(blocks: list, gap: int) -> list:
    """`[(first, last)]` of sorted block ids, joined where fewer than `gap` + 1 ids apart (gaps of up to `gap` ids
    read through)."""
    spans = [[blocks[0], blocks[0]]]
    for block in blocks[1:]:
        if block - spans[-1][1] > gap + 1:
            spans.append([block, block])
        else:
            spans[-1][1] = block
    return [tuple(span) for span in spans]


class ReadShapes:
    """How a decode's store reads fall into runs: each batched read's units grouped by (layer, sequence, KV head),
    their blocks in runs of adjacent ids, and the same with gaps of up to `gap` unread blocks read through — what a
    layout holding a (layer, sequence, KV head)'s blocks in a row would read as one transfer each."""

    def __init__(self, tier, gap: int = 2):
        self.gap, self.calls, self.units = gap, 0, 0
        self.adjacent, self.with_gaps = 0, 0  # transfers: runs of adjacent blocks / with gaps read through
        self.read_through = 0  # blocks read only to join runs (gap reads)
        self.blocks = 0  # distinct (layer, block, sequence) per read: transfers of objects holding every KV head
        self.lengths = {}  # run length (adjacent blocks) -> count
        inner = tier.get_units_of_layers

        def recorded(requests, size):
            self.record(requests)
            return inner(requests, size)

        tier.get_units_of_layers = recorded

    def record(self, requests) -> None:
        self.calls += 1
        for idx, units, _, _ in requests:
            rows = {}
            self.blocks += len({(block, sequence) for block, sequence, _ in units})
            for block, sequence, head in units:
                rows.setdefault((sequence, head), []).append(block)
            for blocks in rows.values():
                blocks.sort()
                self.units += len(blocks)
                adjacent, joined = runs(blocks, 0), runs(blocks, self.gap)
                self.adjacent += len(adjacent)
                for first, last in adjacent:
                    self.lengths[last - first + 1] = self.lengths.get(last - first + 1, 0) + 1
                self.with_gaps += len(joined)
                self.read_through += sum(last - first + 1 for first, last in joined) - len(blocks)

    def summary(self) -> dict:
        return dict(calls=self.calls, units=self.units, blocks=self.blocks, transfers_adjacent=self.adjacent,
                    transfers_with_gaps=self.with_gaps, gap=self.gap, read_through_units=self.read_through,
                    run_lengths=dict(sorted(self.lengths.items())))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--segment", default="2GB", help="the store's storage process memory")
    parser.add_argument("--storage", type=int, default=1, help="storage processes (each of --segment)")
    parser.add_argument("--measure", action="store_true",
                        help="both runs in measurement mode: exposed wait per step (compute waiting on prefetches; "
                             "eager steps, so their TPOT is not the captured one)")
    parser.add_argument("--pipelined", action="store_true",
                        help="publish while the prefill runs (`remote.publishing`: each chunk's blocks put while the "
                             "next chunk computes) instead of after it")
    parser.add_argument("--model", default="qwen3-8b-kv",
                        help="qwen3-8b-kv (random weights with Qwen3-8B's KV on --layers layers: a random model's "
                             "selection changes almost entirely every step) or an offline model (oasis_cache.loaders, "
                             "e.g. qwen25-coder-0.5b: real weights on Python's documentation, whose selections "
                             "persist)")
    parser.add_argument("--deferred", choices=["auto", "on", "off"], default="auto",
                        help="admit(deferred=...): store reads after each step (capturable) or during it on a host "
                             "thread; auto: after it where steps are captured (CUDA)")
    parser.add_argument("--overlap", action="store_true",
                        help="admit(overlap=True): the deferred store reads run while the step runs (a host thread "
                             "waits for each layer's record); needs deferred reads")
    parser.add_argument("--local-cache-sets", type=float, nargs="+", default=None,
                        help="local cache sizes to admit with, in working sets per layer (default: the package's, "
                             "two); several: one admitted run each, units fetched per step for each")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="store client threads to admit with (connect(threads=...)); several: one admitted run "
                             "each, its warm TPOT against the local run's")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    if args.model == "qwen3-8b-kv":
        model = model_with_8b_kv(args.layers, device, dtype)
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)
        what = f"KV of Qwen3-8B ({args.layers} layers, random weights)"
    else:
        from eval.nll import pydoc_token_ids
        from oasis_cache.loaders import load_offline

        model, tokenizer = load_offline(args.model, device, dtype)
        ids = pydoc_token_ids(tokenizer, args.context).to(device)
        what = f"{args.model} on Python's documentation"
    deferred = {"auto": None, "on": True, "off": False}[args.deferred]
    with local_store(args.segment, storage=args.storage) as master:
        prefill = OasisCache(model, token_budget=args.budget, lookahead="previous", advanced=dict(measure=args.measure))
        store = connect(master)
        t0 = time.perf_counter()
        with publishing(prefill, store, "bench") if args.pipelined else contextlib.nullcontext() as job:
            with torch.no_grad():
                model(input_ids=ids[:, :-1], **{generate_cache_argument(model): prefill}, use_cache=True)
            prefill_s = time.perf_counter() - t0
        if args.pipelined:
            report = job.report
        else:
            report = publish(prefill, store, "bench")
        publish_s = time.perf_counter() - t0 - prefill_s  # after the prefill's last forward returned
        t0 = time.perf_counter()
        remote = admit(model, store, "bench", measure=args.measure, deferred=deferred, overlap=args.overlap)
        admit_s = time.perf_counter() - t0
        slots_bytes = remote.remote_tier.bytes_got  # (the working set's blocks, read from the store at admission)
        shapes = ReadShapes(remote.remote_tier)
        out_remote, remote_ms, remote_warm = timed_generate(model, ids, remote, args.steps, cuda)
        stats = remote.stats()  # (with --overlap the last step's reads finish here)
        local_host = prefill.host_nbytes()
        out_local, local_ms, local_warm = timed_generate(model, ids, prefill, args.steps, cuda)
        local_stats = prefill.stats()
        remote_host = remote.host_nbytes()
        sweep = []  # (the admitted caches stay alive: one dropped deletes the request's keys)
        layer = next(layer for layer in prefill.layers if isinstance(layer, OasisLayer))
        working_set = layer.batch_size * layer.num_kv_heads * layer.working_set.num_slots  # units of one step
        for sets in args.local_cache_sets or []:
            sized = admit(model, store, "bench", deferred=deferred, local_cache_units=int(sets * working_set),
                          overlap=args.overlap)
            out_sized, sized_ms, sized_warm = timed_generate(model, ids, sized, args.steps, cuda)
            sized_stats = sized.stats()
            sweep.append(dict(working_sets=sets, units=int(sets * working_set), tpot_ms=sized_ms,
                              same_tokens=torch.equal(out_sized, out_local),
                              units_fetched_per_step=sized_stats["remote_units_fetched"] / args.steps,
                              warm_units_per_step=sized_warm["units_per_step"], warm_tpot_ms=sized_warm["tpot_ms"],
                              local_cache_share=sized_stats["remote_local_cache_bytes"] / report["full_kv"],
                              repair_ms_per_step=sized_stats["remote_repair_ms_per_step"],
                              repair_phases_ms=sized_stats["remote_repair_phases_ms"], cache=sized))
        threads = []
        for count in args.threads or []:
            client = connect(master, threads=count)
            admitted = admit(model, client, "bench", deferred=deferred, overlap=args.overlap)
            out_threads, threads_ms, threads_warm = timed_generate(model, ids, admitted, args.steps, cuda)
            threads.append(dict(threads=count, tpot_ms=threads_ms, warm_tpot_ms=threads_warm["tpot_ms"],
                                warm_ratio=threads_warm["tpot_ms"] / local_warm["tpot_ms"],
                                warm_units_per_step=threads_warm["units_per_step"],
                                repair_phases_ms=admitted.stats()["remote_repair_phases_ms"],
                                same_tokens=torch.equal(out_threads, out_local), cache=admitted, client=client))
        del remote
        for row in sweep + threads:
            row.pop("cache", None)
        for row in threads:
            row.pop("client").close()
        store.close()
    same = torch.equal(out_remote, out_local)
    steps = args.steps
    row = dict(
        model=args.model, deferred=args.deferred, overlap=args.overlap, context=args.context, budget=args.budget,
        layers=args.layers if args.model == "qwen3-8b-kv" else model.config.num_hidden_layers, steps=steps,
        device=str(device),
        dtype=args.dtype, same_tokens=same,
        full_kv_bytes=report["full_kv"], admission_bytes=report["record"], blocks_published_bytes=report["blocks"],
        admission_share=report["record"] / report["full_kv"], admission_slots_bytes=slots_bytes,
        admission_total_share=(report["record"] + slots_bytes) / report["full_kv"],
        decode_host_bytes=remote_host, local_host_bytes=local_host, decode_host_share=remote_host / report["full_kv"],
        remote_units_published=stats["remote_units_published"], remote_units_fetched=stats["remote_units_fetched"],
        remote_units_evicted=stats["remote_units_evicted"], local_cache_bytes=stats["remote_local_cache_bytes"],
        remote_bytes_fetched=stats["remote_bytes_fetched"],
        remote_bytes_per_step=stats["remote_bytes_fetched"] / steps,
        tpot_remote_ms=remote_ms, tpot_local_ms=local_ms, tpot_ratio=remote_ms / local_ms,
        warm_tpot_remote_ms=remote_warm["tpot_ms"], warm_tpot_local_ms=local_warm["tpot_ms"],
        warm_tpot_ratio=remote_warm["tpot_ms"] / local_warm["tpot_ms"],
        warm_units_per_step=remote_warm["units_per_step"],
        prefill_s=prefill_s, publish_s=publish_s, admit_s=admit_s, pipelined=args.pipelined,
        prefill_and_publish_s=prefill_s + publish_s, blocks_in_background=report.get("blocks_in_background", 0),
        repair_ms_per_step=stats["remote_repair_ms_per_step"], repair_phases_ms=stats["remote_repair_phases_ms"],
        repair_exposed_ms_per_step=stats["remote_repair_exposed_ms_per_step"],
        replays_remote=stats.get("captured_replays", 0), replays_local=local_stats.get("captured_replays", 0),
        local_cache_sweep=sweep, threads_sweep=threads, read_shapes=shapes.summary(),
        exposed_wait_ms_per_step_remote=stats.get("exposed_wait_ms_per_step"),
        exposed_wait_ms_per_step_local=local_stats.get("exposed_wait_ms_per_step"),
    )
    header = (f"disaggregation, {what}, {args.dtype} on {device}, torch {torch.__version__}, "
              f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    print(header)
    print(f"context {args.context}, budget {args.budget}: admission record {report['record'] / 2**20:.1f} MiB and "
          f"working set {slots_bytes / 2**20:.1f} MiB of {report['full_kv'] / 2**20:.1f} MiB full KV = "
          f"1/{1 / row['admission_total_share']:.1f}; decode-side host "
          f"{remote_host / 2**20:.1f} MiB = 1/{1 / row['decode_host_share']:.1f} of the KV (local caches "
          f"{row['local_cache_bytes'] / 2**20:.1f} MiB); fetched {row['remote_units_fetched']} of "
          f"{row['remote_units_published']} (block, sequence, KV head) units over {steps} steps "
          f"({row['remote_bytes_per_step'] / 2**20:.2f} MiB per step); TPOT remote {remote_ms:.1f} ms, local "
          f"{local_ms:.1f} ms ({row['tpot_ratio']:.2f}x; store reads after each step {row['repair_ms_per_step']:.2f} "
          f"ms; replayed steps remote {row['replays_remote']}, local {row['replays_local']}); same tokens: {same}")
    if row["repair_ms_per_step"]:
        print("after each step, ms: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}"
                                                 for k, v in row["repair_phases_ms"].items())
              + (f"; overlapped with the step, what the next forward waited and finished: "
                 f"{row['repair_exposed_ms_per_step']:.2f}" if args.overlap else ""))
    print(f"prefill {prefill_s:.2f} s, then publish {publish_s:.2f} s ({'pipelined: ' if args.pipelined else ''}"
          f"{row['blocks_in_background'] / 2**20:.1f} MiB of blocks put while the prefill ran)")
    print(f"warm (the second half of the steps, medians): TPOT remote {row['warm_tpot_remote_ms']:.1f} ms, local "
          f"{row['warm_tpot_local_ms']:.1f} ms ({row['warm_tpot_ratio']:.2f}x), {row['warm_units_per_step']:.0f} "
          f"units read from the store per step")
    shape = row["read_shapes"]
    if shape["units"]:
        print(f"the decode's store reads: {shape['units']} units in {shape['calls']} batched reads; as runs of "
              f"adjacent blocks of one (layer, sequence, KV head) {shape['transfers_adjacent']} transfers "
              f"({shape['units'] / shape['transfers_adjacent']:.2f} units each), with gaps of up to {shape['gap']} "
              f"read through {shape['transfers_with_gaps']} (+{shape['read_through_units']} units read); as objects "
              f"holding every KV head of a (layer, block, sequence) {shape['blocks']} transfers")
    for r in sweep:
        print(f"local cache of {r['working_sets']:g} working sets ({r['local_cache_share']:.1%} of the KV): "
              f"{r['units_fetched_per_step']:.0f} units fetched per step ({r['warm_units_per_step']:.0f} warm), TPOT "
              f"{r['tpot_ms']:.1f} ms ({r['warm_tpot_ms']:.1f} warm), store reads after each step "
              f"{r['repair_ms_per_step']:.2f} ms (" + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in
                                                              r["repair_phases_ms"].items())
              + f"), same tokens: {r['same_tokens']}")
    for r in threads:
        print(f"{r['threads']} store client threads: warm TPOT {r['warm_tpot_ms']:.1f} ms ({r['warm_ratio']:.2f}x the "
              f"local run), {r['warm_units_per_step']:.0f} units per step; after each step, ms: "
              + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in r["repair_phases_ms"].items())
              + f"; same tokens: {r['same_tokens']}")
    if args.measure:
        print(f"exposed wait per step: remote {row['exposed_wait_ms_per_step_remote']:.2f} ms, local "
              f"{row['exposed_wait_ms_per_step_local']:.2f} ms (compute waiting on prefetches)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(header=header, command="python " + " ".join(sys.argv), row=row),
                                             indent=1))
    if not same or not all(r["same_tokens"] for r in sweep + threads):
        sys.exit("the remote and local runs decoded different tokens")


if __name__ == "__main__":
    main()
