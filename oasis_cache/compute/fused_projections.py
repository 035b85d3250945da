"""Grouped projections in compiled decode steps (`OasisConfig.fuse_projections`, on by default wherever decode steps
compile): a decoder layer's q/k/v projections run as one launch, and so do the MLP's gate/up projections, each
reading its own weight where it is.

At one token per sequence a projection is a matrix-vector product bound by reading its weight; the small ones cannot
fill the GPU alone (H200, Qwen3-8B shapes, `bench/matmul.py`: k/v at 1.1 TB/s, gate/up/down at 3.4-3.6): a layer's
seven cuBLAS products take 130 us, 112 with q/k/v and gate/up each one launch of `kernels/grouped_linear.py`
(`bench/matmul.py --grouped`, thirty-eighth session; the thirty-third session's re-homed weights, one buffer per
group, took 112 too, but changed the parameters' storage). inductor does not merge separate `F.linear` calls (no
CSE of extern matmuls), so the grouping is explicit:

    modules   each group's projections become `FusedLinear`s (an `nn.Linear` subclass, one class so that one compiled
              graph serves every layer; `unfuse(model)` turns them back). Parameters, their storage, names and
              `state_dict` are untouched.
    compute   inside a compiled decode step of a cache with the option (`fusing()`, set by `compiled_layers.py`) the
              group's first projection (q, gate) computes every member's product by one `oasis::grouped_linear` op
              (an opaque custom op: the Triton kernel on CUDA for bf16/fp16 inputs of at most `GROUPED_MAX_ROWS`
              rows, else one `F.linear` per member) and keeps them; the others (k, v; up) return theirs when called
              on the same input, else their own product. Outside a compiled step every projection computes its own
              product, as `nn.Linear` does.

The op reads each member's weight and bias as they are at the call (after `model.to(...)` too). Only plain
`nn.Linear` projections of one input width, dtype and device, with or without biases alike and without hooks
(accelerate's offload hooks bring a weight in for its own module's call only) are grouped.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

# (attribute holding the group's modules, names of its projections in call order)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

# Rows (tokens in a step) up to which the grouped kernel runs; more go to cuBLAS, member by member (the kernel holds
# the rows in registers; measured at 1 and 4 rows, `bench/matmul.py --grouped`).
GROUPED_MAX_ROWS = 16


def _knobs(weights) -> dict:
    """The grouped kernel's tiles for a group (H200, Qwen3-8B shapes, thirty-eighth session, best of 72 settings at
    1 and 4 rows: q/k/v [4096, 1024, 1024] x 4096 best at 32 x 256, 18.2 us against 28.5 for three cuBLAS calls;
    gate/up [12288, 12288] x 4096 best at 64 x 128, 49.4 us against 57.0)."""
    wide = sum(w.shape[0] for w in weights) >= 16384
    return dict(block_n=64, block_k=128) if wide else dict(block_n=32, block_k=256)


def _grouped_kernel_runs(x: torch.Tensor, weights) -> bool:
    from ..kernels.gather import triton

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < rows <= GROUPED_MAX_ROWS and all(w.is_contiguous() for w in weights))


@torch.library.custom_op("oasis::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor]) -> List[torch.Tensor]:
    """`[F.linear(x, w, b) for w, b in zip(weights, biases or [None] * len(weights))]`; x `[..., K]`, each weight
    `[N_g, K]`, biases empty or one `[N_g]` per weight; outputs `[..., N_g]` in x's dtype."""
    bias = list(biases) if biases else [None] * len(weights)
    if _grouped_kernel_runs(x, weights):
        from ..kernels.grouped_linear import grouped_linear

        return grouped_linear(x, list(weights), bias if biases else None, **_knobs(weights))
    return [F.linear(x, w, b) for w, b in zip(weights, bias)]


@grouped_linear_op.register_fake
def _(x, weights, biases):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


# Read while tracing: a plain bool (dynamo guards on its value), True only inside `fusing()`: around the compiled
# calls of a cache with `fuse_projections` (another cache's compiled steps compute each projection alone).
FUSING = False


class fusing:
    """`with fusing():` the grouped projections compute one launch per group in compiled code."""

    def __enter__(self):
        global FUSING
        self.previous, FUSING = FUSING, True

    def __exit__(self, *exc):
        global FUSING
        FUSING = self.previous


# The group's products between its calls while dynamo traces them (a list item: a traced write and read): (input,
# group, products).
_PRODUCTS = [None]


class FusedGroup:
    """One group's projections (`linears`, in call order)."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears


class FusedLinear(nn.Linear):
    """A grouped projection: the class a group's `nn.Linear` members take (`fuse`; `unfuse` gives `nn.Linear` back),
    with `fused_group` and `fused_index` set. A class, not a per-module `forward`: dynamo guards on the identity of
    a called object, so per-module forwards made every layer its own graph (recompiles up to the limit, the rest
    eager; thirty-third session), while one class's `forward` traces once for all layers."""

    fused_group: FusedGroup
    fused_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.compiler.is_dynamo_compiling() and FUSING):
            return F.linear(x, self.weight, self.bias)
        group = self.fused_group
        if self.fused_index == 0:
            members = group.linears
            biases = [lin.bias for lin in members] if self.bias is not None else []
            _PRODUCTS[0] = (x, group, torch.ops.oasis.grouped_linear(x, [lin.weight for lin in members], biases))
        kept = _PRODUCTS[0]
        if kept is None or kept[0] is not x or kept[1] is not group:  # (another input, or another group's products)
            return F.linear(x, self.weight, self.bias)
        if self.fused_index == len(group.linears) - 1:
            _PRODUCTS[0] = None  # (the last projection: nothing kept past the group)
        return kept[2][self.fused_index]


def _groupable(linears) -> bool:
    if not all(type(lin) is nn.Linear for lin in linears):  # (subclasses may compute otherwise)
        return False
    first = linears[0]
    return all(lin.weight.dtype == first.weight.dtype and lin.weight.device == first.weight.device
               and lin.in_features == first.in_features and (lin.bias is None) == (first.bias is None)
               and not (lin._forward_hooks or lin._forward_pre_hooks or hasattr(lin, "_hf_hook"))
               and "forward" not in lin.__dict__ for lin in linears)


def fuse(layers: list[nn.Module]) -> list[FusedGroup]:
    """Group the projections of each decoder layer in `layers` that allow it (`_groupable`); returns the groups. A
    group already made (its members `FusedLinear`s of one group) is kept."""
    groups = []
    for layer in layers:
        for holder_name, names in GROUPS:
            holder = getattr(layer, holder_name, None)
            linears = [getattr(holder, name, None) for name in names] if holder is not None else []
            if not linears or any(lin is None for lin in linears):
                continue
            first = linears[0]
            if (all(isinstance(lin, FusedLinear) for lin in linears)
                    and all(lin.fused_group is first.fused_group and lin.fused_index == i
                            for i, lin in enumerate(linears))):
                groups.append(first.fused_group)
                continue
            _restore(linears)
            if not _groupable(linears):
                continue
            group = FusedGroup(linears)
            for index, lin in enumerate(linears):
                lin.__class__ = FusedLinear
                lin.fused_group, lin.fused_index = group, index
            groups.append(group)
    return groups


def _restore(linears) -> None:
    """Each projection back to `nn.Linear`."""
    for lin in linears:
        if isinstance(lin, FusedLinear):
            lin.__class__ = nn.Linear
            del lin.fused_group, lin.fused_index


def unfuse(model: nn.Module) -> None:
    """Turn every grouped projection of `model` back into a plain `nn.Linear` (its parameters were never moved)."""
    _restore([module for module in model.modules() if isinstance(module, FusedLinear)])
