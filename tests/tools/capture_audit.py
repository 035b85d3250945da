"""What stands between a decode step and a CUDA graph, found on the CPU.

    python tests/tools/capture_audit.py --modes dense previous eagle3-exact
    TRITON_INTERPRET=1 python tests/tools/capture_audit.py --backend triton --modes previous [--completing]

A graph captured at one step replays, at the next, exactly the operators it recorded: the same shapes, the same
scalar arguments (slice ends, sizes, offsets), the same kernel grids; every value that changes must come from a
tensor. So: run a tiny random Qwen3 (`tests/tools/op_count.py`'s setup: prefill, a few decode steps, the 2D mask grown as
`generate` grows it), record every aten operator (and, with `--backend triton`, every launch of the package's
kernels with its arguments) of two consecutive decode steps that complete no block, and compare them. Reported:
- host syncs (`.item()` and other operators whose output size or value the host must read): a graph cannot hold them;
- whether both steps ran the same operators in the same order (else a Python branch depends on the step);
- the operators whose shapes or scalar arguments differ, grouped by where they are called (the innermost frame in
  `oasis_cache` or `transformers`): what must move to fixed-capacity buffers and device-side counters.
`--completing` compares two consecutive steps that complete a block (16 steps apart), each after
`replay.prepare_step(OasisCache, "completing")` as the captured forward calls it: what the completing step's own graph
replays (its offload and summary must read the block number on the device, not a host value). `--steady-too` also
records two steady steps between those two (one decoding for both audits: what the tests run).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from oasis_cache.runtime import replay
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from conftest import prompt_ids, random_head, tiny_model  # noqa: E402
from op_count import decoding, step_arguments  # noqa: E402

HOST_SYNCS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2",
              "aten.is_nonzero", "aten.equal", "aten.repeat_interleave"}  # repeat_interleave: with tensor repeats
OUR_KERNELS = (("oasis_cache.kernels.block_scores", "block_scores"), ("oasis_cache.kernels.slot_assign", "slot_assign"),
               ("oasis_cache.memory.transfer", "gather_blocks"), ("oasis_cache.memory.transfer", "store_block"),
               ("oasis_cache.layer", "decode_attention"), ("oasis_cache.kernels.recent_append", "recent_append"),
               ("oasis_cache.kernels.top_k", "top_k"))


@dataclass(frozen=True)
class Op:
    name: str
    signature: tuple  # tensors as (shape, dtype), other arguments as they are
    site: str  # file:line (function) of the innermost frame in oasis_cache, transformers or the tools


def describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, describe(v)) for k, v in sorted(value.items()))
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    return str(value)  # dtypes, devices, layouts, memory formats


def call_site() -> str:
    for frame in reversed(traceback.extract_stack()):
        if frame.filename == __file__:
            continue
        path = frame.filename.replace(os.sep, "/")
        for package in ("/oasis_cache/", "/transformers/", "/tests/tools/"):  # tools: the caller (the growing mask)
            if package in path:
                return f"{package.strip('/')}/{path.split(package, 1)[1]}:{frame.lineno} ({frame.name})"
    return "?"


class Recorder(TorchDispatchMode):
    """Every aten operator run while active, with its signature and call site (`ops`)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.in_kernel = False  # inside a kernel launch run by Triton's interpreter: its own tensor work is no op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_kernel:
            self.ops.append(Op(f"aten.{func.overloadpacket.__name__}", describe((args, kwargs)), call_site()))
        return func(*args, **kwargs)


def record_kernel_launches(recorder_of) -> None:
    """The package's Triton kernels as recorded operators too (their grids follow from their arguments' shapes and
    scalars). `recorder_of()`: the active `Recorder` or None."""
    import importlib

    for module_name, name in OUR_KERNELS:
        module = importlib.import_module(module_name)

        def launch(*args, _fn=getattr(module, name), _name=name, **kwargs):
            recorder = recorder_of()
            if recorder is None:
                return _fn(*args, **kwargs)
            recorder.ops.append(Op(f"triton {_name}", describe((args, kwargs)), call_site()))
            recorder.in_kernel = True
            try:
                return _fn(*args, **kwargs)
            finally:
                recorder.in_kernel = False

        setattr(module, name, launch)


def audit(model, ids, mode, head, budget, backend, state, completing=False, block_size=16, steady_too=False,
          padded=0, store=None) -> dict:
    """Findings for two consecutive steps (`completing`: two that each complete a block; with `steady_too`, also two
    steady steps recorded between them, under `result["steady"]`: one decoding for both audits; `padded`: a batch of
    two whose first sequence starts with that many padding tokens, `op_count.decoding`; `store`: on a cache
    admitted from it, store reads deferred — recorded are the steps, not the reads after them)."""
    if padded:
        ids = ids.expand(2, -1).clone()
    step, cache = decoding(model, ids, mode, head, budget, backend, warm_steps=0, block_size=block_size,
                           padded=padded, store=store)
    if getattr(cache, "ride_along", None) is not None:  # the head's static decode call, as CUDA replays it
        cache.ride_along.static_head = "eager"
    for _ in range(2):
        step()
    T = getattr(getattr(cache, "config", None), "block_size", 16)
    if completing:  # past the first completions (capacities grow there), to the step before the next one
        for _ in range(2 * T):
            step()
        while cache.get_seq_length() % T != T - 1:
            step()
    else:
        while cache.get_seq_length() % T in (0, T - 1, T - 2):  # the two recorded steps must complete no block
            step()
    runs, steady_runs = [], []
    for index in range(2):
        if completing:
            assert replay.completing_step(cache)
            replay.prepare_step(cache, "completing")
        runs.append(record(state, step))
        if completing and index == 0 and steady_too:  # two steady steps between the two completing ones
            step()  # (to a length that is neither a block's end nor the one before)
            steady_runs = [record(state, step), record(state, step)]
            while cache.get_seq_length() % T != T - 1:
                step()
            continue
        for _ in range(T - 1 if completing else 0):  # to the next completing step
            step()
    result = compare(*runs)
    if steady_runs:
        result["steady"] = compare(*steady_runs)
    padding = cache.context.padding  # the steps read the prompt's recorded padding (`padded`)
    links = [layer.pool.remote for layer in getattr(cache, "layers", []) if getattr(layer, "pool", None) is not None
             and layer.pool.remote is not None]
    for part in (result, result.get("steady")):
        if part is not None:
            part["padding_recorded"] = padding is not None and padding.tokens is not None
            # (`store`: every layer's prefetches left records for the reads after the step)
            part["deferred_records"] = bool(links) and all(link.deferred and link.pending for link in links)
    return result


def record(state, step) -> list:
    """The operators (and kernel launches) of one `step()`."""
    state["recorder"] = Recorder()
    with state["recorder"]:
        step(repair=False)  # (an admitted cache's store reads after the step are not part of it)
    ops = state["recorder"].ops
    state["recorder"] = None
    if step.after is not None:
        step.after()
    return ops


def compare(first, second) -> dict:
    syncs = collections.Counter(op.site for op in first if op.name in HOST_SYNCS)
    same_order = [op.name for op in first] == [op.name for op in second]
    differing = collections.Counter()
    if same_order:
        for a, b in zip(first, second):
            if a.signature != b.signature:
                differing[(a.site, a.name)] += 1
    else:
        for i, (a, b) in enumerate(zip(first, second)):
            if a.name != b.name:
                differing[(f"first divergence at op {i}: {a.site} vs {b.site}", f"{a.name} / {b.name}")] += 1
                break
    return dict(ops=(len(first), len(second)), syncs=syncs, same_order=same_order, differing=differing)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the findings here")
    parser.add_argument("--completing", action="store_true", help="two steps that each complete a block")
    parser.add_argument("--padded", type=int, default=0,
                        help="a batch of two, the first sequence left-padded by this many tokens, each step called "
                             "without a mask as a captured step is")
    parser.add_argument("--steady-too", action="store_true",
                        help="with --completing: also two steady steps between them (reported as '<mode> steady')")
    parser.add_argument("--admitted", action="store_true",
                        help="decode on a cache admitted from a Mooncake Store started here (store reads deferred)")
    args = step_arguments(parser, 4, ["dense", "previous", "eagle3-exact"])
    state = {"recorder": None}
    if args.backend == "triton":
        record_kernel_launches(lambda: state["recorder"])
    model = tiny_model("qwen3", num_hidden_layers=args.layers)
    head, ids = random_head(model), prompt_ids(args.context)
    kind = "steps that complete a block" if args.completing else "decode steps"
    print(f"two consecutive {kind}, tiny Qwen3 of {args.layers} layers, context {args.context}, "
          f"{args.backend} backend")
    findings = {}
    with contextlib.ExitStack() as stack:  # the store, with --admitted
        store = None
        if args.admitted:
            from oasis_cache.remote import connect, local_store

            store = connect(stack.enter_context(local_store()))
            stack.callback(store.close)  # (before the store stops: callbacks run last in, first out)
        for mode in args.modes:
            result = audit(model, ids, mode, head, args.budget, args.backend, state, args.completing, args.block_size,
                           args.steady_too and args.completing, args.padded, store)
            for name, part in ((mode, result), (f"{mode} steady", result.get("steady"))):
                if part is None:
                    continue
                findings[name] = dict(ops=part["ops"], same_order=part["same_order"], syncs=dict(part["syncs"]),
                                      padding_recorded=part["padding_recorded"],
                                  deferred_records=part["deferred_records"],
                                      differing=[dict(site=site, op=op, count=n)
                                                 for (site, op), n in sorted(part["differing"].items())])
                differing, syncs = part["differing"], part["syncs"]
                print(f"\n== {name}: {part['ops'][0]} / {part['ops'][1]} operators, same order: {part['same_order']}, "
                      f"host syncs: {sum(syncs.values())}, operators that differ: {sum(differing.values())}")
                for site, n in syncs.most_common():
                    print(f"  sync    {n:3}  {site}")
                for (site, op), n in sorted(differing.items()):
                    print(f"  differs {n:3}  {op:28} {site}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(command="python " + " ".join(sys.argv), layers=args.layers,
                                                   context=args.context, backend=args.backend, padded=args.padded,
                                                   admitted=args.admitted, modes=findings),
                                              indent=1))


if __name__ == "__main__":
    main()
