"""A cache leaves its model as it found it: once the model's last cache is closed, left by `with`, or collected, the
model's forward, attention implementation, decoder layers and parameters are the objects they were, and a dense
`generate` gives the same tokens and logits as before any cache. Nothing of torch is changed."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.nn.modules import module as torch_module

from oasis_cache import OasisCache
from oasis_cache.runtime.build import cache_kwargs

from conftest import dense_cache, generate, prompt_ids, tiny_model


def _state(model, addresses: bool = True) -> dict:
    return {"forward": model.__dict__.get("forward"),
            "attention": [m.config._attn_implementation for m in model.modules() if hasattr(m, "config")],
            "layer forwards": [layer.__dict__.get("forward") for layer in model.model.layers],
            "parameters": [(id(p), p.data_ptr() if addresses else None, p.dtype) for p in model.parameters()],
            "classes": [type(m) for m in model.modules()]}


def _dense(model):
    return generate(model, dense_cache(model), {"input_ids": prompt_ids(50)}, max_new_tokens=8, do_sample=False)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


def _torch_hooks() -> list:
    return [getattr(torch_module, name) for name in dir(torch_module) if name.startswith("_global_")
            and name.endswith("registration_hooks")]


@pytest.mark.parametrize("how", ["close", "with", "collected"])
@pytest.mark.parametrize("options", [dict(lookahead="none"), dict(lookahead="previous", compile_decode=True,
                                                                   fuse_projections=True)])
def test_the_model_is_given_back(how, options):
    model = tiny_model("llama")
    fused = options.get("fuse_projections", False)  # (its projections' storage is their own again, elsewhere)
    before, dense = _state(model, addresses=not fused), _dense(model)
    hooks = [dict(h) for h in _torch_hooks()]
    apply, train = torch.nn.Module._apply, torch.nn.Module.train
    if how == "with":
        with OasisCache(model, **cache_kwargs(dict(token_budget=4096, **options))) as cache:
            generate(model, cache, {"input_ids": prompt_ids(50)}, max_new_tokens=4, do_sample=False)
            assert model.config._attn_implementation == "oasis"
    else:
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=4096, **options)))
        generate(model, cache, {"input_ids": prompt_ids(50)}, max_new_tokens=4, do_sample=False)
        assert model.config._attn_implementation == "oasis" and model.__dict__.get("forward") is not None
        if how == "close":
            cache.close()
            with pytest.raises(RuntimeError, match="was closed"):
                generate(model, cache, {"input_ids": prompt_ids(50)}, max_new_tokens=2, do_sample=False)
        else:
            del cache
            gc.collect()
    assert _state(model, addresses=not fused) == before
    assert torch.nn.Module._apply is apply and torch.nn.Module.train is train
    assert [dict(h) for h in _torch_hooks()] == hooks
    _same(_dense(model), dense)


def test_the_model_stays_installed_while_any_of_its_caches_lives():
    model = tiny_model("llama")
    before = _state(model)
    first = OasisCache(model, token_budget=4096, lookahead="none")
    second = OasisCache(model, token_budget=4096, lookahead="none")
    fork = second.fork()
    first.close()
    assert model.config._attn_implementation == "oasis"
    second.close()
    out = generate(model, fork, {"input_ids": prompt_ids(30)}, max_new_tokens=3, do_sample=False)
    assert out.sequences.shape[1] == 33
    fork.close()
    assert _state(model) == before


def test_a_dynamic_cache_beside_a_live_oasis_cache_runs_as_sdpa():
    """While an OasisCache lives the model's attention is "oasis", which is SDPA for any other cache."""
    model = tiny_model("llama")
    dense = _dense(model)
    cache = OasisCache(model, token_budget=4096, lookahead="none")
    from transformers import DynamicCache

    _same(generate(model, DynamicCache(config=model.config), {"input_ids": prompt_ids(50)}, max_new_tokens=8,
                   do_sample=False), dense)
    cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", ["close", "collected"])
def test_the_model_is_given_back_after_captured_and_compiled_steps_on_cuda(how):
    """On CUDA with decode steps replayed as CUDA graphs and compiled (`cuda_graph=True, compile_decode=True`, the
    projections fused): once its cache is closed or collected, the model's forward, attention, layers and parameters
    are the objects they were, and a dense `generate` gives the same tokens and logits as before any cache."""
    model = tiny_model("qwen3").cuda()
    ids = prompt_ids(300).cuda()

    def dense():
        return generate(model, dense_cache(model), {"input_ids": ids}, max_new_tokens=8, do_sample=False)

    before, expected = _state(model, addresses=False), dense()
    cache = OasisCache(model, token_budget=128, lookahead="previous", cuda_graph=True, compile_decode=True,
                       advanced=dict(recent_tokens=32, fuse_projections=True))
    generate(model, cache, {"input_ids": ids}, max_new_tokens=12, do_sample=False)
    assert cache.captured_steps.replays > 0
    if how == "close":
        cache.close()
    else:
        del cache
        gc.collect()
    assert _state(model, addresses=False) == before
    _same(dense(), expected)
