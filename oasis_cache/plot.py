"""What the cache selected, step by step: record it during `generate`, then draw it (matplotlib, an optional extra).

    from oasis_cache.plot import record, selection

    with record(cache) as rec:
        model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    selection(rec, path="selection.png")      # decode step x block: the share of KV heads attending each block

Recording copies every layer's selection to the host at every step (an analysis mode: decode steps run eagerly).
With a prediction (`lookahead="previous"` / `"eagle3"`) the record also keeps what was prefetched for each step, and
the second panel shows the blocks the step attended that the prediction had missed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class SelectionRecord:
    """Per decode step and full-attention layer: `attended` `[B, Hkv, NB]` bool (the blocks whose slots the step
    attended), `predicted` `[B, Hkv, NB']` bool or None (what the prediction made for this step had placed)."""

    block_size: int
    entries: list = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return sorted({entry["layer"] for entry in self.entries})

    @property
    def steps(self) -> list[int]:
        return sorted({entry["step"] for entry in self.entries})

    def matrix(self, layer: int | None = None, sequence: int = 0, missed: bool = False) -> torch.Tensor:
        """`[steps, blocks]` float: the share of KV heads (of `layer`, or of every layer) that attended each block
        at each decode step; `missed=True`: that attended it although the step's prediction had not placed it."""
        entries = [e for e in self.entries if layer is None or e["layer"] == layer]
        if not entries:
            raise ValueError("nothing recorded: decode with the cache inside `with record(cache):` (decode steps of a "
                             "context longer than the budget record their selection)")
        steps = sorted({e["step"] for e in entries})
        row = {step: i for i, step in enumerate(steps)}
        width = max(e["attended"].shape[-1] for e in entries)
        total = torch.zeros((len(steps), width))
        heads = torch.zeros((len(steps), 1))
        for e in entries:
            chosen = e["attended"][sequence].float()  # [H, NB]
            if missed:
                predicted = e["predicted"]
                if predicted is None:
                    continue
                placed = torch.zeros_like(chosen)
                n = min(predicted.shape[-1], chosen.shape[-1])
                placed[:, :n] = predicted[sequence, :, :n].float()
                chosen = chosen * (1 - placed)
            total[row[e["step"]], : chosen.shape[-1]] += chosen.sum(0)
            heads[row[e["step"]]] += chosen.shape[0]
        return total / heads.clamp(min=1)


@contextlib.contextmanager
def record(cache):
    """Record every decode step's selection of `cache` while the block runs; yields the `SelectionRecord`."""
    rec = SelectionRecord(cache.config.block_size)
    cache.selection_log, cache.record_selection = rec.entries, True
    try:
        yield rec
    finally:
        cache.selection_log, cache.record_selection = None, False


def selection(rec: SelectionRecord, layer: int | None = None, sequence: int = 0, path=None, title: str | None = None):
    """A heatmap of `rec` (decode step x block, the share of KV heads attending), and beside it, when predictions
    were recorded, the blocks attended that the prediction had missed. Returns the matplotlib figure; `path`: also
    saved there."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - matplotlib is in the test and demo extras
        raise ImportError("oasis_cache.plot needs matplotlib: pip install matplotlib") from error
    attended = rec.matrix(layer, sequence)
    has_predictions = any(e["predicted"] is not None for e in rec.entries)
    panels = [(attended, "attended (share of KV heads)")]
    if has_predictions:
        panels.append((rec.matrix(layer, sequence, missed=True), "attended, missed by the prediction"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    T = rec.block_size
    for ax, (data, label) in zip(axes[0], panels):
        image = ax.imshow(data.numpy(), aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1,
                          extent=(0, data.shape[1] * T, data.shape[0], 0))
        ax.set_xlabel("context position (tokens; blocks of %d)" % T)
        ax.set_ylabel("decode step")
        ax.set_title(label)
        fig.colorbar(image, ax=ax)
    where = "every layer" if layer is None else f"layer {layer}"
    fig.suptitle(title or f"What OasisCache attended, {where}, sequence {sequence}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
