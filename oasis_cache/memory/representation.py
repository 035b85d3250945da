"""How the host pool holds a unit — one (block, K or V, sequence, KV head): `[T, D]` elements of the model's dtype,
or fewer bytes (`host_dtype`). A narrow unit is one contiguous run of bytes, codes then scales, so every path that
moves units (offload, gather, a store's objects) moves it as one piece:

    "fp8"   `[T*D]` e4m3 codes, then one fp32 scale (padded to 16 bytes): x = code * scale, scale = max|x| / 448
            over the unit. T*D + 16 bytes (bf16: T*D*2).
    "int4"  `[T, D/2]` bytes, each two codes (channel j in the low nibble, j + D/2 in the high one), then per token
            an fp16 (scale, minimum): x = code * scale + minimum (+ the key center), code in 0..15, scale =
            (max - min) / 15 over the token's D channels. T*D/2 + 4*T bytes. Keys first lose a center per KV head and
            channel (`Int4.center`, fp16 `[Hkv, D]`: their mean over the first blocks narrowed, fixed from then on):
            keys carry large per-channel offsets (a projection's bias), which would otherwise set every token's range.
            (Groups along tokens per channel, as KIVI keeps keys, would take a scale and minimum per channel for the
            16 tokens of a block: 2 bits an element on top of 4.)

`narrow` (torch ops, on any device: the offload runs it on the model's device, before the bytes cross the link) and
`widen` (torch ops; the reference the Triton gather's widening, `kernels/gather.py`, equals bit for bit). Both take
the last dims `[2, B, Hkv, ...]` (K and V, sequences, KV heads), or, with `heads`, `[2, ...]` per entry of that KV
head. Widening computes in fp32 and rounds to the model's dtype: an fp16 scale times a 4-bit code is exact in fp32, so
a fused multiply-add and a multiply then an add round alike.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_PAD = 16  # bytes after an fp8 unit's codes: its fp32 scale, padded so that every unit starts 16-byte aligned
FP16_MAX = 65504.0


class Representation:
    """The model's own dtype: a unit is `[T, D]` elements, as the model made them."""

    name = None
    narrow_form = False

    def __init__(self, dtype: torch.dtype, block_size: int, head_dim: int):
        self.dtype, self.block_size, self.head_dim = dtype, block_size, head_dim

    @property
    def unit_shape(self) -> tuple:
        return (self.block_size, self.head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def unit_nbytes(self) -> int:
        return math.prod(self.unit_shape) * self.storage_dtype.itemsize

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., 2, B, Hkv, T, D]` of the model's dtype -> `[..., 2, B, Hkv, *unit_shape]` of `storage_dtype`."""
        return x

    def widen(self, units: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """`[..., 2, B, Hkv, *unit_shape]` (or `[n, 2, *unit_shape]` of KV heads `heads` `[n]`) -> `[..., T, D]` of
        the model's dtype."""
        return units

    def __repr__(self):
        return f"{type(self).__name__}({self.name or self.dtype}, {self.unit_nbytes} bytes a unit)"


class FP8(Representation):
    name = "fp8"
    narrow_form = True

    @property
    def unit_shape(self) -> tuple:
        return (self.block_size * self.head_dim + SCALE_PAD,)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        lead, TD = x.shape[:-2], self.block_size * self.head_dim
        flat = x.reshape(*lead, TD).float()
        scale = flat.abs().amax(-1, keepdim=True) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # (an all-zero unit: any scale)
        codes = (flat / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        pad = torch.zeros((*lead, SCALE_PAD - 4), dtype=torch.uint8, device=x.device)
        return torch.cat([codes, scale.view(torch.uint8), pad], -1)

    def widen(self, units: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        lead, TD = units.shape[:-1], self.block_size * self.head_dim
        codes = units[..., :TD].contiguous().view(torch.float8_e4m3fn).float()
        scale = units[..., TD : TD + 4].contiguous().view(torch.float32)
        return (codes * scale).to(self.dtype).view(*lead, self.block_size, self.head_dim)


class Int4(Representation):
    name = "int4"
    narrow_form = True

    def __init__(self, dtype: torch.dtype, block_size: int, head_dim: int):
        super().__init__(dtype, block_size, head_dim)
        self.center = None  # fp16 [Hkv, D], fixed by the first `narrow`, on its device
        self._copy = None  # its copy on another device (made once: captured steps read a fixed tensor)

    @property
    def unit_shape(self) -> tuple:
        return (self.block_size * self.head_dim // 2 + 4 * self.block_size,)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def center_on(self, device: torch.device) -> torch.Tensor:
        """The key center on `device` (a copy made once where it lives elsewhere, kept)."""
        if self.center.device == device:
            return self.center
        if self._copy is None or self._copy.device != device:
            self._copy = self.center.to(device)
        return self._copy

    def _offsets(self, like: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
        """What widening adds back (fp32): the center for keys, zero for values, shaped to broadcast over `like`
        `[..., 2, B, Hkv, T, D]` (or `[n, 2, T, D]` with `heads`)."""
        center = self.center_on(like.device).float()  # [Hkv, D]
        if heads is not None:
            return torch.stack([center[heads], torch.zeros_like(center[heads])], 1)[:, :, None]  # [n, 2, 1, D]
        return torch.stack([center, torch.zeros_like(center)])[:, None, :, None]  # [2, 1, Hkv, 1, D]

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        lead, T, half = x.shape[:-2], self.block_size, self.head_dim // 2
        x = x.float()
        if self.center is None:  # the keys' mean over every sequence and token of the first blocks narrowed
            keys = x.select(-5, 0).mean(-2)  # [..., B, Hkv, D]
            self.center = keys.flatten(0, -3).mean(0).clamp(-FP16_MAX, FP16_MAX).half()
        x = x - self._offsets(x, None)
        low = x.amin(-1, keepdim=True).clamp(-FP16_MAX, FP16_MAX).half()
        scale = ((x.amax(-1, keepdim=True) - low.float()) / 15).clamp(max=FP16_MAX).half()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # (a constant token: any scale)
        codes = ((x - low.float()) / scale.float()).round().clamp(0, 15).to(torch.uint8)  # [..., T, D]
        packed = codes[..., :half] | (codes[..., half:] << 4)
        scales = torch.cat([scale, low], -1).view(torch.uint8)  # [..., T, 4]: (scale, minimum) as fp16
        return torch.cat([packed.reshape(*lead, T * half), scales.reshape(*lead, 4 * T)], -1)

    def widen(self, units: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        lead, T, half = units.shape[:-1], self.block_size, self.head_dim // 2
        packed = units[..., : T * half].reshape(*lead, T, half)
        pairs = units[..., T * half :].contiguous().view(torch.float16).view(*lead, T, 2).float()
        codes = torch.cat([packed & 15, packed >> 4], -1).float()  # [..., T, D]
        wide = codes * pairs[..., :1] + pairs[..., 1:]
        return (wide + self._offsets(wide, heads)).to(self.dtype)


def representation_for(host_dtype: str | None, dtype: torch.dtype, block_size: int,
                       head_dim: int) -> Representation:
    """The host pool's representation of units of a layer in `dtype` with heads of `head_dim` channels."""
    if host_dtype == "int4" and head_dim % 2:
        raise ValueError(f"host_dtype='int4' packs two channels a byte: it needs an even head size, this layer's is "
                         f"{head_dim}; use host_dtype='fp8' or leave it out.")
    kind = {None: Representation, "fp8": FP8, "int4": Int4}[host_dtype]
    if host_dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"host_dtype={host_dtype!r} narrows floating-point keys and values, not {dtype}.")
    return kind(dtype, block_size, head_dim)
