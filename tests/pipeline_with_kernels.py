"""Run as a script under TRITON_INTERPRET=1: the whole decode pipeline with backend="triton" on CPU tensors (kernels
interpreted), against dense generation and against the masked-dense reference. Exit code 0 = all agree.
`python pipeline_with_kernels.py [dense|sparse|draft|sinks]`: one part (default: all) — budget >= context against
dense; sparse decode against the masked reference; a riding draft row and half-channel summaries; learned sinks
(gpt-oss) through the decode kernel."""

from __future__ import annotations

import sys

import torch

from oasis_cache import OasisCache
from oasis_cache.compute.reference import block_masked_attention
from oasis_cache.layer import OasisLayer
from oasis_cache.runtime.build import cache_kwargs

from conftest import dense_cache, generate, left_padded, random_head, tiny_model


def main(part: str = "all"):
    if part not in ("all", "dense", "sparse", "draft", "sinks"):
        sys.exit(f"unknown part {part!r}: all, dense, sparse, draft or sinks")
    model = tiny_model("qwen3")
    inputs = left_padded([150, 121])
    kw = dict(max_new_tokens=6, do_sample=False)
    ok = sparse_ok = ride_ok = half_ok = sinks_ok = True
    if part in ("all", "dense"):
        ok = dense_part(model, inputs)
    if part in ("all", "sparse"):
        sparse_ok = sparse_part(model, inputs, kw)
    if part in ("all", "draft"):
        ride_ok, half_ok = draft_part(inputs, kw)
    if part in ("all", "sinks"):
        sinks_ok = sinks_part(inputs)
    sys.exit(0 if ok and sparse_ok and ride_ok and half_ok and sinks_ok else 1)


def sinks_part(inputs) -> bool:
    """gpt-oss's learned sinks with the decode kernel (the sink in its combine): dense eager's tokens and logits at
    a budget above the context; at a sparse one the torch attention's (`attention_kernel=False`) over the same
    selections."""
    from test_architectures import sinks_dense, tiny_sinks_model

    model = tiny_sinks_model()
    dense = sinks_dense(model, inputs, do_sample=False)
    options = dict(backend="triton", sink_tokens=16, recent_tokens=16)
    full = generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=512, **options))), inputs, seed=7,
                    max_new_tokens=16,
                    do_sample=False)
    ok = torch.equal(dense.sequences, full.sequences)
    ok &= all(torch.allclose(a, b, atol=2e-4, rtol=1e-4) for a, b in zip(dense.logits, full.logits))
    kernel, plain = (generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=64, attention_kernel=use,
                                                                           **options))), inputs,
                              seed=7, max_new_tokens=16, do_sample=False) for use in (True, False))
    sparse_ok = torch.equal(kernel.sequences, plain.sequences)
    sparse_ok &= all(torch.allclose(a, b, atol=2e-4, rtol=1e-4) for a, b in zip(kernel.logits, plain.logits))
    print("sinks: budget >= context equals dense:", ok, "; sparse, kernel equals torch attention:", sparse_ok)
    return ok and sparse_ok


def dense_part(model, inputs) -> bool:
    longer = dict(max_new_tokens=12, do_sample=False)  # past 160 tokens: a decode step completes a block (its
    dense = generate(model, dense_cache(model), inputs, **longer)  # offload by the store kernel)
    ok = True
    # (plain `previous` at full budget: the torch-path budget sweeps and the CUDA suite; here its prefetch and the
    # miss repair run through `exact`)
    for mode in (dict(lookahead="none"), dict(lookahead="previous", exact=True)):
        full = generate(model, OasisCache(model, **cache_kwargs(dict(token_budget=512, backend="triton",
                                                                     host_chunk_blocks=2, **mode))),
                        inputs, **longer)  # (small chunks: the gather's address table grows in place)
        ok &= torch.equal(dense.sequences, full.sequences)
        ok &= all(torch.allclose(a, b, atol=2e-4, rtol=1e-4) for a, b in zip(dense.logits, full.logits))
    print("budget >= context equals dense:", ok)
    return ok


def sparse_part(model, inputs, kw) -> bool:
    calls = []
    attend = OasisLayer.attend

    def recording(layer, query, visible, scale):
        out = attend(layer, query, visible, scale)
        if getattr(layer, "last_selection", None) is not None:
            calls.append((query, visible, scale, out, layer.last_selection, layer.full_kv()))
            layer.last_selection = None
        return out

    OasisLayer.attend = recording
    cache = OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16, recent_tokens=16, backend="triton"))
    cache.record_selection = True
    generate(model, cache, inputs, **kw)
    OasisLayer.attend = attend
    sparse_ok = len(calls) == 5 * 2
    for query, visible, scale, out, sel, (keys, values) in calls:
        ref = block_masked_attention(query, keys, values, sel, visible, 16, scale)
        sparse_ok &= torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    print("sparse decode equals masked reference:", sparse_ok, f"({len(calls)} layer steps)")
    return sparse_ok


def draft_part(inputs, kw) -> tuple[bool, bool]:
    # A riding draft row: the kernels read the real and draft rows as strided slices of the two-row queries; with
    # exact, the real rows' choice is attended, so the tokens are those of lookahead="none".
    model = tiny_model("qwen3", num_hidden_layers=4)
    small = dict(token_budget=64, sink_tokens=16, recent_tokens=16, backend="triton")
    none = generate(model, OasisCache(model, **cache_kwargs(small)), inputs, **kw)
    ridden = generate(model, OasisCache(model, **cache_kwargs(dict(lookahead="eagle3", exact=True,
                                                                   draft=random_head(model), **small))),
                      inputs, **kw)
    ride_ok = torch.equal(none.sequences, ridden.sequences)
    print("eagle3 exact equals none:", ride_ok)
    # Summaries on half the key channels: the kernel ranks with the queries read on the chosen channels, as the
    # torch path does (same tokens at a budget that selects).
    half = dict(token_budget=64, sink_tokens=16, recent_tokens=16, lookahead="previous", summary_channels=0.5)
    by_kernels = generate(model, OasisCache(model, **cache_kwargs(dict(backend="triton", **half))), inputs, **kw)
    by_torch = generate(model, OasisCache(model, **cache_kwargs(dict(backend="torch", **half))), inputs, **kw)
    # ... and with the k best blocks taken by torch.topk (best first) instead of the package's select kernel (the
    # default with Triton: the same blocks in block order)
    by_topk = generate(model, OasisCache(model, **cache_kwargs(dict(backend="triton", top_k_kernel=False, **half))),
                       inputs, **kw)
    half_ok = torch.equal(by_kernels.sequences, by_torch.sequences) and torch.equal(by_topk.sequences,
                                                                                    by_torch.sequences)
    print("half-channel summaries, kernels (the select kernel or torch.topk) equal torch:", half_ok)
    return ride_ok, half_ok


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
