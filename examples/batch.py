"""A batch of documents of different lengths, one question each, in one left-padded `generate` through one
OasisCache (budget below the shortest document: every answer is decoded sparsely).

    python examples/batch.py           # SmolLM2-135M-Instruct, offline; CPU is fine
"""

from __future__ import annotations

import argparse

import torch

from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.loaders import load_smollm2

FACTS = [("The vault code is 4172.", "What is the vault code?"),
         ("The ship's cat is called Marmalade.", "What is the ship's cat called?"),
         ("The meeting moved to Thursday.", "On which day is the meeting?")]


def document(tokenizer, n_tokens: int, fact: str, seed: int) -> str:
    """Python's own documentation (`pydoc_data.topics`, PSF licence), `n_tokens` long, with `fact` in the middle."""
    import pydoc_data.topics as topics

    text = "\n\n".join(list(topics.topics.values())[seed * 50:])
    filler = tokenizer.decode(tokenizer(text)["input_ids"][:n_tokens])
    cut = filler.find(". ", len(filler) // 2) + 2
    return filler[:cut] + fact + " " + filler[cut:]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs=3, default=[1500, 1000, 1200], help="document tokens")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    model, tokenizer = load_smollm2(device=args.device)
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": document(tokenizer, n, fact, i) + "\n\n" + question}],
        tokenize=False, add_generation_prompt=True) for i, (n, (fact, question)) in enumerate(zip(args.lengths, FACTS))]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(args.device)
    cache = OasisCache(model, token_budget=args.budget)
    out = model.generate(**inputs, **{generate_cache_argument(model): cache}, max_new_tokens=args.max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.eos_token_id)
    for (fact, question), row in zip(FACTS, out[:, inputs["input_ids"].shape[1]:]):
        print(f"{question}\n  -> {tokenizer.decode(row, skip_special_tokens=True).strip()!r}   (planted: {fact!r})")
    print(f"\n{cache}")


if __name__ == "__main__":
    main()
