"""Would larger store objects help a decode side? Units it fetches per step if one object held G consecutive blocks of
a KV head, from real selections, at equal local-cache memory.

    python bench/remote_units.py --context 4096 --new-tokens 64

SmolLM2-135M (offline, CPU) decodes greedily after a pydoc document with `lookahead="previous"` and a budget of 1/16
of the context; every step's attended blocks per layer and KV head are recorded (`oasis_cache.plot.record`). Each
(layer, head) is then replayed through an LRU cache of objects holding two working sets of blocks (what
`remote.admit` gives by default): G = 1 is the remote tier's layout (one block of one head per object); G > 1 keeps
2 x slots / G objects of G blocks. Prints objects and blocks fetched per step (all layers and heads).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.tasks import filler_text  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.loaders import load_offline  # noqa: E402
from oasis_cache.plot import record  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, tokenizer = load_offline("smollm2")
    ids = torch.tensor([tokenizer(filler_text("pydoc"))["input_ids"][: args.context]])
    cache = OasisCache(model, token_budget=args.context // 16, lookahead="previous")
    with record(cache) as rec:
        model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False)
    by_layer = collections.defaultdict(list)
    for entry in rec.entries:
        by_layer[entry["layer"]].append(entry["attended"][0])  # [H, NB] bool, sequence 0
    slots = cache.layers[0].working_set.num_slots
    steps = len(next(iter(by_layer.values())))
    rows = []
    for G in args.groups:
        capacity = max(1, 2 * slots // G)
        fetched = 0
        for selections in by_layer.values():
            for head in range(selections[0].shape[0]):
                lru = collections.OrderedDict()
                for attended in selections:
                    for group in sorted({b // G for b in attended[head].nonzero().flatten().tolist()}):
                        if group in lru:
                            lru.move_to_end(group)
                            continue
                        fetched += 1
                        lru[group] = True
                        if len(lru) > capacity:
                            lru.popitem(last=False)
        rows.append(dict(blocks_per_object=G, local_cache_objects_per_head=capacity,
                         objects_per_step=fetched / steps, blocks_per_step=fetched * G / steps))
        print(f"G {G:2}: {rows[-1]['objects_per_step']:7.1f} objects, {rows[-1]['blocks_per_step']:7.1f} blocks fetched "
              f"per step ({len(by_layer)} layers x {selections[0].shape[0]} KV heads; local cache {capacity} objects "
              f"of {G} blocks per head)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(command="python " + " ".join(sys.argv), context=args.context,
                                                   slots=slots, steps=steps, rows=rows), indent=1))


if __name__ == "__main__":
    main()
