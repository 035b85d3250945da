"""Why `compile_decode` compiles more than one graph for a model's layers (a diagnosis run, this work): a tiny Qwen3 of
10 layers decodes 12 tokens with `compile_decode=True`, printing dynamo's recompilation reasons and graph breaks,
then the count of unique graphs and whether this torch has `torch.compiler.config.dynamic_sources`.

    python bench/recompiles.py            # CUDA if present (captured steps), else CPU
    python bench/recompiles.py --fuse-projections   # the same with `fuse_projections`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import generate, prompt_ids, tiny_model  # noqa: E402

from oasis_cache import OasisCache  # noqa: E402


def main() -> None:
    from torch._dynamo.utils import counters

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuse-projections", action="store_true")
    args = parser.parse_args()

    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    has_sources = "dynamic_sources" in getattr(torch.compiler.config, "_config", {})
    print("torch", torch.__version__, "dynamic_sources:", has_sources, flush=True)
    model = tiny_model("qwen3", num_hidden_layers=10).to(device)
    inputs = {"input_ids": prompt_ids(300, batch=2).to(device)}
    cache = OasisCache(model, compile_decode=True, token_budget=128, recent_tokens=32, lookahead="previous",
                        fuse_projections=args.fuse_projections)
    generate(model, cache, inputs, max_new_tokens=12, do_sample=False)
    print("unique graphs:", counters["stats"]["unique_graphs"], "frames:", dict(counters["frames"]), flush=True)


if __name__ == "__main__":
    main()
