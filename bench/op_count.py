"""Operators launched per decode step, by lookahead mode: a CPU-side proxy for the launch-bound cost of each mode.

    python bench/op_count.py --layers 8 --modes previous eagle3 eagle3-exact

Runs a tiny random Qwen3 (CPU), prefills `--context` tokens, decodes a few steps, then records one decode step
with `torch.profiler` and counts the outermost `aten::` operators (what a GPU step would launch, roughly). Prints the
totals and, for the last mode against the first, the operators whose counts differ. The head for eagle3 is
untrained (counts do not depend on weights).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import prompt_ids, random_head, tiny_model  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402


def count_ops(model, ids, mode: str, head, budget: int) -> collections.Counter:
    """`mode`: a lookahead, optionally with `-exact` (miss repair), e.g. `eagle3-exact` (the default with a head)."""
    lookahead, _, exact = mode.partition("-")
    draft = dict(draft=head) if lookahead == "eagle3" else {}
    cache = OasisCache(model, token_budget=budget, lookahead=lookahead, exact=exact == "exact", **draft)
    kw = {generate_cache_argument(model): cache, "use_cache": True}
    with torch.no_grad():
        out = model(input_ids=ids, **kw)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(input_ids=token, **kw)
            token = out.logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=token, **kw)
    counts = collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            counts[event.name] += 1
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["none", "previous", "eagle3"])
    args = parser.parse_args()
    model = tiny_model("qwen3", num_hidden_layers=args.layers)
    head, ids = random_head(model), prompt_ids(args.context)
    counts = {mode: count_ops(model, ids, mode, head, args.budget) for mode in args.modes}
    print(f"outermost aten ops in one decode step, {args.layers} layers, context {args.context}:")
    for mode, c in counts.items():
        print(f"  {mode:10} {sum(c.values()):6}  ({sum(c.values()) / args.layers:.1f} per layer)")
    first, last = args.modes[0], args.modes[-1]
    a, b = counts[first], counts[last]
    print(f"\n{first} -> {last}, operators whose counts differ:")
    for name in sorted(set(a) | set(b), key=lambda n: a[n] - b[n]):
        if a[name] != b[name]:
            print(f"  {name:36} {a[name]:5} -> {b[name]:5} ({b[name] - a[name]:+d})")


if __name__ == "__main__":
    main()
