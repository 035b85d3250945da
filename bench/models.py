"""Models for benchmarks: random weights of real shapes (speed does not depend on weight values), SmolLM2 with real
weights, and a tiny shape for smoke runs on CPU."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

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
    "tiny": lambda: Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=262144,
    ),
}


def load_model(name: str, device: str, dtype: torch.dtype):
    """`(model, vocab_size)`; random weights for the shapes above, real ones for "smollm2"."""
    if name == "smollm2":
        from oasis_cache.loaders import load_smollm2

        model, tokenizer = load_smollm2(device=device, dtype=dtype)
        return model, model.config.vocab_size
    config = SHAPES[name]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), config.vocab_size
