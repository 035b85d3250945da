"""Which block scorer keeps dense attention's answers? An analysis of the selection policy, not a speed path.

OasisCache ranks blocks by a small summary of their keys kept on the device (`control/selection.py`). This script
swaps that scorer for others and runs the same task samples with `lookahead="none"` at a budget of
context / `--fraction`, reporting accuracy, retention of dense's correct answers and greedy agreement per scorer:

- `bits`, `bound`, `bits_fp8`: the shipped scorers (`advanced={"scorer": ..., "fp8_levels": ...}`): 1-bit key
  codes with least-squares levels (in fp8 for `bits_fp8`), and the min/max upper bound (Quest's);
- `half_bound`: the same bound over half blocks (summaries twice as large);
- `mean`: the query's dot product with each block's mean key (a summary of the same size as one of min/max);
- `channels`: the exact max of q.k over 1/8 of the key channels, chosen per KV head by mean |k| (as many values
  per block as min/max; Double Sparsity's idea at block granularity); `qk_channels`: chosen by mean |q| x mean |k|
  with the current query (a ceiling for channels calibrated on the prompt's queries);
- `low_rank` / `low_rank16`: the exact max of q.k over keys projected on the top 8 / 16 principal directions of the
  head's keys (8 per token = as many values per block as min/max);
- `quant1` / `quant2`: the exact max of q.k over keys quantized to 1 / 2 bits per channel within the block's
  min/max (codes stored beside the summaries: +50% / +100% of their bytes at bf16; `quant1` was the first `bits`);
  `centroid1` / `centroid1_mid`: 1 bit per channel with the two levels at the means of the keys above and below the
  block mean / the min-max midpoint (`centroid1` is what `bits` ships, simulated); `centroid1_fp8`: its levels cast
  to fp8 (e4m3) without a scale (`bits_fp8` ships them with a power-of-two scale per block); `centroid1_groupG`
  (G = 2, 4, 8, 16): one split and one pair of levels shared by G consecutive blocks (smaller summaries);
  `centroid1_half` (`_groupG`, G = 2, 4): codes and levels on the half of the channels `channels` would pick (by mean
  |k|, rotary pairs together), the rest of q.k left out: summaries half the size (and levels shared by G blocks);
- `max`: the exact maximum of q.k in each block, and `mass`: the softmax attention mass of each block — both read
  every key from the host pool, so they are ceilings: what a better summary could buy, not something to ship.

The simulated scorers compute their summaries from the full keys on the fly; only the ranking changes, the rest of
the decode path (slots, transfer, attention) is the real one.

    python eval/scoring.py --task single_needle --length 4096 --samples 64 --fraction 8
    python eval/scoring.py --tiny      # CI size (random weights: plumbing only)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.report import add_run_arguments, against_dense, load, run_generation, score_outputs  # noqa: E402
from eval.tasks import generate_samples  # noqa: E402
from oasis_cache.control.selection import all_blocks, top_blocks  # noqa: E402
from oasis_cache.layer import OasisLayer  # noqa: E402
from oasis_cache.pools.summaries import heaviest_channels  # noqa: E402


def _half_bound(q, keys):
    B, H, NB, T, D = keys.shape
    halves = keys.view(B, H, NB, 2, T // 2, D)
    kmin, kmax = halves.amin(-2), halves.amax(-2)  # [B, H, NB, 2, D]
    bound = torch.einsum("bhrd,bhnsd->bhrns", q.clamp(min=0), kmax)
    bound += torch.einsum("bhrd,bhnsd->bhrns", q.clamp(max=0), kmin)
    return bound.amax(-1).amax(2)


def _channels(q, keys, share=8, by_query=False):
    """Exact max of q.k over a subset of key channels (Double Sparsity's "label channels"): the D/`share` channels
    (rotary pairs kept together) with the largest mean |k| in each KV head (`by_query`: the largest mean |q| x mean
    |k|, i.e. contribution to q.k, chosen with this step's query — a ceiling for a choice calibrated at prefill).
    Stores D/share of each key: with share = 8 and 16-token blocks, as many values per block as min/max."""
    qs, ks = _on_channels(q, keys, share, by_query)
    return torch.einsum("bhrd,bhntd->bhrnt", qs, ks).amax(-1).amax(2)


def _on_channels(q, keys, share, by_query=False):
    """The query rows `[B, H, R, D/share]` and keys `[B, H, NB, T, D/share]` on the D/`share` channels of `_channels`."""
    B, H, NB, T, D = keys.shape
    weight = keys.abs().mean(dim=(2, 3))  # [B, H, D]
    if by_query:
        weight = weight * q.abs().mean(dim=2)
    channels = heaviest_channels(weight, 2 * max(1, D // share // 2))  # [B, H, D/share]: the shipped choice's rule
    qs = q.gather(-1, channels[:, :, None].expand(-1, -1, q.shape[2], -1))
    ks = keys.gather(-1, channels[:, :, None, None].expand(-1, -1, NB, T, -1))
    return qs, ks


def _low_rank(q, keys, rank=8):
    """Exact max of q.k over each block's keys projected on the `rank` principal directions of the KV head's
    (centered) keys — a per-head basis that a prefill could compute once; `rank` values per token, so rank 8 with
    16-token blocks stores as many values per block as min/max (D = 64). The mean key's term is the same for every
    block and is left out of the ranking."""
    B, H, NB, T, D = keys.shape
    flat = keys.reshape(B, H, NB * T, D)
    centered = flat - flat.mean(dim=2, keepdim=True)
    basis = torch.linalg.svd(centered, full_matrices=False).Vh[:, :, :rank]  # [B, H, rank, D]
    kp = torch.einsum("bhnd,bhrd->bhnr", centered, basis).view(B, H, NB, T, rank)
    qp = torch.einsum("bhqd,bhrd->bhqr", q, basis)
    return torch.einsum("bhqr,bhntr->bhqnt", qp, kp).amax(-1).amax(2)


def _quantized(q, keys, bits=2):
    """Exact max of q.k over keys quantized to `bits` per channel within their block's [min, max] range (the
    summaries already hold the range): `bits * D * T / 8` more bytes per block (bits = 1: half the min/max summary
    in bf16; bits = 2: as much again)."""
    kmin, kmax = keys.amin(-2, keepdim=True), keys.amax(-2, keepdim=True)  # [B, H, NB, 1, D]
    steps = 2**bits - 1
    span = (kmax - kmin).clamp(min=1e-12)
    approx = kmin + torch.round((keys - kmin) / span * steps) / steps * span
    return torch.einsum("bhrd,bhntd->bhrnt", q, approx).amax(-1).amax(2)


def _centroids(q, keys, split="mean", level_dtype=None):
    """1 bit per token and channel as in `bits`, but each channel's two levels are the means of the keys on either
    side of the split (the channel's block mean, or the midpoint of its min and max) instead of its min and max — the
    least-squares 1-bit code (Lloyd-Max) at the same bytes: two values per channel and block, one bit per key."""
    approx = _centroid_keys(keys, split, level_dtype)
    return torch.einsum("bhrd,bhntd->bhrnt", q, approx).amax(-1).amax(2)


def _centroids_grouped(q, keys, group: int):
    """`_centroids` with one split and one pair of levels per channel shared by `group` consecutive blocks (the last
    group may be shorter): the levels' bytes divided by `group`, the codes still one bit per key — the summaries a
    ≤ 10% device-KV budget at 32K would allow (docs/performance.md)."""
    B, H, NB, T, D = keys.shape
    full = NB // group * group
    parts = [_centroid_keys(keys[:, :, :full].reshape(B, H, full // group, group * T, D)).reshape(B, H, full, T, D)]
    if full < NB:
        parts.append(_centroid_keys(keys[:, :, full:].reshape(B, H, 1, (NB - full) * T, D)).reshape(
            B, H, NB - full, T, D))
    return torch.einsum("bhrd,bhntd->bhrnt", q, torch.cat(parts, dim=2)).amax(-1).amax(2)


def _centroids_on_channels(q, keys, share: int, group: int = 1):
    """`_centroids` (or `_centroids_grouped`) over the D/`share` channels of `_channels` only: codes and levels of
    those channels, the other channels' share of q.k left out — summaries 1/`share` the size (half with share = 2:
    3.1% of K+V per block in fp8), the other lever toward ≤ 10% device KV at 32K (docs/performance.md)."""
    qs, ks = _on_channels(q, keys, share)
    return _centroids(qs, ks) if group == 1 else _centroids_grouped(qs, ks, group)


def _centroid_keys(keys, split="mean", level_dtype=None):
    """The coarse keys of `_centroids`: each key's channels replaced by the level on its side of the split, computed
    over the second-to-last dimension (a block's tokens, or a group's)."""
    if split == "mean":
        cut = keys.mean(-2, keepdim=True)
    else:
        cut = (keys.amin(-2, keepdim=True) + keys.amax(-2, keepdim=True)) / 2
    high = keys > cut
    n_high = high.sum(-2, keepdim=True)
    n_low = keys.shape[-2] - n_high
    mean_high = torch.where(high, keys, 0).sum(-2, keepdim=True) / n_high.clamp(min=1)
    mean_low = torch.where(high, 0, keys).sum(-2, keepdim=True) / n_low.clamp(min=1)
    if level_dtype is not None:  # levels stored in a narrower type (e.g. fp8: the codes and levels then take the
        mean_high, mean_low = (x.to(level_dtype).float() for x in (mean_high, mean_low))  # bytes of bf16 min/max)
    return torch.where(high, mean_high, mean_low)


def _mass(q, keys):
    logits = torch.einsum("bhrd,bhntd->bhrnt", q, keys) / q.shape[-1] ** 0.5  # [B, H, R, NB, T]
    return torch.softmax(logits.flatten(-2), -1).view_as(logits).sum(-1).sum(2)


# The shipped scorers: name -> OasisCache options.
SHIPPED = {"bits": dict(scorer="bits", fp8_levels=False), "bound": dict(scorer="bound"),
           "bits_fp8": dict(scorer="bits", fp8_levels=True)}

# name -> scores [B, Hkv, NB] from the query rows q [B, Hkv, R, D] and the full keys [B, Hkv, NB, T, D] (fp32);
# None: a shipped scorer, unchanged.
SCORERS = {
    **{name: None for name in SHIPPED},
    "half_bound": _half_bound,
    "channels": _channels,
    "qk_channels": lambda q, keys: _channels(q, keys, by_query=True),
    "low_rank": _low_rank,
    "low_rank16": lambda q, keys: _low_rank(q, keys, rank=16),
    "quant1": lambda q, keys: _quantized(q, keys, bits=1),
    "quant2": _quantized,
    "centroid1": _centroids,
    "centroid1_mid": lambda q, keys: _centroids(q, keys, split="mid"),
    "centroid1_fp8": lambda q, keys: _centroids(q, keys, level_dtype=torch.float8_e4m3fn),
    **{f"centroid1_group{g}": (lambda q, keys, g=g: _centroids_grouped(q, keys, g)) for g in (2, 4, 8, 16)},
    "centroid1_half": lambda q, keys: _centroids_on_channels(q, keys, 2),
    **{f"centroid1_half_group{g}": (lambda q, keys, g=g: _centroids_on_channels(q, keys, 2, g)) for g in (2, 4)},
    "mean": lambda q, keys: torch.einsum("bhrd,bhnd->bhrn", q, keys.mean(-2)).amax(2),
    "max": lambda q, keys: torch.einsum("bhrd,bhntd->bhrnt", q, keys).amax(-1).amax(2),
    "mass": _mass,
}


@contextlib.contextmanager
def scorer(name: str, dense_layers=()):
    """Within the block, OasisLayer ranks blocks with SCORERS[name] (forced and hidden blocks as usual), and the
    layers in `dense_layers` attend every block (their working set must hold them all: see `main`); yields the
    OasisCache options to run with (a shipped scorer's; the bound's summaries, unused, for a simulated one)."""
    score_fn = SCORERS[name]
    shipped = OasisLayer._select

    def _select(layer, query, view, k):
        B, Hq, Qn, D = query.shape
        H, NB = layer.num_kv_heads, layer.pool.num_blocks
        if NB <= k or layer.layer_idx in dense_layers:
            return all_blocks(view.allowed[:, :NB], H)
        if score_fn is None:
            return shipped(layer, query, view, k)
        keys = layer._cache.transfer.load_range(layer.pool, 0, NB)[0].float()  # [B, H, NB, T, D]
        scores = score_fn(query.reshape(B, H, -1, D).float(), keys)
        ranks = torch.where(view.forced[:, None, :NB], torch.inf, scores)  # (the view is capacity-wide)
        return top_blocks(torch.where(view.allowed[:, None, :NB], ranks, -torch.inf), k)

    OasisLayer._select = _select
    try:
        yield SHIPPED.get(name, SHIPPED["bound"])
    finally:
        OasisLayer._select = shipped


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["single_needle"])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--fraction", type=int, default=8, help="budget = length / fraction")
    parser.add_argument("--scorers", nargs="+", default=list(SCORERS), choices=list(SCORERS))
    parser.add_argument("--dense-layers", type=int, nargs="*", default=[],
                        help="layers that attend every block (simulated: every layer's working set holds the context)")
    add_run_arguments(parser, max_new_tokens=16, tiny="2 samples at 512 tokens")
    args = parser.parse_args()
    if args.tiny:
        args.length, args.samples, args.fraction, args.max_new_tokens = 512, 2, 4, 6
    started = time.time()
    model, tokenizer = load(args)
    budget = max(256, args.length // args.fraction)
    rows = []
    for task in args.tasks:
        samples = generate_samples(tokenizer, task, args.length, args.samples, filler=args.filler)

        # Simulated dense layers need slots for every block (sparse layers still attend their top K only).
        options = dict(num_slots=args.length // 16 + 64) if args.dense_layers else {}

        def answers(mode, scorer_options=None):
            outs = run_generation(model, tokenizer, samples, mode, None if mode == "dense" else budget,
                                  args.max_new_tokens, args.batch_size,
                                  **({} if mode == "dense" else {**options, **scorer_options}))
            return outs, score_outputs(tokenizer, outs, samples)

        dense, dense_scores = answers("dense")
        solved = sum(x == 1.0 for x in dense_scores)
        rows.append(dict(task=task, scorer="dense", accuracy=sum(dense_scores) / len(samples), retention=1.0,
                         agreement=1.0, solved=solved))
        for name in args.scorers:
            with scorer(name, set(args.dense_layers)) as scorer_options:
                outs, scores = answers("none", scorer_options)
            rows.append(dict(task=task, scorer=name, dense_layers=args.dense_layers, solved=solved,
                             **against_dense(outs, scores, dense, dense_scores)))
            print(json.dumps(rows[-1]), flush=True)
    meta = dict(
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU",
        model=args.model, length=args.length, budget=budget, samples=args.samples,
        seconds=round(time.time() - started, 1),
    )
    print(f"\n{meta['model']}, context {args.length}, budget {budget}, {args.samples} samples, {meta['machine']}")
    print(f"{'task':16} {'scorer':11} {'accuracy':>8} {'retention':>9} {'agreement':>9}")
    for r in rows:
        retention = f"{r['retention']:9.3f}" if r["retention"] is not None else f"{'-':>9}"
        print(f"{r['task']:16} {r['scorer']:11} {r['accuracy']:8.3f} {retention} {r['agreement']:9.3f}")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"scoring-{args.model}-{'tiny-' if args.tiny else ''}{meta['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
