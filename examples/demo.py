"""Demo: a long document with one planted fact, a question, and the answers of dense attention and of OasisCache
side by side, with what the cache did. Runs offline on SmolLM2-135M-Instruct (CPU is fine).

    python examples/demo.py --context 4000 --budget 512
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

import oasis_cache  # noqa: F401  (registers the "oasis" attention)
from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.loaders import load_smollm2

FACT = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
PRIMER = "The best thing to do in San Francisco is"


def long_document(tokenizer, n_tokens: int) -> str:
    """Python's own documentation (`pydoc_data.topics`, shipped with Python, PSF licence) with FACT in the middle."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics.values())
    ids = tokenizer(text)["input_ids"][:n_tokens]
    filler = tokenizer.decode(ids)
    cut = filler.find(". ", len(filler) // 2) + 2  # a sentence boundary in the middle
    return filler[:cut] + FACT + " " + filler[cut:]


def answer(model, tokenizer, inputs, cache, max_new_tokens):
    start = time.perf_counter()
    cache_argument = {generate_cache_argument(model): cache}  # `cache=` where generate takes it, else past_key_values
    out = model.generate(**inputs, **cache_argument, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    seconds = time.perf_counter() - start
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4000, help="document tokens (SmolLM2 handles up to ~8K)")
    parser.add_argument("--budget", type=int, default=512, help="OasisCache token_budget")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    print(f"loading SmolLM2-135M-Instruct on {args.device} ...", flush=True)
    model, tokenizer = load_smollm2(device=args.device)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": long_document(tokenizer, args.context) + "\n\n" + QUESTION}],
        tokenize=False,
        add_generation_prompt=True,
    ) + PRIMER
    inputs = {k: v.to(args.device) for k, v in tokenizer(prompt, return_tensors="pt").items()}
    n = inputs["input_ids"].shape[1]
    print(f"prompt: {n} tokens, the fact is in the middle; question: {QUESTION!r}\n", flush=True)

    model.set_attn_implementation("sdpa")
    print("dense attention (a DynamicCache) is answering ...", flush=True)
    dense_text, dense_s = answer(model, tokenizer, inputs, DynamicCache(config=model.config), args.max_new_tokens)
    cache = OasisCache(model, token_budget=args.budget)
    print(f"OasisCache(token_budget={args.budget}) is answering ...\n", flush=True)
    oasis_text, oasis_s = answer(model, tokenizer, inputs, cache, args.max_new_tokens)

    print(f"{'':8}{PRIMER + ' ...':62}  seconds")
    print(f"{'dense':8}{dense_text.strip()[:60]!r:62}  {dense_s:6.1f}")
    print(f"{'oasis':8}{oasis_text.strip()[:60]!r:62}  {oasis_s:6.1f}")
    key = FACT.split(" is ", 1)[1].rstrip(".")  # "eat a sandwich and sit in Dolores Park on a sunny day"
    for name, text in (("dense", dense_text), ("oasis", oasis_text)):
        print(f"{name} answer contains the planted fact: {'yes' if key in text else 'no'}")
    print(compare(dense_text, oasis_text))

    stats = cache.stats()
    per_step, steps = stats["tokens_attended_per_step"], stats["decode_steps"]
    dense_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * n * next(model.parameters()).element_size()
    print(f"\nWhat OasisCache did: the whole {n}-token prompt went to host memory in blocks of {cache.config.block_size} "
          f"tokens. At each of the {steps} answer steps, every layer attended about {per_step:.0f} tokens "
          f"({per_step / n:.0%} of the prompt): the first tokens, the newest ones, and the blocks whose keys scored "
          f"highest against the step's query. It moved {stats['blocks_fetched_per_step']:.1f} blocks per step and "
          f"head from host memory ({stats['blocks_prefetched'] / max(1, stats['blocks_fetched']):.0%} of them ahead "
          f"of time, predicted by {cache.config.lookahead!r}); {stats['hit_rate']:.0%} of the blocks a step needed "
          f"were already on the device.")
    print(f"Memory: {stats['device_bytes'] / 2**20:.1f} MiB on the {args.device} for the cache, "
          f"{stats['host_bytes'] / 2**20:.1f} MiB of host memory, taken by chunks of "
          f"{cache.config.host_chunk_blocks * cache.config.block_size} tokens (a dense cache of this prompt: "
          f"{dense_bytes / 2**20:.1f} MiB, all on the device).")
    if args.device == "cpu":
        print("On a CPU, OasisCache is not faster than dense at this size: it exists to keep long contexts off a "
              "GPU's memory; CPU runs show that it works and what it selects.")
    print(f"\n{cache}")


def compare(dense_text: str, oasis_text: str) -> str:
    """The two answers compared in words."""
    if dense_text == oasis_text:
        return "The two answers are identical."
    if dense_text.split() == oasis_text.split():
        return "The two answers have the same words (they differ only in spacing)."
    a, b = dense_text.split(), oasis_text.split()
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"The two answers share their first {same} words, then differ: with a budget below the context, sparse "
            f"attention may pick other words.")


if __name__ == "__main__":
    main()
