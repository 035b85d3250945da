"""Offline loaders for real models used by the demo, tests and evaluations."""

from .smollm2 import load_smollm2, smollm2_gguf_path

__all__ = ["load_smollm2", "smollm2_gguf_path"]
