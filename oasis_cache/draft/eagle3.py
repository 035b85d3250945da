"""The EAGLE-3 draft head (Li et al., 2025, arXiv:2503.01840), written here.

Inputs per position: the target's hidden states from three layers, `[.., 3 * Ht]` (HF `hidden_states[i]` for i in
`aux_hidden_state_ids`: the input of decoder layer i, i.e. the output of layer i-1, 0 = embeddings), and the
embedding `[.., H]` of the token at that position (the target's embedding table, frozen). Then:

    fused = fc(aux)                                   [.., H]      (bias-free linear, 3*Ht -> H)
    x     = cat(input_layernorm(embed), hidden_norm(fused))        [.., 2H]
    h     = fused + o_proj(attention(q/k/v_proj(x)))               (one Llama decoder layer; q/k/v take 2H)
    h     = h + mlp(post_attention_layernorm(h))
    h     = layer(h) for each of `num_hidden_layers - 1` more Llama decoder layers (ours; published heads have none)
    logits_draft = lm_head(norm(h))                   [.., Vd]     (reduced draft vocabulary)
    target_id = draft_id + d2t[draft_id]

Keys/values of every layer travel together, `(k, v)` each `[L, B, Hkv, rows, Dh]` (L = `num_hidden_layers`).

The layer-numbering convention is stored (`aux_hidden_state_ids` are HF `hidden_states` indices); EAGLE's and vLLM's
layer ids i map to the same index i (both capture the input of decoder layer i).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int | None = None  # defaults to hidden_size
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    aux_hidden_state_ids: list[int] = field(default_factory=list)  # HF hidden_states indices, 3 of them
    norm_before_residual: bool = False  # residual from the normed fused hidden (vLLM/speculators option)
    attention_window: int | None = 256  # rows the head attends back (training and inference alike); None = all
    num_hidden_layers: int = 1  # decoder layers: EAGLE-3's one over [embedding ; fused], then plain ones (ours)

    def __post_init__(self):
        if self.num_hidden_layers < 1:
            raise ValueError(f"an EAGLE-3 head has at least one decoder layer, got {self.num_hidden_layers}")
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if len(self.aux_hidden_state_ids) != 3:
            raise ValueError(f"aux_hidden_state_ids must name 3 target layers, got {self.aux_hidden_state_ids}")

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, **overrides) -> "Eagle3Config":
        """A head shaped for a target model's (text) config; aux layers [2, L//2, L-3] as in EAGLE-3."""
        c = target_config.get_text_config(decoder=True)
        L = c.num_hidden_layers
        values = dict(
            hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size, draft_vocab_size=draft_vocab_size,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, rope_theta=_rope_theta(c), max_position_embeddings=c.max_position_embeddings,
            aux_hidden_state_ids=[min(2, L), L // 2, max(L - 3, 0)],
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):  # normalized in fp32, then scaled in the input's dtype (as the Llama family does)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, inputs: int):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(inputs, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, positions, past=None, past_mask=None):
        """x `[B, n, inputs]`, positions `[B, n]`, past `(k, v)` each `[B, Hkv, m, Dh]` or None (then causal over n);
        `past_mask` `[1, m + 1]` bool for one row (n = 1) over keys that are not all valid (a ring being filled:
        `head_window.HeadKV`), else None. Returns the output `[B, n, H]` and this call's `(k, v)`."""
        c = self.c
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        angles = positions[:, None, :, None].float() * self.inv_freq
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        m = keys.shape[2] - n
        window = c.attention_window
        G = c.num_attention_heads // c.num_key_value_heads
        if n == 1 and past_mask is None and (window is None or m < window):  # one row that sees every key
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        elif past is None and window is not None and n > 2 * window:  # a long text (training): by chunks
            out = windowed_attention(q, k, v, window, G)
        else:  # masked, K/V heads repeated (with a mask or in fp32, SDPA's GQA path falls back to the math kernel,
            # which materializes every head's scores: fine for one row, not for a prompt)
            if past_mask is not None:
                mask = past_mask
            else:  # rows in order: causal, within the window
                mask = torch.ones(n, keys.shape[2], dtype=torch.bool, device=x.device).tril(m)
                if window is not None:  # row i sees the `attention_window` rows up to itself
                    mask &= torch.ones_like(mask).triu(m - window + 1)
            out = F.scaled_dot_product_attention(q, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1),
                                                 attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1)), (k, v)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, groups: int) -> torch.Tensor:
    """Causal attention within a window — row i sees rows i - window + 1 … i — of queries `[B, H, n, D]` over keys
    and values `[B, Hkv, n, D]` (H = `groups` · Hkv), computed by chunks of `window` rows that each see their own
    chunk and the one before it: n × 2·window scores instead of n × n, the same result as the full masked attention
    (`tests/draft/test_draft_head.py`). Returns `[B, H, n, D]`."""
    B, H, n, D = q.shape
    W, C = window, -(-n // window)
    pad = C * W - n
    qc = F.pad(q, (0, 0, 0, pad)).view(B, H, C, W, D).transpose(1, 2).reshape(B * C, H, W, D)

    def pairs(x):  # [B, Hkv, n, D] -> [B * C, Hkv, 2W, D]: chunk c's keys are rows (c - 1) W … (c + 1) W - 1
        x = F.pad(x, (0, 0, W, pad)).unfold(2, 2 * W, W)  # [B, Hkv, C, D, 2W]; a chunk of zeros in front
        return x.permute(0, 2, 1, 4, 3).reshape(B * C, x.shape[1], 2 * W, D).repeat_interleave(groups, 1)

    i = torch.arange(W, device=q.device)[:, None]
    j = torch.arange(2 * W, device=q.device)[None]
    mask = ((j <= i + W) & (j >= i + 1)).expand(C, W, 2 * W).clone()  # key j of a chunk is its row j - W
    mask[0, :, :W] = False  # the first chunk has none before it
    out = F.scaled_dot_product_attention(qc, pairs(k), pairs(v), attn_mask=mask.repeat(B, 1, 1)[:, None])
    return out.view(B, C, H, W, D).transpose(1, 2).reshape(B, H, C * W, D)[:, :, :n]


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, embeds, fused, positions, past=None, past_mask=None):
        normed = self.hidden_norm(fused)
        residual = normed if self.c.norm_before_residual else fused
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        attn, kv = self.self_attn(x, positions, past, past_mask)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class _DecoderLayer(nn.Module):
    """A plain Llama decoder layer over the head's hidden `[B, n, H]` (the layers after the first)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, c.hidden_size)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, h, positions, past=None, past_mask=None):
        attn, kv = self.self_attn(self.input_layernorm(h), positions, past, past_mask)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Eagle3Head(nn.Module):
    """The draft head. Parameter names follow the EAGLE checkpoint format (`fc`, `midlayer.*`, `norm`, `lm_head`,
    buffers `d2t`, `t2d`), so `state_dict()` is an EAGLE/SpecForge checkpoint; a deeper head (ours) adds
    `post_layers.{i}.*`."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.post_layers = nn.ModuleList(_DecoderLayer(c) for _ in range(c.num_hidden_layers - 1))
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # target = draft + d2t
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))  # target ids in the draft vocab

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """`draft_to_target` `[Vd]`: the target id of each draft id (e.g. the Vd most frequent target tokens)."""
        ids = draft_to_target.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def forward(self, aux_hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, past=None,
                past_mask=None):
        """`aux_hidden` `[B, n, 3*Ht]`, `embeds` `[B, n, H]`, `positions` `[B, n]` (those of the *next* tokens the
        rows predict), past `(k, v)` of earlier rows, each `[L, B, Hkv, m, Dh]` (`past_mask`: see
        `_Attention.forward`). Returns draft-vocab logits `[B, n, Vd]`, the last hidden `[B, n, H]` (fed back in
        training-time test), and this call's `(k, v)`, each `[L, B, Hkv, n, Dh]`."""
        h, kv = self.decode(embeds, self.fc(aux_hidden), positions, past, past_mask)
        return self.lm_head(self.norm(h)), h, kv

    def decode(self, embeds, fused, positions, past=None, past_mask=None):
        """The decoder layers over `[embeds ; fused]` (`fused` `[B, n, H]`: the fused target features, or in
        training-time test the head's own last hidden). Returns the hidden `[B, n, H]` and `(k, v)` as `forward`."""
        layer_past = (lambda i: None) if past is None else (lambda i: (past[0][i], past[1][i]))
        h, (k, v) = self.midlayer(embeds, fused, positions, layer_past(0), past_mask)
        if not len(self.post_layers):
            return h, (k[None], v[None])
        keys, values = [k], [v]
        for i, layer in enumerate(self.post_layers, start=1):
            h, (k, v) = layer(h, positions, layer_past(i), past_mask)
            keys.append(k)
            values.append(v)
        return h, (torch.stack(keys), torch.stack(values))

    @torch.no_grad()
    def deepen(self, num_hidden_layers: int) -> "Eagle3Head":
        """This head with decoder layers added after its last (ours), each starting as the identity (its attention
        and MLP outputs zero): the new head drafts exactly what this one does until trained."""
        if num_hidden_layers < self.config.num_hidden_layers:
            raise ValueError(f"a head of {self.config.num_hidden_layers} layers cannot deepen to {num_hidden_layers}")
        config = Eagle3Config(**dict(self.config.to_dict(), num_hidden_layers=num_hidden_layers))
        deeper = Eagle3Head(config).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        deeper.load_state_dict(self.state_dict(), strict=False)
        for layer in deeper.post_layers[len(self.post_layers):]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        return deeper

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy_draft(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft of one row: draft-vocab logits `[B, Vd]` -> its most likely token as target ids `[B, 1]`."""
        return self.to_target_ids(logits.argmax(-1))[:, None]
