"""How a real model's selection moves from step to step: per decode step, the blocks each (layer, KV head) attends
that it never attended before (what a remote tier's decode side must read even with a cache of the whole KV), and how
many of them lie next to the previous step's selection (what a neighbour prefetch could catch).

    python bench/new_blocks.py      # Qwen2.5-Coder-0.5B, Python's documentation, 4K, budget 512, 96 steps, CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.nll import pydoc_token_ids  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.loaders import load_qwen25_coder_05b  # noqa: E402
from oasis_cache.plot import record  # noqa: E402

DISTANCES = (1, 2, 4)


def count(entries) -> tuple[int, int, dict]:
    """`(new, selected, {distance: new within it of the step before's selection})` over a selection record."""
    by_layer: dict = {}
    for entry in entries:
        by_layer.setdefault(entry["layer"], {})[entry["step"]] = entry["attended"][0]  # [Hkv, NB], sequence 0
    new_total = selected = 0
    near = dict.fromkeys(DISTANCES, 0)
    for steps in by_layer.values():
        order = sorted(steps)
        seen = steps[order[0]]
        for before, step in zip(order, order[1:]):
            width = max(seen.shape[-1], steps[step].shape[-1])
            attended, seen, previous = (torch.nn.functional.pad(x, (0, width - x.shape[-1]))
                                        for x in (steps[step], seen, steps[before]))
            new = attended & ~seen
            new_total, selected = new_total + int(new.sum()), selected + int(attended.sum())
            for distance in DISTANCES:
                around = previous.clone()
                for k in range(1, distance + 1):
                    around[:, k:] |= previous[:, :-k]
                    around[:, :-k] |= previous[:, k:]
                near[distance] += int((new & around).sum())
            seen = seen | attended
    return new_total, selected, near


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=96)
    args = parser.parse_args(argv)
    model, tokenizer = load_qwen25_coder_05b(device="cpu", dtype=torch.float32)
    ids = pydoc_token_ids(tokenizer, args.context)
    cache = OasisCache(model, token_budget=args.budget, lookahead="previous")
    with torch.no_grad(), record(cache) as rec:
        model.generate(input_ids=ids, **cache.generate_kwargs(), max_new_tokens=args.steps, do_sample=False)
    new, selected, near = count(rec.entries)
    print(f"{args.context} tokens, budget {args.budget}, {args.steps} steps: {new} of {selected} selected (layer, head, "
          f"block) entries new to their (layer, head) = {new / selected:.2%}")
    for distance, n in near.items():
        print(f"  within {distance} block(s) of the step before's selection: {n / max(1, new):.1%}")


if __name__ == "__main__":
    main()
