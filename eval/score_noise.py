"""How far each host dtype's narrowing would move each layer's attention scores (`memory.representation.score_noise`:
the standard deviation, in nats, of `scale * q . (widen(narrow(k)) - k)` over the prompt's last 16 queries and its
first 256 blocks), per layer, on a real model and Python's documentation. A layer above `SCORE_NOISE_LIMIT` is one
`OasisCache(host_dtype=...)` keeps in the model's dtype (`pools.host_kv.measured_pool`).

    python eval/score_noise.py --model qwen05 --prefill 1024 --out score-noise.json
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

from eval.nll import pydoc_token_ids  # noqa: E402
from oasis_cache.memory.representation import SCORE_NOISE_LIMIT, Int4, representation_for, score_noise  # noqa: E402

T = 16


def queries_by_layer(model, ids: torch.Tensor) -> tuple[DynamicCache, dict]:
    """A dense forward's cache and each layer's queries after the rotary embedding (`[B, Hq, n, D]`), caught from the
    attention function transformers calls (restored after)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    caught, sdpa = {}, ALL_ATTENTION_FUNCTIONS["sdpa"]

    def catching(module, query, *args, **kwargs):
        caught[len(caught)] = query.detach()
        return sdpa(module, query, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = catching
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return cache, caught


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen05")
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from oasis_cache.loaders import load_offline

    model, tokenizer = load_offline(args.model, dtype=getattr(torch, args.dtype))
    model.set_attn_implementation("sdpa")
    ids = pydoc_token_ids(tokenizer, args.prefill // T * T)
    cache, queries = queries_by_layer(model, ids)
    forms = {"fp8": ("fp8", False), "int4": ("int4", False), "int4 rotated": ("int4", True)}
    rows = []
    for idx, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values  # [B, H, L, D]
        blocks = torch.stack([keys, values]).unflatten(3, (-1, T))  # [2, B, H, n, T, D]
        scale = keys.shape[-1] ** -0.5
        row = dict(layer=idx)
        for name, (host_dtype, rotated) in forms.items():
            before, Int4.rotated = Int4.rotated, rotated
            try:
                rep = representation_for(host_dtype, keys.dtype, T, keys.shape[-1])
                row[name] = score_noise(rep, blocks, queries[idx], scale)
            finally:
                Int4.rotated = before
        rows.append(row)
        print(f"layer {idx:3}  " + "  ".join(f"{name} {row[name]:6.2f}" for name in forms), flush=True)
    result = dict(eval="score_noise", command=" ".join(sys.argv), args=vars(args), limit=SCORE_NOISE_LIMIT, rows=rows,
                  host=platform.node(), torch=torch.__version__, date=datetime.date.today().isoformat())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
