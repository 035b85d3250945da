"""The k best blocks per (sequence, KV head) in one launch, in block order: the set `torch.topk(ranks, k)` returns
(ties: the lower block ids), listed by block id instead of best first. torch's radix select (`sbtopk::gatherTopK`,
2 bits a pass) and the sort of its k results took ~28 us a layer at 48K on the H200 (3072 blocks, k = 128; ~1 ms of a
replayed 36-layer step) for what is a few thousand numbers.

One program per (sequence, KV head) holds its whole row in registers, each rank as an unsigned 32-bit key (its fp32
bits made monotonic; held in 64 bits, -1 past the row). The k-th largest key T is found from the top bit down, two
bits a round: a round counts the keys at or above three candidate thresholds (one sum over the registers, the three
counts packed in 64 bits) and keeps the highest candidate that still leaves k keys at or above it; 16 rounds fix all
32 bits. Every key above T is chosen, and the first (in block order) of the keys equal to T until k are; a prefix sum
gives each its place in the output.

The row is held as two parts, a power of two and the next power of two above what is left (`row_parts`): the
ranking's width is the summaries' capacity, a sixteenth past the prompt's blocks from the prefill on (a 32K prompt
ranks 2,176 blocks, a 128K one 8,704), and one power of two past it doubled the work (2,048 ->
4,096 ranks: 8.6 -> 14.3 us on the H200) or, past 8,192, fell back to `torch.topk` + sort (~60 us a layer).

Four bits a round (8 rounds, 15 candidates' counts as four packed sums in one reduction) was slower on the H200:
24.8 against 8.4 us for 8 rows of 2048 (a micro-benchmark, 2026-12-03).

An earlier kernel sorted each row instead (a bitonic `tl.sort` of 64-bit keys): 87 us a layer at 32K,
130 at 48K on the H200 — ~66 dependent exchange stages of the whole row for one program; here 16 sums.

Long rows run in two stages (`segments`): one program per (sequence, KV head) left 8 programs for 132 SMs and a
128K prompt's 8,704-block rows took ~42 us a layer inside a compiled step (1.5 ms of its 10.3 in a
profile). Stage one cuts each row into S segments of at least k ranks and selects each segment's k best
(B * H * S programs); stage two selects the k best of those S * k candidates, carrying their block ids. Exact, ties
included: under the order (rank descending, block id ascending) a row's k best are each among their segment's k best,
and the candidates stay in block order.

Shapes:
    ranks        `[B, H, W]` fp32, last dim contiguous (a strided view, e.g. one half of a split ranking, is read in
                 place); +inf forced, -inf not allowed
    ids (out)    `[B, H, k]` int64, increasing   values (out) `[B, H, k]` fp32
"""

from __future__ import annotations

import torch

from .gather import triton

MAX_ROW = 16384  # ranks one program holds (a row, or a segment of one); longer: torch.topk

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _keys(ranks, start, end, BLOCK: tl.constexpr):
        """Ranks [start, start + BLOCK) of a row (-inf from `end` on) and their keys: fp32 order as unsigned 32-bit
        integers, held in 64 bits, -1 past the row (below every rank)."""
        offs = start + tl.arange(0, BLOCK)
        inside = offs < end
        x = tl.load(ranks + offs, mask=inside, other=-float("inf")) + 0.0  # (-0 -> +0)
        bits = x.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # fp32 order as 0 .. 2^32 - 1
        return offs, x, tl.where(inside, key, -1)

    @triton.jit
    def _counts(key, t1, t2, t3):
        """Keys at or above each of three thresholds, packed in one 64-bit sum (counts < 2^21)."""
        packed = ((key >= t1).to(tl.int64) + ((key >= t2).to(tl.int64) << 21) + ((key >= t3).to(tl.int64) << 42))
        return tl.sum(packed, axis=0)

    @triton.jit
    def _round(key_a, key_b, threshold, r, k):
        """One round of the threshold's search: its next two bits (of 32, the highest first), so that still
        count(key >= threshold) >= k."""
        step = 1 << (30 - 2 * r)  # (an int32: the candidates are made by int64 additions)
        t1 = threshold + step
        t2 = t1 + step
        t3 = t2 + step
        counts = _counts(key_a, t1, t2, t3) + _counts(key_b, t1, t2, t3)
        n1 = counts & 0x1FFFFF
        n2 = (counts >> 21) & 0x1FFFFF
        n3 = counts >> 42
        return tl.where(n3 >= k, t3, tl.where(n2 >= k, t2, tl.where(n1 >= k, t1, threshold)))

    @triton.jit
    def _top_k_kernel(ranks, source_ids, ids, values, W, k, H, S, L, stride_b, stride_h, HEAD: tl.constexpr,
                      TAIL: tl.constexpr, SOURCE_IDS: tl.constexpr, UNROLLED: tl.constexpr):
        """Program p: segment p % S (ranks [s * L, s * L + L), the last one to W) of row p // S; its k best go to
        outputs [p * k, p * k + k), with their positions in the row, or `source_ids` at those positions."""
        program = tl.program_id(0)
        row = program // S
        segment = program % S
        b = row // H
        h = row % H
        base = ranks + b * stride_b + h * stride_h
        start = segment * L
        end = tl.where(segment == S - 1, W, start + L)
        offs_a, x_a, key_a = _keys(base, start, end, HEAD)  # the segment as a power-of-two head and a short tail:
        offs_b, x_b, key_b = _keys(base, start + HEAD, end, TAIL)  # 2176 ranks cost 2048 + 128, not 4096
        threshold = tl.full((), 0, tl.int64)  # count(key >= threshold) >= k throughout
        if UNROLLED:  # two bits a round, the highest first: unrolled where a program holds ~1K ranks (two stages)
            for r in tl.static_range(16):
                threshold = _round(key_a, key_b, threshold, r, k)
        else:  # a loop where it holds a whole row (one stage): see `unrolled`
            for r in range(16):
                threshold = _round(key_a, key_b, threshold, r, k)
        above_a, equal_a = key_a > threshold, key_a == threshold
        above_b, equal_b = key_b > threshold, key_b == threshold
        # the equal keys taken, lowest block ids first
        room = k - tl.sum(above_a.to(tl.int32), axis=0) - tl.sum(above_b.to(tl.int32), axis=0)
        chosen_a = above_a | (equal_a & (tl.cumsum(equal_a.to(tl.int32), axis=0) <= room))
        room_b = room - tl.sum(equal_a.to(tl.int32), axis=0)
        chosen_b = above_b | (equal_b & (tl.cumsum(equal_b.to(tl.int32), axis=0) <= room_b))
        place_a = tl.cumsum(chosen_a.to(tl.int32), axis=0) - 1
        place_b = tl.cumsum(chosen_b.to(tl.int32), axis=0) - 1 + tl.sum(chosen_a.to(tl.int32), axis=0)
        out = program.to(tl.int64) * k
        if SOURCE_IDS:  # stage two: the candidates' block ids
            id_base = source_ids + b * stride_b + h * stride_h
            id_a = tl.load(id_base + offs_a, mask=chosen_a, other=0)
            id_b = tl.load(id_base + offs_b, mask=chosen_b, other=0)
        else:
            id_a, id_b = offs_a.to(tl.int64), offs_b.to(tl.int64)
        tl.store(ids + out + place_a, id_a, mask=chosen_a)
        tl.store(values + out + place_a, x_a, mask=chosen_a)
        tl.store(ids + out + place_b, id_b, mask=chosen_b)
        tl.store(values + out + place_b, x_b, mask=chosen_b)


MAX_SEGMENTS = 16
PREFERRED_SEGMENTS = 8  # (`default_segments`)


def unrolled(segments: int) -> bool:
    """Whether the kernel's 16 rounds are unrolled (compiled as 16 copies) or a loop: a loop compiles ~5x faster for
    sm_90 (CI machine, a micro-benchmark: 1.8 -> 0.31 s at 2,176 blocks a row, 2.6 -> 0.47 s at 8,704; the
    first decode step's longest compilation on a new machine) and costs nothing where a program holds a whole row (H200,
    `gpu_run.sh looptopk`: 2,176 blocks 10.97 against 10.78 us), but ~9% where a row is cut in
    segments of ~1K (8,704 blocks, two stages: 18.97 against 17.47 us, ~54 us a 128K step of Qwen3-8B's 36 layers).
    Unrolled there: a 128K prompt's prefill dwarfs a compilation, a 32K prompt's first call does not."""
    return segments > 1


def default_segments(W: int, k: int) -> int:
    """Segments a row of W ranks is cut into (1: one stage). Two stages once a row is past 4,096 ranks: 8 segments
    (fewer where segments of 4k ranks would not fill them; more where one would pass `MAX_ROW`), so 8,704 blocks,
    k = 128 -> 8 segments of 1,088 and 1,024 candidates. H200, 8 rows, k = 128 (a micro-benchmark
    --segments`): alone 8 segments fastest at 4,352 and 8,704 ranks (13.8, 17.7 us), one
    stage at 2,176, 8 and 16 tied at 17,408; beside the gather as in a step (`--beside-gather`) 8
    fastest at 8,704 (17.9 us, 16 segments 19.4) and 4,352."""
    if W <= 4096:
        return 1
    segments = max(min(PREFERRED_SEGMENTS, W // (4 * k)), -(-W // MAX_ROW))
    return segments if 2 <= segments <= MAX_SEGMENTS else 1


def row_parts(W: int, grows: bool = True) -> tuple[int, int]:
    """`(HEAD, TAIL)`: a row of W ranks held as a power of two (the largest <= W, at least 16) and the next power of
    two >= what is left (at least 16; masked past W). Where the row `grows` with the summaries, the tail is at least a
    sixteenth of the head: a growth by a sixteenth (`BlockSummaries.reserve`) then keeps the kernel's specialization
    — 2,048 blocks rank 2,048 + 128 before and after — instead of compiling a second one (~1.5 s on a new machine;
    the first growth is made at the prefill, `OasisLayer._offload_complete_blocks`).
    Stage two's rows (S * k candidates) do not grow."""
    head = max(16, 1 << (W.bit_length() - 1))
    return head, max(16, head // 16 if grows else 16, triton.next_power_of_2(max(1, W - head)))


def default_warps(keys: int) -> int:
    """Warps of the program that holds `keys` ranks (a row's two parts; H200, a micro-benchmark, rows
    of 8 (sequence, KV head) pairs: 4 fastest at 2,048 and 2,176 blocks, 8 at 4,096, 16 at 8,192 and 8,704)."""
    return 4 if keys <= 2560 else 8 if keys <= 5120 else 16


def _stages(ranks: torch.Tensor, k: int, segments: int | None) -> tuple[int, int, int] | None:
    """`(S, L, widest)` where the kernel takes `ranks` — S segments of L ranks (the last one to W), the widest
    W - (S - 1) * L — else None (`torch.topk`)."""
    if not (triton is not None and ranks.dtype == torch.float32 and ranks.dim() == 3 and ranks.stride(-1) == 1
            and 0 < k <= ranks.shape[-1]):
        return None
    W = ranks.shape[-1]
    S = default_segments(W, k) if segments is None else segments
    if S < 1 or (S > 1 and W // S < k):
        raise ValueError(f"top_k: {S} segments of a row of {W} leave fewer than k = {k} ranks in one; use at most "
                         f"{max(1, W // k)} (or segments=None)")
    L = W // S
    widest = W - (S - 1) * L
    return (S, L, widest) if widest <= MAX_ROW and S * k <= MAX_ROW else None


def kernel_fits(ranks: torch.Tensor, k: int, segments: int | None = None) -> bool:
    """Whether `top_k` runs the kernel for `ranks` (else it is `torch.topk`)."""
    return _stages(ranks, k, segments) is not None


def top_k(ranks: torch.Tensor, k: int, num_warps: int | None = None,
          segments: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, values)` `[B, H, k]`: the k largest of `ranks` `[B, H, W]` per row (equal values: the lower indices),
    in index order. Rows the kernel does not take (`kernel_fits`) go through `torch.topk` and are put in index
    order too (which of equal values it keeps is its own choice). `num_warps` (the one-stage kernel's, or stage
    one's) and `segments` (1: one stage; None: `default_segments`) are tuning knobs (a micro-benchmark)."""
    stages = _stages(ranks, k, segments)
    if stages is None:
        top = torch.topk(ranks, k, dim=-1, sorted=False)
        ids, order = top.indices.sort(dim=-1)
        return ids, top.values.gather(-1, order)
    B, H, W = ranks.shape
    S, L, widest = stages
    width = S * k  # what stage one leaves per row (the k best when S = 1)
    ids = torch.empty((B, H, width), dtype=torch.int64, device=ranks.device)
    values = torch.empty((B, H, width), dtype=torch.float32, device=ranks.device)
    head, tail = row_parts(widest)
    _top_k_kernel[(B * H * S,)](ranks, ranks, ids, values, W, k, H, S, L, ranks.stride(0), ranks.stride(1),
                                HEAD=head, TAIL=tail, SOURCE_IDS=False, UNROLLED=unrolled(S),
                                num_warps=num_warps or default_warps(head + tail))
    if S == 1:
        return ids, values
    best_ids = torch.empty((B, H, k), dtype=torch.int64, device=ranks.device)
    best = torch.empty((B, H, k), dtype=torch.float32, device=ranks.device)
    head, tail = row_parts(width, grows=False)
    _top_k_kernel[(B * H,)](values, ids, best_ids, best, width, k, H, 1, width, H * width, width, HEAD=head,
                            TAIL=tail, SOURCE_IDS=True, UNROLLED=unrolled(S), num_warps=default_warps(head + tail))
    return best_ids, best
