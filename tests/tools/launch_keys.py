"""Which of the package's Triton kernels compile at which forward of a `generate` (run on the CPU under Triton's
interpreter): each launch's specialization as Triton's JIT computes it on the GPU (argument types, 16-byte alignment
and divisibility by 16 of pointers and ints, ints equal to 1, constexpr values), and the forward where each kernel
first meets each one. A new specialization is a compilation on the GPU: ~0.2-2 s each on a machine without the
kernels on disk, and a
load from disk elsewhere. Compiling them ahead needs to know them; a decode step meeting a new one late (an int
whose divisibility changes as blocks complete) would stall a long generation.

    TRITON_INTERPRET=1 python tests/tools/launch_keys.py                          # tiny qwen3, prompt 500, 40 tokens
    TRITON_INTERPRET=1 python tests/tools/launch_keys.py --lookahead none --prompt 300 --batch 2
    TRITON_INTERPRET=1 python tests/tools/launch_keys.py --check   # exit 1 if a kernel meets a new specialization after
                                                            # the first step that completes a block (CPU test)

    python tests/tools/launch_keys.py --model qwen3-8b --prompt 32768 --new-tokens 40   # on CUDA: the real launches
                                # (`JITFunction.run`), each first one timed (its compilation, or its load from disk)

Prints, per kernel, its specializations and the forward (1: the prefill) where each first appeared (on CUDA with the
seconds its first launch took), and how a later one differs from the first. Without the interpreter the eager path
and the captured steps both run (the CPU has no captured steps: on a fresh H200 machine decode step 16 still took
2.4 s, where the interpreter's run meets nothing new past step 1).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]


class LaunchKeys:
    """Records `(kernel, specialization) -> first forward` for interpreted launches while active (`with`)."""

    def __init__(self):
        self.first_seen: dict = collections.OrderedDict()
        self.seconds: dict = {}  # (kernel, key) -> its first launch's host time (CUDA: the compilation or load)
        self.ahead: set = set()  # (kernel, key) first met as a warm-up (compiled, not run: `kernels/ahead.py`)
        self.first_run: dict = {}  # kernel -> the forward of its first real launch (not a warm-up)
        self.forward = 0

    def key(self, kernel, args, kwargs) -> tuple:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        signature = inspect.signature(kernel.fn)
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
        bound.apply_defaults()
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in signature.parameters))
        parts = []
        for name, param in signature.parameters.items():
            value = bound.arguments[name]
            if "constexpr" in str(param.annotation):
                parts.append((name, "constexpr", getattr(value, "value", value)))
            else:
                parts.append((name, native_specialize_impl(BaseBackend, value, False, True, True)))
        return tuple(parts) + options

    def _kind(self):
        import os

        from triton.runtime import interpreter, jit

        return interpreter.InterpretedFunction if os.environ.get("TRITON_INTERPRET") == "1" else jit.JITFunction

    def __enter__(self):
        import time

        kind = self._kind()
        self.run = kind.run
        keys = self

        def run(kernel, *args, grid, warmup, **kwargs):
            key = (kernel.fn.__name__, keys.key(kernel, args, kwargs))
            if not warmup:
                keys.first_run.setdefault(key[0], keys.forward)
            if key in keys.first_seen:
                return keys.run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            keys.first_seen[key] = keys.forward
            if warmup:
                keys.ahead.add(key)
            start = time.perf_counter()
            try:
                return keys.run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                keys.seconds[key] = time.perf_counter() - start

        kind.run = run
        return self

    def __exit__(self, *exc):
        self._kind().run = self.run

    def count_forwards(self, model):
        """Number the forwards of `model` (1: the first, a prefill)."""
        return model.register_forward_pre_hook(lambda module, args: setattr(self, "forward", self.forward + 1))

    def by_kernel(self) -> dict:
        """kernel name -> [(first forward, specialization)], in order of appearance."""
        out = collections.defaultdict(list)
        for (name, key), forward in self.first_seen.items():
            out[name].append((forward, key))
        return dict(out)


def record(lookahead: str = "previous", prompt: int = 500, new_tokens: int = 40, batch: int = 1,
           budget: int = 128, model_name: str | None = None, compile_ahead: bool = False,
           prefill_chunk: int | None = None, ahead_at_prefill: bool = False) -> LaunchKeys:
    """A `generate` with backend="triton", its launches recorded: the tiny qwen3 of `tests/conftest.py` (on the CPU,
    recent_tokens 32), or `model_name` from `bench/models.py` on CUDA (random bf16 weights, the package's defaults).
    `compile_ahead`: with the option (a dry first decode step compiles its kernels); the greedy tokens are kept in
    `keys.tokens`. `prefill_chunk`: the cache's `prefill_chunk_tokens` (None: its default). `ahead_at_prefill`: the
    dry step's compilations started during the prefill (`OasisConfig.ahead_at_prefill`)."""
    import torch

    from conftest import generate, prompt_ids, tiny_model
    from oasis_cache import OasisCache
    from oasis_cache.runtime.build import cache_kwargs

    if model_name is None:
        model, options = tiny_model("qwen3"), dict(recent_tokens=32)
    else:
        sys.path.insert(0, str(HERE.parent.parent / "bench"))
        from models import load_model

        model, _ = load_model(model_name, "cuda", torch.bfloat16)
        options = {}
    if prefill_chunk is not None:
        options["prefill_chunk_tokens"] = prefill_chunk
    keys = LaunchKeys()
    hook = keys.count_forwards(model)
    options.update(backend="triton", compile_ahead=compile_ahead, ahead_at_prefill=ahead_at_prefill)
    cache = OasisCache(model, **cache_kwargs(dict(options, token_budget=budget, lookahead=lookahead)))
    with keys:
        ids = prompt_ids(prompt, batch=batch)
        keys.tokens = generate(model, cache, {"input_ids": ids.to(model.device)}, max_new_tokens=new_tokens,
                               do_sample=False)
    hook.remove()
    return keys


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookahead", default="previous", choices=["none", "previous"])
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="the cache's prefill_chunk_tokens (a prefill in chunks; default: the package's)")
    parser.add_argument("--model", default=None, help="a bench/models.py name (CUDA; default: the tests' tiny qwen3)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a specialization first appears after the first forward that completes a "
                             "block (the store kernel's first): those steps must replay what is compiled")
    parser.add_argument("--compile-ahead", action="store_true",
                        help="with compile_ahead=True: a dry first decode step compiles its kernels (marked 'ahead'); "
                             "with --check, every kernel a decode step meets must have been compiled ahead, and the "
                             "greedy tokens must equal a run without the option")
    parser.add_argument("--ahead-at-prefill", action="store_true",
                        help="with --compile-ahead: ahead_at_prefill=True (the compilations start during the prefill)")
    args = parser.parse_args()
    keys = record(args.lookahead, args.prompt, args.new_tokens, args.batch, args.budget, args.model,
                  args.compile_ahead, args.prefill_chunk, args.ahead_at_prefill)
    kernels = keys.by_kernel()
    for name, seen in kernels.items():
        timed = [f"{forward} ({keys.seconds[name, key]:.2f} s{', ahead' if (name, key) in keys.ahead else ''})"
                 for forward, key in seen]
        print(f"{name}: {len(seen)} specialization(s), first at forward(s) {', '.join(timed)}")
        for forward, key in seen[1:]:
            print(f"   at forward {forward}, unlike the first: {[b for a, b in zip(seen[0][1], key) if a != b]}")
    if args.check:
        completing = keys.first_run["_store_block_kernel"]  # (a decode step completed a block: KeyError if none did)
        late = [(name, forward) for name, seen in kernels.items() for forward, _ in seen if forward > completing]
        print(f"first completing forward {completing} of {keys.forward}; late specializations: {late or 'none'}")
        failed = bool(late) or keys.forward < completing + 16
        if args.compile_ahead:  # every decode step's kernels (the first, the first completing one, ...): compiled
            # ahead, none met first by a real launch
            first = [(name, forward) for name, seen in kernels.items() for forward, key in seen
                     if forward >= 2 and (name, key) not in keys.ahead]
            from oasis_cache.runtime import ahead

            print(f"dry step: {'ran' if 'total_s' in ahead.LAST else 'none'}"
                  f"{' at the prefill' if args.ahead_at_prefill and 'copy_s' in ahead.LAST else ''}")
            plain = record(args.lookahead, args.prompt, args.new_tokens, args.batch, args.budget, args.model,
                           prefill_chunk=args.prefill_chunk)
            same = torch.equal(*(getattr(run.tokens, "sequences", run.tokens) for run in (keys, plain)))
            print(f"not compiled ahead, met by a decode step: {first or 'none'}; "
                  f"tokens as without the option: {same}")
            failed |= bool(first) or not same
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
