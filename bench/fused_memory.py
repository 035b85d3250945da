"""Device memory through the first compiled decode steps, with and without `fuse_projections` (CUDA).

    python bench/fused_memory.py --layers 4            # Qwen3-8B's layer shape, 4 layers, 4K prompt, 6 tokens
    python bench/fused_memory.py --layers 36 --history  # and where the largest blocks alive after the run came from

earlier `bench/decode.py` rows showed a fused compiled run's decode peak 16.8 GiB above the unfused one
(Qwen3-8B, 32K and 128K: twice the fused groups' 8.4 GiB) — a rise inside one step. Here each mode runs alone
(`compile_decode=True`, `lookahead="previous"`, the other options the package's), one after the other in this
process (the unfused first: its weights are the model's own), through `model.generate`; printed per new token: the
allocated bytes and the peak since the token before (GiB). With `--history`, the allocator records each block's
Python frames (`torch.cuda.memory._record_memory_history`) and the largest blocks still allocated after the fused
run are printed with the innermost frames outside torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


def largest_blocks(snapshot: dict, top: int = 8) -> list[str]:
    """The `top` largest allocated blocks of an allocator snapshot: size and the innermost frames outside torch."""
    blocks = []
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in block.get("frames", [])
                          if "/torch/" not in f["filename"] and f["filename"].endswith(".py")]
                blocks.append((block["size"], frames[:4]))
    blocks.sort(key=lambda b: -b[0])
    return [f"{size / 2**30:7.3f} GiB  " + " < ".join(frames) for size, frames in blocks[:top]]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    from models import SHAPES
    from oasis_cache import OasisCache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the shape's own count: 0)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--history", action="store_true", help="record the blocks' frames (slower)")
    args = parser.parse_args()
    config = SHAPES[args.model]()
    if args.layers:  # (a config made with the count: its per-layer lists follow it)
        config = type(config)(**{**config.to_dict(), "num_hidden_layers": args.layers, "layer_types": None})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    vocab = config.vocab_size
    gib = 2**30
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.model} x {model.config.num_hidden_layers} layers, weights {weights / gib:.2f} GiB; "
          f"{torch.__version__}", flush=True)
    ids = torch.randint(0, vocab, (1, args.context), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    class Memory(StoppingCriteria):
        def __init__(self):
            self.rows = []

        def __call__(self, input_ids, scores, **kwargs):
            torch.cuda.synchronize()
            self.rows.append((torch.cuda.memory_allocated() / gib, torch.cuda.max_memory_allocated() / gib))
            torch.cuda.reset_peak_memory_stats()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    for fuse in (False, True):
        if fuse and args.history:
            torch.cuda.memory._record_memory_history(max_entries=200000)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() / gib
        cache = OasisCache(model, token_budget=2048, lookahead="previous", compile_decode=True,
                           fuse_projections=fuse)
        made = torch.cuda.memory_allocated() / gib
        clock = Memory()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, stopping_criteria=[clock],
                       **cache.generate_kwargs())
        print(f"fuse_projections={fuse}: allocated {start:.2f} GiB before the cache, {made:.2f} once made; per new "
              "token (allocated / peak since the one before): "
              + ", ".join(f"{a:.2f}/{p:.2f}" for a, p in clock.rows), flush=True)
        if fuse and args.history:
            for line in largest_blocks(torch.cuda.memory._snapshot()):
                print("   " + line, flush=True)
            torch.cuda.memory._record_memory_history(enabled=None)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
