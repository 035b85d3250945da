"""Device KV bytes of OasisCache against dense KV, by pool, for a model shape's KV geometry: counted, not timed, so a
CPU run gives what the GPU holds (the pools' sizes do not depend on the device; fp8 levels, as on an H200).

    python bench/kv_bytes.py --model qwen3-8b --context 32768 --budget 2048 --options summary_channels=1.0 ""

A one-layer model with the shape's KV heads, query heads per KV head and head size (every layer holds the same bytes,
so the ratio is the model's), a prefill of random tokens in chunks, then `--steps` decode steps (past a block
completion: the summaries' capacity grows then, as in the decode benchmark's runs). Per option set (`name=value`
pairs, OasisCache options; "" = the defaults): working set, summaries, slot map, their total, dense K+V of the same
tokens in the model's dtype, and the ratio. Writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import SHAPES  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402


def one_layer_model(shape: str, dtype: torch.dtype):
    """The shape's attention geometry (KV heads, query heads per KV head, head size) in one layer, small elsewhere."""
    config = SHAPES[shape]()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    config.update(dict(num_hidden_layers=1, hidden_size=256, intermediate_size=256, vocab_size=512, head_dim=head_dim,
                       num_attention_heads=config.num_key_value_heads * group))
    if getattr(config, "layer_types", None):  # (transformers 5.17 keeps the list made for the full depth)
        config.layer_types = config.layer_types[:1]
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def parse_options(text: str) -> dict:
    options = {}
    for pair in text.split():
        name, _, value = pair.partition("=")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return options


@torch.no_grad()
def measure(model, options: dict, args) -> dict:
    cache = OasisCache(model, token_budget=args.budget, **options)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context))
    passing = {generate_cache_argument(model): cache, "use_cache": True}  # past_key_values= or cache=
    for start in range(0, args.context, args.prefill_chunk):
        out = model(input_ids=ids[:, start : start + args.prefill_chunk], **passing)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(args.steps):
        token = model(input_ids=token, **passing).logits[:, -1:].argmax(-1)
    held = cache.device_nbytes()
    layer = cache.layers[0]
    tokens = args.context + args.steps
    dense = 2 * args.batch * layer.num_kv_heads * tokens * layer.head_dim * model.dtype.itemsize
    total = sum(held.values())
    return dict(options=options, tokens=tokens, **{f"{k}_bytes": v for k, v in held.items()}, total_bytes=total,
                dense_bytes=dense, ratio=total / dense,
                summary_blocks_capacity=layer.summaries.capacity_blocks, blocks=layer.pool.num_blocks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", choices=[s for s in SHAPES if s != "tiny"] + ["tiny"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--options", nargs="+", default=[""])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = one_layer_model(args.model, torch.bfloat16)
    rows = [measure(model, parse_options(text), args) for text in args.options]
    print(f"{args.model} KV geometry, {args.context} x {args.batch} + {args.steps} decode steps, budget {args.budget}")
    print(f"{'options':28s} {'working set':>12s} {'summaries':>10s} {'slot map':>9s} {'total':>10s} {'dense':>11s} "
          f"{'ratio':>7s}")
    for r in rows:
        name = " ".join(f"{k}={v}" for k, v in r["options"].items()) or "(defaults)"
        print(f"{name:28s} {r['working_set_bytes']:12d} {r['summaries_bytes']:10d} {r['slot_map_bytes']:9d} "
              f"{r['total_bytes']:10d} {r['dense_bytes']:11d} {100 * r['ratio']:6.2f}%")
    out = args.out or (f"bench/results/kv-bytes-{args.model}-{args.context // 1024}k-b{args.batch}-"
                       f"{datetime.date.today().isoformat()}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(model=args.model, context=args.context, batch=args.batch, budget=args.budget, steps=args.steps,
                machine=platform.node(), torch=torch.__version__, date=datetime.datetime.now().isoformat())
    Path(out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
