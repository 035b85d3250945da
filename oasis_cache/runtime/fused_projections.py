"""Fused projections in compiled decode steps (`OasisCache(..., advanced={"fuse_projections": True})`, with
`compile_decode`): a decoder layer's q/k/v projections read one weight, and so do the MLP's gate/up projections.

At one token per sequence a projection is a matrix-vector product bound by reading its weight; the small ones cannot
fill the GPU alone (H200, Qwen3-8B shapes, a micro-benchmark: k/v at 1.1 TB/s, gate/up/down at 3.4-3.6): a layer's
seven products take 128 us, and 109 us with q/k/v as one [q + 2kv, h] product and gate/up as one [2i, h] (-0.68 ms a
36-layer step). inductor does not merge separate `F.linear` calls (no CSE of extern
matmuls), so the fusion is explicit:

    storage   each group's weights (and biases) are copied once into one buffer; each projection's parameter becomes
              its rows of it (a view: same values, same names, same shapes). `save_pretrained` clones parameters
              that share a storage at disjoint ranges (transformers' `_find_disjoint`; tested), so checkpoints are
              unchanged. A bare `safetensors.save_file(model.state_dict())` refuses shared storage: `unfuse(model)`
              gives every projection its own storage back.
    compute   the projections become `FusedLinear`s (an `nn.Linear` subclass; `unfuse` turns them back); inside a
              compiled decode step (`compiled_layers.py`) the group's first projection (q, gate) computes
              the whole product and keeps it; the others (k, v; up) return their columns of it when called on the
              same input, else their own product. Outside a compiled step every projection computes its own product.

A group stays fused while its projections' parameters are still views of its buffer (`valid`, checked before each
compiled call: `model.to(...)` to another dtype or device, or assigning a new parameter, ends it and the projections
compute alone). Only plain `nn.Linear` projections on one device and dtype, without hooks, are fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (attribute holding the group's modules, names of its projections in call order)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

# The fused product between a group's calls while dynamo traces them (a list item: a traced write and read).
_PRODUCT = [None]

# Read while tracing: a plain bool (dynamo guards on its value), True only inside `fusing()`: around the compiled
# calls of a cache made with `fuse_projections` (another cache's compiled steps compute each projection alone).
FUSING = False


class fusing:
    """`with fusing(groups):` the fused projections compute one product per group in compiled code; each of
    `groups` (the layer's) is checked first (`FusedGroup.valid`)."""

    def __init__(self, groups):
        self.groups = groups

    def __enter__(self):
        global FUSING
        for group in self.groups:
            group.valid()
        self.previous, FUSING = FUSING, True

    def __exit__(self, *exc):
        global FUSING
        FUSING = self.previous


class FusedGroup:
    """One group's buffer: `weight` `[sum of out_features, in_features]`, `bias` likewise or None, and the rows of
    each member."""

    def __init__(self, linears: list[nn.Linear]):
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        with_bias = linears[0].bias is not None
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if with_bias else None
        self.rows = []
        start = 0
        for lin in linears:
            end = start + lin.out_features
            self.rows.append((start, end))
            lin.weight.data = self.weight[start:end]  # (the same parameter objects, their rows of the buffer)
            if with_bias:
                lin.bias.data = self.bias[start:end]
            start = end
        self.rows = tuple(self.rows)
        self.linears = linears
        self.on = True

    def valid(self) -> bool:
        """Whether every member's parameters are still its rows of the buffer (else the group is off for good and
        lets its buffer go: members still viewing it keep their own rows alive)."""
        if self.on:
            size = self.weight.element_size() * self.weight.shape[1]
            for lin, (start, _) in zip(self.linears, self.rows):
                w = lin.weight
                if (w.dtype != self.weight.dtype or w.device != self.weight.device
                        or w.data_ptr() != self.weight.data_ptr() + start * size
                        or self.bias is not None and (lin.bias is None or lin.bias.data_ptr() != self.bias.data_ptr()
                                                      + start * self.bias.element_size())):
                    self.on = False
                    self.weight = self.bias = None
                    break
        return self.on


class FusedLinear(nn.Linear):
    """A fused projection: the class a group's `nn.Linear` members take (`fuse`; `unfuse` gives `nn.Linear` back),
    with `fused_group` and `fused_index` set. A class, not a per-module `forward`: dynamo guards on the identity of
    a called object, so per-module forwards made every layer its own graph (recompiles up to the limit, the rest
    eager), while one class's `forward` traces once for all layers."""

    fused_group: FusedGroup
    fused_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.fused_group
        if not (torch.compiler.is_dynamo_compiling() and FUSING and group.on):
            return F.linear(x, self.weight, self.bias)
        start, end = group.rows[self.fused_index]
        if self.fused_index == 0:
            _PRODUCT[0] = (x, F.linear(x, group.weight, group.bias))
        kept = _PRODUCT[0]
        if kept is None or kept[0] is not x:  # (called on another input than the group's first projection)
            return F.linear(x, self.weight, self.bias)
        if self.fused_index == len(group.rows) - 1:
            _PRODUCT[0] = None  # (the last projection: nothing kept past the group)
        return kept[1][..., start:end]


def _fusable(linears) -> bool:
    if not all(type(lin) is nn.Linear for lin in linears):  # (subclasses may compute otherwise)
        return False
    first = linears[0].weight
    return (all(lin.weight.dtype == first.dtype and lin.weight.device == first.device
                and lin.in_features == linears[0].in_features and (lin.bias is None) == (linears[0].bias is None)
                and not (lin._forward_hooks or lin._forward_pre_hooks or hasattr(lin, "_hf_hook"))
                and "forward" not in lin.__dict__ for lin in linears)
            and first.device.type != "meta")


def fuse(model: nn.Module, layers: list[nn.Module]) -> list[FusedGroup]:
    """Fuse the projection groups of each decoder layer in `layers` whose projections allow it; returns the groups
    (one buffer each; a group already fused and still valid is kept, one whose parameters moved is fused anew) and
    sets each layer's compiled forward's `fused_groups` (`compiled_layers.CompiledDecode`). Parameters shared with
    another module are left alone."""
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    groups = []
    for layer in layers:
        own = []
        for holder_name, names in GROUPS:
            holder = getattr(layer, holder_name, None)
            linears = [getattr(holder, name, None) for name in names] if holder is not None else []
            if not linears or any(lin is None for lin in linears):
                continue
            if (all(isinstance(lin, FusedLinear) for lin in linears) and linears[0].fused_group.valid()
                    and all(lin.fused_group is linears[0].fused_group for lin in linears)):
                own.append(linears[0].fused_group)
                continue
            _restore(linears)
            params = [p for lin in linears for p in lin.parameters()]
            if not _fusable(linears) or any(counts.get(id(p), 0) > 1 for p in params):
                continue
            group = FusedGroup(linears)
            for index, lin in enumerate(linears):
                lin.__class__ = FusedLinear
                lin.fused_group, lin.fused_index = group, index
            own.append(group)
        compiled = layer.__dict__.get("forward")
        if compiled is not None and hasattr(compiled, "fused_groups"):
            compiled.fused_groups = own
        groups.extend(own)
    return groups


def _restore(linears) -> None:
    """Each projection back to its own storage and to `nn.Linear`."""
    for lin in linears:
        if isinstance(lin, FusedLinear):
            group = lin.fused_group
            group.on, group.weight, group.bias = False, None, None
            lin.__class__ = nn.Linear
            del lin.fused_group, lin.fused_index
            lin.weight.data = lin.weight.detach().clone()  # (the same parameter objects, their own storage again)
            if lin.bias is not None:
                lin.bias.data = lin.bias.detach().clone()


def unfuse(model: nn.Module) -> None:
    """Give every fused projection of `model` its own storage back (e.g. before a bare `safetensors.save_file`)."""
    for module in model.modules():
        if isinstance(module, FusedLinear):
            _restore([module])
