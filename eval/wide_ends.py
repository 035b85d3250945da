"""What keeping the first and the newest complete blocks in the model's dtype would be worth, for a narrow host pool
(`host_dtype`): decode-mode NLL (`eval/nll.py`) over dense attention, on the model's own keys and values, on every
complete block narrowed and widened (what `OasisCache(host_dtype=...)` attends at `token_budget` >= context), and on
all of them but the first `--sink` and the newest `--recent` tokens' blocks narrowed. No sparse selection: the
difference between the last two rows is what narrowing those blocks costs at most.

    python eval/wide_ends.py --model qwen05 --host-dtype int4 --prefill 8192 --tokens 256
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

from eval.nll import decode_nll, pydoc_token_ids  # noqa: E402
from oasis_cache.memory.representation import representation_for  # noqa: E402


class NarrowedLayer(DynamicLayer):
    """A DynamicLayer whose complete blocks of `T` tokens are attended as `widen(narrow(kv))`, all but the first
    `sink` tokens' blocks and the newest `recent` tokens' complete blocks when `wide_ends` (those as the model made
    them). The forward that completes a block attends it as made, as the cache's prefill does."""

    def __init__(self, host_dtype: str, T: int, sink: int, recent: int, wide_ends: bool):
        super().__init__()
        self.host_dtype, self.T, self.sink, self.recent, self.wide_ends = host_dtype, T, sink, recent, wide_ends
        self.rep, self.narrowed, self.shadow = None, 0, None  # shadow: [2, B, H, N, D] widened copies

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        T, N = self.T, keys.shape[2]
        end = N // T * T
        if self.rep is None:
            self.rep = representation_for(self.host_dtype, keys.dtype, T, keys.shape[-1])
        if end > self.narrowed:
            fresh = torch.stack([keys, values])[:, :, :, self.narrowed : end]
            blocks = fresh.unflatten(3, (-1, T)).permute(3, 0, 1, 2, 4, 5)  # [nb, 2, B, H, T, D], as offloaded
            widened = self.rep.widen(self.rep.narrow(blocks)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
            self.shadow = widened if self.shadow is None else torch.cat([self.shadow, widened], 3)
            self.narrowed = end
        seen = torch.stack([keys, values]).clone()
        before = (N - key_states.shape[2]) // T * T  # blocks complete before this forward (it attends its own as made)
        lo, hi = 0, before
        if self.wide_ends:  # the sink blocks and the newest complete ones, as a step attends them, stay as made
            lo, hi = -(-self.sink // T) * T, before - -(-self.recent // T) * T
        if hi > lo:
            seen[:, :, :, lo:hi] = self.shadow[:, :, :, lo:hi]
        return seen[0], seen[1]


def cache_for(model, host_dtype, wide_ends, args):
    cache = DynamicCache(config=model.config)
    cache.layers = [NarrowedLayer(host_dtype, 16, args.sink, args.recent, wide_ends) for _ in cache.layers]
    return cache


def through_cache(model, ids, args, dense: float) -> list:
    """NLL rows of `OasisCache(token_budget=args.budget, host_dtype=...)` (its sink and newest blocks held as made),
    and of the same with `SlotMap.hold_newest` off (every complete block read from the pool: the ablation), and of
    the model's dtype."""
    from oasis_cache import OasisCache
    from oasis_cache.pools.slot_map import SlotMap

    rows, hold = [], SlotMap.hold_newest
    for host_dtype in [*args.host_dtype, None]:
        for held in (True, False) if host_dtype else (True,):
            SlotMap.hold_newest = hold if held else (lambda *a, **k: None)
            try:
                with OasisCache(model, token_budget=args.budget, host_dtype=host_dtype) as cache:
                    nll = decode_nll(model, ids, args.prefill, cache).mean().item()
            finally:
                SlotMap.hold_newest = hold
            name = f"cache {host_dtype or 'model dtype'}{'' if held else ', every block from the pool'}"
            rows.append(dict(name=name, host_dtype=host_dtype, budget=args.budget, newest_held=held, nll=nll,
                             delta=nll - dense))
            print(f"{name:44} {nll:.4f}  {nll - dense:+.4f}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen05")
    parser.add_argument("--host-dtype", nargs="+", default=["fp8", "int4"])
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=0,
                        help="also through OasisCache at this token_budget, the sink and newest blocks held as made and not")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from oasis_cache.loaders import load_offline

    model, tokenizer = load_offline(args.model, dtype=getattr(torch, args.dtype))
    model.set_attn_implementation("sdpa")
    ids = pydoc_token_ids(tokenizer, args.prefill + args.tokens)
    rows = [dict(name="dense", nll=decode_nll(model, ids, args.prefill, DynamicCache(config=model.config)).mean().item())]
    print(f"dense {rows[0]['nll']:.4f}", flush=True)
    for host_dtype in args.host_dtype:
        for wide_ends in (False, True):
            nll = decode_nll(model, ids, args.prefill, cache_for(model, host_dtype, wide_ends, args)).mean().item()
            name = f"{host_dtype}{' wide ends' if wide_ends else ''}"
            rows.append(dict(name=name, host_dtype=host_dtype, wide_ends=wide_ends, nll=nll,
                             delta=nll - rows[0]["nll"]))
            print(f"{name:16} {nll:.4f}  {nll - rows[0]['nll']:+.4f}", flush=True)
    if args.budget:
        rows += through_cache(model, ids, args, rows[0]["nll"])
    result = dict(eval="wide_ends", command=" ".join(sys.argv), args=vars(args), rows=rows, host=platform.node(),
                  torch=torch.__version__, date=datetime.date.today().isoformat())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
