"""Host time of the checks a decode step makes before it runs, on a model's module tree: `ModelState.unchanged()`
(before each replayed step: the model's modules, parameters, buffers and modes as when the steps were captured) and
`ForwardMarks(cache)` (before each forward: what a failed forward would be undone to). Host work only: the module
tree of the named shape with small dimensions (the same modules, parameters and layers; the checks do not read
tensor data), a short prefill on the CPU. A replayed step's host time is its floor, so these add to it directly.

    python bench/step_checks.py --model qwen3-8b
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.models import SHAPES  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.runtime.captured_step import ModelState  # noqa: E402
from oasis_cache.undo import ForwardMarks  # noqa: E402


def small(name: str):
    """The shape's model with its layer count and kinds, its dimensions small."""
    config = SHAPES[name]()
    for field, value in dict(vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32,
                             num_attention_heads=4, num_key_value_heads=2).items():
        if hasattr(config, field):
            setattr(config, field, value)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of `calls` calls, in µs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = small(args.model)
    state = ModelState(model)
    assert state.unchanged()
    cache = OasisCache(model, token_budget=256)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 512, (1, 320)), **cache.generate_kwargs())
    rows = dict(model_state_unchanged=per_call_us(state.unchanged, args.calls, args.repeats),
                forward_marks=per_call_us(lambda: ForwardMarks(cache), args.calls, args.repeats))
    cache.close()
    counts = dict(modules=len(state.modules), tensors=len(state.tensors), references=len(state.objects))
    header = (f"step checks, {args.model}'s module tree ({counts['modules']} modules, {counts['tensors']} parameters "
              f"and buffers), {platform.processor() or platform.machine()}, torch {torch.__version__}, "
              f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    print(header)
    for name, us in rows.items():
        print(f"{name:24} {us:8.1f} µs a call")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(header=header, command="python " + " ".join(sys.argv), counts=counts,
                                                  us_per_call=rows), indent=1))


if __name__ == "__main__":
    main()
