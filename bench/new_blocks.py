"""How a real model's selection moves from step to step: per decode step, the blocks each (layer, KV head) attends
that it never attended before (what a remote tier's decode side must read even with a cache of the whole KV), and how
many of them lie next to the previous step's selection (what a neighbour prefetch could catch).

    python bench/new_blocks.py      # Qwen2.5-Coder-0.5B, Python's documentation, 4K, budget 512, 96 steps, CPU
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from oasis_cache import OasisCache
from oasis_cache.loaders import load_qwen25_coder_05b
from oasis_cache.plot import record
from eval.nll import pydoc_token_ids
model, tok = load_qwen25_coder_05b(device="cpu", dtype=torch.float32)
ids = pydoc_token_ids(tok, 4096)
cache = OasisCache(model, token_budget=512, lookahead="previous")
with torch.no_grad(), record(cache) as rec:
    model.generate(input_ids=ids, **cache.generate_kwargs(), max_new_tokens=96, do_sample=False)
by = {}
for e in rec.entries:
    by.setdefault(e["layer"], {})[e["step"]] = e["attended"][0]  # [H, NB]
tot_new = tot_sel = 0
near = {1: 0, 2: 0, 4: 0}
pred_hit = 0
for layer, steps in by.items():
    ss = sorted(steps)
    seen = None
    for i, s in enumerate(ss):
        a = steps[s]
        if seen is None:
            seen = a.clone(); continue
        W = max(seen.shape[-1], a.shape[-1])
        pad = lambda x: torch.nn.functional.pad(x, (0, W - x.shape[-1]))
        a, seen_p, prev = pad(a), pad(seen), pad(steps[ss[i - 1]])
        new = a & ~seen_p
        tot_new += int(new.sum()); tot_sel += int(a.sum())
        for d in near:
            dil = prev.clone()
            for k in range(1, d + 1):
                dil[:, k:] |= prev[:, :-k]; dil[:, :-k] |= prev[:, k:]
            near[d] += int((new & dil).sum())
        seen = seen_p | a
print(f"selected per step per layer-head avg {tot_sel / sum(len(v) - 1 for v in by.values()) / 2:.1f}; new (never attended before) {tot_new} of {tot_sel} = {tot_new / tot_sel:.3%}")
for d, n in near.items():
    print(f"  new within +-{d} blocks of the previous step's selection (same head): {n / max(1, tot_new):.1%}")
