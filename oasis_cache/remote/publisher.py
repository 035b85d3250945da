"""Publishing a prefilled cache to a Mooncake Store (the prefill side of `remote/__init__.py`): the request's record
(`oasis/{request}/record`, JSON: the generation, the admission record's digest, the model's configuration and a
fingerprint of its weights, the prompt's digest), the admission record in parts (`remote/wire.py`, no pickle), and
the blocks, one object per (block, sequence, KV head). A request published already is refused unless `replace=True`:
then the new generation's record replaces the old one in one step, and the old blocks are deleted after it."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import secrets

import torch

from ..cache import OasisCache
from ..layer import OasisLayer
from . import wire
from .mooncake import RemoteTier, StoreClient, record_key


RECORD_FORMAT = "oasis-cache admission record"
RECORD_VERSION = 6  # 3: no pickle (`wire`), generations, the weights' fingerprint, the working set's slots not in it;
# 4: a narrow pool's newest blocks as held (`newest`); 5: its sink blocks too; 6: int4 units in a rotated basis
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
    prompt = prompt_digest(input_ids, tokens) if input_ids is not None else None
    tier = _tier or RemoteTier(store, request, generation=_new_generation())
    before = _refuse_published(tier, replace)
    if cache.streams is not None:
        cache.streams.synchronize()  # prefetches and offloads landed
    if any(layer.pool.pin_memory for _, layer in layers if layer.is_initialized) and torch.cuda.is_available():
        torch.cuda.synchronize()  # the offload copies into the host pools
    try:
        report = _publish(cache, tier, prompt, tokens, before, _published)
    except BaseException:
        delete_quietly(tier, generation_only=True)  # nothing of this publication stays
        raise
    if before is not None:  # replaced: the record names the new generation now; the old one's blocks go
        delete_quietly(RemoteTier(tier.store, request, before["generation"]), generation_only=True)
    return report


def _publish(cache, tier: RemoteTier, prompt: str | None, tokens: int, before: dict | None,
             published: dict | None) -> dict:
    blocks_bytes = full = 0
    state = {"config": dataclasses.asdict(cache.config), "oasis": {}, "kept": {},
             "draft": _draft_state(cache.ride_along) if cache.ride_along is not None else None,
             "padding": cache.context.padding}  # the prompt's padding: decode steps called without a mask read it
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
            newest=_newest_as_held(layer) if pool.representation.narrow_form else None,
            pool=dict(batch_size=pool.batch_size, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                      block_size=pool.block_size, dtype=pool.dtype, chunk_blocks=pool.chunk_blocks,
                      host_dtype=pool.host_dtype, num_blocks=pool.num_blocks,
                      center=getattr(pool.representation, "center", None),  # (int4's key center)
                      rotated=getattr(pool.representation, "rotates", None)))  # (int4: in the rotated basis)
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
                "tokens": tokens, "prompt": prompt, "model": model_signature(cache._model())}
    text = json.dumps(manifest).encode()
    key = tier.record_key
    if before is None:  # (a put of a key that exists keeps the old value: the record read back says who won)
        status = tier.store.put(key, text)
    else:
        status = tier.store.upsert(key, text)
    if status != 0:
        raise RuntimeError(f"Mooncake Store refused the record of request {tier.request!r} (status {status}).")
    now = read_manifest(tier.store, tier.request)
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


def _newest_as_held(layer: OasisLayer) -> dict:
    """A narrow pool's sink and newest complete blocks as the working set holds them (in the model's dtype:
    `SlotMap.hold_newest`), which the store's narrow units cannot give back: `slots` `[B, Hkv, r]` (-1: not held) and
    their contents `kv` `[2, B, Hkv, r, T, D]`."""
    slot_map, ws = layer.slot_map, layer.working_set
    sinks = layer._cache.context.sink_blocks(layer)
    ids = slot_map.held_ids(layer.summaries.count, layer.config.num_recent_blocks, sinks)
    slots = torch.where(ids >= 0, slot_map.block_slot.gather(-1, ids.clamp(min=0)), -1)
    return dict(slots=slots, kv=ws.read_slots(slots.clamp(min=0)))


def _new_generation() -> str:
    return secrets.token_hex(8)


def _part_bytes(store) -> int:
    buffer = store.buffer_bytes if isinstance(store, StoreClient) else PART_BYTES * 4
    return max(1 << 16, min(PART_BYTES, buffer // 4))


def read_manifest(store, request: str) -> dict | None:
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
    before = read_manifest(tier.store, tier.request)
    if before is not None and not replace:
        raise AlreadyPublished(
            f"request {tier.request!r} is in the Mooncake Store already: publish(..., replace=True) replaces it "
            f"(its admitted caches then fail to read its old blocks), oasis_cache.remote.cleanup(store, "
            f"{tier.request!r}) removes it, or publish under a new name.")
    return before


def prompt_digest(input_ids, tokens: int) -> str:
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
        delete_quietly(self.tier, generation_only=True)  # nothing half-published stays
        if error is not None and exc_type is None:
            raise error
        return False


def model_signature(model) -> dict:
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


_DRAFT_NOT_PUBLISHED = ("oracle", "_aux", "static_head")  # analysis hooks, one forward's captures, a local choice


def head_fingerprint(head) -> list:
    """A few numbers that tell draft heads apart: shapes, and the first weights of its input and output layers."""
    return [list(head.fc.weight.shape), list(head.lm_head.weight.shape),
            head.fc.weight.detach().float().flatten()[:8].cpu().tolist(),
            head.lm_head.weight.detach().float().flatten()[:8].cpu().tolist()]


def _draft_state(ride) -> dict:
    return {"fingerprint": head_fingerprint(ride.head),
            "state": {k: v for k, v in ride.state().items() if k not in _DRAFT_NOT_PUBLISHED}}


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


def delete_quietly(tier: RemoteTier, generation_only: bool = False) -> None:
    try:
        tier.delete(generation_only)
    except Exception:  # the store may be gone at interpreter exit
        pass


__all__ = ["publish", "publishing", "AlreadyPublished"]
