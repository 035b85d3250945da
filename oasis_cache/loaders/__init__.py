"""Offline loaders for real models used by the demo, tests and evaluations.

`load_offline(name, device)`: "smollm2" (SmolLM2-135M-Instruct, 8K context) or "qwen25-coder-0.5b" (alias "qwen05":
Qwen2.5-Coder-0.5B-Instruct, 32K context), each from its PyPI wheels, no hub."""

from . import plain_copy, qwen25_coder, smollm2
from .qwen25_coder import load_qwen25_coder_05b, qwen25_coder_gguf_path
from .smollm2 import load_smollm2, smollm2_gguf_path

OFFLINE_MODELS = {"smollm2": load_smollm2, "qwen25-coder-0.5b": load_qwen25_coder_05b, "qwen05": load_qwen25_coder_05b}
_MODULES = {"smollm2": smollm2, "qwen25-coder-0.5b": qwen25_coder, "qwen05": qwen25_coder}


def _known(name: str) -> None:
    if name not in OFFLINE_MODELS:
        raise ValueError(f"unknown offline model {name!r}: {', '.join(OFFLINE_MODELS)}")


def load_offline(name: str, device: str = "cpu", dtype=None):
    """`(model, tokenizer)` of an offline model by name (`OFFLINE_MODELS`)."""
    _known(name)
    return OFFLINE_MODELS[name](device=device, dtype=dtype)


def has_plain_copy(name: str) -> bool:
    """Whether an earlier load left the model's plain checkpoint (default cache folder): the next load takes seconds,
    not the GGUF's dequantization (~40 s for Qwen2.5-Coder-0.5B on a CPU core, 2026-12-03)."""
    _known(name)
    return plain_copy.has_plain_copy(_MODULES[name].plain_copy_dir())


__all__ = ["load_smollm2", "smollm2_gguf_path", "load_qwen25_coder_05b", "qwen25_coder_gguf_path", "load_offline",
           "has_plain_copy", "OFFLINE_MODELS"]
