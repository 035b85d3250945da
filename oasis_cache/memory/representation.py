"""How the host pool holds a unit — one (block, K or V, sequence, KV head): `[T, D]` elements of the model's dtype,
or fewer bytes (`host_dtype`). A narrow unit is one contiguous run of bytes, codes then scales, so every path that
moves units (offload, gather, a store's objects) moves it as one piece:

    "fp8"   `[T*D]` e4m3 codes, then one fp32 scale (padded to 16 bytes): x = code * scale, scale = max|x| / 448
            over the unit. T*D + 16 bytes (bf16: T*D*2).
    "int4"  `[T, D/2]` bytes, each two codes (channel j in the low nibble, j + D/2 in the high one), then per token
            an fp16 (scale, minimum): y = code * scale + minimum, code in 0..15, scale = (max - min) / 15 over the
            token's D channels. T*D/2 + 4*T bytes. x = R (y + center): keys lose a center per KV head and channel
            (`Int4.center`, fp32 `[Hkv, D]`: their mean over the first blocks narrowed, fixed from then on), as large
            per-channel offsets (a projection's bias) would otherwise set every token's range. R = 1, or with
            `Int4.rotated` (where D is a power of two >= 32 and T one >= 16: `Int4.rotates`) H / sqrt(D), the
            normalized Walsh-Hadamard transform (its own inverse): it spreads a token's outlier channels over all
            of them (a key bias turned by rotary embeddings varies from token to token, so no center removes it);
            widening then computes H code exactly (integer sums), then `H code * (scale / sqrt(D)) + [j = 0]
            minimum * sqrt(D) + R center` (R 1 = sqrt(D) e_0). A layer whose keys narrowed would move its attention
            scores too far keeps the model's dtype (`score_noise`, `pools.host_kv.measured_pool`).
            (Groups along tokens per channel, as KIVI keeps keys, would take a scale and minimum per channel for the
            16 tokens of a block: 2 bits an element on top of 4.)

`narrow` (torch ops, on any device: the offload runs it on the model's device, before the bytes cross the link) and
`widen` (torch ops; the reference the Triton gather's widening, `kernels/gather.py`, equals bit for bit). Both take
the last dims `[2, B, Hkv, ...]` (K and V, sequences, KV heads), or, with `heads`, `[2, ...]` per entry of that KV
head. Widening computes in fp32 and rounds to the model's dtype once, operation by operation as written (no fused
multiply-add), so that the kernel's bits equal torch's.
"""

from __future__ import annotations

import copy
import math

import torch

FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_PAD = 16  # bytes after an fp8 unit's codes: its fp32 scale, padded so that every unit starts 16-byte aligned
FP16_MAX = 65504.0
SCORE_NOISE_LIMIT = 2.0  # nats: a layer whose narrowed keys would move its attention scores more keeps its own dtype


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


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of `x`'s last dim (fp32, a power of two long): stages pairing
    channel i with i + h in blocks of 2h, h from half the size down to 1. Its own inverse up to a factor of the
    size; exact on integers (codes) whose sums stay below 2**24."""
    lead, D = x.shape[:-1], x.shape[-1]
    h = D // 2
    while h >= 1:
        a, b = x.reshape(*lead, D // (2 * h), 2, h).unbind(-2)
        x = torch.stack([a + b, a - b], -2).reshape(*lead, D)
        h //= 2
    return x


class Int4(Representation):
    name = "int4"
    narrow_form = True
    rotated = False  # units narrowed in a Hadamard-rotated basis where the sizes allow (`rotates`): not the default
    # (its gather is slower and what it saves is within the sample's noise once `SCORE_NOISE_LIMIT` applies)

    def __init__(self, dtype: torch.dtype, block_size: int, head_dim: int):
        super().__init__(dtype, block_size, head_dim)
        # (powers of two, as the gather's tensor-core product of codes and H takes them: `kernels/gather.py`)
        self.rotates = self.rotated and head_dim >= 32 and block_size >= 16 and \
            not head_dim & (head_dim - 1) and not block_size & (block_size - 1)
        self.root = torch.tensor(math.sqrt(head_dim), dtype=torch.float32)  # (fp32 constants: the kernel's too)
        self.inverse_root = torch.tensor(1 / math.sqrt(head_dim), dtype=torch.float32)
        self._roots = {}  # device -> (root, inverse_root) there (made at a prefill's narrow, before any capture)
        self.center = None  # fp32 [Hkv, D] in the basis narrowed in, fixed by the first `narrow`, on its device
        self._copy = None  # what widening adds back to keys (`offsets_on`), on the device last asked for

    @property
    def unit_shape(self) -> tuple:
        return (self.block_size * self.head_dim // 2 + 4 * self.block_size,)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def offsets_on(self, device: torch.device) -> torch.Tensor:
        """What widening adds back to keys, fp32 `[Hkv, D]` on `device`: the center, turned back to the model's
        basis where units are rotated. Made once per device (captured steps read a fixed tensor)."""
        if self._copy is None or self._copy.device != device:
            self._copy = self.rotate(self.center).to(device)
        return self._copy

    def _offsets(self, like: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
        """`offsets_on` for keys, zero for values, shaped to broadcast over `like` `[..., 2, B, Hkv, T, D]` (or
        `[n, 2, T, D]` with `heads`)."""
        return self._for_keys(self.offsets_on(like.device), heads)

    @staticmethod
    def _for_keys(center: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """`center` (`[Hkv, D]`) for keys and zero for values, to broadcast over `[..., 2, B, Hkv, T, D]` (or over
        `[n, 2, T, D]` with `heads`)."""
        if heads is not None:
            return torch.stack([center[heads], torch.zeros_like(center[heads])], 1)[:, :, None]  # [n, 2, 1, D]
        return torch.stack([center, torch.zeros_like(center)])[:, None, :, None]  # [2, 1, Hkv, 1, D]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 `[..., D]` into the basis units are narrowed in (and back: the transform is its own inverse): a
        normalized Walsh-Hadamard transform. It spreads a token's outlier channels (a key bias turned by RoPE, say)
        over all of them, so that they no longer set the token's 16 levels."""
        return butterfly(x) * self.roots_on(x.device)[1] if self.rotates else x

    def roots_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(root, inverse_root)` on `device` (made once: a captured step copies nothing from the host)."""
        if device not in self._roots:
            self._roots[device] = (self.root.to(device), self.inverse_root.to(device))
        return self._roots[device]

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        lead, T, half = x.shape[:-2], self.block_size, self.head_dim // 2
        x = self.rotate(x.float())
        if self.center is None:  # the keys' mean over every sequence and token of the first blocks narrowed
            keys = x.select(-5, 0).mean(-2)  # [..., B, Hkv, D]
            self.center = keys.flatten(0, -3).mean(0)
        x = x - self._for_keys(self.center.to(x.device))  # (the center is in the basis narrowed in)
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
        if self.rotates:  # R(code * scale + minimum) with R = H / root: H code exactly (integers), the minimum's
            # image R 1 = root * e_0, the center's image in `_offsets`
            root, inverse_root = self.roots_on(codes.device)
            first = torch.arange(self.head_dim, device=codes.device) == 0
            lows = torch.where(first, pairs[..., 1:] * root, 0.0)
            wide = butterfly(codes) * (pairs[..., :1] * inverse_root) + lows
        else:
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


def score_noise(representation: Representation, blocks: torch.Tensor, query: torch.Tensor, scale: float,
                blocks_at_most: int = 256, queries_at_most: int = 16) -> float | None:
    """How far narrowing a layer's keys would move its attention scores: the standard deviation, in nats, of
    `scale * q . (widen(narrow(k)) - k)` over the forward's last queries (`query`, `[B, Hq, Qn, D]`) and the keys of
    the layer's first blocks (`blocks`, `[2, B, Hkv, n, T, D]`), narrowed by a fresh copy of `representation` (its
    key center fixed by these blocks, as the pool's will be). Tokens whose scores carry noise of deviation s take
    attention from those attended as made (the mean of exp(score + noise) is exp(score + s^2 / 2)); a layer whose
    queries are very large (Qwen2's first: scores in the hundreds) would move by nats (`SCORE_NOISE_LIMIT`). None
    where the queries are not the keys' shape (latent attention)."""
    B, Hq, Qn, D = query.shape
    H = blocks.shape[2]
    if not representation.narrow_form or D != blocks.shape[-1] or Hq % H or not blocks.shape[3]:
        return None
    probe = copy.copy(representation)
    if hasattr(probe, "center"):
        probe.center, probe._copy = None, None
    part = blocks[:, :, :, :blocks_at_most]
    widened = probe.widen(probe.narrow(part.movedim(3, 0)))[:, 0].float()  # keys, [n, B, Hkv, T, D]
    error = widened - part[0].movedim(2, 0).float()
    rows = min(Qn, queries_at_most)
    q = query[:, :, -rows:].float().reshape(B, H, Hq // H * rows, D)  # (query head h*G + g reads KV head h)
    return (torch.einsum("bhqd,nbhtd->bhqnt", q, error) * scale).std().item()
