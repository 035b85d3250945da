"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash, Kimi-Linear, MiniCPM3, Youtu, LongCat, ...) as
transformers runs it: a layer caches one latent row per token — `kv_nope` `[B, 1, N, R]` (R = `kv_lora_rank`,
normed) and the shared rotary key `k_rot` `[B, 1, N, rope]` — and expands every head's keys and values from them
(`module.expand_kv`, through `kv_b_proj`: `W_UK_h` `[nope, R]`, `W_UV_h` `[v, R]`) before attending.

An OasisLayer of such a model stores the row `c_j = [kv_nope_j, k_rot_j]` (R + rope channels, one KV head) as its keys
and as its values, and the attention runs in the absorbed form, exact in real arithmetic:

    score_h(j) = q_nope_h · (W_UK_h kv_j) + q_rot_h · k_rot_j = [W_UK_hᵀ q_nope_h, q_rot_h] · c_j
    out_h      = Σ_j p_hj W_UV_h kv_j = W_UV_h (Σ_j p_hj c_j)[:R]

so each query head attends the latent rows as plain attention with one shared KV head (`absorbed_query`, then
`latent_output`): the host pool, the block summaries, selection and the sparse step work on it unchanged, and the
model's own expansion of the new tokens (what `cache.update` returned) is not read. Costs: the values repeat the
keys (2 × (R + rope) per token and layer: DeepSeek-V3 2,304 bytes in bf16, a dense cache of its latents 1,152).

A forward that attends densely (a prefill, its chunks) takes the expanded form instead where the expanded keys and
values fit `EXPAND_BYTES` (`expanded_attention`): every head's keys and values made from the rows through
`kv_b_proj`, as transformers makes them, then attended with the module's own queries. The absorbed form's scores
span R + rope channels and its outputs R where the expanded form's span nope + rope and v (576 / 512 against 192 /
128 for DeepSeek-V3): 3-4x the work, and wider than fused attention kernels take (a 32K prefill of DeepSeek-V2-Lite
on the H200 took 7.2 s absorbed, its kernels compiled already, against dense's 3.8).
"""

from __future__ import annotations

import torch

from .sinks import causal_attention

# The most bytes a dense forward's expanded keys and values may take (`expanded_attention`; transformers' own
# attention expands as many): past it the forward attends the rows absorbed, whose memory grows with one KV head.
EXPAND_BYTES = 2 * 2**30


def latent_dims(module) -> tuple[int, int] | None:
    """`(R, rope)` of an attention module that caches MLA latents (it expands keys and values from them: `expand_kv`,
    `kv_b_proj`), else None."""
    if not callable(getattr(module, "expand_kv", None)) or getattr(module, "kv_b_proj", None) is None:
        return None
    return int(module.kv_lora_rank), int(module.qk_rope_head_dim)


def check_latent(module) -> None:
    """What the absorbed form needs of an MLA module, else refused by name (at the cache's construction)."""
    name = type(module).__name__
    if getattr(module, "indexer", None) is not None:
        raise NotImplementedError(
            f"{name} (layer {module.layer_idx}) selects the keys each query attends with a learned indexer (sparse "
            "attention, DSA); OasisCache computes full attention over what it holds. Use a DynamicCache.")
    proj = module.kv_b_proj
    weight = getattr(proj, "weight", None)
    if (not isinstance(proj, torch.nn.Linear) or getattr(proj, "bias", None) is not None
            or not isinstance(weight, torch.Tensor) or not weight.is_floating_point()):
        raise NotImplementedError(
            f"{name} (layer {module.layer_idx}) expands its latents through a {type(proj).__name__} (`kv_b_proj`) "
            "that is not a plain floating-point nn.Linear without bias; OasisCache attends MLA's latents through its "
            "weight (absorbed). Use a DynamicCache, or load kv_b_proj unquantized.")


def stored_form(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent rows an OasisLayer stores as keys and as values: `[kv_nope, k_rot]` `[B, 1, q, R + rope]`."""
    rows = torch.cat((kv_nope, k_rot), dim=-1)
    return rows, rows


def transformers_form(rows: torch.Tensor, dims: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(kv_nope, k_rot)` of stored rows `[B, 1, N, R + rope]`, as transformers' cache layers keep them."""
    return rows[..., : dims[0]], rows[..., dims[0]:]


def _weights(module, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`(W_UK [H, nope, R], W_UV [H, v, R])` views of `kv_b_proj`'s weight (in `dtype`)."""
    nope, v = module.qk_nope_head_dim, module.v_head_dim
    weight = module.kv_b_proj.weight.to(dtype).view(-1, nope + v, module.kv_lora_rank)
    return weight[:, :nope], weight[:, nope:]


def absorbed_query(module, query: torch.Tensor) -> torch.Tensor:
    """The queries `[B, H, Qn, nope + rope]` the module hands its attention, as queries over the latent rows:
    `[W_UK_hᵀ q_nope_h, q_rot_h]` `[B, H, Qn, R + rope]`."""
    w_uk, _ = _weights(module, query.dtype)
    nope = module.qk_nope_head_dim
    return torch.cat((torch.einsum("bhqn,hnr->bhqr", query[..., :nope], w_uk), query[..., nope:]), dim=-1)


def latent_output(module, out: torch.Tensor) -> torch.Tensor:
    """Attention over the latent rows `[B, H, Qn, R + rope]` taken to each head's values: `[B, H, Qn, v]`."""
    _, w_uv = _weights(module, out.dtype)
    return torch.einsum("bhqr,hvr->bhqv", out[..., : module.kv_lora_rank], w_uv)


def expanded_attention(module, query: torch.Tensor, rows: int):
    """The dense attention of a forward in the expanded form (`module`'s own queries `[B, H, Qn, nope + rope]`), a
    function of the stored rows as `dense_causal_attention` takes keys and values, giving each head's values
    `[B, H, Qn, v]`; or None where `rows` tokens' expanded keys and values would pass `EXPAND_BYTES`."""
    nope, v, R = module.qk_nope_head_dim, module.v_head_dim, module.kv_lora_rank
    heads = module.kv_b_proj.weight.shape[0] // (nope + v)
    B, rope = query.shape[0], query.shape[-1] - nope
    if B * heads * rows * (nope + rope + v) * query.element_size() > EXPAND_BYTES:
        return None

    def attend(_, keys, values, visible, scale, sinks=None, pattern=None, softcap=None):
        N = keys.shape[2]
        kv = torch.nn.functional.linear(keys[:, 0, :, :R], module.kv_b_proj.weight.to(keys.dtype))
        kv = kv.view(B, N, heads, nope + v).transpose(1, 2)  # [B, H, N, nope + v]
        expanded = torch.cat((kv[..., :nope], keys[:, :, :, R:].expand(B, heads, N, rope)), dim=-1)
        return causal_attention(query, expanded, kv[..., nope:], visible, scale, sinks, pattern, softcap)
    return attend
