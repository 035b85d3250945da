"""Admitting a published request on the decode side: the record checked against the model and the prompt, the
layers rebuilt from the admission record, the working set's slots filled from the store, and the host pool linked to
the store through a bounded local cache (`remote/local_cache.py`) that a decode step fetches selected units into."""

from __future__ import annotations

import hashlib
import warnings
import weakref

import torch

from ..cache import OasisCache
from ..layer import OasisLayer
from ..pools.host_kv import HostKVPool
from ..runtime.build import cache_kwargs
from . import wire
from .local_cache import LocalBlockCache, LocalCacheGroup
from .mooncake import RemoteBlocksMissing, RemoteTier, StoreClient
from .publisher import (RECORD_VERSION, delete_quietly, head_fingerprint, model_signature, prompt_digest,
                        read_manifest)
from .repair import RepairAfterStep


# Default local cache per layer: this many working sets of units, but at most this share of the published units
# (and at least one working set: a step's selection must fit). Qwen2.5-Coder-0.5B on Python's documentation, 4K,
# budget 1/8, 128 steps (`bench/disagg.py --local-cache-sets`, docs/performance.md): warm steps read 212 / 94 / 25 units
# from the store with 1 / 2 / 4 working sets.
LOCAL_CACHE_STEPS = 4
LOCAL_CACHE_SHARE = 1 / 4
DECODE_CHUNK_BLOCKS = 32  # the decode side's pools hold only the blocks decode completes: grown by small chunks


def admit(model, store, request: str, device=None, local_cache_units: int | None = None, draft=None,
          measure: bool = False, deferred: bool | None = None, cuda_graph: bool | None = None,
          overlap: bool = False, input_ids: torch.Tensor | None = None) -> OasisCache:
    """An `OasisCache` for `model` holding the tokens `publish` wrote under `request`, on `device` (default: the
    model's). Its decode steps fetch the (block, sequence, KV head) units they select from the store into a bounded
    local cache per layer (`local_cache_units` units each; default: four working sets, B x Hkv x 4 x the slots, at
    most a quarter of the published units, at least one working set); the
    request's keys are deleted from the store when the cache is reset or dropped. A request published with
    lookahead="eagle3" continues with the same draft head: the one shipped for the model, or `draft` (as
    `OasisCache(draft=...)` takes it); its state (keys/values of its window, last features, drafts) comes with the
    record. `measure`: as `OasisCache(advanced={"measure": True})` (how long compute waits on prefetches, `stats()`).
    `deferred`: whether prefetches leave their store reads to after the step (`repair_after_step`), so that the
    steps can be captured as CUDA graphs; only for lookahead "previous" / "eagle3" without `exact`. None (default):
    where this cache captures its steps (CUDA); elsewhere the store reads run on a host thread during the step.
    `cuda_graph`: as `OasisCache(cuda_graph=...)` for the decode side; None (default): the publishing cache's
    setting (a prefill process that decoded eagerly hands on `cuda_graph=False`). `overlap` (with deferred store
    reads): a host thread reads each layer's record as soon as the step has written it and reads the store while the
    later layers compute (`start_repair`); the next forward finishes the maps and gathers. Off by default: slower
    on the H200 (its host thread competes with the step for the GIL; docs/performance.md).
    `input_ids`: the prompt (`[B, N or more]`): refused unless the request was published with the same first N
    tokens (`publish(..., input_ids=)`)."""
    manifest = _checked_manifest(model, store, request, input_ids)
    tier = RemoteTier(store, request, manifest["generation"])
    device = torch.device(device) if device is not None else next(model.parameters()).device
    state = wire.decode(_read_record(tier, manifest), device)
    options = dict(state["config"])
    if cuda_graph is not None:
        options["cuda_graph"] = cuda_graph
    prefetching, in_step, why = _where_steps_read(options, request, deferred, cuda_graph)
    drafted = state.get("draft")
    if drafted is not None:
        options["draft"] = draft
    cache = OasisCache(model, **cache_kwargs(dict(options, measure=measure)))
    if in_step:
        cache.why["cuda_graph"] = (f"off: this request's decode steps read the store inside the step ({why}), which "
                                   f"a CUDA graph cannot replay")
        if device.type == "cuda" and cuda_graph is None and not prefetching:  # (deferred=False: asked for)
            warnings.warn(f"admit: request {request!r} was published with {why}: its decode steps read the Mooncake "
                          f"Store inside the step and run eagerly, several times slower than steps that read it "
                          f"after the step and replay as CUDA graphs (docs/performance.md). For those, publish from "
                          f"OasisCache(model, token_budget=..., lookahead='previous') or with exact=False; "
                          f"admit(..., cuda_graph=False) silences this.", stacklevel=2)
    if deferred is None:
        deferred = cache.captured_steps is not None
    if overlap and not deferred:
        raise ValueError(f"admit(..., overlap=True) overlaps the store reads that deferred prefetches leave to after "
                         f"the step, and request {request!r} is admitted without them here (deferred=False, lookahead "
                         f"'none', exact, or no captured steps on this device: pass deferred=True with lookahead "
                         f"'previous' / 'eagle3' without exact).")
    if drafted is not None:
        _restore_draft(cache, drafted, request)
    if len(cache.layers) != len(state["oasis"]) + len(state["kept"]):
        raise ValueError(f"the admission record of request {request!r} holds {len(state['oasis']) + len(state['kept'])} "
                         f"layers; {type(model).__name__} has {len(cache.layers)}: admit with the prefill's model.")
    cache.context.start_engine(device)
    if deferred:
        cache._after_forward.append(RepairAfterStep(cache))
    else:
        cache.streams.use_host_worker()  # a prefetch's store reads overlap the rest of the step
    cache.context.padding = state.get("padding")  # (a captured step is called without a mask: it reads this record)
    for idx, kept in state["kept"].items():
        cache.layers[idx].__dict__.update(kept)
    for idx, saved in state["oasis"].items():
        _restore_layer(cache, idx, saved, tier, device, local_cache_units, deferred, overlap)
    links = [layer.pool.remote for layer in cache.layers
             if isinstance(layer, OasisLayer) and layer.is_initialized and layer.pool.remote is not None]
    # the after-step repair plans every layer at once where the layers' local caches share one shape
    tier.local_group = LocalCacheGroup(links) if deferred and LocalCacheGroup.fits(links) else None
    tier.overlap = overlap
    cache.remote_tier = tier
    cache._remote_release = weakref.finalize(cache, delete_quietly, tier)  # once: at `reset` or when dropped
    _fill_slots(cache, tier)
    for idx, saved in state["oasis"].items():  # a narrow pool's newest blocks, held as the model made them
        if saved.get("newest") is not None:
            held = saved["newest"]["slots"].to(device)
            b, h, r = (held >= 0).nonzero(as_tuple=True)
            cache.layers[idx].working_set.slots[:, b, h, held[b, h, r]] = saved["newest"]["kv"].to(device)[:, b, h, r]
    return cache


def _where_steps_read(options: dict, request: str, deferred, cuda_graph) -> tuple[bool, bool, str]:
    """`(prefetching, in_step, why)`: whether the published lookahead prefetches without `exact` (its store reads can
    wait until after the step, `repair_after_step`: such steps can be captured), whether the steps read the store
    inside themselves (a fetch on the critical path: lookahead "none", `exact`, or `deferred=False`), and why in
    words; refuses `deferred=True` or `cuda_graph=True` where they cannot hold. Sets `options["cuda_graph"]`."""
    prefetching = options["lookahead"] != "none" and not options["exact"]
    if deferred and not prefetching:
        raise ValueError(f"admit(..., deferred=True): request {request!r} was published with lookahead="
                         f"{options['lookahead']!r}{' and exact=True' if options['exact'] else ''}, whose steps read "
                         f"the store on their critical path; deferred store reads need lookahead 'previous' or "
                         f"'eagle3' without exact. Drop deferred, or publish with such a cache.")
    in_step = not prefetching or deferred is False
    why = "deferred=False" if prefetching else f"lookahead={options['lookahead']!r}" + (
        " with exact=True" if options["exact"] else "")  # (why the store would be read inside the steps)
    if cuda_graph and in_step:
        raise ValueError(f"admit(..., cuda_graph=True): request {request!r} would read the store inside its decode "
                         f"steps ({why}), which a CUDA graph cannot replay. Drop cuda_graph, or publish with lookahead "
                         f"'previous' or 'eagle3' without exact and leave deferred at its default.")
    if in_step:
        options["cuda_graph"] = False  # a remote fetch inside the step reads the selected blocks on the host
    return prefetching, in_step, why


def _checked_manifest(model, store, request: str, input_ids) -> dict:
    """The request's record, after refusing another release's, another model's and another prompt's by name."""
    manifest = read_manifest(store if isinstance(store, StoreClient) else RemoteTier(store, request).store, request)
    if manifest is None:
        raise RemoteBlocksMissing(f"No record of request {request!r} in the Mooncake Store: publish it from the "
                                  f"prefill process first (oasis_cache.remote.publish), or it was deleted.")
    if manifest.get("version") != RECORD_VERSION:
        raise ValueError(f"admission record version {manifest.get('version')} of request {request!r}; this "
                         f"oasis-cache reads version {RECORD_VERSION}: publish and admit with the same oasis-cache "
                         f"release.")
    published_by, here = manifest["model"], model_signature(model)
    if published_by != here:
        differ = ", ".join(f"{key} {published_by.get(key)!r} there, {here.get(key)!r} here"
                           for key in sorted(set(published_by) | set(here)) if published_by.get(key) != here.get(key))
        raise ValueError(f"request {request!r} was published by another model than this one ({differ}): its keys and "
                         f"values mean nothing to this model. Admit with the prefill's model and weights, loaded in "
                         f"the same dtype (from_pretrained(..., dtype={published_by.get('dtype')})).")
    if input_ids is not None:
        if manifest.get("prompt") is None:
            raise ValueError(f"admit(..., input_ids=...): request {request!r} was published without its prompt's "
                             f"digest, so the prompt cannot be checked: publish(..., input_ids=prompt).")
        if prompt_digest(input_ids, manifest["tokens"]) != manifest["prompt"]:
            raise ValueError(f"request {request!r} holds the keys and values of another prompt than input_ids' first "
                             f"{manifest['tokens']} tokens: admit the request published for this prompt.")
    return manifest


def _restore_layer(cache, idx: int, saved: dict, tier, device, local_cache_units, deferred: bool,
                   overlap: bool) -> None:
    """Layer `idx` of an admitted cache from its part of the admission record, its host pool starting at the published
    blocks and linked to the store through a local cache."""
    layer = cache.layers[idx]
    if not isinstance(layer, OasisLayer):
        raise ValueError(f"layer {idx} of the admission record is a full-attention layer; not in this model.")
    layer.__dict__.update(saved["layer"])
    _rebuild_working_set(layer, saved["recent_region"])
    layer.device = device
    layer.choose_kernels()  # this side's device decides
    meta = dict(saved["pool"])
    published = meta.pop("num_blocks")
    center = meta.pop("center", None)  # (int4: the keys' center the published units were narrowed with, or None)
    rotated = meta.pop("rotated", None)  # (int4: narrowed in the rotated basis)
    meta["chunk_blocks"] = min(meta["chunk_blocks"], DECODE_CHUNK_BLOCKS)
    pin = device.type == "cuda"
    pool = layer.pool = HostKVPool(**meta, pin_memory=pin)
    if center is not None:
        if rotated != pool.representation.rotates:
            raise ValueError(f"layer {idx} of the admission record holds int4 units narrowed "
                             f"{'in' if rotated else 'outside'} the rotated basis; this side would widen them "
                             f"{'in' if pool.representation.rotates else 'outside'} it: admit with the same "
                             f"oasis-cache (and `Int4.rotated`) as the prefill's.")
        pool.representation.center = center.to(device)
    pool.num_blocks = pool.first_block = published  # the pool holds the blocks decode completes
    layer.reserve_ahead()
    one_step = pool.batch_size * pool.num_kv_heads * layer.working_set.num_slots
    units = local_cache_units or max(one_step, min(LOCAL_CACHE_STEPS * one_step, int(
        LOCAL_CACHE_SHARE * published * pool.batch_size * pool.num_kv_heads)))
    if published:
        pool.remote = LocalBlockCache(tier, idx, published, pool.batch_size, pool.num_kv_heads, pool.representation,
                                      units, pin, device)
        pool.remote.deferred = deferred
        pool.remote.overlap = overlap


def _read_record(tier: RemoteTier, manifest: dict) -> bytes:
    """The admission record's bytes, its parts read and checked against the request's record."""
    parts = []
    for i, size in enumerate(manifest["parts"]):
        part = tier.store.get(tier.key("record", i)) if size else b""
        if len(part) != size:
            raise RemoteBlocksMissing(f"part {i} of the admission record of request {tier.request!r} is "
                                      f"{'not in the store' if not part else f'{len(part)} bytes, not {size}'}: it "
                                      f"was deleted or replaced while it was read. Admit again, or publish again.")
        parts.append(bytes(part))
    record = b"".join(parts)
    if hashlib.sha256(record).hexdigest() != manifest["sha256"]:
        raise wire.RecordError(f"the admission record of request {tier.request!r} does not match its digest: it was "
                               f"changed in the store. Publish the request again.")
    return record


def _rebuild_working_set(layer: OasisLayer, recent_region: torch.Tensor) -> None:
    """The working set of an admitted layer: its slots empty (filled from the store by `_fill_slots`), its recent
    region as published, the recent tokens a view of it again."""
    ws, recent = layer.working_set, layer.recent
    two, B, H, R, D = recent_region.shape
    ws.kv = torch.zeros((two, B, H, ws.slot_tokens + R, D), dtype=recent_region.dtype, device=recent_region.device)
    ws.kv[:, :, :, ws.slot_tokens :] = recent_region
    recent.region = ws.recent_region


def _fill_slots(cache: OasisCache, tier: RemoteTier) -> None:
    """Every admitted layer's working-set slots filled with the blocks its slot map holds (the prefill's, with a
    lookahead its first step's prediction), read from the store in one series of batched calls per unit size."""
    wanted = {}
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, OasisLayer) or not layer.is_initialized or layer.pool.remote is None:
            continue
        S = layer.working_set.num_slots
        held = layer.slot_map.slot_block[..., :S].cpu()  # [B, Hkv, S]
        b, h, s = (held >= 0).nonzero(as_tuple=True)
        if not b.numel():
            continue
        rep = layer.pool.representation
        staging = torch.empty((b.numel(), 2, *rep.unit_shape), dtype=rep.storage_dtype,
                              pin_memory=layer.device.type == "cuda")
        units = list(zip(held[b, h, s].tolist(), b.tolist(), h.tolist()))
        size = staging[0].numel() * staging.element_size()
        wanted.setdefault(size, []).append((idx, layer, units, staging, (b, h, s)))
    for size, reads in wanted.items():
        tier.get_units_of_layers([(idx, units, [row.data_ptr() for row in staging], staging)
                                  for idx, _, units, staging, _ in reads], size)
        for _, layer, _, staging, (b, h, s) in reads:
            index = tuple(i.to(layer.device) for i in (b, h, s))
            widened = layer.pool.representation.widen(staging.to(layer.device), heads=index[1])  # [n, 2, T, D]
            layer.working_set.slots[(slice(None), *index)] = widened.transpose(0, 1)


def _restore_draft(cache: OasisCache, drafted: dict, request: str) -> None:
    ride = cache.ride_along
    if ride is None or head_fingerprint(ride.head) != drafted["fingerprint"]:
        raise ValueError(f"request {request!r} was published with lookahead='eagle3' and a draft head that this "
                         f"process {'did not load' if ride is None else 'does not have'}: admit with the prefill's "
                         f"head (admit(..., draft=<the same head or checkpoint>)).")
    ride.__dict__.update(drafted["state"])


