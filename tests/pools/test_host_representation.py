"""The host pool's narrow representations (`host_dtype`, `memory/representation.py`): their bytes, their error, and
a pool that holds them: what it gives back is the widened units, wherever it is read."""

from __future__ import annotations

import pytest
import torch

from oasis_cache.memory import TransferEngine
from oasis_cache.memory.representation import FP8_MAX, Int4, representation_for
from oasis_cache.pools import HostKVPool, WorkingSet


def kv_like(*lead, T=16, D=128, seed=0, dtype=torch.bfloat16):
    """Keys-like data: channels of very different scales (a few outlier channels, as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(D, generator=g) * 1.5)
    return (torch.randn(*lead, T, D, generator=g) * channel).to(dtype)


def test_a_unit_takes_half_or_about_a_quarter_of_bf16s_bytes_scales_included():
    wide = representation_for(None, torch.bfloat16, 16, 128).unit_nbytes
    assert wide == 16 * 128 * 2
    fp8 = representation_for("fp8", torch.bfloat16, 16, 128).unit_nbytes
    int4 = representation_for("int4", torch.bfloat16, 16, 128).unit_nbytes
    assert fp8 / wide <= 0.53 and int4 / wide <= 0.30, (fp8 / wide, int4 / wide)
    assert fp8 % 16 == 0 and int4 % 16 == 0  # (every unit starts 16-byte aligned in a chunk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rotated", [True, False])
def test_widening_errs_by_at_most_the_rounding_of_the_narrow_form(dtype, rotated, monkeypatch):
    """fp8: each element within half an e4m3 step. int4: each token within half of its 16 levels' step in the basis
    it was narrowed in (the rotated one: an orthogonal transform keeps the error's length, not each element's)."""
    monkeypatch.setattr(Int4, "rotated", rotated)
    x = kv_like(2, 3, 2, dtype=dtype)  # [K and V, B, Hkv, T, D]
    wide_ulp = torch.finfo(dtype).eps
    fp8 = representation_for("fp8", dtype, 16, 128)
    y = fp8.widen(fp8.narrow(x)).float()
    scale = x.float().abs().amax((-2, -1), keepdim=True) / FP8_MAX
    # e4m3: 3 mantissa bits (half an ulp: 2**-4 of the value), subnormals below 2**-6 (steps of 2**-9) of the scale
    bound = x.float().abs() * (2 ** -4 + wide_ulp) + scale * 2 ** -10
    assert bool(((y - x.float()).abs() <= bound * 1.001).all())
    int4 = representation_for("int4", dtype, 16, 128)
    assert int4.rotates == rotated
    y = int4.widen(int4.narrow(x)).float()
    center = int4.center.float()
    centered = int4.rotate(x.float()) - torch.stack([center, torch.zeros_like(center)])[:, None, :, None]
    span = centered.amax(-1, keepdim=True) - centered.amin(-1, keepdim=True)
    step = span / 15 / 2 * 1.01 + span * 2 ** -10  # (fp16 scale and minimum)
    error = y - x.float()
    if rotated:
        assert bool((error.norm(dim=-1, keepdim=True) <= step * 128 ** 0.5 + x.float().norm(dim=-1, keepdim=True)
                     * wide_ulp * 2).all())
    else:
        assert bool((error.abs() <= step + x.float().abs() * wide_ulp).all())
    assert fp8.widen(fp8.narrow(torch.zeros_like(x))).abs().max() == 0  # an all-zero unit stays zero
    fresh = representation_for("int4", dtype, 16, 128)  # a constant token: exact in the model's basis; rotated,
    # a value's only nonzero channel is 15 levels of an fp16 scale
    assert fresh.widen(fresh.narrow(torch.ones_like(x))).float().sub(1).abs().max() <= (2 ** -10 if rotated else 0)


def test_int4_centers_the_keys_and_so_keeps_a_biased_channel_from_setting_every_tokens_range():
    """Keys with a large per-channel offset (a projection's bias): int4 without a center would spend its 16 levels on
    the offset; the center (the first blocks' mean, fixed from then on, for later blocks too) keeps them for the
    rest. Values are not centered."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 2, 16, 64, generator=g)
    bias = torch.zeros(64)
    bias[5], bias[40] = 60.0, -45.0
    x[0] += bias
    int4 = representation_for("int4", torch.float32, 16, 64)
    error = (int4.widen(int4.narrow(x)) - x)[0].abs().mean()
    later = torch.randn(2, 1, 2, 16, 64, generator=g)
    later[0] += bias
    center = int4.offsets_on(torch.device("cpu"))  # (in the model's basis)
    assert torch.allclose(center[:, [5, 40]], bias[[5, 40]], atol=3)  # (fixed by the first blocks)
    later_error = (int4.widen(int4.narrow(later)) - later)[0].abs().mean()
    uncentered = representation_for("int4", torch.float32, 16, 64)
    uncentered.center = torch.zeros(2, 64, dtype=torch.float16)
    plain_error = (uncentered.widen(uncentered.narrow(later)) - later)[0].abs().mean()
    assert error < plain_error / 4 and later_error < plain_error / 4, (error, later_error, plain_error)


def test_int4_narrows_in_a_rotated_basis_so_a_bias_turned_by_rope_does_not_set_every_tokens_range(monkeypatch):
    """A key bias turned by rotary embeddings changes from token to token, so no per-channel center removes it: in
    the model's basis its few large channels set each token's 16 levels. Narrowed after a Hadamard rotation (which
    spreads those channels over all), int4's error is a fraction of that; exact up to rounding without narrowing."""
    g = torch.Generator().manual_seed(0)
    D, positions = 64, torch.arange(64.0)
    bias = torch.zeros(D)
    bias[[3, 3 + D // 2, 20, 20 + D // 2]] = torch.tensor([30.0, -25.0, 18.0, 22.0])
    raw = torch.randn(2, 1, 2, 64, D, generator=g)
    raw[0] += bias
    angle = positions[:, None] * 10000 ** (-torch.arange(D // 2) / (D // 2))  # [tokens, D/2]
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    turned = raw * cos + torch.cat([-raw[..., D // 2:], raw[..., : D // 2]], -1) * sin
    x = turned.unflatten(-2, (4, 16)).movedim(-3, 0)  # [blocks, 2, B, Hkv, T, D]
    errors = {}
    for rotated in (True, False):
        monkeypatch.setattr(Int4, "rotated", rotated)
        int4 = representation_for("int4", torch.float32, 16, D)
        errors[rotated] = (int4.widen(int4.narrow(x)) - x)[:, 0].norm() / x[:, 0].norm()
    assert errors[True] < errors[False] / 2, errors
    assert torch.allclose(Int4(torch.float32, 16, D).rotate(Int4(torch.float32, 16, D).rotate(x)), x, atol=1e-4)


@pytest.mark.parametrize("host_dtype", ["fp8", "int4"])
def test_a_narrow_pool_holds_bytes_and_every_read_gives_the_widened_units(host_dtype):
    B, H, T, D, NB, C = 2, 3, 16, 64, 11, 4
    pool = HostKVPool(B, H, D, T, torch.float32, C, pin_memory=False, host_dtype=host_dtype)
    plain = HostKVPool(B, H, D, T, torch.float32, C, pin_memory=False)
    data = kv_like(2, B, H, NB, T=T, D=D, dtype=torch.float32)  # [2, B, H, NB, T, D]
    engine = TransferEngine("torch", torch.device("cpu"))
    engine.offload(pool, data)
    engine.offload(plain, data)
    rep = pool.representation
    assert pool.chunks[0].dtype == torch.uint8 and pool.chunks[0].shape[-1] == rep.unit_nbytes
    assert pool.nbytes / plain.nbytes == rep.unit_nbytes / (T * D * 4)
    widened = rep.widen(rep.narrow(data.permute(3, 0, 1, 2, 4, 5))).permute(1, 2, 3, 0, 4, 5)
    assert torch.equal(engine.load_range(pool, 0, NB), widened)  # a dense read (crop, a forward over the past)
    assert torch.equal(engine.load_range(pool, 3, 9), widened[:, :, :, 3:9])
    ws = WorkingSet(B, H, 4, T, 2 * T, D, torch.float32, "cpu")
    ids = torch.tensor([[7, 2, 10, 0]]).expand(B, H, 4)
    dest = torch.tensor([[3, 0, 1, 2]]).expand(B, H, 4)
    engine.fetch(pool, ws, ids, dest, torch.ones(B, H, 4, dtype=torch.bool))  # a sparse step's gather
    for k in range(4):
        assert torch.equal(ws.slots[:, :, :, dest[0, 0, k]], widened[:, :, :, ids[0, 0, k]])
    pool.index_batch(torch.tensor([1, 1, 0]))  # beam search's reorder moves the narrow bytes as they are
    assert torch.equal(engine.load_range(pool, 0, NB), widened[:, [1, 1, 0]])


def test_a_host_dtype_it_does_not_know_is_refused_by_name():
    from oasis_cache import OasisCache

    from conftest import tiny_model

    with pytest.raises(ValueError, match=r"host_dtype must be None \(the model's dtype\), 'fp8' or 'int4', got 'fp16'"):
        OasisCache(tiny_model("llama"), token_budget=256, host_dtype="fp16")


def test_the_newest_blocks_take_free_slots_as_they_complete_and_give_them_up_as_they_leave():
    """`SlotMap.hold_newest` (a narrow pool's newest blocks, held as made): each completed block among the newest R
    takes a free slot and is written there; a block leaving the newest R frees its slot; a block that finds no free
    slot is not held (and nothing is written)."""
    from oasis_cache.pools import SlotMap, WorkingSet

    B, H, S, T, D, R = 1, 2, 3, 2, 4, 2
    slots, ws = SlotMap(B, H, S, "cpu"), WorkingSet(B, H, S, T, T, D, torch.float32, "cpu")
    slots.reserve(16)
    step = torch.zeros(1, dtype=torch.long)

    def complete(first, n):
        blocks = torch.arange(first, first + n).float()[None, None, None, :, None, None].expand(2, B, H, n, T, D)
        slots.hold_newest(ws, blocks, torch.tensor([first + n]), R, step)

    def held():
        return {int(b) for b in slots.slot_block[0, 0, :S] if b >= 0}

    complete(0, 5)  # a prompt of five blocks: the newest two held
    assert held() == {3, 4}
    for block in (3, 4):
        slot = int(slots.block_slot[0, 0, block])
        assert (ws.slots[:, 0, :, slot] == block).all()  # (both heads)
    complete(5, 1)  # block 3 leaves, block 5 comes
    assert held() == {4, 5} and int(slots.block_slot[0, 0, 3]) == -1
    slots.slot_block[0, 1, :S] = torch.tensor([7, 8, 9])  # head 1: every slot taken by other blocks
    slots.block_slot[0, 1, :] = -1
    slots.block_slot[0, 1, 7:10] = torch.tensor([0, 1, 2])
    before = ws.slots[:, 0, 1].clone()
    complete(6, 1)
    assert held() == {5, 6} and int(slots.block_slot[0, 1, 6]) == -1  # head 1: no free slot, not held
    assert torch.equal(ws.slots[:, 0, 1], before)  # nothing written there


def test_each_sequences_sink_blocks_are_held_and_kept():
    """`hold_newest` with sinks (`control.visibility.sink_blocks`): each sequence's sink blocks (after its padding)
    take slots as they complete and keep them when they leave the newest blocks; `held_ids` names them."""
    from oasis_cache.control import Padding, sink_blocks
    from oasis_cache.pools import SlotMap, WorkingSet

    B, H, S, T, D, R = 2, 1, 4, 2, 4, 1
    slots, ws = SlotMap(B, H, S, "cpu"), WorkingSet(B, H, S, T, T, D, torch.float32, "cpu")
    slots.reserve(16)
    step = torch.zeros(1, dtype=torch.long)
    padding = Padding(None, torch.tensor([[0], [3]]), 0)  # sequence 1's first real token: 3 (block 1)
    sinks = sink_blocks(padding, B, 3, T, "cpu")  # 3 sink tokens: blocks 0-1, and 1-2
    assert sinks.tolist() == [[0, 1, -1], [1, 2, -1]]

    def complete(first, n):
        blocks = torch.arange(first, first + n).float()[None, None, None, :, None, None].expand(2, B, H, n, T, D)
        slots.hold_newest(ws, blocks, torch.tensor([first + n]), R, step, sinks)

    def held(row):
        return {int(b) for b in slots.slot_block[row, 0, :S] if b >= 0}

    complete(0, 5)
    assert held(0) == {0, 1, 4} and held(1) == {1, 2, 4}
    for row, block in ((0, 0), (1, 2), (1, 4)):
        assert (ws.slots[:, row, 0, int(slots.block_slot[row, 0, block])] == block).all()
    complete(5, 1)  # block 4 leaves the newest: freed; the sinks stay
    assert held(0) == {0, 1, 5} and held(1) == {1, 2, 5}
    ids = slots.held_ids(torch.tensor([6]), R, sinks)
    assert ids[:, 0].tolist() == [[0, 1, -1, 5], [1, 2, -1, 5]]
    complete(6, 1)
    assert held(0) == {0, 1, 6}
    assert sink_blocks(None, B, 0, T, "cpu") is None
