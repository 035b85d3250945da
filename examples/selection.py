"""The picture of what OasisCache attends: SmolLM2-135M-Instruct answers a question about a long document (the demo's,
the fact in the middle) while every decode step's selection is recorded; drawn as decode step x context position.

    python examples/selection.py --out selection.png     # offline; CPU is fine (about a minute)
"""

from __future__ import annotations

import argparse

import torch

from demo import PRIMER, QUESTION, long_document
from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.loaders import load_smollm2
from oasis_cache.plot import record, selection


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--layer", type=int, default=None, help="one layer (default: the mean over every layer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="selection.png")
    args = parser.parse_args()
    model, tokenizer = load_smollm2(device=args.device)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": long_document(tokenizer, args.context) + "\n\n" + QUESTION}],
        tokenize=False, add_generation_prompt=True) + PRIMER
    inputs = tokenizer(prompt, return_tensors="pt").to(args.device)
    n = inputs["input_ids"].shape[1]
    cache = OasisCache(model, token_budget=args.budget)
    with record(cache) as rec:
        out = model.generate(**inputs, **{generate_cache_argument(model): cache}, max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, n:], skip_special_tokens=True).strip()
    fact_at = len(tokenizer(prompt[: prompt.find("The best thing to do in San Francisco is eat")])["input_ids"])
    selection(rec, layer=args.layer, path=args.out,
              title=f"SmolLM2-135M, {n}-token prompt (the fact at token ~{fact_at}), budget {args.budget}, "
                    f"lookahead {cache.config.lookahead!r}")
    print(f"answer: {PRIMER} {answer!r}\nthe planted fact starts near token {fact_at}; picture: {args.out}")


if __name__ == "__main__":
    main()
