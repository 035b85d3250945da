"""Compile a machine's kernels for a model's shapes before its first `generate`.

    python -m oasis_cache.warm path/to/model --context 32768            # once per machine (and per shape)
    python -m oasis_cache.warm path/to/model --context 8192 32768 131072 --batch 4 --token-budget 4096

A process's first `generate` with an OasisCache compiles the package's Triton kernels for its shapes and has the
driver compile cuDNN's attention kernels for the prompt's chunks: on a new machine it takes ~2.3x a later call
(docs/performance.md). Both land in caches on disk — Triton's (`TRITON_CACHE_DIR`, default `~/.triton/cache`) and the
driver's (`CUDA_CACHE_PATH`, default `~/.nv/ComputeCache`) — that every later process on the machine finds. This
runs one `generate` of the model's shapes, so that the machine's first real process finds them there: the first
layers of the model (one of each kind in `layer_types`, else two), random weights, a random prompt of `--context`
tokens, the same cache options. It reads only the model's `config.json`, no weights; a few seconds and the memory of
two layers and the embeddings.

What it cannot carry to the next process: CUDA graphs of the decode steps (each process captures its own) and the
process's own start (CUDA context, cuBLAS handles). Kernels are keyed by shapes, dtype and the cache's options:
warm the context length, batch and options you will run (another context compiles anew where its block count
changes a kernel's specialization).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

__all__ = ["warm", "first_layers"]


def first_layers(config):
    """A copy of `config` (a transformers config) with the fewest first layers, at least two, that hold one of each
    layer kind in `layer_types` (hybrids, sliding windows): up to the first layer of its last new kind."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    keep = max([types.index(kind) + 1 for kind in set(types or ())] + [min(2, text.num_hidden_layers)])
    if types:
        text.layer_types = list(types[:keep])
    text.num_hidden_layers = keep
    return config


def warm(config, context: int | list[int], batch: int = 1, token_budget: int = 2048, dtype: torch.dtype | None = None,
         device: str | torch.device = "cuda", new_tokens: int = 20, **cache_options) -> dict:
    """One `generate` of `config`'s first layers (`first_layers`) with random weights over a random prompt of
    `batch x context` tokens (each of several contexts in turn) and `new_tokens` greedy ones, through
    `OasisCache(model, token_budget=token_budget, **cache_options)`: the kernels a real model of this config compiles
    at its first `generate` in a process, now on disk. `new_tokens` (20) passes a block's completion (16 tokens a
    block). Returns `{"seconds", "layers"}`."""
    from transformers import AutoModelForCausalLM

    from .cache import OasisCache

    contexts = [context] if isinstance(context, int) else list(context)
    if not contexts or min(contexts) < 1 or batch < 1 or new_tokens < 1:
        raise ValueError(f"warm: context, batch and new_tokens must be positive, got {context}, {batch}, {new_tokens}.")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("oasis_cache.warm compiles CUDA kernels and this machine has no CUDA device: nothing to "
                           "warm (device='cpu' runs the same generate on the CPU, which keeps no compiled kernels).")
    small = first_layers(config)
    text = small.get_text_config() if hasattr(small, "get_text_config") else small
    if dtype is None:
        dtype = getattr(text, "dtype", None) or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(text, dtype=dtype).eval()  # (a multimodal config: its text model)
    generator = torch.Generator().manual_seed(0)
    for tokens in contexts:
        ids = torch.randint(0, text.vocab_size, (batch, tokens), generator=generator).to(device)
        cache = OasisCache(model, token_budget=token_budget, **cache_options)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **cache.generate_kwargs())
        del cache
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds": time.perf_counter() - start, "layers": text.num_hidden_layers}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oasis_cache.warm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model directory (its config.json is read), a config.json, or a hub id")
    parser.add_argument("--context", type=int, nargs="+", required=True,
                        help="prompt tokens a sequence, as you will run (several: each in turn)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the config's, else bfloat16)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    from pathlib import Path

    from transformers import AutoConfig

    source = Path(args.model)
    if min(args.context) < 1 or args.batch < 1:
        parser.error("--context and --batch must be positive")
    config = AutoConfig.from_pretrained(str(source.parent if source.name == "config.json" else args.model))
    dtype = getattr(torch, args.dtype, None) if args.dtype else None
    if args.dtype and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        parser.error(f"--dtype {args.dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16, float32)")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: this machine has no CUDA device: nothing to warm (the package's kernels "
                       "compile for CUDA; --device cpu runs the same generate on the CPU, which keeps nothing)\n")
    try:
        done = warm(config, args.context, args.batch, args.token_budget, dtype, args.device)
    except ValueError as error:  # (the cache's options: OasisConfig names what is wrong)
        parser.exit(2, f"{parser.prog}: {error}\n")
    print(f"warmed {type(config).__name__} ({done['layers']} of {config.get_text_config().num_hidden_layers} layers "
          f"run) at {args.batch} x {' / '.join(map(str, args.context))}, token_budget {args.token_budget}, on {args.device}: "
          f"{done['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
