"""`Stamped`: the device pools' base class, for captured steps (`runtime/captured_step.py`).

A captured step reads its pools' tensors at the addresses they had at capture, so it may replay only while no tensor
attribute of a pool was rebound (a capacity that grew, an overflow that came or went) and no pool was replaced. Reading
every tensor's address before every replay cost ~0.13 ms of host time a step on this CPU (36 layers, ~15 tensors each),
which `generate`'s per-token sync leaves exposed. Instead each pool carries a `stamp`, a number no other pool or
assignment ever had: taken when the pool is made and again whenever one of its attributes is bound to a tensor, or
from a tensor to something else (`__setattr__`, `__delattr__`). A layer's stamps equal to those at capture mean the same
pool objects with the same tensors. Tensors change address only by rebinding here: no pool calls `resize_`, `set_` or
assigns `.data` (a test compares stamps with addresses through growth, copies and every generate mode).
"""

from __future__ import annotations

import itertools

import torch

_STAMPS = itertools.count(1)


class Stamped:
    """A base class: `self.stamp` changes whenever a tensor attribute is bound, rebound or unbound."""

    stamp: int

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        object.__setattr__(obj, "stamp", next(_STAMPS))
        return obj

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor) or isinstance(self.__dict__.get(name), torch.Tensor):
            object.__setattr__(self, "stamp", next(_STAMPS))
        object.__setattr__(self, name, value)

    def __setstate__(self, state: dict) -> None:
        """A copy (`copy.copy`, `copy.deepcopy`, pickle) holds other tensors: it takes a stamp of its own."""
        self.__dict__.update(state)
        object.__setattr__(self, "stamp", next(_STAMPS))

    def __delattr__(self, name: str) -> None:
        if isinstance(self.__dict__.get(name), torch.Tensor):
            object.__setattr__(self, "stamp", next(_STAMPS))
        object.__delattr__(self, name)
