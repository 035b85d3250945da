"""The EAGLE-3 draft head (for `lookahead="eagle3"`): the head itself and its checkpoint formats. The trainer and
the ride-along lookahead are the rest of the draft issue."""

from .eagle3 import Eagle3Config, Eagle3Head
from .loading import check_fits, load_eagle3, save_eagle3

__all__ = ["Eagle3Config", "Eagle3Head", "load_eagle3", "save_eagle3", "check_fits"]
