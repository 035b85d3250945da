"""The package's own page-locked regions (`memory/pinned_regions.py`): the bookkeeping, on CPU without registration
(the CUDA side: `tests/test_cuda.py::test_a_prefill_pins_its_pools_in_one_region_reused_by_the_next_cache`)."""

import gc

import pytest
import torch

from oasis_cache.memory import pinned_regions
from oasis_cache.memory.pinned_regions import HUGE_PAGE, PinnedRegions

pytestmark = pytest.mark.skipif(not PinnedRegions().available, reason="maps memory through Linux's libc")


def test_chunks_come_back_when_their_last_view_goes_and_are_reused_without_a_new_mapping():
    regions = PinnedRegions(register=False)
    chunks = regions.reserve(100_000, 5)
    assert len(chunks) == 5 and all(c.numel() == 100_000 and c.dtype == torch.uint8 for c in chunks)
    assert len(regions.regions) == 1 and regions.regions[0].start % HUGE_PAGE == 0
    addresses = sorted(c.data_ptr() for c in chunks)
    assert all(b - a >= 100_000 and b % 4096 == 0 for a, b in zip(addresses, addresses[1:]))
    view = chunks[2].view(torch.bfloat16).view(2, 5, -1)  # (what a pool keeps: a typed, shaped view)
    view.fill_(1.5)
    kept = view.data_ptr()
    del chunks
    gc.collect()
    assert len(regions.returned) == 4  # the chunk under `view` is still out
    mapped = regions.mapped_total
    again = regions.reserve(100_000, 4)
    assert regions.mapped_total == mapped and kept not in {c.data_ptr() for c in again}
    assert regions.release_unused() == 0  # every chunk is out
    del view, again
    assert regions.release_unused() == mapped and regions.regions == [] and regions.held_bytes() == 0
    assert regions.reserve(100_000, 0) == [] and regions.mapped_total == mapped


def test_a_request_larger_than_the_free_chunks_maps_one_region_for_the_rest():
    regions = PinnedRegions(register=False)
    first = regions.reserve(8192, 3)
    del first
    more = regions.reserve(8192, 7)  # 3 reused, 4 in a new region
    assert len(more) == 7 and len(regions.regions) == 2 and regions.regions[1].count == 4
    other = regions.reserve(4096, 1)  # another size: a region of its own
    assert len(regions.regions) == 3 and other[0].numel() == 4096
    del more
    regions.release_unused()
    assert len(regions.regions) == 1  # the 4096-byte chunk is still out
    del other
    regions.release_unused()
    assert regions.regions == []


def test_a_forwards_stash_hands_out_what_it_reserved_and_gives_back_the_rest(monkeypatch):
    regions = PinnedRegions(register=False)
    monkeypatch.setattr(pinned_regions, "REGIONS", regions)
    pinned_regions.reserve_for_forward(4096, 3)  # outside a forward: nothing
    assert pinned_regions.take(4096) is None and regions.regions == []
    with pinned_regions.reserving():
        pinned_regions.reserve_for_forward(4096, 3)
        pinned_regions.reserve_for_forward(4096, 3)  # (a later chunk of the prompt: tops up, does not add)
        assert regions.regions[0].count == 3 and len(regions.regions) == 1
        taken = pinned_regions.take(4096)
        assert taken is not None and pinned_regions.take(8192) is None
        pinned_regions.reserve_for_forward(4096, 3)  # one taken: one more
        assert sum(r.count for r in regions.regions) == 4
    assert pinned_regions.take(4096) is None  # the forward is over
    regions.release_unused()
    assert len(regions.regions) == 1  # the region of the chunk taken stays
    del taken
    regions.release_unused()
    assert regions.regions == []


def test_a_refused_region_leaves_the_rest_to_torch_and_is_not_tried_again(monkeypatch):
    regions = PinnedRegions(register=False)
    tries = []

    def refused(*args):
        tries.append(args)
        raise MemoryError("cudaHostRegister of 2097152 bytes failed (CUDA error 2)")
    monkeypatch.setattr(pinned_regions, "Region", refused)
    assert regions.reserve(4096, 3) == [] and regions.reserve(4096, 3) == []
    assert len(tries) == 1 and "CUDA error 2" in regions.refused and regions.regions == []
