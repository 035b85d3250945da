"""Operators launched per decode step, by lookahead mode: a CPU-side proxy for the launch-bound cost of each mode.

    python tests/tools/op_count.py --layers 8 --modes dense previous eagle3 eagle3-exact
    TRITON_INTERPRET=1 python tests/tools/op_count.py --backend triton --layers 4 --modes previous eagle3-exact
    TRITON_INTERPRET=1 python tests/tools/op_count.py --backend triton --layers 4 --modes dense previous --by-site
    python tests/tools/op_count.py --layers 4 --modes previous --inductor   # what compile_decode's regions compile into

Runs a tiny random Qwen3 (CPU), prefills `--context` tokens, decodes a few steps, then records one decode step
with `torch.profiler` and counts the outermost `aten::` operators (what a GPU step would launch, roughly); `dense` is HF's
SDPA + DynamicCache step, the baseline. Prints the
totals and, for the last mode against the first, the operators whose counts differ. The head for eagle3 is
untrained (counts do not depend on weights).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from conftest import prompt_ids, random_head, tiny_model  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402
from oasis_cache.runtime.build import cache_kwargs


KERNEL = "triton kernel"
_IN_KERNEL = [0]  # > 0 while a wrapped Triton launch runs (what the interpreter does inside it is one launch)
_LAUNCHED = collections.Counter()  # wrapped Triton launches by kernel name
# Operators that launch no kernel on a GPU (views, allocations, metadata), left out of `--by-site`
NO_LAUNCH = {"set_", "empty", "new_empty", "empty_like", "empty_strided", "select", "slice", "expand", "unsqueeze",
             "squeeze", "alias", "view", "_unsafe_view", "_reshape_alias", "reshape", "transpose", "t", "permute",
             "as_strided", "detach", "lift_fresh", "split", "split_with_sizes", "unbind", "narrow",
             "_local_scalar_dense"}


def count_kernels_as_launches() -> None:
    """Wrap the package's Triton kernel launches in a profiler range each, so that what Triton's interpreter runs
    inside them counts as the one launch it is on a GPU."""
    import oasis_cache.kernels.block_scores as scores
    import oasis_cache.kernels.recent_append as append
    import oasis_cache.kernels.slot_assign as assign
    import oasis_cache.kernels.top_k as top_k
    import oasis_cache.memory.transfer as transfer

    for module, name in ((scores, "block_scores"), (assign, "slot_assign"), (transfer, "gather_blocks"),
                         (append, "recent_append"), (top_k, "top_k")):
        def launch(*args, _fn=getattr(module, name), _name=name, **kwargs):
            _LAUNCHED[_name] += not _IN_KERNEL[0]
            _IN_KERNEL[0] += 1
            try:
                with record_function(f"{KERNEL} {_name}"):
                    return _fn(*args, **kwargs)
            finally:
                _IN_KERNEL[0] -= 1
        setattr(module, name, launch)


def decoding(model, ids, mode: str, head, budget: int, backend: str = "torch", warm_steps: int = 3,
             block_size: int = 16, padded: int = 0, store=None):
    """A cache for `mode` (below), prefilled with `ids` `[B, n]` and decoded `warm_steps` steps. Returns `step()`,
    which runs the next decode step (one token, the mask of the whole sequence as `generate` passes it), and the
    cache. `mode`: "dense" (HF's SDPA + DynamicCache, the baseline) or a lookahead, optionally with `-exact` (miss
    repair), e.g. `eagle3-exact` (the default with a head). `padded` > 0: the first sequence's first `padded` tokens
    are left padding, and each step is called as a captured step records it: no mask, each sequence's own
    `position_ids` (the cache reads the padding it recorded at the prefill). `store` (a Mooncake Store client): the
    prefilled cache is published and the decoding continues on the cache admitted from it with its store reads
    deferred (`oasis_cache.remote.admit(deferred=True)`); `step(repair=False)` then leaves out the reads after the
    step (`step.after()` runs them)."""
    if mode == "dense":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        lookahead, _, exact = mode.partition("-")
        draft = dict(draft=head) if lookahead == "eagle3" else {}
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=budget, lookahead=lookahead, exact=exact == "exact",
                                                      backend=backend,
                           block_size=block_size, sink_tokens=block_size, recent_tokens=4 * block_size, **draft)))
    kw = {generate_cache_argument(model): cache, "use_cache": True}
    B, n = ids.shape
    state = {"mask": torch.ones(B, n, dtype=torch.long)}
    state["mask"][0, :padded] = 0
    positions = (state["mask"].cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=state["mask"], position_ids=positions, **kw)
    state["token"] = out.logits[:, -1:].argmax(-1)
    state["position"] = positions[:, -1:]
    after = None
    if store is not None and mode != "dense":
        from oasis_cache.remote import admit, publish

        publish(cache, store, "decoding")
        cache = admit(model, store, "decoding", deferred=True)
        kw[generate_cache_argument(model)] = cache
        after = cache._after_forward.pop()  # the store reads after each step, run by `step` itself

    @torch.no_grad()
    def step(repair: bool = True):
        state["mask"] = torch.cat((state["mask"], torch.ones_like(state["mask"][:, :1])), 1)
        state["position"] = state["position"] + 1
        inputs = dict(position_ids=state["position"]) if padded else dict(attention_mask=state["mask"])
        out = model(input_ids=state["token"], **inputs, **kw)
        state["token"] = out.logits[:, -1:].argmax(-1)
        if repair and after is not None:
            after()

    step.after = after
    for _ in range(warm_steps):
        step()
    return step, cache


def count_ops(model, ids, mode: str, head, budget: int, backend: str = "torch") -> collections.Counter:
    """Outermost operators of one decode step (`decoding`'s modes). `backend="triton"` (under `TRITON_INTERPRET=1`):
    the CUDA path's operators, each kernel launch counted once."""
    step, _ = decoding(model, ids, mode, head, budget, backend)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = collections.Counter()
    for event in prof.events():
        ancestors = []
        parent = event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if any(name.startswith(KERNEL) for name in ancestors):
            continue  # inside an interpreted Triton kernel: one launch on a GPU, counted below
        if event.name.startswith(KERNEL) or (event.name.startswith("aten::") and not (
                ancestors and ancestors[0].startswith("aten::"))):
            counts[event.name] += 1
    return counts


def launches_by_site(model, ids, mode: str, head, budget: int, backend: str = "torch") -> collections.Counter:
    """The operators of one decode step that launch a kernel (not in `NO_LAUNCH`; a Triton launch counted as its
    kernels, not looked into), by the innermost line of `oasis_cache` on the stack: {(site, operator): count}, site
    "model" for the model's own work. `backend="triton"` needs `count_kernels_as_launches()` first."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    sites = collections.Counter()

    class Sites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not _IN_KERNEL[0] and name not in NO_LAUNCH:
                ours = [f for f in traceback.extract_stack() if "oasis_cache/" in f.filename and
                        not f.filename.endswith(("oasis_cache/cache.py", "runtime/captured_step.py"))]
                where = ours[-1] if ours else None
                site = f"{where.filename.split('oasis_cache/')[-1]}:{where.lineno}" if where else "model"
                sites[(site, name)] += 1
            return func(*args, **(kwargs or {}))

    import oasis_cache.layer as layer

    attend = layer.decode_attention  # the Triton decode attention: two launches (split, combine), not looked into

    def decode_attention(*args, **kwargs):
        sites[("kernels/decode_attention.py", "triton kernels split + combine")] += 2
        _IN_KERNEL[0] += 1
        try:
            return attend(*args, **kwargs)
        finally:
            _IN_KERNEL[0] -= 1

    step, _ = decoding(model, ids, mode, head, budget, backend)
    layer.decode_attention = decode_attention
    _LAUNCHED.clear()
    try:
        with torch.no_grad(), Sites():
            step()
    finally:
        layer.decode_attention = attend
    for name, n in _LAUNCHED.items():
        sites[(f"triton {name}", "triton kernel")] += n
    return sites


def inductor_kernels(model, ids, budget: int, steps: int = 3) -> dict:
    """`OasisCache(..., lookahead="previous", compile_decode=True)`: the kernels inductor generates for the decoder
    layers' compiled regions over a few decode steps (its own backend on this device: C++ on a CPU, a proxy for the
    Triton one), the distinct graphs, and the graph breaks between them."""
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.metrics as metrics

    cache = OasisCache(model, token_budget=budget, lookahead="previous", compile_decode=True)
    kw = {generate_cache_argument(model): cache, "use_cache": True}
    with torch.no_grad():
        token = model(input_ids=ids, **kw).logits[:, -1:].argmax(-1)
        metrics.reset()
        dynamo_utils.counters.clear()
        for _ in range(steps):
            token = model(input_ids=token, **kw).logits[:, -1:].argmax(-1)
    return dict(kernels=metrics.generated_kernel_count, graphs=dynamo_utils.counters["stats"]["unique_graphs"],
                graph_breaks=sum(dynamo_utils.counters["graph_break"].values()))


def step_arguments(parser, layers: int, modes: list[str]):
    """The options of the CPU step tools (this one, `capture_audit.py`): the tiny model, its prompt, the modes."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16, help="block size T (sink T tokens, recent 4T)")
    parser.add_argument("--modes", nargs="+", default=modes)
    parser.add_argument("--by-site", action="store_true",
                        help="also: the last mode's kernel-launching operators by the package line that issues them")
    parser.add_argument("--inductor", action="store_true",
                        help="also: what compile_decode compiles (`previous`): inductor's kernels, graphs, breaks")
    parser.add_argument("--backend", choices=["torch", "triton"], default="torch",
                        help="triton: the CUDA path's operators, run with TRITON_INTERPRET=1 on CPU")
    args = parser.parse_args()
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--backend triton runs on CPU through Triton's interpreter: prefix the command with "
                     "TRITON_INTERPRET=1")
    return args


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = step_arguments(parser, 8, ["none", "previous", "eagle3"])
    if args.backend == "triton":
        count_kernels_as_launches()
    model = tiny_model("qwen3", num_hidden_layers=args.layers)
    head, ids = random_head(model), prompt_ids(args.context)
    counts = {mode: count_ops(model, ids, mode, head, args.budget, args.backend) for mode in args.modes}
    print(f"outermost aten ops in one decode step, {args.layers} layers, context {args.context}, "
          f"{args.backend} backend:")
    for mode, c in counts.items():
        print(f"  {mode:10} {sum(c.values()):6}  ({sum(c.values()) / args.layers:.1f} per layer)")
    first, last = args.modes[0], args.modes[-1]
    a, b = counts[first], counts[last]
    print(f"\n{first} -> {last}, operators whose counts differ:")
    for name in sorted(set(a) | set(b), key=lambda n: a[n] - b[n]):
        if a[name] != b[name]:
            print(f"  {name:36} {a[name]:5} -> {b[name]:5} ({b[name] - a[name]:+d})")
    if args.by_site:
        sites = launches_by_site(model, ids, last, head, args.budget, args.backend)
        ours = {key: n for key, n in sites.items() if key[0] != "model"}
        print(f"\n{last}: {sum(sites.values())} kernel-launching operators in one step (Triton launches included), "
              f"{sum(sites.values()) - sum(ours.values())} of them the model's own, {sum(ours.values())} the "
              f"package's, by line:")
        for (site, name), n in sorted(ours.items(), key=lambda item: -item[1]):
            print(f"  {n:4} {name:24} {site}")
    if args.inductor:
        found = inductor_kernels(model, ids, args.budget)
        print(f"\ncompile_decode, {args.layers} layers: {found['kernels']} kernels generated in {found['graphs']} "
              f"distinct graphs, {found['graph_breaks']} graph breaks (the cache's update and the oasis attention)")


if __name__ == "__main__":
    main()
