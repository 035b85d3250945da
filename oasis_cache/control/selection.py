"""Block selection: rank every complete block against the query with the min/max bound, keep the top K.

Bound (Quest, arXiv:2406.10774): for a block with elementwise key minimum `kmin` and maximum `kmax`, and any key k
in it, q.k <= sum_d max(q_d * kmin_d, q_d * kmax_d) = relu(q).kmax + min(q, 0).kmin — two matrix products, no
`[.., NB, D]` temporary. A KV head serves G query heads (GQA) and possibly several query tokens: a block's score is
the maximum over those rows (it is selected if any of them may need it). Forced blocks (sink, recent) rank +inf,
blocks without a visible token -inf.
"""

from __future__ import annotations

import torch


def score_blocks(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k per block, maximised over the rows that share a KV head.

    Args:
        query: `[B, Hkv, R, D]`, the R = G * Qn query rows of each KV head.
        kmin, kmax: `[B, Hkv, NB, D]`.
    Returns:
        `[B, Hkv, NB]` float32.
    """
    q = query.float()
    bound = torch.matmul(q.clamp(min=0), kmax.float().transpose(-1, -2))
    bound += torch.matmul(q.clamp(max=0), kmin.float().transpose(-1, -2))
    return bound.amax(dim=2)


def rank_blocks(
    query: torch.Tensor, minmax: torch.Tensor, num_blocks: int, forced: torch.Tensor, allowed: torch.Tensor,
    use_kernel: bool = False,
) -> torch.Tensor:
    """Ranking scores `[B, Hkv, NB]`: the bound, +inf where `forced`, -inf where not `allowed`.

    Args:
        query: `[B, Hkv, R, D]`.
        minmax: `[2, B, Hkv, NBcap, D]` block summaries (blocks [0, NB) valid).
        forced, allowed: `[B, NB]` bool.
        use_kernel: one Triton launch (CUDA) instead of the plain-PyTorch ops.
    """
    if use_kernel:
        from ..kernels.block_scores import block_scores

        return block_scores(query, minmax, num_blocks, forced, allowed)
    scores = score_blocks(query, minmax[0, :, :, :num_blocks], minmax[1, :, :, :num_blocks])
    ranked = torch.where(forced[:, None], torch.inf, scores)
    return torch.where(allowed[:, None], ranked, -torch.inf)


def top_blocks(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(block_ids, ranks)` of the k best blocks per KV head, `[B, Hkv, k]` each, best first (a fetch cap keeps
    the first ones)."""
    top = torch.topk(ranks, k, dim=-1, sorted=True)
    return top.indices, top.values


def all_blocks(allowed: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block (the budget covers the context): `[B, Hkv, NB]` ids and ranks (0, or -inf if not allowed)."""
    B, NB = allowed.shape
    ids = torch.arange(NB, device=allowed.device).expand(B, num_kv_heads, NB)
    ranks = torch.where(allowed, 0.0, -torch.inf)[:, None].expand(B, num_kv_heads, NB)
    return ids, ranks
