"""Offline loaders for real models used by the demo, tests and evaluations."""

from .qwen25_coder import load_qwen25_coder_05b, qwen25_coder_gguf_path
from .smollm2 import load_smollm2, smollm2_gguf_path

__all__ = ["load_smollm2", "smollm2_gguf_path", "load_qwen25_coder_05b", "qwen25_coder_gguf_path"]
