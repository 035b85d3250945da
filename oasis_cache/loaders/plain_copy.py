"""What both GGUF loaders do: load the plain checkpoint saved by an earlier call, else dequantize the GGUF with
transformers and save that plain checkpoint for the next call."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Callable


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive lock on `path` (created if missing) while the block runs: processes that load the same
    model at once (parallel test workers, several notebooks) write its files one at a time and never read a half
    written one. A no-op where `fcntl` is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def has_plain_copy(saved: Path | None) -> bool:
    """Whether `saved` holds a plain checkpoint left by an earlier load (which then takes seconds, not the GGUF's
    dequantization)."""
    return saved is not None and (saved / "config.json").is_file()


def load_plain_or_dequantize(saved: Path | None, gguf_path: Callable[[], Path], device: str, dtype, what: str,
                             install_hint: str):
    """`(model, tokenizer)` in eval mode on `device` in `dtype` (fp32 if None).

    `saved`: the plain checkpoint's folder (None: always dequantize, save nothing); `gguf_path()`: the GGUF file,
    asked for only when no plain copy exists; `what`, `install_hint`: for the error when `gguf` is missing."""
    import torch

    dtype = dtype or torch.float32
    if saved is None:
        return _load(None, gguf_path, device, dtype, what, install_hint)
    with file_lock(saved.parent / f"{saved.name}.lock"):
        return _load(saved, gguf_path, device, dtype, what, install_hint)


def _load(saved, gguf_path, device, dtype, what, install_hint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if has_plain_copy(saved):
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
