"""The memory plane: the only code that moves K/V bytes between host and device (and, with the prefetch issue,
creates streams)."""

from .transfer import TransferEngine

__all__ = ["TransferEngine"]
