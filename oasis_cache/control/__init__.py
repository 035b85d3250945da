"""The control plane: decisions that return block ids (selection, visibility of blocks). No bytes move here."""

from .selection import all_blocks, attended_blocks, marked_blocks, rank_blocks, score_blocks, top_blocks
from .visibility import Padding, StepVisibility, sink_blocks, step_visibility

__all__ = ["score_blocks", "rank_blocks", "top_blocks", "all_blocks", "marked_blocks", "attended_blocks", "Padding",
           "StepVisibility", "sink_blocks", "step_visibility"]
