"""The admission record's bytes: a JSON header and raw tensor storages, nothing executable.

    b"OASISREC" | header length (8 bytes, little endian) | header (JSON, UTF-8) | storage bytes, one after another

The header describes the value: JSON's own types, tuples, dicts with any keys, dtypes, devices, tensors (a storage,
an offset, a shape and strides: views of one storage stay views of one storage, as `torch.save` keeps them) and
objects of the classes in `CLASSES` (the package's pools and records, transformers' cache layers: their attributes,
set on an instance made without calling its constructor). Reading builds nothing else: an unknown type or class in
the header is refused, so whoever can write to the store cannot make a reader run code (the record was a pickle).
"""

from __future__ import annotations

import importlib
import json
import struct

import torch

MAGIC = b"OASISREC"
# Classes a record may hold (module, name): the layer pools of `OasisLayer`, the batch's padding record, and the
# cache layers of transformers that hybrid models keep (their attributes only).
CLASSES = {
    ("oasis_cache.pools.summaries", "BlockSummaries"),
    ("oasis_cache.pools.working_set", "WorkingSet"),
    ("oasis_cache.pools.recent", "RecentTokens"),
    ("oasis_cache.pools.slot_map", "SlotMap"),
    ("oasis_cache.control.visibility", "Padding"),
    ("oasis_cache.draft.head_window", "HeadKV"),
    ("oasis_cache.window", "WindowLayer"),
    ("oasis_cache.hybrid", "HybridWindowLayer"),
}
_TRANSFORMERS_CACHE = "transformers.cache_utils"  # (its layer classes, by name: versions add some)
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


class RecordError(ValueError):
    """Bytes that are not a record this package wrote (or of a type it does not read)."""


def encode(value) -> bytes:
    """`value`'s record bytes (see the module's docstring)."""
    storages: dict[int, int] = {}
    blobs: list[torch.Tensor] = []

    def tensor(t: torch.Tensor) -> dict:
        t = t.detach()
        storage = t.untyped_storage()
        key = storage.data_ptr(), storage.nbytes(), str(t.device)
        if key not in storages:
            storages[key] = len(blobs)
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            blobs.append(whole.cpu())
        return {"storage": storages[key], "offset": t.storage_offset(), "shape": list(t.shape),
                "stride": list(t.stride()), "dtype": _dtype_name(t.dtype)}

    def walk(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            return {"tensor": tensor(v)}
        if isinstance(v, torch.dtype):
            return {"dtype": _dtype_name(v)}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, (list, tuple)):
            return {"tuple" if isinstance(v, tuple) else "list": [walk(x) for x in v]}
        if isinstance(v, dict):
            return {"dict": [[walk(k), walk(x)] for k, x in v.items()]}
        cls = type(v)
        if _allowed(cls.__module__, cls.__qualname__):
            return {"object": [cls.__module__, cls.__qualname__], "state": walk(vars(v))}
        raise TypeError(f"the admission record cannot hold a {cls.__module__}.{cls.__qualname__}")

    header = json.dumps({"value": walk(value), "storages": [b.numel() for b in blobs]}).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *(b.numpy().tobytes() for b in blobs)])


def decode(data: bytes | memoryview, device) -> object:
    """The value `encode` wrote, its tensors on `device`."""
    data = memoryview(data)
    if bytes(data[:8]) != MAGIC or len(data) < 16:
        raise RecordError("not an oasis-cache admission record (its first bytes differ)")
    (length,) = struct.unpack("<Q", data[8:16])
    try:
        header = json.loads(bytes(data[16 : 16 + length]))
        sizes = [int(n) for n in header["storages"]]
    except (ValueError, KeyError, TypeError) as error:
        raise RecordError(f"the record's header does not read: {error}") from error
    if 16 + length + sum(sizes) != len(data):
        raise RecordError(f"the record holds {len(data)} bytes; its header describes {16 + length + sum(sizes)}")
    storages, at = [], 16 + length
    for n in sizes:
        raw = torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        storages.append(raw.to(device).untyped_storage())
        at += n

    def tensor(spec: dict) -> torch.Tensor:
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise RecordError(f"the record holds a tensor of dtype {spec['dtype']!r}, which is not read")
        storage = storages[int(spec["storage"])]
        shape, stride, offset = [int(x) for x in spec["shape"]], [int(x) for x in spec["stride"]], int(spec["offset"])
        last = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
        if offset < 0 or last * dtype.itemsize > storage.nbytes():
            raise RecordError("a tensor of the record reaches past its storage")
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)

    def walk(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if not isinstance(v, dict) or len(v) not in (1, 2):
            raise RecordError(f"the record's header holds an entry it does not read: {str(v)[:80]}")
        (kind, body), *rest = v.items()
        if kind == "tensor":
            return tensor(body)
        if kind == "dtype":
            if body not in _DTYPES:
                raise RecordError(f"unknown dtype {body!r} in the record")
            return _DTYPES[body]
        if kind == "device":
            return torch.device(device)  # (every tensor comes to `device`: so do the devices recorded with them)
        if kind in ("list", "tuple"):
            items = [walk(x) for x in body]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return {_hashable(walk(k)): walk(x) for k, x in body}
        if kind == "object":
            module, name = body
            if not _allowed(module, name):
                raise RecordError(f"the record names the class {module}.{name}, which a record may not hold")
            cls = getattr(importlib.import_module(module), name)
            obj = object.__new__(cls)
            state = walk(rest[0][1]) if rest and rest[0][0] == "state" else {}
            if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
                raise RecordError(f"the record's {name} has no attributes by name")
            obj.__dict__.update(state)
            return obj
        raise RecordError(f"the record's header holds an entry of kind {kind!r}, which it does not read")

    return walk(header["value"])


def _allowed(module: str, name: str) -> bool:
    if (module, name) in CLASSES:
        return True
    if module == _TRANSFORMERS_CACHE and name.endswith("Layer") and "." not in name:
        import transformers.cache_utils as cache_utils

        cls = getattr(cache_utils, name, None)
        return isinstance(cls, type) and issubclass(cls, cache_utils.CacheLayerMixin)
    return False


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"the admission record cannot hold tensors of {dtype}")
    return name
