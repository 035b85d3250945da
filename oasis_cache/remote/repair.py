"""After a decode step of an admitted cache: the units a prefetch could not gather from the local cache are read
from the store and gathered into the working set (one sync per step), or, with `overlap`, read on a host thread while
the next step runs. Steps that read the store only here are captured as CUDA graphs like a local cache's."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch

from ..cache import OasisCache
from ..layer import OasisLayer


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


def _plan_and_read(links, tier, device, copies, plans: list) -> tuple[float, float, float]:
    """`start_repair`'s host thread: each layer's record copied once it landed, its evictions planned (appended to
    `plans`), the store read every `READ_BATCH_UNITS` planned units; returns the seconds waited, planning, reading."""
    cuda = device.type == "cuda"
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

    work = functools.partial(_plan_and_read, links, tier, device, copies, plans)

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


class RepairAfterStep:
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


