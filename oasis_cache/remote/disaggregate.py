"""Prefill here, decode there: a prefill process publishes its cache to a Mooncake Store and a decode process admits
it with a small record, fetching the rest of the blocks from the store as decode steps select them.

    # prefill process
    cache = OasisCache(model, token_budget=2048, lookahead="previous")
    model(input_ids=prompt[:, :-1], **cache.generate_kwargs())              # all but the last prompt token
    report = publish(cache, connect(master), "req-7", input_ids=prompt)     # blocks + admission record
    # or, overlapped with a chunked prefill: with publishing(cache, store, "req-7") as job: model(...)
    # decode process (same model, same weights)
    cache = admit(model, connect(master), "req-7", input_ids=prompt)
    out = model.generate(input_ids=prompt, **cache.generate_kwargs(), max_new_tokens=256)

The request's record (`oasis/{request}/record`, JSON) names the publication's generation (the blocks' keys hold it),
the digest of the admission record, the model that made the keys and values (its configuration and a fingerprint of
its weights) and, where `input_ids` were given, a digest of the tokens they hold. The admission record itself (in
parts under the generation: `remote/wire.py`, no pickle) holds what a decode step reads on the device: each
full-attention layer's block summaries, sink and recent tokens, its slot map and the recent part of its working set;
the kept layers of hybrid models whole; the prompt's padding record (what a decode step called without a mask, as a
captured one is, reads); the options. The blocks stay in the store: admission fills the working set's slots from it
(with a lookahead, the first step's predicted blocks), and the decode side's host pool fetches a block the first time
a step selects it (`LocalBlockCache.ensure`), so admission moves the record and one working set, not the KV, and
nothing is published twice. Publishing a request that is in the store already is refused unless `replace=True`:
then the new generation's record replaces the old one in one step, and the old blocks are deleted after it.

The store holds one object per (block, sequence, KV head); a decode step fetches the units it selects into a bounded
LRU cache per layer (`remote/local_cache.py`), so the decode side's host memory per request is that cache plus the
blocks decode completes, not the prompt's KV. With lookahead "previous" or "eagle3" and without `exact`, a prefetch
gathers the units already local and leaves the store reads to after the step (one sync per step;
`repair_after_step`), so such steps are captured as CUDA graphs like a local cache's (the default where the cache
captures steps); with lookahead "none" or `exact`, a fetch on the critical path reads the store inside the step,
which then runs eagerly. With lookahead="eagle3" the record also carries the draft head's state (its window's
keys/values, the last features, the pending drafts).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import secrets
import time
import warnings
import weakref

import torch

from ..cache import OasisCache
from ..layer import OasisLayer
from ..pools.host_kv import HostKVPool
from . import wire
from .local_cache import LocalBlockCache, LocalCacheGroup
from .mooncake import KEY_PREFIX, RemoteBlocksMissing, RemoteTier, StoreClient, record_key

RECORD_FORMAT = "oasis-cache admission record"
RECORD_VERSION = 3  # 3: no pickle (`wire`), generations, the weights' fingerprint, the working set's slots not in it
_LAYER_SKIP = ("_cache", "config", "pool", "device")  # rebuilt on the decode side
PART_BYTES = 16 << 20  # the admission record is put and got in parts of at most this (and a quarter of the buffer)


class AlreadyPublished(ValueError):
    """A request of that name is in the store already (publishing it again needs `replace=True`)."""


def publish(cache: OasisCache, store, request: str, *, input_ids: torch.Tensor | None = None,
            replace: bool = False, _published: dict | None = None, _tier: RemoteTier | None = None) -> dict:
    """Write every full-attention layer's complete blocks and the admission record of `cache` (prefilled, on this
    process) to the store under `request`. Returns the bytes: `blocks`, `record`, and `full_kv` (what a whole
    transfer of the cache's keys and values would move).

    `input_ids`: the tokens the cache holds (`[B, N]`, or the whole prompt: its first N are read): their digest goes
    into the request's record, and `admit(..., input_ids=)` refuses another prompt. `replace`: a request of that name
    in the store already is replaced (its record in one step, its blocks deleted after); without it, refused
    (`AlreadyPublished`) before anything is written. A publication that fails deletes what it had put.
    (`_published`, `_tier`: `publishing`'s blocks put so far and its tier.)"""
    layers = [(idx, layer) for idx, layer in enumerate(cache.layers) if isinstance(layer, OasisLayer)]
    if not any(layer.is_initialized for _, layer in layers):
        raise ValueError("publish: the cache is empty. Run the prompt through the model with this cache first "
                         "(all but its last token: the decode side's generate computes that one).")
    tokens = cache.get_seq_length(cache._first_oasis_layer)
    prompt = _prompt_digest(input_ids, tokens) if input_ids is not None else None
    tier = _tier or RemoteTier(store, request, generation=_new_generation())
    before = _refuse_published(tier, replace)
    if cache.streams is not None:
        cache.streams.synchronize()  # prefetches and offloads landed
    if any(layer.pool.pin_memory for _, layer in layers if layer.is_initialized) and torch.cuda.is_available():
        torch.cuda.synchronize()  # the offload copies into the host pools
    try:
        report = _publish(cache, tier, prompt, tokens, before, _published)
    except BaseException:
        _delete_quietly(tier, generation_only=True)  # nothing of this publication stays
        raise
    if before is not None:  # replaced: the record names the new generation now; the old one's blocks go
        _delete_quietly(RemoteTier(tier.store, request, before["generation"]), generation_only=True)
    return report


def _publish(cache, tier: RemoteTier, prompt: str | None, tokens: int, before: dict | None,
             published: dict | None) -> dict:
    blocks_bytes = full = 0
    state = {"config": dataclasses.asdict(cache.config), "oasis": {}, "kept": {},
             "draft": _draft_state(cache.ride_along) if cache.ride_along is not None else None,
             "padding": cache.padding}  # the prompt's padding: decode steps called without a mask read it
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, OasisLayer):
            skipped = getattr(layer, "not_recorded", ())  # (a window's ring and its owner's padding reader)
            state["kept"][idx] = {k: v for k, v in vars(layer).items() if k not in skipped}
            continue
        if not layer.is_initialized:
            raise ValueError(f"publish: layer {idx} holds no tokens while others do.")
        layer.summaries.fix_channels()  # (the prompt is complete: the channels its first decode step would choose)
        pool = layer.pool
        pool.fetch_all_remote()  # a cache admitted from a store publishes every block, not only those it fetched
        blocks_bytes += tier.publish(idx, pool, start=(published or {}).get(idx, 0))
        recent = layer.recent.kv
        full += pool.num_blocks * pool.block_nbytes + recent.numel() * recent.element_size()
        state["oasis"][idx] = dict(
            layer=_layer_record(layer),
            recent_region=layer.working_set.recent_region.clone(),  # (the slots' blocks: from the store at admit)
            pool=dict(batch_size=pool.batch_size, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                      block_size=pool.block_size, dtype=pool.dtype, chunk_blocks=pool.chunk_blocks,
                      num_blocks=pool.num_blocks))
    record = wire.encode(_detached(state))
    size = _part_bytes(tier.store)
    parts = [record[at : at + size] for at in range(0, len(record), size)] or [b""]
    for i, part in enumerate(parts):
        status = tier.store.put(tier.key("record", i), part)
        if status != 0:
            raise RuntimeError(f"Mooncake Store refused part {i} of the admission record of request "
                               f"{tier.request!r} ({len(part)} of {len(record)} bytes; status {status}): its storage "
                               f"is full or cannot be reached.")
    manifest = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "generation": tier.generation,
                "parts": [len(part) for part in parts], "sha256": hashlib.sha256(record).hexdigest(),
                "tokens": tokens, "prompt": prompt, "model": _model_signature(cache._model())}
    text = json.dumps(manifest).encode()
    key = tier.record_key
    if before is None:  # (a put of a key that exists keeps the old value: the record read back says who won)
        status = tier.store.put(key, text)
    else:
        status = tier.store.upsert(key, text)
    if status != 0:
        raise RuntimeError(f"Mooncake Store refused the record of request {tier.request!r} (status {status}).")
    now = _read_manifest(tier.store, tier.request)
    if now is None or now.get("generation") != tier.generation:
        raise AlreadyPublished(f"request {tier.request!r} was published by another process at the same time; this "
                               f"publication was withdrawn. Publish under another name, or with replace=True.")
    return {"blocks": blocks_bytes, "record": len(record), "full_kv": full}


def _layer_record(layer: OasisLayer) -> dict:
    """The layer's attributes as the record holds them: its working set without its slots' contents (made anew,
    filled from the store at admission) and its recent tokens without the view into it."""
    state = {k: v for k, v in layer.__dict__.items() if k not in _LAYER_SKIP}
    working_set, recent = copy.copy(layer.working_set), copy.copy(layer.recent)
    working_set.kv, recent.region = None, None
    if recent._overflow is not None:
        raise ValueError("publish: a forward left more recent tokens than the working set holds; publish after a "
                         "whole forward (fewer than block_size tokens past the last complete block).")
    state.update(working_set=working_set, recent=recent)
    return state


def _new_generation() -> str:
    return secrets.token_hex(8)


def _part_bytes(store) -> int:
    buffer = store.buffer_bytes if isinstance(store, StoreClient) else PART_BYTES * 4
    return max(1 << 16, min(PART_BYTES, buffer // 4))


def _read_manifest(store, request: str) -> dict | None:
    """The request's record, or None where it is not in the store."""
    raw = store.get(record_key(request))
    if not raw:
        return None
    try:
        manifest = json.loads(bytes(raw))
    except ValueError as error:
        raise wire.RecordError(f"the record of request {request!r} in the store does not read ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != RECORD_FORMAT:
        raise wire.RecordError(f"the key {record_key(request)!r} in the store is not an oasis-cache record")
    return manifest


def _refuse_published(tier: RemoteTier, replace: bool) -> dict | None:
    """The record a publication would replace (None where the request is not in the store); refused without
    `replace`, before anything is written."""
    if isinstance(replace, bool) is False:
        raise TypeError(f"replace must be True or False, got {replace!r}.")
    before = _read_manifest(tier.store, tier.request)
    if before is not None and not replace:
        raise AlreadyPublished(
            f"request {tier.request!r} is in the Mooncake Store already: publish(..., replace=True) replaces it "
            f"(its admitted caches then fail to read its old blocks), oasis_cache.remote.cleanup(store, "
            f"{tier.request!r}) removes it, or publish under a new name.")
    return before


def _prompt_digest(input_ids, tokens: int) -> str:
    """A digest of the first `tokens` positions of `input_ids` `[B, >= tokens]` (their ids as int64)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < tokens:
        raise ValueError(f"input_ids must be the prompt's token ids, [batch, at least {tokens}] (the tokens the cache "
                         f"holds), got {getattr(input_ids, 'shape', type(input_ids).__name__)}.")
    ids = input_ids[:, :tokens].detach().to("cpu", torch.int64).contiguous()
    return hashlib.sha256(f"{list(ids.shape)}".encode() + ids.numpy().tobytes()).hexdigest()


class publishing:
    """Publish `cache` to the store while its prefill runs: `with publishing(cache, store, request) as job:` around
    the prefill's forward (in chunks: the cache's own `prefill_chunk_tokens`, or several calls). After each forward
    through the cache, the blocks it completed are put by a host thread while the next chunk computes (on CUDA once
    their offloads have landed); leaving the block puts the rest and the admission record, as `publish` does, and
    `job.report` holds its bytes (`blocks_in_background`: those put while the prefill ran). An error in the
    prefill or in a put deletes what was put and raises. `input_ids`, `replace`: as `publish`'s (a request in the
    store already is refused here, before the prefill)."""

    def __init__(self, cache: OasisCache, store, request: str, *, input_ids: torch.Tensor | None = None,
                 replace: bool = False):
        if cache.remote_tier is not None:
            raise ValueError("publishing: this cache was admitted from a store; publish(cache, store, request) "
                             "brings its blocks home and publishes them.")
        self.cache, self.tier = cache, RemoteTier(store, request, generation=_new_generation())
        self.input_ids, self.replace = input_ids, replace
        _refuse_published(self.tier, replace)
        self.done: dict[int, int] = {}  # layer -> blocks handed to the thread
        self.report: dict | None = None
        self._futures = []
        self._worker = None

    def __enter__(self) -> "publishing":
        from concurrent.futures import ThreadPoolExecutor

        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oasis-publish")
        self.cache._after_forward.append(self._after_forward)
        return self

    def _after_forward(self) -> None:
        streams, landed = self.cache.streams, ()
        if streams is not None and streams.cuda:  # the offloads queued so far (side stream; a captured step's on
            compute = torch.cuda.Event()  # the compute stream)
            compute.record(torch.cuda.current_stream(streams.device))
            landed = (streams.side_event(), compute)
        for idx, layer in enumerate(self.cache.layers):
            if not isinstance(layer, OasisLayer) or not layer.is_initialized:
                continue
            start, end = self.done.get(idx, 0), layer.pool.num_blocks
            if end > start:  # complete blocks never change: the next chunk writes others
                self._futures.append(self._worker.submit(self._put, landed, idx, layer.pool, start, end))
                self.done[idx] = end

    def _put(self, landed, idx: int, pool, start: int, end: int) -> int:
        for event in landed:
            event.synchronize()
        return self.tier.publish(idx, pool, start, end)

    def __exit__(self, exc_type, exc, traceback):
        self.cache._after_forward.remove(self._after_forward)
        error = None
        background = 0
        for future in self._futures:  # every put joined before anything else happens
            try:
                background += future.result()
            except BaseException as raised:
                error = error or raised
        self._worker.shutdown(wait=True)
        if exc_type is None and error is None:
            try:
                self.report = publish(self.cache, self.tier.store, self.tier.request, input_ids=self.input_ids,
                                      replace=self.replace, _published=self.done, _tier=self.tier)
                self.report["blocks"] += background
                self.report["blocks_in_background"] = background
                return False
            except BaseException as raised:
                error = raised
        _delete_quietly(self.tier, generation_only=True)  # nothing half-published stays
        if error is not None and exc_type is None:
            raise error
        return False


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
    record. `measure`: as `OasisCache(measure=True)` (how long compute waits on prefetches, `stats()`).
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
    manifest = _read_manifest(store if isinstance(store, StoreClient) else RemoteTier(store, request).store, request)
    if manifest is None:
        raise RemoteBlocksMissing(f"No record of request {request!r} in the Mooncake Store: publish it from the "
                                  f"prefill process first (oasis_cache.remote.publish), or it was deleted.")
    if manifest.get("version") != RECORD_VERSION:
        raise ValueError(f"admission record version {manifest.get('version')} of request {request!r}; this "
                         f"oasis-cache reads version {RECORD_VERSION}: publish and admit with the same oasis-cache "
                         f"release.")
    published_by, here = manifest["model"], _model_signature(model)
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
        if _prompt_digest(input_ids, manifest["tokens"]) != manifest["prompt"]:
            raise ValueError(f"request {request!r} holds the keys and values of another prompt than input_ids' first "
                             f"{manifest['tokens']} tokens: admit the request published for this prompt.")
    tier = RemoteTier(store, request, manifest["generation"])
    device = torch.device(device) if device is not None else next(model.parameters()).device
    state = wire.decode(_read_record(tier, manifest), device)
    options = dict(state["config"])
    if cuda_graph is not None:
        options["cuda_graph"] = cuda_graph
    # Prefetches without `exact` can leave their store reads to after the step (`repair_after_step`): those steps
    # can be captured. A fetch on the critical path (lookahead "none", `exact`) reads the store inside the step.
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
    drafted = state.get("draft")
    if drafted is not None:
        options["draft"] = draft
    cache = OasisCache(model, measure=measure, **options)
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
    cache._start_engine(device)
    if deferred:
        cache._after_forward.append(_RepairAfterStep(cache))
    else:
        cache.streams.use_host_worker()  # a prefetch's store reads overlap the rest of the step
    cache.padding = state.get("padding")  # (a captured step is called without a mask: it reads this record)
    for idx, kept in state["kept"].items():
        cache.layers[idx].__dict__.update(kept)
    for idx, saved in state["oasis"].items():
        layer = cache.layers[idx]
        if not isinstance(layer, OasisLayer):
            raise ValueError(f"layer {idx} of the admission record is a full-attention layer; not in this model.")
        layer.__dict__.update(saved["layer"])
        _rebuild_working_set(layer, saved["recent_region"])
        layer.device = device
        layer.choose_kernels()  # this side's device decides
        meta = dict(saved["pool"])
        published = meta.pop("num_blocks")
        meta["chunk_blocks"] = min(meta["chunk_blocks"], DECODE_CHUNK_BLOCKS)
        pin = device.type == "cuda"
        pool = layer.pool = HostKVPool(**meta, pin_memory=pin)
        pool.num_blocks = pool.first_block = published  # the pool holds the blocks decode completes
        layer.reserve_ahead()
        one_step = pool.batch_size * pool.num_kv_heads * layer.working_set.num_slots
        units = local_cache_units or max(one_step, min(LOCAL_CACHE_STEPS * one_step, int(
            LOCAL_CACHE_SHARE * published * pool.batch_size * pool.num_kv_heads)))
        if published:
            pool.remote = LocalBlockCache(tier, idx, published, pool.batch_size, pool.num_kv_heads, pool.block_size,
                                          pool.head_dim, pool.dtype, units, pin, device)
            pool.remote.deferred = deferred
            pool.remote.overlap = overlap
    links = [layer.pool.remote for layer in cache.layers
             if isinstance(layer, OasisLayer) and layer.is_initialized and layer.pool.remote is not None]
    # the after-step repair plans every layer at once where the layers' local caches share one shape
    tier.local_group = LocalCacheGroup(links) if deferred and LocalCacheGroup.fits(links) else None
    tier.overlap = overlap
    cache.remote_tier = tier
    cache._remote_release = weakref.finalize(cache, _delete_quietly, tier)  # once: at `reset` or when dropped
    _fill_slots(cache, tier)
    return cache


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
        T, D = layer.pool.block_size, layer.pool.head_dim
        staging = torch.empty((b.numel(), 2, T, D), dtype=layer.pool.dtype,
                              pin_memory=layer.device.type == "cuda")
        units = list(zip(held[b, h, s].tolist(), b.tolist(), h.tolist()))
        size = staging[0].numel() * staging.element_size()
        wanted.setdefault(size, []).append((idx, layer, units, staging, (b, h, s)))
    for size, reads in wanted.items():
        tier.get_units_of_layers([(idx, units, [row.data_ptr() for row in staging], staging)
                                  for idx, _, units, staging, _ in reads], size)
        for _, layer, _, staging, (b, h, s) in reads:
            index = tuple(i.to(layer.device) for i in (b, h, s))
            layer.working_set.slots[(slice(None), *index)] = staging.to(layer.device).transpose(0, 1)


def _model_signature(model) -> dict:
    """What a decode side's model must share with the prefill's for the published keys and values to be its own: the
    architecture, the attention's shapes, rotary embedding, the weights' dtype, and a fingerprint of the weights that
    make keys and values (`_weights_fingerprint`)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    return {"model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "hidden_size": config.hidden_size,
            "rope": repr(getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)),
            "dtype": str(next(model.parameters()).dtype), "weights": _weights_fingerprint(model)}


FINGERPRINT_VALUES = 4096  # values read from each sampled tensor (spread over it)


def _weights_fingerprint(model) -> str:
    """A digest of values sampled from the weights that shape the keys and values: the input embeddings and, in the
    first, middle and last decoder layers, every parameter (a few thousand values each, spread over the tensor; in
    float32). Two models of one architecture with other weights differ here (a fine-tune, another seed); a model
    loaded in another dtype differs in its `dtype` already."""
    named = [(name, p) for name, p in model.named_parameters() if p.dim() >= 1]
    layer_ids = sorted({int(part) for name, _ in named for part, before in zip(name.split(".")[1:], name.split("."))
                        if before == "layers" and part.isdigit()})
    picked = {layer_ids[0], layer_ids[len(layer_ids) // 2], layer_ids[-1]} if layer_ids else set()
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    chosen = [p for p in ([embeddings.weight] if getattr(embeddings, "weight", None) is not None else [])]
    chosen += [p for name, p in named if any(f"layers.{i}." in name for i in picked)]
    digest = hashlib.sha256()
    with torch.no_grad():
        for p in chosen:
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_VALUES)
            digest.update(flat[::step][:FINGERPRINT_VALUES].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def _pending_links(cache: OasisCache) -> list:
    """The local caches of the admitted layers that hold a deferred record (`LocalBlockCache.defer`)."""
    return [layer.pool.remote for layer in cache.layers if isinstance(layer, OasisLayer) and layer.is_initialized
            and layer.pool.remote is not None and layer.pool.remote.pending is not None]


def repair_after_step(cache: OasisCache) -> None:
    """After a forward of an admitted cache whose prefetches are deferred: every layer's record read back in one
    copy (one sync); the units they wanted marked used and slots chosen for the missing ones, layer by layer
    (`LocalBlockCache.repair_plan`); one series of batched store reads for all layers; then each layer's gather of
    what they brought into its slots (`repair_gather`)."""
    links = _pending_links(cache)
    if not links:
        return
    cache.streams.compute_waits_for_side()  # the step's prefetches wrote the records on the side stream
    ids = [link.pending[1] for link in links]
    group = cache.remote_tier.local_group
    if group is not None and group.stacked(links):  # every layer's record in two tensors
        stacked_ids, _, stacked_wanted = group.records
        host = torch.cat([stacked_ids.flatten(), stacked_wanted.flatten().to(stacked_ids.dtype)])
    else:
        host = torch.cat([t.flatten() for t in ids] + [link.pending[3].flatten().to(ids[0].dtype) for link in links])
    waited = time.perf_counter()
    host = host.cpu()  # (waits for the step's end)
    started = time.perf_counter()
    if group is not None and group.holds(links) and len({t.shape for t in ids}) == 1:
        _repair_group(cache, group, links, host, ids[0].shape, waited, started)
        return
    offsets = [0]
    for t in ids:
        offsets.append(offsets[-1] + t.numel())
    repairs = []
    try:
        for i, link in enumerate(links):
            shape, lo, hi = ids[i].shape, offsets[i], offsets[i + 1]
            repairs.append(link.repair_plan(host[lo:hi].view(shape),
                                            host[offsets[-1] + lo : offsets[-1] + hi].view(shape).bool()))
        planned = time.perf_counter()
        tier = cache.remote_tier  # one series of batched store reads for every layer (not one per layer)
        for size in sorted({link.unit_nbytes for link in links}):
            tier.get_units_of_layers([link.reads(plan) for link, (plan, _) in zip(links, repairs)
                                      if plan is not None and link.unit_nbytes == size], size)
    except BaseException:
        for link, (plan, _) in zip(links, repairs):
            if plan is not None:
                link.failed(plan)
        raise
    read = time.perf_counter()
    for link, (plan, missing) in zip(links, repairs):
        if plan is not None:
            link.placed(plan)
        link.repair_gather(cache.transfer, missing)
    _count_repair(tier, waited, started, planned, read)


def _repair_group(cache, group, links, host, shape, waited, started) -> None:
    """`repair_after_step` for layers of one shape (`LocalCacheGroup`): the same decisions in a few operations."""
    n = host.numel() // 2
    ids, wanted = host[:n].view(len(links), *shape), host[n:].view(len(links), *shape).bool()
    tier = cache.remote_tier
    result = group.plan(ids, wanted)
    planned = time.perf_counter()
    if result is not None:
        plan, missing = result
        try:
            tier.get_units_of_layers(group.reads(plan), group.unit_nbytes)
        except BaseException:
            group.failed(plan)
            raise
    read = time.perf_counter()
    if result is not None:
        group.placed(plan)
        _gather_repaired(cache, links, list(missing), missing, group)
    else:
        _gather_repaired(cache, links, [None] * len(links), group=group)
    _count_repair(tier, waited, started, planned, read)


def _count_repair(tier, waited: float, started: float, planned: float, read: float) -> None:
    """A repair's host time between steps (bookkeeping and store reads) and its phases: the records' copy back (the
    wait for the step's end included), plan, store reads, maps and gathers (until now)."""
    done = time.perf_counter()
    tier.repair_seconds += done - started
    tier.repair_phases += torch.tensor([started - waited, planned - started, read - planned, done - read],
                                       dtype=torch.float64)
    tier.repairs += 1


READ_BATCH_UNITS = 256  # an overlapped repair reads the store once this many units are planned (and at the end)


def start_repair(cache: OasisCache) -> None:
    """`repair_after_step` begun while the step still runs (`admit(..., overlap=True)`): a host thread takes the
    layers' deferred records as they land (CUDA: after each layer's `ready` event, copied on a stream of its own),
    plans each layer's evictions (`LocalBlockCache.repair_plan`, the decisions of the other paths) and reads the store
    every `READ_BATCH_UNITS` planned units; the slot maps and the gathers into the working sets are finished on the
    step's thread before the next forward (`PrefetchStreams.finish_held`). Same working set before every step."""
    links = _pending_links(cache)
    if not links:
        return
    tier, streams = cache.remote_tier, cache.streams
    device = links[0].device
    cuda = device.type == "cuda"
    if cuda and any(link.ready is None for link in links):  # (a record made before `overlap` was set)
        repair_after_step(cache)
        return
    if cuda and tier.copies is None:
        tier.copies = torch.cuda.Stream(device)  # the helper's copies of the records (waits for their events only)
    copies = tier.copies if cuda else None
    plans: list = []  # (link, plan, missing entries), in layer order

    def work():
        started = time.perf_counter()
        waited = planned = reading = 0.0
        batch = []
        with contextlib.ExitStack() as stack:
            if cuda:
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(copies))
            for i, link in enumerate(links):
                t0 = time.perf_counter()
                if cuda:
                    copies.wait_event(link.ready)
                ids, wanted = link.pending[1].to("cpu"), link.pending[3].to("cpu")  # (waits for this record only)
                t1 = time.perf_counter()
                plan, missing = link.repair_plan(ids, wanted.bool())
                plans.append((link, plan, missing))
                if plan is not None:
                    batch.append((link, plan))
                t2 = time.perf_counter()
                waited, planned = waited + t1 - t0, planned + t2 - t1
                if batch and (sum(plan[0].numel() for _, plan in batch) >= READ_BATCH_UNITS or i == len(links) - 1):
                    for size in sorted({link.unit_nbytes for link, _ in batch}):
                        tier.get_units_of_layers([link.reads(plan) for link, plan in batch
                                                  if link.unit_nbytes == size], size)
                    batch = []
                    reading += time.perf_counter() - t2
        return waited, planned, reading

    def finish(future, abandon: bool) -> None:
        joined = time.perf_counter()
        try:
            waited, planned, reading = future.result()
        except BaseException:
            failed = True
            if not abandon:
                raise
        else:
            failed = abandon  # (an error elsewhere left the step: what was read is dropped with its slots)
        finally:
            if failed or abandon:  # every planned slot holds nothing usable: emptied (on this thread)
                for link, plan, _ in plans:
                    if plan is not None:
                        link.failed(plan)
        if failed:
            return
        exposed = time.perf_counter() - joined
        cache.streams.compute_waits_for_side()  # (the records and this step's gathers of what was here: side stream)
        group = tier.local_group
        if group is not None and group.holds([link for link, _, _ in plans]):
            _finish_as_group(cache, group, plans)
        else:
            for link, plan, missing in plans:
                if plan is not None:
                    link.placed(plan)
                link.repair_gather(cache.transfer, missing)
        done = time.perf_counter()
        tier.repair_seconds += planned + reading + done - joined - exposed
        tier.repair_phases += torch.tensor([waited, planned, reading, done - joined - exposed], dtype=torch.float64)
        tier.repair_exposed_seconds += done - joined
        tier.repairs += 1

    streams.hold(work, finish)


def _finish_as_group(cache, group, plans) -> None:
    """The maps and gathers of an overlapped repair whose layers form `group`: one copy of every layer's map changes
    and one of the gathers' masks to the device (as `_repair_group`)."""
    rows = [(i, plan) for i, (_, plan, _) in enumerate(plans) if plan is not None]
    if rows:
        group.placed(tuple(torch.cat(parts) for parts in zip(*[
            (torch.full_like(plan[0], i), plan[0], plan[1], plan[2]) for i, plan in rows])))
    _gather_repaired(cache, [link for link, _, _ in plans], [missing for _, _, missing in plans], group=group)


def _gather_repaired(cache, links, missing: list, stacked: torch.Tensor | None = None, group=None) -> None:
    """Each layer's repair gathers (`LocalBlockCache.repair_gather`) of its `missing` entries (host masks, None:
    nothing), their masks brought to the device in one copy where every layer's record has one shape (`stacked`:
    the masks already as one `[L, B, Hkv, W]` tensor). Where the records are rows of `group`'s stacked ones, their
    arena slots are looked up and the records cleared once for every layer."""
    present = [m is not None and bool(m.any()) for m in missing]
    on_device = None
    if any(present) and links[0].device.type == "cuda":
        shapes = {link.pending[3].shape for link in links}
        if stacked is None and len(shapes) == 1:
            (shape,) = shapes
            stacked = torch.stack([m if m is not None else torch.zeros(shape, dtype=torch.bool) for m in missing])
        if stacked is not None:
            on_device = stacked.pin_memory().to(links[0].device, non_blocking=True)  # one copy for every layer
    rows = group is not None and group.stacked(links)
    slots = group.record_slots() if rows and any(present) else None
    for i, link in enumerate(links):
        if present[i]:
            link.repair_gather(cache.transfer, missing[i], on_device[i] if on_device is not None else None,
                               slots[i] if slots is not None else None, clear=not rows)
        elif not rows:
            link.repair_gather(cache.transfer, None)
    if rows:
        group.records[2].fill_(False)


class _RepairAfterStep:
    """`OasisCache._after_forward` listener of an admitted cache with deferred prefetches (a weak reference: the
    cache still goes, and with it its request's keys, when its user drops it)."""

    def __init__(self, cache: OasisCache):
        self.cache = weakref.ref(cache)

    def __call__(self) -> None:
        cache = self.cache()
        if cache is not None:
            if cache.remote_tier is not None and cache.remote_tier.overlap:
                start_repair(cache)
            else:
                repair_after_step(cache)


_DRAFT_NOT_PUBLISHED = ("oracle", "_aux", "static_head")  # analysis hooks, one forward's captures, a local choice


def _head_fingerprint(head) -> list:
    """A few numbers that tell draft heads apart: shapes, and the first weights of its input and output layers."""
    return [list(head.fc.weight.shape), list(head.lm_head.weight.shape),
            head.fc.weight.detach().float().flatten()[:8].cpu().tolist(),
            head.lm_head.weight.detach().float().flatten()[:8].cpu().tolist()]


def _draft_state(ride) -> dict:
    return {"fingerprint": _head_fingerprint(ride.head),
            "state": {k: v for k, v in ride.state().items() if k not in _DRAFT_NOT_PUBLISHED}}


def _restore_draft(cache: OasisCache, drafted: dict, request: str) -> None:
    ride = cache.ride_along
    if ride is None or _head_fingerprint(ride.head) != drafted["fingerprint"]:
        raise ValueError(f"request {request!r} was published with lookahead='eagle3' and a draft head that this "
                         f"process {'did not load' if ride is None else 'does not have'}: admit with the prefill's "
                         f"head (admit(..., draft=<the same head or checkpoint>)).")
    ride.__dict__.update(drafted["state"])


def _detached(value):
    """`value` with every tensor detached (a prefill run outside `torch.no_grad` leaves tensors that require grad),
    objects copied shallowly with their attributes detached; the originals untouched."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type) and \
            type(value).__module__.startswith(("oasis_cache.", "transformers.")):
        new = copy.copy(value)
        new.__dict__ = _detached(vars(value))
        return new
    return value


def _delete_quietly(tier: RemoteTier, generation_only: bool = False) -> None:
    try:
        tier.delete(generation_only)
    except Exception:  # the store may be gone at interpreter exit
        pass


__all__ = ["publish", "publishing", "admit", "KEY_PREFIX"]
