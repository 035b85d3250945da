"""Block selection: score every complete block against the query with the min/max bound, keep the top K.

Bound (Quest, arXiv:2406.10774): for a block with elementwise key minimum `kmin` and maximum `kmax`, and any key k
in it, q.k <= sum_d max(q_d * kmin_d, q_d * kmax_d) = relu(q).kmax + min(q, 0).kmin — two matrix products, no
`[.., NB, D]` temporary. A KV head serves G query heads (GQA) and possibly several query tokens: a block's score is
the maximum over those rows (it is selected if any of them may need it).
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


def select_blocks(
    scores: torch.Tensor, forced: torch.Tensor, allowed: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`k` blocks per KV head, forced blocks first, never a block that is not allowed.

    Args:
        scores: `[B, Hkv, NB]`.
        forced: `[B, NB]` bool, always selected when allowed (sink and recent blocks).
        allowed: `[B, NB]` bool, blocks that hold at least one visible token.
        k: blocks to select, 0 < k < NB.
    Returns:
        `(block_ids, selected)`: `[B, Hkv, k]` int64 and bool (False where fewer than k blocks are allowed).
    """
    ranked = torch.where(forced[:, None], torch.inf, scores)
    ranked = torch.where(allowed[:, None], ranked, -torch.inf)
    top = torch.topk(ranked, k, dim=-1, sorted=False)
    return top.indices, top.values > -torch.inf


def all_blocks(allowed: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block (the budget covers the context): `[B, Hkv, NB]` ids and selection mask."""
    B, NB = allowed.shape
    ids = torch.arange(NB, device=allowed.device).expand(B, num_kv_heads, NB)
    return ids, allowed[:, None].expand(B, num_kv_heads, NB)
