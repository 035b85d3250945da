"""Exactness at scale: a random-weight model of a real shape, a long context, OasisCache with token_budget >= context
against SDPA + DynamicCache. Prints greedy agreement and the largest logit difference per step.

    python bench/exactness.py --model qwen3-8b --context 32768 --dtype float32 --new-tokens 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache import OasisCache  # noqa: E402
from models import load_model  # noqa: E402


def greedy(model, ids, cache, steps):
    tokens, logits = [], []
    token_ids = ids
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=token_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step_logits = out.logits[:, -1].float()
            token_ids = step_logits.argmax(-1, keepdim=True)
            tokens.append(token_ids)
            logits.append(step_logits)
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    model, vocab = load_model(args.model, args.device, getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=g).to(args.device)
    model.set_attn_implementation("sdpa")
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config), args.new_tokens)
    cache = OasisCache(model, token_budget=args.context + 2 * args.new_tokens + 64)
    tokens, logits = greedy(model, ids, cache, args.new_tokens)
    same = bool(torch.equal(tokens, ref_tokens))
    diff = (logits - ref_logits).abs().amax(dim=(0, 2))
    scale = ref_logits.abs().amax().item()
    print(f"{args.model} {args.dtype} context {args.context} batch {args.batch}: greedy identical: {same}; "
          f"max |logit diff| per step: {[round(x, 5) for x in diff.tolist()]} (logit scale {scale:.2f}); "
          f"stats: decode_steps={cache.stats()['decode_steps']} transfer={cache.stats()['transfer']}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
