"""What both GGUF loaders do: load the plain checkpoint saved by an earlier call, else dequantize the GGUF with
transformers and save that plain checkpoint for the next call."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable


def load_plain_or_dequantize(saved: Path | None, gguf_path: Callable[[], Path], device: str, dtype, what: str,
                             install_hint: str):
    """`(model, tokenizer)` in eval mode on `device` in `dtype` (fp32 if None).

    `saved`: the plain checkpoint's folder (None: always dequantize, save nothing); `gguf_path()`: the GGUF file,
    asked for only when no plain copy exists; `what`, `install_hint`: for the error when `gguf` is missing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    if saved is not None and (saved / "config.json").is_file():
        return (AutoModelForCausalLM.from_pretrained(saved, dtype=dtype).to(device).eval(),
                AutoTokenizer.from_pretrained(saved))
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading {what}'s GGUF file needs the `gguf` package:\n    {install_hint}")
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if saved is not None:
        model.hf_quantizer = None  # dequantized already: saved as plain tensors, loadable by any from_pretrained
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        saved.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(saved)  # fp32, as dequantized
        tokenizer.save_pretrained(saved)
    return model.to(dtype).to(device).eval(), tokenizer
