"""Multi-turn chat on one OasisCache: each turn continues the same cache (the earlier turns are not recomputed).

    python examples/chat.py            # SmolLM2-135M-Instruct, offline; CPU is fine
"""

from __future__ import annotations

import argparse

import torch

from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.loaders import load_smollm2

TURNS = ["Name three uses of Python's dictionaries.", "Which of those is the most common?", "Say it in five words."]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=60)
    args = parser.parse_args()
    model, tokenizer = load_smollm2(device=args.device)
    cache = OasisCache(model, token_budget=512)
    argument = generate_cache_argument(model)  # `cache=` (transformers >= 5.24) or `past_key_values=`
    messages, held, fresh = [], None, 0  # held: the token ids the cache holds keys and values for, [1, n]
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"].to(args.device)
        if held is not None:  # keep the cached prefix the new conversation shares; drop the rest (crop)
            n = min(held.shape[1], ids.shape[1])
            same = int((held[0, :n] == ids[0, :n]).cumprod(0).sum())
            cache.crop(same - cache.get_seq_length())  # (a negative count: the tokens removed)
        out = model.generate(input_ids=ids, **{argument: cache}, max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        held = out[:, :-1]  # the last token was generated, not yet run through the model
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        fresh += ids.shape[1]  # what a new cache per turn would have to run
        print(f"user: {turn}\nassistant: {reply.strip()}\n  (cache: {cache.get_seq_length()} tokens; prompt tokens "
              f"run so far {cache.stats()['prefill_tokens']}, with a new cache per turn {fresh})\n", flush=True)

if __name__ == "__main__":
    main()
