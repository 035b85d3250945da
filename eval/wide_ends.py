"""What keeping the first and the newest complete blocks in the model's dtype would be worth, for a narrow host pool
(`host_dtype`): decode-mode NLL (`eval/nll.py`) over dense attention, on the model's own keys and values, on every
complete block narrowed and widened (what `OasisCache(host_dtype=...)` attends at `token_budget` >= context), and on
all of them but the first `--sink` and the newest `--recent` tokens' blocks narrowed. No sparse selection: the
difference between the last two rows is what narrowing those blocks costs at most.

    python eval/wide_ends.py --model qwen05 --host-dtype int4 --prefill 8192 --tokens 256
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from eval.nll import decode_nll, pydoc_token_ids  # noqa: E402
from eval.widened import widened_cache  # noqa: E402
from oasis_cache.memory.representation import Int4  # noqa: E402


def variants(model, args) -> list:
    """`(name, fields, make_cache)` of every row: dense, each host dtype with every complete block narrowed and with
    the ends as made (not with `--cache-only`), and with `--budget` through `OasisCache` (its sink and newest blocks
    held as made; with `--ablations` also `SlotMap.hold_newest` off: every complete block read from the pool), and
    the model's dtype there."""
    from oasis_cache import OasisCache
    from oasis_cache.pools.slot_map import SlotMap

    rows = [("dense", {}, lambda: contextlib.nullcontext(DynamicCache(config=model.config)))]
    kinds = [(d, r) for d in args.host_dtype for r in ((False, True) if d == "int4" and args.rotated else (False,))]
    for host_dtype, rotated in [] if args.cache_only else kinds:
        for wide_ends in (False, True):
            rows.append((f"{host_dtype}{' rotated' if rotated else ''}{' wide ends' if wide_ends else ''}",
                         dict(host_dtype=host_dtype, wide_ends=wide_ends, rotated=rotated),
                         lambda d=host_dtype, w=wide_ends, r=rotated: rotation(r, contextlib.nullcontext(
                             widened_cache(model, d, args.recent if w else 0, args.sink if w else 0)))))

    @contextlib.contextmanager
    def oasis(host_dtype, held):
        hold = SlotMap.hold_newest
        SlotMap.hold_newest = hold if held else (lambda *a, **k: None)
        try:
            with OasisCache(model, token_budget=args.budget, host_dtype=host_dtype) as cache:
                yield cache
        finally:
            SlotMap.hold_newest = hold

    for host_dtype, rotated in [*kinds, (None, False)] if args.budget else []:
        for held in (True, False) if host_dtype and args.ablations else (True,):
            rows.append((f"cache {host_dtype or 'model dtype'}{' rotated' if rotated else ''}"
                         f"{'' if held else ', every block from the pool'}",
                         dict(host_dtype=host_dtype, budget=args.budget, newest_held=held, rotated=rotated),
                         lambda d=host_dtype, h=held, r=rotated: rotation(r, oasis(d, h))))
    return rows


@contextlib.contextmanager
def rotation(rotated: bool, context):
    """`context` entered with int4's rotation (`Int4.rotated`) on or off (as the package narrows by default)."""
    before = Int4.rotated
    Int4.rotated = rotated
    try:
        with context as cache:
            yield cache
    finally:
        Int4.rotated = before


def paired(nll: torch.Tensor, base: torch.Tensor) -> dict:
    """Mean per-token NLL difference from `base` and its standard error (tokens taken as independent: a lower bound
    of the true error, tokens of one window being correlated)."""
    diff = nll - base
    return dict(delta=diff.mean().item(), se=(diff.std() / diff.numel() ** 0.5).item())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen05")
    parser.add_argument("--host-dtype", nargs="+", default=["fp8", "int4"])
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--offsets", type=int, nargs="+", default=[0],
                        help="windows of Python's documentation starting at these tokens (each prefill + tokens)")
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=0,
                        help="also through OasisCache at this token_budget (its sink and newest blocks held as made, "
                             "and not)")
    parser.add_argument("--rotated", action="store_true",
                        help="also int4 with keys and values narrowed in a Hadamard-rotated basis (`Int4.rotated`)")
    parser.add_argument("--ablations", action="store_true",
                        help="also the cache with every block read from the pool (`SlotMap.hold_newest` off)")
    parser.add_argument("--cache-only", action="store_true",
                        help="only dense and the cache's rows (the reference narrows every layer: the cache keeps "
                             "a layer whose scores narrowing would move too far in the model's dtype)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from oasis_cache.loaders import load_offline

    model, tokenizer = load_offline(args.model, dtype=getattr(torch, args.dtype))
    model.set_attn_implementation("sdpa")
    rows = variants(model, args)
    per_token, wide = {name: [] for name, _, _ in rows}, {}
    for offset in args.offsets:
        ids = pydoc_token_ids(tokenizer, args.prefill + args.tokens, offset=offset)
        for name, _, make in rows:
            with make() as cache:
                per_token[name].append(decode_nll(model, ids, args.prefill, cache).float().cpu())
                if hasattr(cache, "stats"):  # (the layers the cache kept in the model's dtype)
                    wide[name] = cache.stats()["layers_in_model_dtype"]
            print(f"offset {offset:6} {name:44} {per_token[name][-1].mean().item():.4f}", flush=True)
    nll = {name: torch.cat(values) for name, values in per_token.items()}
    results = []
    for name, fields, _ in rows:
        row = dict(name=name, **fields, nll=nll[name].mean().item(), **paired(nll[name], nll["dense"]))
        if name in wide:
            row["layers_in_model_dtype"] = wide[name]
        if fields.get("budget") and fields.get("host_dtype"):  # the pool's own share: against the model's dtype
            row["against_model_dtype"] = paired(nll[name], nll["cache model dtype"])
        results.append(row)
        extra = f"  ({row['against_model_dtype']['delta']:+.4f} ± {row['against_model_dtype']['se']:.4f} against " \
                f"the model's dtype)" if "against_model_dtype" in row else ""
        print(f"{name:44} {row['nll']:.4f}  {row['delta']:+.4f} ± {row['se']:.4f}{extra}", flush=True)
    result = dict(eval="wide_ends", command=" ".join(sys.argv), args=vars(args), tokens=nll["dense"].numel(),
                  rows=results, host=platform.node(), torch=torch.__version__, date=datetime.date.today().isoformat())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
