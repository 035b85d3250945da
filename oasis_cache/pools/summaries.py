"""The summary pool: per complete block, what selection ranks it by, kept on the compute device. Keys are as cached
(after RoPE). Two kinds, one per scorer (`control.selection`):

bound (`key_bits=False`):
    `levels` `[2, B, Hkv, NBcap, D]`: the elementwise min (0) and max (1) of the block's keys; they bound q.k over
    the block from above.
bits (`key_bits=True`): a 1-bit code of every key, channel by channel.
    `codes` `[B, Hkv, NBcap, ceil(T/8), D]` uint8: bit `t % 8` of byte `t // 8` is set when token t's key lies above
        the block's mean key in that channel.
    `levels` `[2, B, Hkv, NBcap, D]`: per channel, the mean of the keys below or at the block mean (0) and of those
        above it (1) — the least-squares levels of a 1-bit code (Lloyd-Max), which measured far better than
        snapping to the min and max (docs/performance.md). A channel with no key above its mean has both levels equal.
    Token t's coarse key is `where(bit, levels[1], levels[0])`. T*D/8 more bytes per block and KV head than the
    bound: half of `levels` in bf16.
    With `fp8_levels=True`, `levels` are float8 (e4m3) and `scales` `[B, Hkv, NBcap]` fp32 holds a power of two per
    block and KV head (level = fp8 value * scale; the largest level maps to at most 448, fp8's range): codes and
    levels then take the bytes of a bf16 min/max. Products of such levels with bf16 queries stay exact in TF32.

With `kept_channels` < D (`OasisConfig.summary_channels`), codes and levels cover only that many key channels per
sequence and KV head (`channels` `[B, Hkv, D']`: rotary pairs kept together, those of largest mean |k| over the real
tokens of the prompt — a left-padded row's padding does not choose), and queries are read on the same channels
(`query_channels`): the summaries shrink by D / D', the rest of q.k is left out of the ranking (eval/scoring.py
`centroid1_half` measured what it keeps). Every shape above then has D' in place of D. Until the channels are
chosen (`fix_channels`, at the first decode step: the prompt's blocks, whatever chunks and batch its prefill ran
in) the blocks are summarized on all D channels and `channel_weight` `[B, Hkv, D]` sums their |k|; choosing keeps
those blocks' codes and levels on the chosen channels (their fp8 scales stay: powers of two, exact either way).

Blocks [0, num_blocks) are valid (`count`: the same number, `[1]` int64 on the device, which selection reads so that
a captured decode step stays valid as blocks complete); entries past it are never ranked. Capacity grows by a
sixteenth (at least 64 blocks) when full, on fixed steps (`capacity_for`: the same capacity for the same blocks
however they came): the pool costs about 2/T of the keys' size (1/16 of K+V at
T=16; 3/32 with codes at bf16), with at most 1/16 of slack (a quarter: 1.6 points of device
KV at 32K), and is reallocated O(log N) times over a sequence (each growth, a recapture of the captured steps: every 2048 decode
tokens at 32K, 8192 at 128K).
"""

from __future__ import annotations

import torch

from .stamped import Stamped

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def pack_key_bits(above: torch.Tensor) -> torch.Tensor:
    """`above` `[..., T, D]` bool -> codes `[..., ceil(T/8), D]` uint8 (bit t % 8 of byte t // 8 is token t)."""
    *lead, T, D = above.shape
    padded = torch.zeros((*lead, -(-T // 8) * 8, D), dtype=torch.uint8, device=above.device)
    padded[..., :T, :] = above
    weights = (1 << torch.arange(8, device=above.device)).to(torch.uint8)[:, None]  # [8, 1]
    return (padded.view(*lead, -1, 8, D) * weights).sum(dim=-2, dtype=torch.uint8)


def unpack_key_bits(codes: torch.Tensor, block_size: int) -> torch.Tensor:
    """codes `[..., ceil(T/8), D]` uint8 -> `[..., T, D]` bool."""
    shifts = torch.arange(8, device=codes.device, dtype=torch.uint8)[:, None]  # [8, 1]
    bits = (codes.unsqueeze(-2) >> shifts) & 1  # [..., ceil(T/8), 8, D]
    return bits.flatten(-3, -2)[..., :block_size, :].bool()


def one_bit_code(key_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`key_blocks` `[..., T, D]` -> `(above [..., T, D] bool, low [..., D] fp32, high [..., D] fp32)`: which keys lie
    above their block's mean in each channel, and the mean of the keys on each side."""
    keys = key_blocks.float()
    mean = keys.mean(dim=-2, keepdim=True)
    above = keys > mean
    n_above = above.sum(dim=-2)
    n_low = keys.shape[-2] - n_above
    high_sum = torch.where(above, keys, 0.0).sum(dim=-2)
    low_sum = keys.sum(dim=-2) - high_sum
    mean = mean.squeeze(-2)  # a side without keys (all equal, or rounding) takes the mean
    high = torch.where(n_above > 0, high_sum / n_above.clamp(min=1), mean)
    low = torch.where(n_low > 0, low_sum / n_low.clamp(min=1), mean)
    return above, low, high


def without_padding(key_blocks: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """`key_blocks` `[B, Hkv, n, T, D]` with each padding token's key (`real` `[B, n, T]` False) replaced by the key of
    its block's last real token, and zeros in blocks of padding only: a block's summary then depends on its real keys
    alone — not on what a prefill made of the padding (HF's model, the cache's, or zeros in `from_dynamic_cache` of
    a padded `DynamicCache`), which attention never reads. A repeated key changes no token-wise maximum; in the bits
    scorer's mean and levels it weighs as that key again."""
    B, H, n, T, D = key_blocks.shape
    positions = torch.arange(T, device=real.device)
    last = torch.where(real, positions, -1).amax(dim=-1)  # [B, n]: each block's last real token, -1 if none
    source = torch.where(real, positions, last[..., None].clamp(min=0))  # [B, n, T]
    filled = key_blocks.gather(3, source[:, None, :, :, None].expand(B, H, n, T, D))
    return torch.where((last >= 0)[:, None, :, None, None], filled, 0.0)


def channel_weight(key_blocks: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """`key_blocks` `[B, Hkv, n, T, D]` -> `[B, Hkv, D]` fp32: the sum of |k| per channel over the real tokens (`real`
    `[B, n, T]` bool, False = padding; None: all)."""
    weight = key_blocks.float().abs()
    if real is not None:
        weight = weight * real[:, None, :, :, None]
    return weight.sum(dim=(2, 3))


def key_channels(key_blocks: torch.Tensor, kept: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """`key_blocks` `[B, Hkv, n, T, D]` -> `[B, Hkv, kept]` int64: the channels of largest mean |k| over the real tokens
    (`heaviest_channels`; `real` as for `channel_weight`)."""
    return heaviest_channels(channel_weight(key_blocks, real), kept)


def heaviest_channels(weight: torch.Tensor, kept: int) -> torch.Tensor:
    """`weight` `[..., D]` -> `[..., kept]` int64, ascending within each half: the `kept` channels of largest weight,
    by rotary pairs (the rotate-half layout of HF's models: channel d turns with d + D/2; `kept` even)."""
    D = weight.shape[-1]
    pairs = weight[..., : D // 2] + weight[..., D // 2 :]
    top = pairs.topk(kept // 2, dim=-1).indices.sort(dim=-1).values
    return torch.cat((top, top + D // 2), dim=-1)


def fp8_scales(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """`low`, `high` `[..., D]` fp32 -> `[...]` the smallest powers of two that bring every level within fp8's range."""
    largest = torch.maximum(low.abs().amax(dim=-1), high.abs().amax(dim=-1))
    return torch.exp2(torch.ceil(torch.log2(largest.clamp(min=2.0**-100) / FP8_MAX)))


FP8_MIN_CAPABILITY = (8, 9)  # Triton converts fp8 e4m3 on Ada / Hopper and later


def fp8_levels_for(requested: bool | None, scorer: str, device: torch.device, use_kernels: bool) -> bool:
    """Whether a layer keeps its bits levels in fp8: `requested` (`OasisConfig.fp8_levels`) when given, else fp8
    wherever it runs (the bits scorer on CPU, on CUDA with the torch path, or with the Triton kernels on compute
    capability >= 8.9; CPU measurements: the same retention as bf16 levels, `docs/performance.md`)."""
    kernels_cannot = (use_kernels and device.type == "cuda"
                      and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY)
    if requested is None:
        return scorer == "bits" and not kernels_cannot
    if requested and kernels_cannot:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"fp8_levels=True: the Triton kernels cannot convert fp8 on this GPU (compute capability {major}.{minor}, "
            f"needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}). Use fp8_levels=None or False, or "
            "backend='torch'."
        )
    return requested


def capacity_for(num_blocks: int) -> int:
    """The summaries' capacity for `num_blocks` blocks: rounded up to a multiple of 64 blocks, or of a sixteenth of
    the power of two at or below it past 1,024 (at most 1/16 more). A function of the largest count ever reserved,
    not of the steps that reached it: a prompt prefilled in chunks (its whole length reserved at once), one grown
    block by block and a fork that prefilled part of it end with the same capacity — the selection ranks blocks over
    it, and blocks of equal score are taken in an order that depends on it."""
    step = max(64, (1 << max(0, num_blocks.bit_length() - 1)) // 16)
    return -(-num_blocks // step) * step


class BlockSummaries(Stamped):
    def __init__(self, batch_size, num_kv_heads, head_dim, dtype, device, block_size: int, key_bits: bool,
                 fp8_levels: bool = False, kept_channels: int | None = None):
        self.head_dim = head_dim
        self.kept_channels = head_dim if kept_channels is None else kept_channels  # D' (see the module doc)
        D = head_dim  # (all channels until `fix_channels` chooses D')
        self.channels = None  # [B, Hkv, D'] int64 once chosen (D' < D), at the first decode step
        self.channel_weight = None  # [B, Hkv, D] fp32 until then (D' < D): |k| summed over the real tokens
        self.levels = torch.empty((2, batch_size, num_kv_heads, 0, D), dtype=FP8 if fp8_levels else dtype,
                                  device=device)
        self.scales = (torch.empty((batch_size, num_kv_heads, 0), dtype=torch.float32, device=device)
                       if fp8_levels else None)
        self.codes = (
            torch.empty((batch_size, num_kv_heads, 0, -(-block_size // 8), D), dtype=torch.uint8, device=device)
            if key_bits else None
        )
        self.num_blocks = 0
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # num_blocks, on the device

    @property
    def channels_fixed(self) -> bool:
        """Whether the summarized channels are known (all of them, or chosen): a step may then be captured."""
        return self.kept_channels == self.head_dim or self.channels is not None

    def query_channels(self, query: torch.Tensor) -> torch.Tensor:
        """`query` `[B, Hq, Qn, D]` -> `[B, Hq, Qn, D']`: the channels the summaries cover (the query itself if all)."""
        if self.channels is None:
            return query
        B, Hq, Qn, _ = query.shape
        index = self.channels.repeat_interleave(Hq // self.channels.shape[1], dim=1)  # [B, Hq, D']
        return query.gather(-1, index[:, :, None, :].expand(B, Hq, Qn, self.kept_channels))

    @property
    def capacity_blocks(self) -> int:
        return self.levels.shape[3]

    def reserve(self, num_blocks: int) -> None:
        """Make room for `num_blocks` blocks (new tensors of `capacity_for(num_blocks)`)."""
        if num_blocks <= self.capacity_blocks:
            return
        capacity = capacity_for(num_blocks)
        self.levels = self._grown(self.levels, 3, capacity)
        if self.codes is not None:
            self.codes = self._grown(self.codes, 2, capacity)
        if self.scales is not None:
            self.scales = self._grown(self.scales, 2, capacity)

    def append(self, key_blocks: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Summarize and append new complete blocks. `key_blocks`: `[B, Hkv, n, T, D]` on the compute device; `real`:
        `[B, n, T]` bool (False = padding) or None (given while the prompt's blocks are appended): a sequence's
        padding weighs neither in `channel_weight` nor in the blocks' summaries (`without_padding`). One block (a
        decode step's) is written at the device count and counted by a device add — the same operators for every
        block, so that a captured step that completes a block replays for the next ones."""
        B, H, n, T, _ = key_blocks.shape
        end = self.num_blocks + n
        self.reserve(end)
        if not self.channels_fixed:
            weight = channel_weight(key_blocks, real)
            self.channel_weight = weight if self.channel_weight is None else self.channel_weight + weight
        if real is not None:
            key_blocks = without_padding(key_blocks, real)
        if self.channels is not None:  # (chosen: the blocks are summarized on them)
            key_blocks = key_blocks.gather(-1, self.channels[:, :, None, None].expand(B, H, n, T, self.kept_channels))
        if self.codes is None:
            low, high = key_blocks.amin(dim=3), key_blocks.amax(dim=3)  # [B, Hkv, n, D]
        else:
            above, low, high = one_bit_code(key_blocks)
            self._write(self.codes, 2, pack_key_bits(above))
        if self.scales is not None:
            scale = fp8_scales(low, high)  # [B, Hkv, n]
            self._write(self.scales, 2, scale)
            low, high = low / scale[..., None], high / scale[..., None]
        self._write(self.levels, 3, torch.stack((low, high)).to(self.levels.dtype))
        if n == 1:
            self.num_blocks = end
            self.count.add_(1)
        else:
            self._set_count(end)

    def fix_channels(self) -> None:
        """Choose the kept channels from the blocks so far (`channel_weight`) and keep their codes and levels on them
        (new tensors: before any captured step). Nothing to do with all channels kept, once chosen, or before the
        first block."""
        if self.channels_fixed or self.channel_weight is None:
            return
        self.channels = heaviest_channels(self.channel_weight, self.kept_channels)  # [B, Hkv, D']
        self.channel_weight = None
        B, H, D = self.channels.shape

        def kept(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            source = pool.view(torch.uint8) if pool.element_size() == 1 else pool  # (fp8 has no gather)
            return source.gather(-1, index.expand(*pool.shape[:-1], D)).view(pool.dtype)

        self.levels = kept(self.levels, self.channels.view(1, B, H, 1, D))  # [2, B, Hkv, NBcap, D]
        if self.codes is not None:
            self.codes = kept(self.codes, self.channels.view(B, H, 1, 1, D))  # [B, Hkv, NBcap, ceil(T/8), D]

    def _write(self, pool: torch.Tensor, block_dim: int, values: torch.Tensor) -> None:
        """`values` (n blocks along `block_dim`) into `pool` after the valid blocks: one block at the device count."""
        n = values.shape[block_dim]
        if n == 1:
            if pool.element_size() == 1:  # (fp8 has no index_copy_: its bytes are copied)
                pool, values = pool.view(torch.uint8), values.view(torch.uint8)
            pool.index_copy_(block_dim, self.count, values)
        else:
            pool.narrow(block_dim, self.num_blocks, n).copy_(values)

    def _set_count(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.count.fill_(num_blocks)

    def _grown(self, pool: torch.Tensor, block_dim: int, capacity: int) -> torch.Tensor:
        shape = list(pool.shape)
        shape[block_dim] = capacity
        grown = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
        grown.narrow(block_dim, 0, self.num_blocks).copy_(pool.narrow(block_dim, 0, self.num_blocks))
        return grown

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(levels[0], levels[1])` of the valid blocks, each `[B, Hkv, NB, D]` (the min and max for the bound; fp32,
        scaled back, for fp8 levels)."""
        low, high = self.levels[0, :, :, : self.num_blocks], self.levels[1, :, :, : self.num_blocks]
        if self.scales is None:
            return low, high
        scale = self.scales[:, :, : self.num_blocks, None]
        return low.float() * scale, high.float() * scale

    def truncate(self, num_blocks: int) -> None:
        self._set_count(num_blocks)  # (before the channels are chosen, the blocks cut off still weigh in them)

    def index_batch(self, indices: torch.Tensor) -> None:
        self.levels = self.levels.index_select(1, indices.to(self.levels.device))
        if self.channel_weight is not None:
            self.channel_weight = self.channel_weight.index_select(0, indices.to(self.channel_weight.device))
        if self.channels is not None:
            self.channels = self.channels.index_select(0, indices.to(self.channels.device))
        if self.codes is not None:
            self.codes = self.codes.index_select(0, indices.to(self.codes.device))
        if self.scales is not None:
            self.scales = self.scales.index_select(0, indices.to(self.scales.device))

    @property
    def nbytes(self) -> int:
        codes = 0 if self.codes is None else self.codes.numel()
        scales = 0 if self.scales is None else self.scales.numel() * 4
        channels = 0 if self.channels is None else self.channels.numel() * 8
        return self.levels.numel() * self.levels.element_size() + codes + scales + channels
