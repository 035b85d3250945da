"""oasis-cache: decode with a KV cache far larger than GPU memory, in HF transformers.

    import oasis_cache                       # registers the "oasis" attention and mask functions
    from oasis_cache import OasisCache
    cache = OasisCache(model, token_budget=2048)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)
    print(cache.stats())

Importing adds the name "oasis" to transformers' `AttentionInterface` and `AttentionMaskInterface`; nothing else
is patched.
"""

from .compat import ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS
from .compute.attention import oasis_attention_forward, oasis_mask
from .cache import ATTENTION_NAME, OasisCache
from .config import OasisConfig
from .layer import OasisLayer

ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, oasis_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, oasis_mask)

__version__ = "0.1.0"
__all__ = ["OasisCache", "OasisConfig", "OasisLayer", "oasis_attention_forward", "oasis_mask", "ATTENTION_NAME"]
