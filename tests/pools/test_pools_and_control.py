"""Model-free tests of the pools and the control plane, with exact expected orders."""

from __future__ import annotations

import copy

import pytest
import torch

from oasis_cache.control import rank_blocks, score_blocks, step_visibility, top_blocks
from oasis_cache.memory import TransferEngine
from oasis_cache.pools import BlockSummaries, HostKVPool, SlotMap, WorkingSet
from oasis_cache.pools.host_kv import READ_ONLY_COPY, SHARE_CHUNKS, fitted_chunk_blocks
from oasis_cache.pools.summaries import unpack_key_bits
from oasis_cache.runtime.build import cache_kwargs


def ids(*rows):
    return torch.tensor([[list(rows)]])


def sel(*rows):
    """Ranks that select exactly the True entries."""
    return torch.tensor([[[0.0 if r else -torch.inf for r in rows]]])


T = 4


def assign(sm, block_ids, ranks, step):
    visible = torch.zeros((1, 1, sm.num_slots * T + 3), dtype=torch.bool)
    counts = torch.zeros(4, dtype=torch.int64)
    placed = sm.assign(block_ids, ranks, step, visible, counts, T)
    placed.visible, placed.counts = visible, counts
    return placed


class TestSlotMap:
    def test_fills_free_slots_in_order_then_keeps_hits_in_place(self):
        sm = SlotMap(1, 1, num_slots=3, device="cpu")
        sm.reserve(10)
        a = assign(sm, ids(4, 7, 2), sel(True, True, True), step=1)
        assert a.dest.tolist() == [[[0, 1, 2]]] and a.fetch.all() and a.counts[1] == 0
        assert sm.slot_block[0, 0, :3].tolist() == [4, 7, 2]
        b = assign(sm, ids(2, 9, 4), sel(True, True, True), step=2)
        # 2 and 4 stay where they are; 9 replaces the only unselected block, 7 in slot 1.
        assert b.dest.tolist() == [[[2, 1, 0]]]
        assert b.fetch.tolist() == [[[False, True, False]]]
        assert b.counts.tolist() == [3, 2, 1, 3 * T]  # selected, resident, fetched, tokens
        assert sm.slot_block[0, 0, :3].tolist() == [4, 9, 2]
        assert sm.block_slot[0, 0, 7] == -1 and sm.block_slot[0, 0, 9] == 1

    def test_evicts_least_recently_selected(self):
        sm = SlotMap(1, 1, num_slots=4, device="cpu")
        sm.reserve(20)
        assign(sm, ids(1, 2), sel(True, True), step=1)  # slots 0, 1
        assign(sm, ids(3, 4), sel(True, True), step=2)  # free slots 2, 3
        assign(sm, ids(1, 5), sel(True, True), step=3)  # 1 hits (slot 0); 5 evicts 2 (slot 1, used at step 1)
        assert sm.slot_block[0, 0, :4].tolist() == [1, 5, 3, 4]
        assign(sm, ids(6, 7), sel(True, True), step=4)  # evict 3 (step 2, slot 2) then 4 (step 2, slot 3)
        assert sm.slot_block[0, 0, :4].tolist() == [1, 5, 6, 7]
        assert sm.last_used[0, 0, :4].tolist() == [3, 3, 4, 4]

    def test_unselected_entries_change_nothing(self):
        sm = SlotMap(1, 1, num_slots=2, device="cpu")
        sm.reserve(8)
        a = assign(sm, ids(3, 5), sel(True, False), step=1)
        assert a.dest.tolist() == [[[0, 2]]]  # 2 = the scratch slot
        assert a.visible[0, 0].tolist() == [True] * T + [False] * T + [False] * 3  # slot 0's tokens only
        assert sm.slot_block[0, 0, :2].tolist() == [3, -1] and sm.block_slot[0, 0, 5] == -1

    def test_forget_blocks_from(self):
        sm = SlotMap(1, 1, num_slots=3, device="cpu")
        sm.reserve(8)
        assign(sm, ids(1, 6, 4), sel(True, True, True), step=1)
        sm.forget_blocks_from(4)
        assert sm.slot_block[0, 0, :3].tolist() == [1, -1, -1]
        assert sm.block_slot[0, 0, :8].tolist() == [-1, 0, -1, -1, -1, -1, -1, -1]


def test_score_is_an_upper_bound_of_every_key_in_the_block():
    torch.manual_seed(0)
    B, H, R, NB, T, D = 2, 3, 4, 5, 16, 8
    keys = torch.randn(B, H, NB, T, D)
    query = torch.randn(B, H, R, D)
    scores = score_blocks(query, keys.amin(dim=3), keys.amax(dim=3))  # [B, H, NB]
    exact = torch.einsum("bhrd,bhntd->bhrnt", query, keys).amax(dim=(2, 4))  # best key, best row
    assert (scores >= exact - 1e-5).all()
    # The bound is tight for a one-token block.
    one = keys[:, :, :, :1]
    torch.testing.assert_close(
        score_blocks(query, one.amin(dim=3), one.amax(dim=3)),
        torch.einsum("bhrd,bhnd->bhrn", query, one[:, :, :, 0]).amax(dim=2),
    )


def summaries_of(keys: torch.Tensor, scorer: str) -> BlockSummaries:
    """Summaries of `keys` `[B, H, NB, T, D]` for `scorer`."""
    B, H, NB, T, D = keys.shape
    s = BlockSummaries(B, H, D, keys.dtype, "cpu", T, key_bits=scorer == "bits")
    s.append(keys)
    return s


def coarse_keys(keys: torch.Tensor) -> torch.Tensor:
    """`[..., T, D]` -> each channel replaced by the mean of the block's values on its side of the block mean."""
    above = keys > keys.mean(dim=-2, keepdim=True)
    high = (keys * above).sum(-2, keepdim=True) / above.sum(-2, keepdim=True).clamp(min=1)
    low = (keys * ~above).sum(-2, keepdim=True) / (~above).sum(-2, keepdim=True)
    return torch.where(above, high, low)


def test_bits_score_is_the_best_coarse_key_of_each_block():
    """Each channel coded by whether the key lies above the block mean and read back as the mean of its side; the
    block's score is its best token, never above the bound; with two tokens per block the coarse keys are the keys
    themselves (so the score is exact)."""
    torch.manual_seed(0)
    B, H, R, NB, T, D = 2, 3, 4, 5, 16, 8
    keys = torch.randn(B, H, NB, T, D)
    query = torch.randn(B, H, R, D)
    s = summaries_of(keys, "bits")
    expected = torch.einsum("bhrd,bhntd->bhrnt", query, coarse_keys(keys)).amax(dim=(2, 4))
    no_forced, all_allowed = torch.zeros(B, NB, dtype=torch.bool), torch.ones(B, NB, dtype=torch.bool)
    got = rank_blocks(query, s, no_forced, all_allowed, T)
    torch.testing.assert_close(got, expected)
    assert (got <= score_blocks(query, keys.amin(dim=3), keys.amax(dim=3)) + 1e-5).all()
    pairs = keys[:, :, :, :2]
    got = rank_blocks(query, summaries_of(pairs, "bits"), no_forced, all_allowed, 2)
    torch.testing.assert_close(got, torch.einsum("bhrd,bhntd->bhrnt", query, pairs).amax(dim=(2, 4)))


def test_the_kernel_ranking_gets_its_options(monkeypatch):
    """`rank_blocks(use_kernel=True)` hands the summaries' channels, scales and the split to the kernel (whose
    results are checked against these ops in `kernel_cases.py`: interpreter and CUDA)."""
    from oasis_cache.kernels import block_scores as module

    calls = []
    monkeypatch.setattr(module, "block_scores", lambda *args, **kwargs: calls.append(kwargs))
    s = summaries_of(torch.randn(1, 2, 3, 16, 8), "bits")
    none, every = torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)
    for split in (False, True):
        rank_blocks(torch.randn(1, 4, 2, 8), s, none, every, 16, use_kernel=True, split_last=split)
        assert calls[-1]["split_last"] is split
        assert calls[-1]["channels"] is s.channels and calls[-1]["scales"] is s.scales


def test_bits_rank_the_block_holding_the_matching_key_first_where_the_bound_does_not():
    """Block 0 spreads its keys over the channels (one large channel each: a high bound, no key near q); block 1
    holds one key along q. The bound prefers block 0, the bits scorer block 1 — as exact attention would."""
    D, T = 4, 4
    q = torch.ones(1, 1, 1, D)
    spread = 3.0 * torch.eye(D)  # bound 12, best key 3
    needle = torch.zeros(T, D)
    needle[1] = 2.0  # bound 8, best key 8
    keys = torch.stack((spread, needle))[None, None]  # [1, 1, 2, T, D]
    none, every = torch.zeros(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool)
    assert rank_blocks(q, summaries_of(keys, "bound"), none, every, T).tolist() == [[[12.0, 8.0]]]
    assert rank_blocks(q, summaries_of(keys, "bits"), none, every, T).tolist() == [[[3.0, 8.0]]]


def test_selection_forced_first_never_disallowed():
    D = 4
    # One query row of ones: a block's bound is the sum of its kmax; every block's keys span [kmax - 1, kmax].
    kmax = torch.tensor([5.0, 1.0, 9.0, 3.0, 7.0, 8.0])[None, None, :, None].expand(1, 1, 6, D) / D
    minmax = BlockSummaries(1, 1, D, torch.float32, "cpu", 2, key_bits=False)
    minmax.append(torch.stack((kmax - 1, kmax), dim=3))
    query = torch.ones(1, 1, 1, D)
    forced = torch.tensor([[False, True, False, False, False, False]])
    allowed = torch.tensor([[True, True, True, True, True, False]])
    ranks = rank_blocks(query, minmax, forced, allowed, 2)
    assert ranks.tolist() == [[[5.0, torch.inf, 9.0, 3.0, 7.0, -torch.inf]]]
    block_ids, top = top_blocks(ranks, 3)
    assert sorted(block_ids[0, 0].tolist()) == [1, 2, 4] and (top > -torch.inf).all()
    ranks = rank_blocks(query, minmax, forced, torch.tensor([[False, True, False, False, False, False]]), 2)
    block_ids, top = top_blocks(ranks, 3)
    chosen = block_ids[0, 0][top[0, 0] > -torch.inf].tolist()
    assert chosen == [1]


def test_step_visibility_sink_follows_left_padding():
    visible = torch.zeros(2, 100, dtype=torch.bool)
    visible[0, :] = True
    visible[1, 37:] = True
    v = step_visibility(visible, 2, num_blocks=6, count=torch.tensor([6]), width=8, block_size=16, sink_tokens=16,
                        num_recent_blocks=1, device="cpu")
    assert v.allowed.tolist() == [[True] * 6 + [False] * 2, [False, False, True, True, True, True, False, False]]
    assert v.forced.tolist() == [
        [True, False, False, False, False, True, False, False],
        [False, False, True, True, False, True, False, False],  # tokens 37..52 span blocks 2 and 3
    ]
    assert v.recent.shape == (2, 4)


def test_step_visibility_without_padding_reads_the_block_count_on_the_device():
    """Without padding the masks come from the device count alone: the same operators for any block count (what
    a captured step replays), blocks past the count never allowed."""
    count = torch.tensor([5])
    v = step_visibility(None, 1, num_blocks=5, count=count, width=8, block_size=16, sink_tokens=16,
                        num_recent_blocks=2, device="cpu")
    assert v.allowed.tolist() == [[True] * 5 + [False] * 3]
    assert v.forced.tolist() == [[True, False, False, True, True, False, False, False]]
    count.fill_(7)  # what a replay would read after two blocks completed
    v = step_visibility(None, 1, num_blocks=7, count=count, width=8, block_size=16, sink_tokens=16,
                        num_recent_blocks=2, device="cpu")
    assert v.allowed.tolist() == [[True] * 7 + [False]]
    assert v.forced.tolist() == [[True, False, False, False, False, True, True, False]]


def test_host_pool_offload_and_load_roundtrip_across_chunks():
    B, H, T, D = 2, 3, 4, 5
    pool = HostKVPool(B, H, D, T, torch.float32, chunk_blocks=3, pin_memory=False)
    engine = TransferEngine("torch", torch.device("cpu"))
    first = torch.randn(2, B, H, 4, T, D)
    second = torch.randn(2, B, H, 5, T, D)
    engine.offload(pool, first)
    engine.offload(pool, second)
    assert pool.num_blocks == 9 and len(pool.chunks) == 3
    assert torch.equal(engine.load_range(pool, 0, 9), torch.cat([first, second], dim=3))
    assert torch.equal(engine.load_range(pool, 2, 7), torch.cat([first, second], dim=3)[:, :, :, 2:7])
    # written into the first tokens of a `[2, B, H, L, D]` buffer (a dense forward's keys and values), the rest kept
    buffer = torch.full((2, B, H, 7 * T + 3, D), 7.0)
    into = buffer[:, :, :, : 5 * T].view(2, B, H, 5, T, D)
    assert engine.load_range(pool, 2, 7, out=into) is into
    assert torch.equal(into, torch.cat([first, second], dim=3)[:, :, :, 2:7])
    assert (buffer[:, :, :, 5 * T :] == 7.0).all()


def test_pinned_chunks_fill_the_power_of_two_allocation_torch_makes():
    block = 2 * 24 * 3 * 16 * 64 * 4  # SmolLM2 in fp32 at a batch of 24: 589,824 bytes a block
    assert fitted_chunk_blocks(256, block, pin_memory=False) == 256  # (pageable memory: as asked)
    fitted = fitted_chunk_blocks(256, block, pin_memory=True)
    assert fitted == 455 and fitted * block <= 2**28 < (fitted + 1) * block  # 151 MB asked, 256 MiB pinned
    assert fitted_chunk_blocks(256, 2 * 8 * 16 * 128 * 2, pin_memory=True) == 256  # Qwen3-8B, batch 1: 16 MiB
    assert fitted_chunk_blocks(3, 96, pin_memory=True) == 5  # 288 bytes asked, 512 pinned
    assert HostKVPool(2, 3, 5, 4, torch.float32, chunk_blocks=3, pin_memory=False).chunk_blocks == 3


def test_a_shared_copy_shares_full_chunks_and_copies_the_blocks_in_use():
    B, H, T, D = 2, 3, 4, 5
    pool = HostKVPool(B, H, D, T, torch.float32, chunk_blocks=3, pin_memory=False)
    engine = TransferEngine("torch", torch.device("cpu"))
    data = torch.randn(2, B, H, 7, T, D)
    engine.offload(pool, data)
    pool.reserve(10)  # chunks: 0-2, 3-5 full; 6 in use in the third; the fourth empty
    fork = copy.deepcopy(pool, {SHARE_CHUNKS: True})
    assert [a is b for a, b in zip(pool.chunks, fork.chunks)] == [True, True, False, False]
    assert pool.shared == fork.shared == {0, 1}
    assert torch.equal(engine.load_range(fork, 0, 7), data)
    more = torch.randn(2, B, H, 2, T, D)
    engine.offload(fork, more)  # blocks 7, 8: the fork's own third chunk
    assert torch.equal(engine.load_range(pool, 0, 7), data) and pool.num_blocks == 7
    assert torch.equal(engine.load_range(fork, 0, 9), torch.cat([data, more], dim=3))
    pool.truncate(4)  # into shared chunk 1: the pool's own copy of its block 3, chunk 0 still shared
    assert pool.shared == {0} and pool.chunks[1] is not fork.chunks[1]
    assert torch.equal(engine.load_range(pool, 0, 4), data[:, :, :, :4])
    engine.offload(pool, more)  # blocks 4, 5 of the pool: the fork's stay
    assert torch.equal(engine.load_range(fork, 0, 9), torch.cat([data, more], dim=3))
    pool.index_batch(torch.tensor([1, 0]))
    assert torch.equal(engine.load_range(pool, 0, 6), torch.cat([data[:, :, :, :4], more], dim=3).flip(1))


def test_a_read_only_copy_shares_every_chunk_and_refuses_host_writes():
    """A dry step's copy (`runtime/ahead.py`): every chunk shared, neither pool marks any (the original's crops copy
    nothing on its account); a host write from the copy would land in the original's chunks, so it raises."""
    B, H, T, D = 1, 2, 4, 5
    pool = HostKVPool(B, H, D, T, torch.float32, chunk_blocks=3, pin_memory=False)
    engine = TransferEngine("torch", torch.device("cpu"))
    data = torch.randn(2, B, H, 7, T, D)
    engine.offload(pool, data)
    dry = copy.deepcopy(pool, {READ_ONLY_COPY: True})
    assert all(a is b for a, b in zip(pool.chunks, dry.chunks)) and pool.shared == dry.shared == set()
    assert dry.read_only and not pool.read_only
    with pytest.raises(RuntimeError, match="dry step"):
        engine.offload(dry, torch.randn(2, B, H, 2, T, D))
    assert torch.equal(engine.load_range(pool, 0, 7), data) and pool.num_blocks == 7


def test_fetch_copies_exactly_the_flagged_blocks():
    B, H, T, D, S = 2, 2, 4, 3, 3
    pool = HostKVPool(B, H, D, T, torch.float32, chunk_blocks=2, pin_memory=False)
    engine = TransferEngine("torch", torch.device("cpu"))
    data = torch.randn(2, B, H, 7, T, D)
    engine.offload(pool, data)
    ws = WorkingSet(B, H, S, T, 0, D, torch.float32, "cpu")
    ws.kv.fill_(-1.0)
    block_ids = torch.tensor([[[6, 1, 3], [0, 5, 2]], [[4, 4, 4], [2, 3, 6]]])
    dest = torch.tensor([[[2, 0, 1], [1, 2, 0]], [[0, 1, 2], [2, 1, 0]]])
    fetch = torch.tensor([[[True, True, False], [True, False, True]], [[True, False, False], [True, True, True]]])
    engine.fetch(pool, ws, block_ids, dest, fetch)
    slots = ws.slots
    for b in range(B):
        for h in range(H):
            for k in range(3):
                got = slots[:, b, h, dest[b, h, k]]
                if fetch[b, h, k]:
                    assert torch.equal(got, data[:, b, h, block_ids[b, h, k]])
    assert (slots[:, 0, 0, 1] == -1).all() and (slots[:, 1, 0, 1:3] == -1).all()  # untouched slots


def test_summaries_grow_and_truncate():
    s = BlockSummaries(1, 2, 4, torch.float32, "cpu", 8, key_bits=False)
    blocks = torch.randn(1, 2, 40, 8, 4)
    s.append(blocks[:, :, :10])
    s.append(blocks[:, :, 10:])
    kmin, kmax = s.view()
    assert torch.equal(kmin, blocks.amin(dim=3)) and torch.equal(kmax, blocks.amax(dim=3))
    s.truncate(7)
    assert s.view()[0].shape == (1, 2, 7, 4)


def test_the_summaries_capacity_is_that_of_the_largest_count_reserved_whatever_the_steps():
    """`capacity_for`: a multiple of 64 blocks, at most a sixteenth over the count past 1,024; a prompt's blocks
    reserved at once (a chunked prefill), one reservation at a time (growth block by block) or in a fork's two parts
    end at the same capacity, which decides the order of equal-scored blocks in the selection."""
    from oasis_cache.pools.summaries import capacity_for

    for n in [1, 63, 64, 65, 1000, 1024, 1025, 2049, 8193, 131072 // 16 + 1]:
        c = capacity_for(n)
        assert c >= n and c % 64 == 0 and c - n < max(64, n // 16)
    rng = torch.Generator().manual_seed(0)
    for final in (75, 1100, 2305, 9000):
        ways = [[final], list(range(1, final + 1)), [final // 3, final]]
        ways.append(sorted(torch.randint(1, final + 1, (12,), generator=rng).tolist()) + [final])
        capacities = set()
        for steps in ways:
            s = BlockSummaries(1, 1, 4, torch.float32, "cpu", 16, key_bits=True)
            for n in steps:
                s.reserve(n)
            capacities.add(s.capacity_blocks)
        assert capacities == {capacity_for(final)}, final


def test_key_bits_follow_growth_truncation_and_batch_reorder():
    B, H, T, D = 3, 2, 16, 5
    blocks = torch.randn(B, H, 90, T, D)
    blocks[0, 0, 3] = 1.5  # a block of equal keys: no key above the mean, both levels equal
    s = BlockSummaries(B, H, D, torch.float32, "cpu", T, key_bits=True)
    for start in (0, 30, 80):  # grows past the first capacity (64 blocks)
        s.append(blocks[:, :, start : start + (30 if start < 60 else 10)])
    s.truncate(60)
    s.append(blocks[:, :, 60:90])
    assert s.num_blocks == 90 and s.codes.shape[2] >= 90
    above = blocks > blocks.mean(dim=3, keepdim=True)
    coarse = coarse_keys(blocks)
    low, high = s.view()

    def decoded():
        return torch.where(unpack_key_bits(s.codes[:, :, :90], T), high[:, :, :, None], low[:, :, :, None])

    assert torch.equal(unpack_key_bits(s.codes[:, :, :90], T), above)
    torch.testing.assert_close(decoded(), coarse)
    order = torch.tensor([2, 0, 0])
    s.index_batch(order)
    low, high = s.view()
    assert torch.equal(unpack_key_bits(s.codes[:, :, :90], T), above[order])
    torch.testing.assert_close(decoded(), coarse[order])
    assert s.nbytes == s.levels.numel() * 4 + s.codes.numel()


def test_fp8_levels_are_scaled_powers_of_two_within_fp8_rounding():
    """fp8 levels: each block's scale is a power of two that brings its largest level to at most 448; the levels
    read back within fp8's rounding (2^-4 relative) of the exact ones, through growth and batch reorder."""
    B, H, T, D = 2, 3, 16, 8
    blocks = torch.randn(B, H, 80, T, D) * torch.logspace(-3, 3, 80)[None, None, :, None, None]  # scales vary
    s = BlockSummaries(B, H, D, torch.bfloat16, "cpu", T, key_bits=True, fp8_levels=True)
    s.append(blocks[:, :, :50].bfloat16())
    s.append(blocks[:, :, 50:].bfloat16())
    exact = BlockSummaries(B, H, D, torch.float32, "cpu", T, key_bits=True)
    exact.append(blocks.bfloat16().float())
    assert s.levels.dtype == torch.float8_e4m3fn and torch.equal(s.codes[:, :, :80], exact.codes[:, :, :80])
    scales = s.scales[:, :, :80]
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    assert (s.levels[:, :, :, :80].float().abs() <= 448).all()
    for got, want in zip(s.view(), exact.view()):
        assert ((got - want).abs() <= want.abs() * 2**-4 + scales[..., None] * 2**-9).all()
    s.index_batch(torch.tensor([1, 1]))
    torch.testing.assert_close(s.view()[1][0], s.view()[1][1])
    assert s.nbytes == s.levels.numel() + s.codes.numel() + s.scales.numel() * 4


def test_fp8_levels_by_default_where_they_run(monkeypatch):
    """`fp8_levels=None` (the default): fp8 levels with the bits scorer, except where the Triton kernels meet a GPU
    that cannot convert fp8 (compute capability < 8.9: bf16 levels there, and True is an error naming the ways out);
    the bound never. `stats()` says which."""
    from oasis_cache import OasisCache
    from oasis_cache.pools.summaries import fp8_levels_for

    from conftest import prompt_ids, tiny_model

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fp8_levels_for(None, "bits", cpu, use_kernels=False)
    assert not fp8_levels_for(None, "bound", cpu, use_kernels=False)
    assert not fp8_levels_for(False, "bits", cpu, use_kernels=False)
    for capability, fp8 in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_levels_for(None, "bits", cuda, use_kernels=True) == fp8
        assert fp8_levels_for(None, "bits", cuda, use_kernels=False)  # the torch path converts anywhere
        if not fp8:
            with pytest.raises(ValueError, match="cannot convert fp8 on this GPU.*backend='torch'"):
                fp8_levels_for(True, "bits", cuda, use_kernels=True)
    model = tiny_model("llama")
    for kwargs, expected in ((dict(), True), (dict(fp8_levels=False), False), (dict(scorer="bound"), False)):
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=64, sink_tokens=16, recent_tokens=16, **kwargs)))
        assert cache.stats()["fp8_levels"] is None  # not resolved before a layer has seen its device
        with torch.no_grad():
            model(input_ids=prompt_ids(100), past_key_values=cache, use_cache=True)
        assert cache.stats()["fp8_levels"] is expected


def test_summary_channels_default_to_half_with_the_bits_scorer():
    """summary_channels=None: half the key channels with the bits scorer (where that keeps an even number), every
    channel with the bound scorer or a head too narrow to halve; `stats()` reports the share once resolved."""
    from oasis_cache import OasisCache
    from oasis_cache.config import OasisConfig
    from conftest import prompt_ids, tiny_model

    assert OasisConfig(token_budget=256).kept_channels(128) == 64
    assert OasisConfig(token_budget=256).kept_channels(4) == 2
    assert OasisConfig(token_budget=256).kept_channels(6) == 6  # 3 channels would split a rotary pair
    assert OasisConfig(token_budget=256, scorer="bound").kept_channels(128) == 128
    assert OasisConfig(token_budget=256, summary_channels=1.0).kept_channels(128) == 128
    model = tiny_model("llama")
    for kwargs, expected in ((dict(), 0.5), (dict(summary_channels=1.0), 1.0), (dict(scorer="bound"), 1.0)):
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=64, sink_tokens=16, recent_tokens=16, **kwargs)))
        assert cache.stats()["summary_channels"] is None
        with torch.no_grad():
            model(input_ids=prompt_ids(100), past_key_values=cache, use_cache=True)
        assert cache.stats()["summary_channels"] == expected


def test_summaries_on_half_the_channels():
    """summary_channels < 1: the channels are chosen once (`fix_channels`, at the first decode step), by rotary pairs
    of largest mean |k| in each sequence and KV head over the blocks so far, however they were appended; those
    blocks' summaries are kept on them and later blocks summarized on the same channels; queries are read on them;
    the summaries shrink by the fraction; a batch reorder moves them."""
    from oasis_cache.pools.summaries import key_channels

    B, H, T, D = 2, 3, 16, 8
    blocks = torch.randn(B, H, 40, T, D)
    blocks[0, 1, :, :, 2] *= 10  # channel 2 (paired with 6) dominates sequence 0's head 1
    blocks[0, 1, :, :, 6] *= 10
    s = BlockSummaries(B, H, D, torch.float32, "cpu", T, key_bits=True, kept_channels=4)
    assert not s.channels_fixed
    s.append(blocks[:, :, :10])
    s.append(blocks[:, :, 10:30])  # (a prefill in two chunks)
    assert not s.channels_fixed and s.levels.shape[-1] == D  # every channel until chosen
    s.fix_channels()
    chosen = s.channels.clone()
    assert s.channels_fixed and chosen.shape == (B, H, 4)
    assert torch.equal(chosen, key_channels(blocks[:, :, :30], 4))
    assert {2, 6} <= set(chosen[0, 1].tolist()) and (chosen[..., 2:] == chosen[..., :2] + D // 2).all()
    blocks[:, :, 30] *= 100  # a later block with other loud channels: the choice stays
    s.append(blocks[:, :, 30:31])
    assert torch.equal(s.channels, chosen) and s.levels.shape[-1] == 4 and s.codes.shape[-1] == 4
    full = BlockSummaries(B, H, D, torch.float32, "cpu", T, key_bits=True)
    full.append(blocks[:, :, :31])
    assert s.nbytes - s.channels.numel() * 8 == full.nbytes // 2

    picked = blocks[:, :, :31].gather(-1, chosen[:, :, None, None].expand(B, H, 31, T, 4))
    reference = BlockSummaries(B, H, 4, torch.float32, "cpu", T, key_bits=True)
    reference.append(picked)  # the same summaries, built from the chosen channels directly
    query = torch.randn(B, 2 * H, 1, D)  # two query heads per KV head
    q_picked = query.gather(-1, chosen.repeat_interleave(2, dim=1)[:, :, None, :])
    none, every = torch.zeros(B, 31, dtype=torch.bool), torch.ones(B, 31, dtype=torch.bool)
    torch.testing.assert_close(rank_blocks(query, s, none, every, T), rank_blocks(q_picked, reference, none, every, T))
    order = torch.tensor([1, 1])
    s.index_batch(order)
    assert torch.equal(s.channels, chosen[order])


def test_summary_channels_are_the_prompts_whatever_its_chunks_batch_and_padding():
    """The summaries' channels come from the prompt's real tokens, chosen at the first decode step: a prompt gets the
    same channels and decodes the same tokens alone, in a left-padded batch where it is mostly padding, and prefilled
    in chunks of any size (taken from the first chunk's blocks, padding included, they would
    change with the batch and the chunk size)."""
    from conftest import left_padded, tiny_model

    from oasis_cache import OasisCache
    from oasis_cache.pools.summaries import key_channels

    blocks = torch.randn(1, 1, 3, 4, 8)
    real = torch.zeros(1, 3, 4, dtype=torch.bool)
    real[0, 2] = True
    blocks[0, :, :2, :, 1] = blocks[0, :, :2, :, 5] = 100.0  # loud padding on channels 1 and 5
    assert torch.equal(key_channels(blocks, 2, real), key_channels(blocks[:, :, 2:], 2))  # padding weighs nothing

    model = tiny_model("llama", num_hidden_layers=2)
    batch = left_padded([480, 320])
    alone = {k: v[1:, -320:] for k, v in batch.items()}
    runs = []
    for inputs, chunk in ((alone, 0), (alone, 64), (batch, 0), (batch, 192)):  # (budget 128 of 320 tokens)
        cache = OasisCache(model, token_budget=128, prefill_chunk_tokens=chunk, advanced=dict(summary_channels=0.5))
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=0, **cache.generate_kwargs())
        channels = [layer.summaries.channels[-1] for layer in cache.layers]
        runs.append((channels, out[-1, inputs["input_ids"].shape[1]:].tolist(), chunk))
    for channels, tokens, chunk in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(channels, runs[0][0])), chunk
        assert tokens == runs[0][1], chunk


def test_attention_over_two_sets_of_keys_merges_into_attention_over_both():
    """`compute.dense.merge_partial` (a prompt's chunk over its past and over itself, each with its log-sum-exp, on
    CUDA by cuDNN: `_past_then_chunk`) equals one softmax over all the keys, in both log-sum-exp shapes."""
    from oasis_cache.compute import dense

    torch.manual_seed(0)
    B, H, Qn, P, D = 2, 3, 6, 11, 8
    q, k, v = torch.randn(B, H, Qn, D), torch.randn(B, H, P + Qn, D) * 2, torch.randn(B, H, P + Qn, D)
    scores = q @ k.transpose(-1, -2) * 0.4
    scores[..., P:] = scores[..., P:].masked_fill(torch.ones(Qn, Qn, dtype=torch.bool).triu(1), float("-inf"))
    whole = torch.softmax(scores, -1) @ v
    past, own = scores[..., :P], scores[..., P:]
    own_out = torch.softmax(own, -1) @ v[:, :, P:]
    kept = own_out.clone()
    merged = dense.merge_partial(torch.softmax(past, -1) @ v[:, :, :P], past.logsumexp(-1),
                                 own_out, own.logsumexp(-1)[..., None])
    torch.testing.assert_close(merged, whole)
    assert torch.equal(own_out, kept)  # (the parts are left as they were)
    half = dense.merge_partial((torch.softmax(past, -1) @ v[:, :, :P]).bfloat16(), past.logsumexp(-1),
                               (torch.softmax(own, -1) @ v[:, :, P:]).bfloat16(), own.logsumexp(-1))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), whole, atol=2e-2, rtol=2e-2)


def test_dense_causal_attention_masks_align_bottom_right(monkeypatch):
    """`compute.dense.dense_causal_attention` for Qn new queries after a past: no mask, an all-visible mask (one
    batched SDPA call, as without a mask), left padding (a call per sequence) and a hole in the mask all equal an
    explicit bottom-right causal softmax."""
    from oasis_cache.compute import dense

    torch.manual_seed(0)
    B, Hq, H, Qn, L, D = 3, 4, 2, 5, 19, 8
    q, k, v = torch.randn(B, Hq, Qn, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)

    def reference(visible):
        kk, vv = k.repeat_interleave(Hq // H, 1), v.repeat_interleave(Hq // H, 1)
        causal = torch.arange(L)[None, :] <= torch.arange(L - Qn, L)[:, None]
        allowed = causal[None] & visible[:, None, :]  # (a hidden query's own key hidden too, as in SDPA's mask)
        scores = (q @ kk.transpose(-1, -2)) * 0.3
        weights = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
        return weights.nan_to_num(0.0) @ vv  # (a row that sees nothing: zeros, as SDPA gives)

    calls = []
    causal = dense._sdpa_causal
    monkeypatch.setattr(dense, "_sdpa_causal", lambda *a: calls.append(a[0].shape[0]) or causal(*a))
    everything = torch.ones(B, L, dtype=torch.bool)
    torch.testing.assert_close(dense.dense_causal_attention(q, k, v, None, 0.3), reference(everything))
    calls.clear()
    torch.testing.assert_close(dense.dense_causal_attention(q, k, v, everything, 0.3), reference(everything))
    assert calls == [B]  # one batched call
    left = everything.clone()
    left[0, :4] = left[2, :1] = False
    calls.clear()
    out = dense.dense_causal_attention(q, k, v, left, 0.3)
    assert calls == [1] * B  # a call per sequence, on its unpadded tokens
    real = torch.ones(B, Qn, dtype=torch.bool)  # (every query is a real token here)
    torch.testing.assert_close(out[real[:, None, :, None].expand_as(out)], reference(left)[
        real[:, None, :, None].expand_as(out)])
    hole = everything.clone()
    hole[1, 7:9] = False
    torch.testing.assert_close(dense.dense_causal_attention(q, k, v, hole, 0.3), reference(hole))
    right = everything.clone()  # right padding, a masked last query and a row that sees nothing
    right[0, -3:] = right[1, -1] = right[2, :] = False
    torch.testing.assert_close(dense.dense_causal_attention(q, k, v, right, 0.3), reference(right))
    # the mask is read on the host once per mask tensor (every layer of a forward gets the same one)
    layout = dense.mask_layout(left)
    assert layout == (True, True, [4, 0, 1]) and dense.mask_layout(left) is layout
    assert dense.mask_layout(left.clone()) == layout and dense.mask_layout(left.clone()) is not layout
    assert dense.mask_layout(hole)[0] is False


@pytest.mark.parametrize("way", ["grouped", "expanded", "refused"])
def test_a_prompts_first_chunk_warms_the_later_chunks_attention_in_a_thread(monkeypatch, way):
    """A prompt prefilled in chunks: its first chunk starts the later chunks' attention (`_past_then_chunk`, cuDNN's
    kernels on CUDA) once, in a thread, on `SPLIT_WARM_QUERIES` queries over twice as many keys, as the later chunks
    call it: queries laid out as the chunk's, keys with their own KV heads laid out as the chunk's (`SPLIT_GQA`), or
    expanded to the query heads (off, or refused once). The thread has ended when `generate` returns, a later prompt
    starts none, nor does a prompt in one forward, and the tokens are those of a run without it. (On CPU
    `_cudnn_applies` is made True and the split computed by the masked call: what runs in the thread is recorded.)"""
    import threading

    import torch.nn.functional as F
    from conftest import prompt_ids, tiny_model
    from torch.nn.attention.bias import causal_lower_right

    from oasis_cache import OasisCache
    from oasis_cache.compute import dense

    calls = []

    def split(q, k, v, scale):
        calls.append((threading.current_thread() is threading.main_thread(), tuple(q.shape), tuple(k.shape),
                      dense._order(q), dense._order(k)))
        k, v = dense._expand_kv_heads(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              scale=scale)

    squares = []
    sdpa = dense._sdpa_causal

    def watched(query, keys, values, scale):
        if query.shape[2] == keys.shape[2]:
            squares.append((dense._order(query), dense._order(keys),
                            dense._order(dense._expand_kv_heads(query, keys, values)[0])))
        return sdpa(query, keys, values, scale)

    monkeypatch.setattr(dense, "_cudnn_applies", lambda query: query.shape[2] >= dense.SPLIT_MIN_QUERIES)
    monkeypatch.setattr(dense, "_past_then_chunk", split)
    monkeypatch.setattr(dense, "_sdpa_causal", watched)
    monkeypatch.setattr(dense, "_WARM_THREADS", {})
    monkeypatch.setattr(dense, "SPLIT_WARM_QUERIES", 32)
    monkeypatch.setattr(dense, "SPLIT_GQA", way != "expanded")
    monkeypatch.setattr(dense, "_CUDNN", {"failed": False, "gqa_failed": way == "refused"})
    model = tiny_model("llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    inputs = {"input_ids": prompt_ids(640)}

    def run(chunk: int) -> list:
        cache = OasisCache(model, token_budget=128, prefill_chunk_tokens=chunk)
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, past_key_values=cache)
        return out[0, 640:].tolist()

    tokens = run(256)  # chunks of 256, 256, 128 tokens
    warm = [call for call in calls if not call[0]]
    assert len(warm) == 1 and len(dense._WARM_THREADS) == 1, calls
    assert not any(thread.is_alive() for thread in dense._WARM_THREADS.values())
    heads = 2 if way == "grouped" else 4
    _, q_shape, k_shape, q_order, k_order = warm[0]
    assert q_shape == (1, 4, 32, 16) and k_shape == (1, heads, 64, 16)  # (the model's heads and head size)
    chunk_q, chunk_k, chunk_expanded = squares[0]  # laid out as the first chunk's query and (its own or expanded) keys
    assert (q_order, k_order) == (chunk_q, chunk_k if way == "grouped" else chunk_expanded)
    chunks = [call for call in calls if call[0]]  # the later chunks' own calls: 2 chunks x 2 layers
    assert len(chunks) == 2 * 2 and {call[2][1] for call in chunks} == {heads}
    calls.clear()
    assert run(256) == tokens and not [call for call in calls if not call[0]]  # once a process
    monkeypatch.setattr(dense, "_WARM_THREADS", {})
    assert run(0) == tokens and not dense._WARM_THREADS  # one forward: nothing follows its chunk
    monkeypatch.setattr(dense, "SPLIT_WARM_QUERIES", 0)
    assert run(256) == tokens and not dense._WARM_THREADS


@pytest.mark.parametrize("budget_heads", [1, 2])
def test_grouped_heads_attend_in_slices_of_kv_heads_past_the_expansion_bound(budget_heads, monkeypatch):
    """`compute.dense.EXPAND_BYTES`: where a layer's keys and values expanded for grouped query heads would pass it,
    the attention runs in slices of KV heads (each slice's query heads with it), a remainder included; the output
    equals one call's, for a chunk over a past and a square prompt, and the calls expand no more than the bound."""
    from oasis_cache.compute import dense

    torch.manual_seed(0)
    B, Hkv, G, D = 2, 3, 4, 8
    expanded = []
    expand = dense._expand_kv_heads
    monkeypatch.setattr(dense, "_expand_kv_heads",
                        lambda q, k, v: expanded.append(k.shape[1]) or expand(q, k, v))
    for Qn, L in ((5, 19), (12, 12)):
        q, k, v = torch.randn(B, Hkv * G, Qn, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
        whole = dense.dense_causal_attention(q, k, v, None, 0.3)
        assert expanded == [Hkv]
        per_head = 2 * B * G * L * D * k.element_size()
        monkeypatch.setattr(dense, "EXPAND_BYTES", budget_heads * per_head + per_head // 2)
        sliced = dense.dense_causal_attention(q, k, v, None, 0.3)
        monkeypatch.setattr(dense, "EXPAND_BYTES", 1 << 29)
        assert expanded[1:] == [budget_heads] * (Hkv // budget_heads) + [Hkv % budget_heads] * (Hkv % budget_heads > 0)
        torch.testing.assert_close(sliced, whole, atol=0, rtol=0)
        expanded.clear()


def test_the_split_on_unexpanded_grouped_heads_where_asked_and_expanded_once_refused(monkeypatch):
    """`compute.dense.SPLIT_GQA` (the default): a chunk after its past hands the split (`_past_then_chunk`, cuDNN on
    CUDA) its keys and values with their own KV heads; where that call raises a RuntimeError, the same call runs on
    expanded heads and later chunks go expanded directly. Off: always expanded. (On CPU `_cudnn_applies` is made
    True and the split is the masked call on expanded heads; what it received is recorded.)"""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from oasis_cache.compute import dense

    heads, refuse = [], []

    def split(q, k, v, scale):
        heads.append(k.shape[1])
        if refuse and k.shape[1] != q.shape[1]:
            raise RuntimeError("(refused)")
        k, v = dense._expand_kv_heads(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              scale=scale)

    monkeypatch.setattr(dense, "_cudnn_applies", lambda query: True)
    monkeypatch.setattr(dense, "_past_then_chunk", split)
    monkeypatch.setattr(dense, "_CUDNN", {"failed": False, "gqa_failed": False})
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 21, 16), torch.randn(2, 2, 21, 16)
    monkeypatch.setattr(dense, "SPLIT_GQA", False)
    expanded = dense.dense_causal_attention(q, k, v, None, 0.25)
    assert heads == [8]
    monkeypatch.setattr(dense, "SPLIT_GQA", True)
    heads.clear()
    torch.testing.assert_close(dense.dense_causal_attention(q, k, v, None, 0.25), expanded, atol=0, rtol=0)
    assert heads == [2]
    refuse.append(True)
    heads.clear()
    torch.testing.assert_close(dense.dense_causal_attention(q, k, v, None, 0.25), expanded, atol=0, rtol=0)
    assert heads == [2, 8] and dense._CUDNN["gqa_failed"] and not dense._CUDNN["failed"]
    heads.clear()
    dense.dense_causal_attention(q, k, v, None, 0.25)
    assert heads == [8]  # refused once: expanded from then on

