"""`transformers.pipeline("text-generation")` with an OasisCache: the pipeline hands `generate` keyword arguments
through, the cache among them (one cache per call: a pipeline call is a new batch).

    python examples/pipeline.py        # SmolLM2-135M-Instruct, offline; CPU is fine
"""

from __future__ import annotations

import argparse

import torch
from transformers import pipeline

from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.loaders import load_smollm2


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    args = parser.parse_args()
    model, tokenizer = load_smollm2(device=args.device)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    chat = [{"role": "user", "content": "Write one sentence about the Python programming language."}]
    cache = OasisCache(model, token_budget=256)
    result = generator(chat, **{generate_cache_argument(model): cache}, max_new_tokens=args.max_new_tokens,
                       do_sample=False)
    print(result[0]["generated_text"][-1]["content"])
    print(f"\n{cache}")


if __name__ == "__main__":
    main()
