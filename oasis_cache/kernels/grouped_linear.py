"""Projections that share an input, in one launch, each reading its own weight where it is: `grouped_linear(x,
[w_q, w_k, w_v])` returns `[x @ w_q.T, x @ w_k.T, x @ w_v.T]` (a research kernel, not used by the package: as the
compiled steps' q/k/v and gate/up, commit `20cb175`, its calls took 48.6 us inside a step against 33.5 alone, and the
H200's 32K and 128K x 1 steps were 0.2 ms slower than with cuBLAS a projection).

At decode sizes (a few rows) a projection is a read of its weight; the small ones cannot fill the GPU alone (H200,
Qwen3-8B, a micro-benchmark: k/v 1.1 TB/s, q 2.6, gate/up/down 3.4-3.6): a layer's seven cuBLAS products take 128
us, 109 with q/k/v and gate/up as one product each. `fuse_projections` (research) gets the
109 by re-homing each group's weights into one buffer, which changes the model's parameters' storage. This kernel
reads the group's weights in place: one launch whose programs split the group's rows, so k and v ride with q's
programs instead of running alone.

Program p: rows [p * BLOCK_N, p * BLOCK_N + BLOCK_N) of the group's rows stacked in order (the first weight's, then
the second's, ...; a program's rows never cross two weights: each weight's rows start at a multiple of BLOCK_N in
that stacking, its last program masked past its rows), over all of K in BLOCK_K steps; fp32 accumulation,
tensor-core products on the tiles in fp32 (TF32, exact for bf16 / fp16 values; IEEE for fp32 inputs; the rows padded
to 16).

Shapes: x `[M, K]` (K contiguous), each weight `[N_g, K]` contiguous, its bias `[N_g]` or None; outputs `[M, N_g]`
in x's dtype. Up to three weights.
"""

from __future__ import annotations

import torch

from .gather import triton

MAX_WEIGHTS = 3

if triton is not None:
    import triton.language as tl

    from .block_scores import precise_dot

    @triton.jit
    def _rows_of(x, w, b, y, row0, N, K, M, stride_xm, stride_ym, M_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        """y[:, row0 : row0 + BLOCK_N] = x @ w[row0 : row0 + BLOCK_N].T (+ b): one program's rows of one weight."""
        rows = row0 + tl.arange(0, BLOCK_N)
        in_rows = rows < N
        m = tl.arange(0, M_POW2)
        in_m = m < M
        acc = tl.zeros((M_POW2, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            in_k = ks < K
            wt = tl.load(w + rows[:, None].to(tl.int64) * K + ks[None, :], mask=in_rows[:, None] & in_k[None, :],
                         other=0.0).to(tl.float32)
            xt = tl.load(x + m[:, None] * stride_xm + ks[None, :], mask=in_m[:, None] & in_k[None, :],
                         other=0.0).to(tl.float32)
            acc += precise_dot(xt, tl.trans(wt), IEEE)
        if HAS_BIAS:
            acc += tl.load(b + rows, mask=in_rows, other=0.0).to(tl.float32)[None, :]
        tl.store(y + m[:, None] * stride_ym + rows[None, :], acc.to(y.dtype.element_ty),
                 mask=in_m[:, None] & in_rows[None, :])

    @triton.jit
    def _grouped_linear_kernel(x, w0, w1, w2, b0, b1, b2, y0, y1, y2, N0, N1, N2, K, M, stride_xm,
                               M_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        p = tl.program_id(0)
        p0 = tl.cdiv(N0, BLOCK_N)
        p1 = tl.cdiv(N1, BLOCK_N)
        if p < p0:
            _rows_of(x, w0, b0, y0, p * BLOCK_N, N0, K, M, stride_xm, N0, M_POW2, BLOCK_N, BLOCK_K, HAS_BIAS, IEEE)
        elif WEIGHTS >= 2 and p < p0 + p1:
            _rows_of(x, w1, b1, y1, (p - p0) * BLOCK_N, N1, K, M, stride_xm, N1, M_POW2, BLOCK_N, BLOCK_K, HAS_BIAS,
                     IEEE)
        elif WEIGHTS >= 3:
            _rows_of(x, w2, b2, y2, (p - p0 - p1) * BLOCK_N, N2, K, M, stride_xm, N2, M_POW2, BLOCK_N, BLOCK_K,
                     HAS_BIAS, IEEE)


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None,
                   block_n: int = 32, block_k: int = 256, num_warps: int = 4,
                   num_stages: int = 3) -> list[torch.Tensor]:
    """`[F.linear(x, w, b) for w, b in zip(weights, biases)]` in one launch (shapes above; `x` may have leading
    dims, flattened to M rows). `block_n`, `block_k`, `num_warps`, `num_stages`: tuning knobs
    (a micro-benchmark)."""
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"grouped_linear takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights) or any((b is None) != (biases[0] is None) for b in biases):
        raise ValueError("grouped_linear: give a bias for every weight or for none")
    K = x.shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != K or not w.is_contiguous() or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"grouped_linear needs contiguous [N, {K}] weights of x's dtype and device, got "
                             f"{tuple(w.shape)} {w.dtype} on {w.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    outs = [torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    pad = MAX_WEIGHTS - len(weights)
    ws, bs, ys = weights + [weights[0]] * pad, biases + [biases[0]] * pad, outs + [outs[0]] * pad
    Ns = [w.shape[0] for w in weights] + [0] * pad
    has_bias = biases[0] is not None
    programs = sum(triton.cdiv(n, block_n) for n in Ns)
    _grouped_linear_kernel[(programs,)](
        x2, *ws, *(b if has_bias else ws[0] for b in bs), *ys, *Ns, K, M, x2.stride(0),
        M_POW2=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, WEIGHTS=len(weights),
        HAS_BIAS=has_bias, IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return [out.view(*lead, out.shape[-1]) for out in outs]
