"""Heads shipped inside the package, and the model each one was trained for.

`heads/<name>/` holds a checkpoint in the EAGLE format (`config.json`, `model.safetensors`) and `target.json`, the
target's fingerprint: its shape and a sample of its input embeddings. `OasisCache(model)` without a `lookahead`
drafts with the bundled head whose target matches `model`: the same shape, and embedding samples with a cosine of at
least `MATCH_COSINE` (a quantized copy of the same weights matches; another model of the same shape does not).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HEADS_DIR = Path(__file__).with_name("heads")
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
MATCH_COSINE = 0.95
_SAMPLE_ROWS, _SAMPLE_COLS = 16, 16


def _shape(model) -> dict:
    config = model.config.get_text_config(decoder=True)
    return {key: getattr(config, key, None) for key in SHAPE_KEYS}


def target_fingerprint(model) -> dict | None:
    """The shape of `model` and `[16 rows x 16 columns]` of its input embeddings, spread over the vocabulary; None
    when the embeddings are not materialized (meta device)."""
    weight = model.get_input_embeddings().weight  # [V, H]
    if weight.is_meta:
        return None
    rows = torch.arange(_SAMPLE_ROWS, device=weight.device) * (weight.shape[0] // _SAMPLE_ROWS)
    sample = weight.detach()[rows, :_SAMPLE_COLS].float().flatten().cpu()
    return dict(_shape(model), embedding_sample=sample.tolist())


def write_target(model, directory) -> None:
    """Record `model` as the target of the head checkpoint in `directory`."""
    (Path(directory) / "target.json").write_text(json.dumps(target_fingerprint(model)))


def matches(target: dict, model) -> bool:
    """Whether a head trained for `target` (a fingerprint) was trained for `model`."""
    if any(target.get(key) != value for key, value in _shape(model).items()):
        return False
    mine = target_fingerprint(model)
    if mine is None:
        return False
    a, b = torch.tensor(target["embedding_sample"]), torch.tensor(mine["embedding_sample"])
    return bool(torch.nn.functional.cosine_similarity(a, b, dim=0) >= MATCH_COSINE)


def bundled_head_for(model, heads_dir: Path | None = None) -> Path | None:
    """The directory of the bundled head trained for `model`, or None."""
    heads_dir = HEADS_DIR if heads_dir is None else Path(heads_dir)
    if not heads_dir.is_dir():
        return None
    for directory in sorted(p for p in heads_dir.iterdir() if (p / "target.json").is_file()):
        if matches(json.loads((directory / "target.json").read_text()), model):
            return directory
    return None
