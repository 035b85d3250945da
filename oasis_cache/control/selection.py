"""Block selection: rank every complete block against the query by its summary, keep the top K.

Two scorers (`OasisConfig.scorer`), both maximised over the rows that share a KV head (GQA groups, several query
tokens: a block is selected if any of them may need it):

- "bound" (Quest, arXiv:2406.10774): for a block with elementwise key minimum `kmin` and maximum `kmax`, and any key
  k in it, q.k <= sum_d max(q_d * kmin_d, q_d * kmax_d) = relu(q).kmax + min(q, 0).kmin — two matrix products. An
  upper bound: a block of keys spread over many channels ranks high though none of its keys is near q.
- "bits": each key is coded with 1 bit per channel (above or below its block's mean; `pools.summaries`) and read
  back as the mean of the keys on its side; a block scores the best q.(coarse key) over its tokens. It ranks like
  the exact max of q.k per block, which keeps dense attention's answers where the bound does not (docs/performance.md,
  "block scorers").

Forced blocks (sink, recent) rank +inf, blocks without a visible token -inf.
"""

from __future__ import annotations

import torch

from ..pools.summaries import unpack_key_bits


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


def score_blocks_bits(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor, codes: torch.Tensor,
                      block_size: int, chunk_blocks: int = 512) -> torch.Tensor:
    """Best q.(coarse key) per block, maximised over the rows that share a KV head.

    Args:
        query: `[B, Hkv, R, D]`.
        low, high: `[B, Hkv, NB, D]` the two levels of each channel; codes: `[B, Hkv, NB, ceil(T/8), D]` uint8
            (`pools.summaries`).
        chunk_blocks: blocks expanded at a time (the coarse keys of a chunk, `[B, Hkv, chunk, T, D]` fp32, are the
            only large temporary).
    Returns:
        `[B, Hkv, NB]` float32.
    """
    q = query.float()
    NB = low.shape[2]
    scores = []
    for start in range(0, NB, chunk_blocks):
        end = min(NB, start + chunk_blocks)
        bits = unpack_key_bits(codes[:, :, start:end], block_size)  # [B, Hkv, n, T, D]
        coarse = torch.where(bits, high[:, :, start:end, None].float(), low[:, :, start:end, None].float())
        per_token = torch.matmul(q, coarse.flatten(2, 3).transpose(-1, -2))  # [B, Hkv, R, n*T]
        scores.append(per_token.unflatten(-1, (end - start, block_size)).amax(dim=-1).amax(dim=2))
    return torch.cat(scores, dim=-1) if scores else q.new_zeros((*q.shape[:2], 0))


def rank_blocks(query: torch.Tensor, summaries, forced: torch.Tensor, allowed: torch.Tensor,
                block_size: int, use_kernel: bool = False, split_last: bool = False) -> torch.Tensor:
    """Ranking scores `[B, Hkv, W]`: the scorer's value, +inf where `forced`, -inf where not `allowed`.

    Args:
        query: `[B, Hq, Qn, D]`, possibly a strided slice of a forward's queries (the kernel reads it in place).
        summaries: a `pools.BlockSummaries` (its `codes` present: the "bits" scorer; absent: the "bound").
        forced, allowed: `[B, W]` bool, NB <= W <= the summaries' capacity; blocks past NB must not be allowed
            (`control.visibility`: a fixed W keeps the shapes of a decode step as blocks complete).
        use_kernel: one Triton launch (CUDA) instead of the plain-PyTorch ops.
        split_last: rank the last query token apart (a riding draft): `[B, Hkv, 2, NB]`, 0 = the first Qn - 1
            tokens, 1 = the last one. The kernel reads the summaries once for both.
    """
    if use_kernel:  # (the kernel reads the summaries' channels of the query itself)
        from ..kernels.block_scores import block_scores

        return block_scores(query, summaries.levels, allowed.shape[-1], forced, allowed, summaries.codes, block_size,
                            scales=summaries.scales, split_last=split_last, channels=summaries.channels)
    query = summaries.query_channels(query)  # [B, Hq, Qn, D']: the channels the summaries cover
    if split_last:
        return torch.stack([_rank_blocks(part, summaries, forced, allowed, block_size)
                            for part in (query[:, :, :-1], query[:, :, -1:])], dim=2)
    return _rank_blocks(query, summaries, forced, allowed, block_size)


def _rank_blocks(query, summaries, forced, allowed, block_size: int) -> torch.Tensor:
    """`rank_blocks` in plain PyTorch, `query` already on the summaries' channels."""
    NB, W = summaries.num_blocks, allowed.shape[-1]
    B, Hq, Qn, D = query.shape
    query = query.reshape(B, summaries.levels.shape[2], -1, D)  # [B, Hkv, R = G * Qn, D]
    low, high = summaries.view()
    if summaries.codes is None:
        scores = score_blocks(query, low, high)
    else:
        scores = score_blocks_bits(query, low, high, summaries.codes[:, :, :NB], block_size)
    scores = torch.nn.functional.pad(scores, (0, W - NB), value=-torch.inf)  # [B, Hkv, W]
    ranked = torch.where(forced[:, None], torch.inf, scores)
    return torch.where(allowed[:, None], ranked, -torch.inf)


def top_blocks(ranks: torch.Tensor, k: int, use_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(block_ids, ranks)` of the k best blocks per KV head, `[B, Hkv, k]` each, best first (a fetch cap keeps
    the first ones). `use_kernel`: the package's one-launch select (`kernels/top_k.py`; ties: the lower block ids),
    listed in block order instead (`OasisConfig` refuses it beside a fetch cap)."""
    if use_kernel:
        from ..kernels.top_k import top_k

        return top_k(ranks, k)
    top = torch.topk(ranks, k, dim=-1, sorted=True)
    return top.indices, top.values


def all_blocks(allowed: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block (the budget covers the context): `[B, Hkv, NB]` ids and ranks (0, or -inf if not allowed)."""
    B, NB = allowed.shape
    ids = torch.arange(NB, device=allowed.device).expand(B, num_kv_heads, NB)
    ranks = torch.where(allowed, 0.0, -torch.inf)[:, None].expand(B, num_kv_heads, NB)
    return ids, ranks


def marked_blocks(block_ids: torch.Tensor, keep: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`[B, H, num_blocks]` bool: the blocks named in `block_ids` `[B, H, k]` where `keep` `[B, H, k]` is True."""
    B, H = block_ids.shape[:2]
    marked = torch.zeros((B, H, num_blocks + 1), dtype=torch.bool, device=block_ids.device)
    return marked.scatter_(-1, torch.where(keep, block_ids, num_blocks), True)[..., :num_blocks]


def attended_blocks(working_set, slot_map, block_size: int, num_blocks: int) -> torch.Tensor:
    """`[B, H, NB]` bool: the blocks whose working-set slots a step attends to."""
    S, T = working_set.num_slots, block_size
    B, H = working_set.visible.shape[:2]
    attended = working_set.visible[:, :, : S * T].reshape(B, H, S, T).any(-1)
    held = slot_map.slot_block[..., :S]
    return marked_blocks(held, attended & (held >= 0), num_blocks)
