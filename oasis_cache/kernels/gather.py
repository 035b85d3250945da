"""Gather selected blocks straight from pinned host memory into the device working set (one launch per layer).

Shapes and strides (all contiguous, element type E = the model's K/V dtype):
    host chunk c         `[C, 2, B, Hkv, T, D]`   base address `chunk_addrs[c]` (pinned, read through unified
                                                 addressing: the kernel's loads cross PCIe, no staging copy);
                         `[C, 2, 1, 1, T, D]`     with `per_unit` (an arena of (sequence, KV head) blocks)
    working set          `[2, B, Hkv, L, D]`, L >= S*T: slot s is tokens [s*T, s*T + T) of each row
    block_ids, dest      `[B, Hkv, K]` int64      block to read, slot to write
    fetch                `[B, Hkv, K]` int8       1 = copy this entry, 0 = skip
Program (p, kv): entries i = p, p + P, p + 2P, ... (P programs; entry i = (b*Hkv + h)*K + k), kv in {0 keys,
1 values}; copies T*D elements per entry. P = one per entry by default; fewer programs keep the gather on fewer SMs
(it mostly waits on PCIe) so that compute kernels running beside it keep theirs.
Offsets are computed in int64 (a 128K context at batch 8 exceeds 2**31 elements per chunk family).

With a narrow host pool (`memory/representation.py`) a chunk is `[C, 2, B, Hkv, U]` bytes; `_gather_narrow_kernel`
reads each selected unit's U bytes and writes it widened to E, computed as `Representation.widen` computes it (fp32,
one rounding to E): the same values, bit for bit.
"""

from __future__ import annotations

import torch

try:  # Triton is present wherever CUDA torch is; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines without triton
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def host_block(chunk_addrs, block, C, kv, BH, bh, like, BLOCK_ELEMS: tl.constexpr):
        """Pointer to the T*D elements of (block `block`, K or V `kv`, sequence x KV head `bh`) in the host pool whose
        chunk `c` starts at `chunk_addrs[c]` (layout above), typed as `like`'s elements. Shared with `host_store.py`."""
        chunk = block // C
        local = block - chunk * C
        base = tl.load(chunk_addrs + chunk).to(tl.pointer_type(like.dtype.element_ty))
        return base + ((local * 2 + kv) * BH + bh) * BLOCK_ELEMS

    @triton.jit
    def round_of_entries(first, fetch, block_ids, dest, num_entries, K, ENTRIES: tl.constexpr):
        """Entries `first .. first + ENTRIES` of a gather: (to copy, their blocks, their slots, their sequence x KV
        head), the block and slot of an entry not copied 0."""
        entry = first + tl.arange(0, ENTRIES)
        wanted = (tl.load(fetch + entry, mask=entry < num_entries, other=0) != 0)
        block = tl.load(block_ids + entry, mask=wanted, other=0)
        slot = tl.load(dest + entry, mask=wanted, other=0)
        return wanted, block, slot, (entry // K).to(tl.int64)

    @triton.jit
    def _gather_blocks_kernel(
        chunk_addrs,
        block_ids,
        dest,
        fetch,
        out,
        BH,
        K,
        C,
        ROW,
        num_entries,
        SRC_BH,
        BLOCK_ELEMS: tl.constexpr,
        BLOCK_POW2: tl.constexpr,
        ENTRIES: tl.constexpr,
    ):
        kv = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, BLOCK_POW2)
        mask = offs < BLOCK_ELEMS
        if ENTRIES == 1:
            for entry in range(tl.program_id(0), num_entries, tl.num_programs(0)):
                if tl.load(fetch + entry) != 0:
                    block = tl.load(block_ids + entry)
                    slot = tl.load(dest + entry)
                    bh = (entry // K).to(tl.int64)
                    src = host_block(chunk_addrs, block, C, kv, SRC_BH, bh % SRC_BH, out, BLOCK_ELEMS)
                    dst = out + (kv * BH + bh) * ROW + slot * BLOCK_ELEMS
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
        else:  # ENTRIES entries a round: more bytes in flight per program (fewer programs, fewer SMs)
            for first in range(tl.program_id(0) * ENTRIES, num_entries, tl.num_programs(0) * ENTRIES):
                wanted, block, slot, bh = round_of_entries(first, fetch, block_ids, dest, num_entries, K, ENTRIES)
                src = host_block(chunk_addrs, block, C, kv, SRC_BH, bh % SRC_BH, out, BLOCK_ELEMS)
                dst = out + (kv * BH + bh) * ROW + slot * BLOCK_ELEMS
                both = wanted[:, None] & mask[None, :]
                tl.store(dst[:, None] + offs[None, :], tl.load(src[:, None] + offs[None, :], mask=both), mask=both)

    @triton.jit
    def _rounded(x, out):
        """fp32 `x` as `out`'s elements, rounded to nearest even as torch rounds (bf16 by its bits: Triton's
        interpreter truncates to bf16)."""
        if out.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(out.dtype.element_ty)

    @triton.jit
    def _load_u32(at, mask, ALIGNED4: tl.constexpr):
        """The 4 bytes at byte pointers `at` as uint32 (little-endian): one load where 4-byte aligned, else by bytes."""
        if ALIGNED4:
            return tl.load(at.to(tl.pointer_type(tl.uint32)), mask=mask, other=0)
        word = tl.load(at, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint32)
        for i in tl.static_range(1, 4):
            word |= tl.load(at + i, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint32) << (8 * i)
        return word

    @triton.jit
    def _hadamard_rows(first: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
        """Rows `first .. first + W` of the `[D, D]` Sylvester Hadamard matrix (entry (i, j): -1 to the number of
        bits i and j share), fp16."""
        both = (first + tl.arange(0, W))[:, None] & tl.arange(0, D)[None, :]
        parity = both
        for shift in tl.static_range(0, 5):  # (fold the bits: D <= 2**32)
            parity = parity ^ (parity >> (16 >> shift))
        return tl.where((parity & 1) != 0, -1.0, 1.0).to(tl.float16)

    @triton.jit
    def _widen_rotated(u, scale, low, top, bottom, inverse_root, root, ROWS: tl.constexpr, W: tl.constexpr,
                       D: tl.constexpr):
        """int4 codes `u` (`[E, T, W]` bytes: channel j low, j + W high) of units narrowed in the rotated basis,
        widened to `[E * T, D]` fp32 but for the center: H code (`top`, `bottom`: rows of H, fp16; the sums are
        integers below 2**11, exact in any order) * (scale * inverse_root), plus minimum * root at channel 0 —
        `Int4.widen`'s operations in its order."""
        low_codes = (u & 15).to(tl.float16).reshape(ROWS, W)
        high_codes = (u >> 4).to(tl.float16).reshape(ROWS, W)
        turned = tl.dot(low_codes, top) + tl.dot(high_codes, bottom)  # [ROWS, D] fp32
        first = tl.arange(0, D)[None, :] == 0
        return turned * (scale.reshape(ROWS, 1) * inverse_root) + tl.where(first, low.reshape(ROWS, 1) * root, 0.0)

    @triton.jit
    def _gather_narrow_kernel(
        chunk_addrs, block_ids, dest, fetch, out, center, inverse_root, root, H, BH, K, C, ROW, num_entries, SRC_BH,
        FORMAT: tl.constexpr,  # 1: fp8 (codes [T, D], an fp32 scale); 2: int4 (bytes [T, D/2], fp16 pairs [T, 2],
        # what keys add back `center` fp32 [H, D]); 3: int4 narrowed in the Hadamard-rotated basis
        T: tl.constexpr, D: tl.constexpr, W: tl.constexpr, UNIT: tl.constexpr,
        T_POW2: tl.constexpr, W_POW2: tl.constexpr, ENTRIES: tl.constexpr, ALIGNED: tl.constexpr,
        ALIGNED4: tl.constexpr,  # the scales after the codes start 4-byte aligned (T * W % 4 == 0, UNIT % 4 == 0)
    ):
        kv = tl.program_id(1).to(tl.int64)
        t = tl.arange(0, T_POW2)
        w = tl.arange(0, W_POW2)
        inside = (t[:, None] < T) & (w[None, :] < W)  # W: bytes of a token's codes
        if FORMAT == 3:  # (T, W and D powers of two here)
            top, bottom = _hadamard_rows(0, W, D), _hadamard_rows(W, W, D)
            d = tl.arange(0, D)
        for first in range(tl.program_id(0) * ENTRIES, num_entries, tl.num_programs(0) * ENTRIES):
            wanted, block, slot, bh = round_of_entries(first, fetch, block_ids, dest, num_entries, K, ENTRIES)
            src = host_block(chunk_addrs, block, C, kv, SRC_BH, bh % SRC_BH, fetch, UNIT)
            if ALIGNED:  # (units start 16-byte aligned in pinned chunks; rows of W bytes keep that: vector loads)
                src = tl.multiple_of(src, 16)
            dst = out + (kv * BH + bh) * ROW + slot * (T * D)
            both = wanted[:, None, None] & inside[None, :, :]
            codes = tl.load(src[:, None, None] + (t[None, :, None] * W + w[None, None, :]), mask=both, other=0)
            at = dst[:, None, None] + (t[None, :, None] * D + w[None, None, :])
            if FORMAT == 1:
                scale = _load_u32(src + T * D, wanted, ALIGNED4).to(tl.float32, bitcast=True)
                x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None, None]
                tl.store(at, _rounded(x, out), mask=both)
            else:
                # a token's (scale, minimum): one 4-byte load, split by bits (fp16 scale in the low half)
                pairs = (src + T * W)[:, None] + 4 * t[None, :]
                both16 = _load_u32(pairs, wanted[:, None] & (t[None, :] < T), ALIGNED4)
                scale = (both16 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
                low = (both16 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
                u = codes.to(tl.uint8, bitcast=True)
            if FORMAT == 3:  # rows of `wide`: (entry, token)
                wide = _widen_rotated(u, scale, low, top, bottom, inverse_root, root, ENTRIES * T, W, D)
                on = tl.reshape(wanted[:, None] & (t[None, :] < T), (ENTRIES * T,))
                head = tl.reshape((bh % H)[:, None] + t[None, :] * 0, (ENTRIES * T,))
                keys = on & (head * 0 + kv == 0)  # (the center for keys; values add 0)
                mu = tl.load(center + head[:, None] * D + d[None, :], mask=keys[:, None], other=0.0)
                offset = (kv * BH + bh) * ROW + slot * (T * D)  # [ENTRIES] int64: the entry's slot
                row = tl.reshape(offset[:, None] + t[None, :] * D, (ENTRIES * T,))
                tl.store(out + row[:, None] + d[None, :], _rounded(wide + mu, out), mask=on[:, None])
            elif FORMAT == 2:
                # the center for keys; values add 0, as torch's widening does (`kv` a tensor here: the interpreter)
                keys = wanted[:, None, None] & (w[None, None, :] < W) & (w[None, None, :] * 0 + kv == 0)
                mu = center + ((bh % H) * D)[:, None, None] + w[None, None, :]
                mu_low = tl.load(mu, mask=keys, other=0.0)
                mu_high = tl.load(mu + W, mask=keys, other=0.0)
                tl.store(at, _rounded(((u & 15).to(tl.float32) * scale + low) + mu_low, out), mask=both)
                tl.store(at + W, _rounded(((u >> 4).to(tl.float32) * scale + low) + mu_high, out), mask=both)


# The widening's `code * scale + minimum` as two roundings, as torch computes it on every device (a fused
# multiply-add rounds once: other bits than `Representation.widen`'s).
NARROW_FP_FUSION = False


def gather_blocks(
    chunk_addrs: torch.Tensor,
    chunk_blocks: int,
    block_ids: torch.Tensor,
    dest: torch.Tensor,
    fetch: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    max_programs: int | None = None,
    per_unit: bool = False,
    num_warps: int = 4,
    entries: int = 1,
    representation=None,
) -> None:
    """Copy host blocks `block_ids[fetch]` into working-set slots `dest[fetch]` of `out` (shapes above). `per_unit`:
    the host side is an arena of single (sequence, KV head) blocks, `[C, 2, 1, 1, T, D]` per chunk, and `block_ids`
    are its slots (the local cache of a remote tier, `remote/local_cache.py`). `num_warps`: per program (a tuning knob;
    64 programs of 2 warps and 128 of 1 were 3.7-4.6 ms slower a compiled step than the 32 of 4 the package runs on
    the side stream: docs/performance.md). `entries` (a power of two): blocks a program copies at
    once (a tuning knob, a micro-benchmark). `representation`: the host side's
    (`memory/representation.py`); a narrow one is widened on the way."""
    two, B, H, L, D = out.shape
    T = block_size
    K = block_ids.shape[-1]
    if entries < 1 or entries & (entries - 1):
        raise ValueError(f"gather_blocks copies a power of two of entries at once, got entries={entries}")
    total = B * H * K
    if total == 0:
        return
    rounds = triton.cdiv(total, entries)
    grid = (min(rounds, max_programs) if max_programs else rounds, 2)
    fetch = fetch.view(torch.int8) if fetch.dtype == torch.bool else fetch
    if representation is not None and representation.narrow_form:
        fp8 = representation.name == "fp8"
        W, UNIT = (D if fp8 else D // 2), representation.unit_nbytes  # (a token's code bytes, a unit's bytes)
        rotated = not fp8 and representation.rotates
        roots = (float(representation.inverse_root), float(representation.root)) if rotated else (1.0, 1.0)
        _gather_narrow_kernel[grid](
            chunk_addrs, block_ids.contiguous(), dest.contiguous(), fetch, out,
            fetch if fp8 else representation.offsets_on(out.device), *roots, H, B * H, K, chunk_blocks, L * D, total,
            1 if per_unit else B * H, FORMAT=1 if fp8 else 3 if rotated else 2, T=T, D=D, W=W, UNIT=UNIT,
            T_POW2=triton.next_power_of_2(T), W_POW2=triton.next_power_of_2(W), ENTRIES=entries,
            num_warps=num_warps, ALIGNED=W % 16 == 0 and UNIT % 16 == 0, ALIGNED4=T * W % 4 == 0 and UNIT % 4 == 0,
            enable_fp_fusion=NARROW_FP_FUSION,
        )
        return
    _gather_blocks_kernel[grid](
        chunk_addrs,
        block_ids.contiguous(),
        dest.contiguous(),
        fetch,
        out,
        B * H,
        K,
        chunk_blocks,
        L * D,
        total,
        1 if per_unit else B * H,
        BLOCK_ELEMS=T * D,
        BLOCK_POW2=triton.next_power_of_2(T * D),
        ENTRIES=entries,
        num_warps=num_warps,
    )
