"""Shape grids for the Triton kernels against their plain-PyTorch references, shared by the CPU (Triton
interpreter) and GPU tests. Run as a script, it checks every case on the given device and prints one line each."""

from __future__ import annotations

import sys
from functools import partial

import torch

from oasis_cache.compute.sparse import new_token_bias, sparse_attention
from oasis_cache.control import rank_blocks
import oasis_cache.kernels.block_scores as block_scores_module
import oasis_cache.kernels.decode_attention as decode_attention_module
from oasis_cache.kernels.block_scores import block_scores
from oasis_cache.kernels.decode_attention import decode_attention
from oasis_cache.kernels.gather import gather_blocks
from oasis_cache.kernels.host_store import store_block
from oasis_cache.memory import TransferEngine
from oasis_cache.pools import BlockSummaries, HostKVPool, SlotMap, WorkingSet

# (B, Hkv, T, D, S, NB, chunk_blocks, dtype)
CASES = [
    (1, 1, 16, 64, 4, 9, 4, torch.float32),
    (2, 3, 16, 64, 5, 13, 5, torch.bfloat16),
    (3, 2, 8, 80, 3, 7, 2, torch.float16),  # head_dim 80: T*D not a power of two
    (2, 2, 4, 5, 6, 17, 3, torch.float32),  # odd everything
]


def check_case(B, H, T, D, S, NB, C, dtype, device, max_programs=None, num_warps=4, entries=1) -> bool:
    g = torch.Generator().manual_seed(B * 1000 + D)
    pool = HostKVPool(B, H, D, T, dtype, C, pin_memory=device.type == "cuda")
    C = pool.chunk_blocks  # (as many as fill a pinned allocation)
    engine = TransferEngine("torch", torch.device("cpu"))
    data = torch.randn(2, B, H, NB, T, D, generator=g).to(dtype)
    engine.offload(pool, data)
    ws = WorkingSet(B, H, S, T, 2 * T, D, dtype, device)  # with a recent region: slots are not the whole row
    ws.kv.fill_(-7.0)  # poison: every written element must change, every other must stay
    K = min(S, NB)
    block_ids = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    dest = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    fetch = torch.rand(B, H, K, generator=g) < 0.7
    addrs = torch.tensor([c.data_ptr() for c in pool.chunks], dtype=torch.int64, device=device)
    gather_blocks(addrs, C, block_ids.to(device), dest.to(device), fetch.to(device), ws.kv, T, max_programs,
                  num_warps=num_warps, entries=entries)
    got = ws.kv.cpu()
    return torch.equal(got, gathered(got, fetch, dest, T, lambda b, h, k: data[:, b, h, block_ids[b, h, k]]))


def gathered(got: torch.Tensor, fetch, dest, T: int, source) -> torch.Tensor:
    """What a gather into a working set poisoned with -7 must leave: `source(b, h, k)` (`[2, T, D]`) in slot
    `dest[b, h, k]` of each fetched entry, the poison elsewhere."""
    expected = torch.full_like(got, -7.0)
    for b, h, k in fetch.nonzero().tolist():
        expected[:, b, h, dest[b, h, k] * T : dest[b, h, k] * T + T] = source(b, h, k)
    return expected


def check_unit_gather(B, H, T, D, S, NB, C, dtype, device, max_programs=None, entries=1) -> bool:
    """`gather_blocks(per_unit=True)`: the host side is an arena of single (sequence, KV head) blocks `[U, 2, 1, 1, T,
    D]` (a remote tier's local cache) and the ids are its slots; each entry lands in its own sequence's and head's
    row of the working set."""
    g = torch.Generator().manual_seed(B * 10 + D)
    U = NB + 3
    arena = torch.randn(U, 2, 1, 1, T, D, generator=g).to(dtype)
    if device.type == "cuda":
        arena = arena.pin_memory()
    ws = WorkingSet(B, H, S, T, 2 * T, D, dtype, device)
    ws.kv.fill_(-7.0)
    K = min(S, NB)
    slots = torch.randint(0, U, (B, H, K), generator=g)
    dest = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    fetch = torch.rand(B, H, K, generator=g) < 0.7
    table = torch.tensor([arena.data_ptr()], dtype=torch.int64, device=device)
    gather_blocks(table, U, slots.to(device), dest.to(device), fetch.to(device), ws.kv, T, max_programs,
                  per_unit=True, entries=entries)
    got = ws.kv.cpu()
    return torch.equal(got, gathered(got, fetch, dest, T, lambda b, h, k: arena[slots[b, h, k], :, 0, 0]))


# (B, Hkv, T, D, S, NB, chunk_blocks, dtype, host_dtype): a narrow host pool (`memory/representation.py`)
NARROW_CASES = [
    (2, 3, 16, 64, 5, 13, 5, torch.bfloat16, "fp8"),
    (2, 3, 16, 64, 5, 13, 5, torch.bfloat16, "int4"),
    (3, 2, 8, 80, 3, 7, 2, torch.float16, "int4"),  # a token's codes not a power of two of bytes
    (1, 2, 16, 128, 4, 9, 4, torch.float16, "int4 rotated"),  # (`Int4.rotated`)
    (2, 3, 16, 64, 5, 13, 5, torch.bfloat16, "int4 rotated"),
    (1, 2, 16, 128, 4, 9, 4, torch.float32, "fp8"),
    (2, 1, 4, 6, 6, 17, 3, torch.float32, "int4"),  # odd sizes
    (2, 2, 2, 6, 4, 11, 3, torch.float32, "int4"),  # scales not 4-byte aligned: read by bytes
    (2, 1, 1, 6, 5, 9, 4, torch.float32, "fp8"),
]


def check_narrow_gather(B, H, T, D, S, NB, C, dtype, host_dtype, device, max_programs=None, entries=1,
                        per_unit=False) -> bool:
    """The gather from a narrow pool widens each unit to exactly what `Representation.widen` gives (bit for bit),
    from the pool's chunks or (`per_unit`) from an arena of single units (a remote tier's local cache); `store_block`
    writes a narrowed block where `offload` would."""
    g = torch.Generator().manual_seed(B * 1000 + D + len(host_dtype))
    host_dtype, rotated = host_dtype.split()[0], host_dtype.endswith("rotated")
    pool = HostKVPool(B, H, D, T, dtype, C, pin_memory=device.type == "cuda", host_dtype=host_dtype)
    if rotated:  # (the sizes `Int4.rotated` needs)
        pool.representation.rotates = True
    C = pool.chunk_blocks  # (pinned chunks hold as many blocks as fill their allocation: more than asked)
    rep = pool.representation
    data = torch.randn(2, B, H, NB, T, D, generator=g) * torch.rand(1, 1, 1, 1, 1, D, generator=g) * 8
    data = (data + torch.tensor([1.0, 0.0])[:, None, None, None, None, None] * 20 * torch.randn(D, generator=g)).to(
        dtype)  # (keys with per-channel offsets: int4's center)
    TransferEngine("torch", torch.device("cpu")).offload(pool, data)
    units = torch.cat(pool.chunks)[:NB]  # [NB, 2, B, H, U]
    ws = WorkingSet(B, H, S, T, 2 * T, D, dtype, device)
    ws.kv.fill_(-7.0)
    K = min(S, NB)
    block_ids = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    dest = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    fetch = torch.rand(B, H, K, generator=g) < 0.7
    if per_unit:  # unit (block, b, h) at arena slot (block * B + b) * H + h
        arena = units.permute(0, 2, 3, 1, 4).reshape(NB * B * H, 2, 1, 1, -1).contiguous()
        arena = arena.pin_memory() if device.type == "cuda" else arena
        ids = (block_ids * B + torch.arange(B)[:, None, None]) * H + torch.arange(H)[None, :, None]
        table, capacity = torch.tensor([arena.data_ptr()], dtype=torch.int64, device=device), NB * B * H
    else:
        ids, table, capacity = block_ids, torch.tensor([c.data_ptr() for c in pool.chunks], dtype=torch.int64,
                                                       device=device), C
    gather_blocks(table, capacity, ids.to(device), dest.to(device), fetch.to(device), ws.kv, T, max_programs,
                  entries=entries, per_unit=per_unit, representation=rep)
    got = ws.kv.cpu()
    widened = gathered(got, fetch, dest, T, lambda b, h, k: rep.widen(units[block_ids[b, h, k], :, b, h][None],
                                                                      heads=torch.tensor([h]))[0])
    pinned = device.type == "cuda"  # (written through its address)
    stored = torch.empty(pool.chunks[0].shape, dtype=torch.uint8, pin_memory=pinned).fill_(7)
    block = rep.narrow(data[:, :, :, 0].to(device)).contiguous()  # [2, B, H, U], narrowed where the model runs
    store_block(torch.tensor([stored.data_ptr()], dtype=torch.int64, device=device), C,
                torch.tensor([C - 1], device=device), block)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return torch.equal(got, widened) and torch.equal(stored[C - 1], block.cpu()) and bool((stored[: C - 1] == 7).all())


def check_store(B, H, T, D, S, NB, C, dtype, device) -> bool:
    """`store_block` writes one block at a block number read on the device into the right chunk and place of a host
    pool (the same layout `offload` writes), and nothing else."""
    g = torch.Generator().manual_seed(B * 100 + NB)
    pool = HostKVPool(B, H, D, T, dtype, C, pin_memory=device.type == "cuda")
    C = pool.chunk_blocks  # (as many as fill a pinned allocation)
    pool.reserve(NB)
    for chunk in pool.chunks:
        chunk.fill_(-7.0)
    addrs = torch.tensor([c.data_ptr() for c in pool.chunks], dtype=torch.int64, device=device)
    expected = [chunk.clone() for chunk in pool.chunks]
    for number in (0, NB - 1, NB // 2):  # the first chunk's first block, the last block, one between
        block = torch.randn(2, B, H, T, D, generator=g).to(dtype)
        store_block(addrs, C, torch.tensor([number], device=device), block.to(device))
        expected[number // C][number % C] = block
    if device.type == "cuda":
        torch.cuda.synchronize()
    return all(torch.equal(a, b) for a, b in zip(pool.chunks, expected))


# (B, Hkv, G, Qn, D, NB, T, dtype, scorer): G query heads per KV head, Qn query tokens, NB blocks of T tokens;
# scorer "bits-fp8": the bits scorer with fp8 levels; "bits-half": summaries on half the channels (the kernel reads
# the query's kept channels itself)
SCORE_CASES = [
    (1, 2, 4, 1, 64, 100, 16, torch.float32, "bound"),
    (2, 3, 1, 1, 128, 257, 16, torch.bfloat16, "bound"),
    (2, 1, 5, 4, 80, 33, 16, torch.float16, "bound"),  # R = 20 rows and D not powers of two
    (1, 2, 2, 2, 64, 100, 16, torch.float32, "bits"),
    (2, 3, 2, 1, 128, 70, 16, torch.bfloat16, "bits"),
    (2, 1, 5, 4, 80, 33, 8, torch.float16, "bits"),
    (1, 2, 3, 1, 16, 9, 4, torch.float32, "bits"),  # T < 8: one byte, half used
    (2, 3, 2, 1, 128, 70, 16, torch.bfloat16, "bits-fp8"),
    (1, 2, 4, 2, 64, 100, 16, torch.float32, "bits-fp8"),  # Qn = 2: also the split ranking
    (2, 2, 3, 2, 64, 70, 16, torch.bfloat16, "bits-half"),
    (2, 1, 5, 4, 80, 33, 8, torch.float16, "bits"), (2, 2, 3, 2, 64, 70, 16, torch.float16, "bits-half"),
]


def check_scores(B, H, G, Qn, D, NB, T, dtype, scorer, device) -> bool:
    g = torch.Generator().manual_seed(NB)
    keys = torch.randn(B, H, NB, T, D, generator=g).to(dtype)
    summaries = BlockSummaries(B, H, D, dtype, "cpu", T, key_bits=scorer != "bound", fp8_levels=scorer == "bits-fp8",
                               kept_channels=D // 2 if scorer == "bits-half" else None)
    summaries.append(keys)  # capacity beyond NB
    summaries.fix_channels()  # ("bits-half": the heaviest half of the channels, as at a first decode step)
    channels = None if summaries.channels is None else summaries.channels.to(device)
    # The forward's queries with one more token: the kernel reads the strided slice of the first Qn in place.
    queries = torch.randn(B, H * G, Qn + 1, D, generator=g).to(dtype)
    forced = torch.rand(B, NB, generator=g) < 0.1
    allowed = torch.rand(B, NB, generator=g) < 0.9
    expected = rank_blocks(queries[:, :, :Qn].float(), summaries, forced, allowed, T)
    query = queries.to(device)[:, :, :Qn]
    codes = None if summaries.codes is None else summaries.codes.to(device)
    scales = None if summaries.scales is None else summaries.scales.to(device)
    levels, forced_d, allowed_d = summaries.levels.to(device), forced.to(device), allowed.to(device)

    def same(got, expected):
        return torch.equal(torch.isinf(got), torch.isinf(expected)) and torch.allclose(got, expected, atol=1e-3,
                                                                                         rtol=1e-4)

    for per_program in (64, 16, 32):
        got = block_scores(query, levels, NB, forced_d, allowed_d, codes, T, per_program, scales=scales,
                           channels=channels).cpu()
        if not same(got, expected):
            return False
    if Qn >= 2:  # the last token ranked apart from the others (a riding draft), from the same pass
        split = torch.stack([rank_blocks(part.float(), summaries, forced, allowed, T)
                             for part in (queries[:, :, : Qn - 1], queries[:, :, Qn - 1 : Qn])], dim=2)
        got = block_scores(query, levels, NB, forced_d, allowed_d, codes, T, scales=scales, split_last=True,
                           channels=channels).cpu()
        if got.shape != (B, H, 2, NB) or not same(got, split):
            return False
    return True


# (B, Hkv, G, Qn, D, slot_tokens, R, count, dtype, splits): G query heads per KV head, Qn new tokens, a working set
# of slot_tokens + R tokens of which the first `count` recent ones exist; splits None: the kernel's choice
DECODE_CASES = [
    (1, 2, 4, 1, 64, 128, 32, 9, torch.float32, None),
    (1, 2, 4, 2, 64, 128, 32, 9, torch.float32, 3),  # a riding draft row; three key ranges
    (2, 3, 3, 2, 64, 96, 32, 17, torch.bfloat16, None),  # G = 3 (SmolLM2); the recent region past one block
    (2, 1, 5, 4, 80, 48, 16, 16, torch.float16, 1),  # 20 rows, D not a power of two, one key range
    (1, 2, 1, 16, 32, 64, 32, 16, torch.float32, 2),  # a whole block of new tokens (an assisted forward)
    (1, 1, 5, 4, 80, 2048, 64, 16, torch.float32, 33),  # 33 key ranges: a row's sum split over combine programs
]


def check_decode(B, H, G, Qn, D, slot_tokens, R, count, dtype, splits, device) -> bool:
    """The kernel against `sparse_attention` (SDPA with the additive mask) on the same working set; the query a
    transposed view as transformers hands it, visibility random (some rows of a KV head see few tokens)."""
    g = torch.Generator().manual_seed(B * 100 + Qn * 10 + G)
    L = slot_tokens + R
    query = torch.randn(B, Qn, H * G, D, generator=g).to(dtype).transpose(1, 2)  # [B, Hq, Qn, D], strided
    kv = torch.randn(2, B, H, L, D, generator=g).to(dtype)
    visible = torch.rand(B, H, L, generator=g) < 0.6
    visible[:, :, slot_tokens + count :] = False  # past the last recent token
    visible[:, :, slot_tokens + count - Qn :slot_tokens + count] = True  # the new tokens see themselves
    counter = torch.tensor([count])
    bias = new_token_bias(Qn, G, L, slot_tokens, counter, torch.float32, "cpu")
    expected = sparse_attention(query.float(), kv[0].float(), kv[1].float(), visible, D ** -0.5, bias)
    got = decode_attention(query.to(device), kv[0].to(device), kv[1].to(device), visible.to(device),
                           counter.to(device), slot_tokens, D ** -0.5, splits)
    if got.shape != expected.shape or not got.transpose(1, 2).is_contiguous() or got.dtype != dtype:
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    if not torch.allclose(got.cpu().float(), expected, atol=tolerance, rtol=tolerance):
        return False
    # The recent region's mask apart (what a layer passes: one per forward, per sequence, or one for the whole batch
    # as here with B > 1 and Qn != 2): `visible`'s own recent part is not read (inverted here).
    recent = visible[:, :1, slot_tokens:].clone()
    if B > 1 and Qn != 2:
        recent = recent[:1]
    apart = visible.clone()
    apart[:, :, slot_tokens:] = recent
    expected = sparse_attention(query.float(), kv[0].float(), kv[1].float(), apart, D ** -0.5, bias)
    apart[:, :, slot_tokens:] = ~recent
    got = decode_attention(query.to(device), kv[0].to(device), kv[1].to(device), apart.to(device),
                           counter.to(device), slot_tokens, D ** -0.5, splits, recent_visible=recent.to(device))
    if not torch.allclose(got.cpu().float(), expected, atol=tolerance, rtol=tolerance):
        return False
    # One launch (`tickets`): the last split of each KV head combines; twice, the counters back at 0 between
    tickets = torch.zeros(B * H + 3, dtype=torch.int32, device=device)
    for _ in range(2):
        got = decode_attention(query.to(device), kv[0].to(device), kv[1].to(device), apart.to(device),
                               counter.to(device), slot_tokens, D ** -0.5, splits, recent_visible=recent.to(device),
                               tickets=tickets)
        if not torch.allclose(got.cpu().float(), expected, atol=tolerance, rtol=tolerance) or tickets.any():
            return False
    # Learned sinks (gpt-oss): one logit per query head in each softmax's sum, some far above the scores (a row
    # then mostly attends to its sink), some far below; a row seeing nothing gets 0 either way. Both launch forms.
    sinks = (torch.randn(H * G, generator=g) * 4).to(dtype)
    sinks[0] = 30.0
    seen = apart.clone()
    seen[:, :, slot_tokens:] = recent  # (what `apart` stands for: its own recent part is inverted, and not read)
    expected = sparse_attention(query.float(), kv[0].float(), kv[1].float(), seen, D ** -0.5, bias, sinks=sinks)
    for fused in (None, tickets):
        got = decode_attention(query.to(device), kv[0].to(device), kv[1].to(device), apart.to(device),
                               counter.to(device), slot_tokens, D ** -0.5, splits, recent_visible=recent.to(device),
                               tickets=fused, sinks=sinks.to(device))
        if not torch.allclose(got.cpu().float(), expected, atol=tolerance, rtol=tolerance):
            return False
    return True


def check_refused_tiles(module, kernel, smallest, check, *case, device) -> bool:
    """`check(*case)` where the device refuses `kernel`'s launches with tiles (`BLOCK` / `BLOCK_N`) above
    `smallest` for lack of shared memory (as a 512-wide float32 head on the H100): the launch halves its tile
    until one fits (`kernels/fitting.py`), the result unchanged, and only tiles of `smallest` ran."""
    from triton.runtime.errors import OutOfResources

    import oasis_cache.kernels.fitting as fitting

    real, ran = getattr(module, kernel), []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tile = kwargs.get("BLOCK", kwargs.get("BLOCK_N"))
                if tile > smallest:
                    raise OutOfResources(tile * 4096, smallest * 4096, "shared memory")
                ran.append(tile)
                return real[grid](*args, **kwargs)
            return launch

    setattr(module, kernel, Refusing())
    fitting._fitted.clear()
    try:
        ok = check(*case, device=device)
    finally:
        setattr(module, kernel, real)
        fitting._fitted.clear()
    return ok and bool(ran) and set(ran) == {smallest}


# (B, Hkv, S, K, NB, steps, max_fetch)
ASSIGN_CASES = [(1, 2, 8, 8, 40, 6, 8), (2, 3, 12, 7, 30, 8, 7), (1, 1, 5, 5, 5, 3, 5), (2, 2, 9, 9, 50, 6, 2)]


def check_assign(B, H, S, K, NB, steps, max_fetch, device) -> bool:
    """Both implementations run the same sequence of selections; state and outputs must agree at every step."""
    from oasis_cache.kernels.slot_assign import slot_assign  # noqa: F401  (fails early without triton)

    g = torch.Generator().manual_seed(S * 100 + K)
    T = 4
    ref, ker = SlotMap(B, H, S, "cpu"), SlotMap(B, H, S, device, use_kernel=True)
    ref.reserve(NB), ker.reserve(NB)
    vis_ref = torch.zeros(B, H, S * T + 5, dtype=torch.bool)
    vis_ker = vis_ref.to(device)
    cnt_ref, cnt_ker = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64, device=device)
    for step in range(1, steps + 1):
        ids = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
        ranks = torch.where(torch.rand(B, H, K, generator=g) < 0.8, torch.rand(B, H, K, generator=g), -torch.inf)
        a = ref.assign(ids, ranks, step, vis_ref, cnt_ref, T, max_fetch)
        b = ker.assign(ids.to(device), ranks.to(device), step, vis_ker, cnt_ker, T, max_fetch)
        same = (
            torch.equal(a.dest, b.dest.cpu()) and torch.equal(a.fetch, b.fetch.cpu().bool())
            # state, scratch entries (the last of each row) excluded
            and torch.equal(ref.slot_block[..., :S], ker.slot_block.cpu()[..., :S])
            and torch.equal(ref.block_slot[..., :NB], ker.block_slot.cpu()[..., :NB])
            and torch.equal(ref.last_used[..., :S], ker.last_used.cpu()[..., :S]) and torch.equal(vis_ref, vis_ker.cpu())
            and torch.equal(cnt_ref, cnt_ker.cpu())
        )
        if not same:
            return False
    return True


# (B, Hkv, W, k, split[, segments]): rows of W ranks, the k best; split: one half of a `[B, Hkv, 2, W]` ranking
# (strided rows); segments: the two-stage select's (None: the package's choice, two stages past 4,096 ranks)
TOP_K_CASES = [(1, 8, 2048, 128, False), (2, 2, 37, 5, True), (1, 1, 16, 16, False), (3, 4, 300, 64, True),
               (1, 2, 1000, 1, False), (1, 2, 4096, 512, True), (1, 1, 600, 40, True), (1, 8, 8192, 128, True),
               # rows held as a power of two and a tail
               (1, 2, 2176, 128, True), (1, 1, 8704, 128, False), (1, 1, 2049, 2049, False), (1, 1, 17, 3, True),
               # two stages: a longer last segment; segments of exactly k; a row past one program's 16,384
               (2, 3, 1015, 7, True, 16), (1, 1, 300, 100, False, 3), (1, 2, 64, 16, True, 4),
               (1, 2, 20000, 100, False)]


def check_top_k(B, H, W, k, split, segments=None, device="cpu") -> bool:
    """The top-k kernel's k best per row against a stable descending sort's first k: the same ids (ties, +inf forced
    and -inf excluded blocks among them: the lower block ids) with their values, listed in block order."""
    from oasis_cache.kernels.top_k import kernel_fits, top_k

    g = torch.Generator().manual_seed(W + k)
    ranks = torch.randn(B, H, 2, W, generator=g).round(decimals=1)  # (rounded: many ties)
    ranks[..., :3], ranks[..., W // 2], ranks[..., -5:] = torch.inf, torch.inf, -torch.inf
    ranks[..., W - 6] = torch.inf  # (in the last segment's remainder: W % segments ranks past the others' length)
    ranks[..., 7 % W] = -0.0  # (the two zeros are equal ranks)
    ranks = ranks.to(device)
    rows = ranks.unbind(2)[1] if split else ranks[:, :, 0].contiguous()
    if not kernel_fits(rows, k, segments):
        return False
    ids, values = top_k(rows, k, segments=segments)
    expected, order = torch.sort(rows.cpu(), dim=-1, descending=True, stable=True)
    chosen, by_id = order[..., :k].sort(dim=-1)
    return torch.equal(ids.cpu(), chosen) and torch.equal(values.cpu(), expected[..., :k].gather(-1, by_id))


# (B, Hkv, q, D, R, steps, key dtype, region dtype): q new tokens a step into a region of R (a strided view)
APPEND_CASES = [(1, 8, 1, 128, 40, 5, torch.bfloat16, torch.bfloat16),
                (3, 8, 3, 64, 20, 4, torch.bfloat16, torch.bfloat16),
                (2, 2, 2, 80, 9, 3, torch.float32, torch.float32),  # (the second: 72 rows, two programs)
                (1, 2, 1, 64, 8, 3, torch.float32, torch.bfloat16)]  # (another dtype: torch's cast, not the kernel)


def check_append(B, H, q, D, R, steps, key_dtype, dtype, device) -> bool:
    """A decode step's append in one launch against `RecentTokens.append`'s operators: the same region and count
    after every step (the kernel's programs advance the count once, after all have read it)."""
    from oasis_cache.pools.recent import RecentTokens

    g = torch.Generator().manual_seed(B * 100 + q)
    base = torch.zeros(2, B, H, R + 6, D, dtype=dtype)  # the region is a view, as in the working set
    ref = RecentTokens(base[:, :, :, 6:].clone())
    kernel_base = base.to(device)
    ker = RecentTokens(kernel_base[:, :, :, 6:], use_kernel=True)
    for _ in range(steps):
        keys = torch.randn(B, H, q + 1, D, generator=g).to(key_dtype)[:, :, 1:]  # (strided, as a forward's are)
        values = torch.randn(B, H, q, D, generator=g).to(key_dtype)
        ref.append(keys, values)
        ker.append(keys.to(device), values.to(device))
        if not (torch.equal(ref.region, ker.region.cpu()) and torch.equal(ref.count, ker.count.cpu())
                and ker.num_tokens == ref.num_tokens and int(ker._tickets.cpu()) == 0):
            return False
    return torch.equal(kernel_base[:, :, :, :6].cpu(), base[:, :, :, :6])  # nothing written before the region


# Every kernel check with its cases: (name, cases, check); run here in the interpreter, by test_kernels.py on CUDA.
CHECKS = [("gather", CASES, check_case), ("gather-3-programs", CASES[1:2], partial(check_case, max_programs=3)),
          ("gather-1-warp", CASES[1:2], partial(check_case, max_programs=5, num_warps=1)),
          ("gather-4-entries", CASES, partial(check_case, max_programs=2, entries=4)),
          ("gather-2-entries", CASES[1:2], partial(check_case, entries=2)),
          ("gather-units", CASES[1:], check_unit_gather),
          ("gather-units-4-entries", CASES[2:3], partial(check_unit_gather, max_programs=1, entries=4)),
          ("store", CASES, check_store),
          ("gather-narrow", NARROW_CASES, check_narrow_gather),
          ("gather-narrow-4-entries", NARROW_CASES[:4], partial(check_narrow_gather, max_programs=2, entries=4)),
          ("gather-narrow-units", NARROW_CASES[1:2] + NARROW_CASES[4:5], partial(check_narrow_gather, per_unit=True)),
          ("scores", SCORE_CASES, check_scores),
          ("assign", ASSIGN_CASES, check_assign),
          ("append", APPEND_CASES, check_append),
          ("top-k", TOP_K_CASES, check_top_k),
          ("decode", DECODE_CASES, check_decode),
          ("decode-refused-tiles", DECODE_CASES[:1], partial(check_refused_tiles, decode_attention_module,
                                                             "_split_kernel", 16, check_decode)),
          ("scores-refused-tiles", SCORE_CASES[3:4], partial(check_refused_tiles, block_scores_module,
                                                             "_block_scores_kernel", 16, check_scores))]


if __name__ == "__main__":
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    ok = True
    for name, cases, check in CHECKS:
        for case in cases:
            result = check(*case, device=device)
            ok &= result
            print(name, case, "OK" if result else "MISMATCH", flush=True)
    sys.exit(0 if ok else 1)
