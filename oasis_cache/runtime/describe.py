"""`print(cache)` and parts of `cache.stats()`: what an OasisCache runs and why, in words and numbers."""

from __future__ import annotations

from ..layer import OasisLayer
from . import compiled_layers, replay


def host_bytes_per_token(cache) -> int:
    """Host bytes one token of one sequence takes in the pools (every full-attention layer's keys and values, scales
    included); 0 before the first forward."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, OasisLayer) and layer.is_initialized:
            pool = layer.pool
            total += 2 * pool.num_kv_heads * pool.representation.unit_nbytes // pool.block_size
    return total


def layers_kept_wide(cache) -> dict[int, float]:
    """Layers whose pool keeps the model's dtype under a narrow `host_dtype` -> how far narrowing their keys would
    have moved their attention scores (nats, `pools.host_kv.measured_pool`)."""
    return {layer.layer_idx: layer.score_noise for layer in cache.layers
            if isinstance(layer, OasisLayer) and layer.is_initialized and cache.config.host_dtype is not None
            and layer.pool.host_dtype is None and getattr(layer, "score_noise", None) is not None}


def describe(cache) -> str:
    """What `cache` runs and why, in words."""
    cfg, model = cache.config, cache._model()
    name = type(model).__name__ if model is not None else "a deleted model"
    n_oasis = sum(isinstance(layer, OasisLayer) for layer in cache.layers)
    tokens = cache.get_seq_length(cache._first_oasis_layer)
    lines = [f"OasisCache for {name}: {tokens} tokens cached; each decode step attends at most "
             f"{cfg.token_budget} tokens per KV head (every token while the context fits)."]
    kept = sorted({type(layer).__name__ for layer in cache.layers if not isinstance(layer, OasisLayer)})
    held = "in the model's dtype" if cfg.host_dtype is None else \
        f"as {cfg.host_dtype}, widened to the model's dtype when gathered"
    per_token = host_bytes_per_token(cache)
    wide = layers_kept_wide(cache)
    if wide:
        held += (f" but layers {sorted(wide)} in the model's dtype (narrowing their keys would move their attention "
                 f"scores by {max(wide.values()):.1f} nats)")
    lines.append(f"- layers: {n_oasis} full-attention layers offloaded to host memory in blocks of "
                 f"{cfg.block_size} tokens, {held}" + (f" ({per_token} bytes a token of a sequence)" if per_token
                                                       else "")
                 + (f"; {len(cache.layers) - n_oasis} others kept by transformers ({', '.join(kept)})" if kept
                    else ""))
    modes = {"none": "the real query selects its blocks, fetched on the critical path",
             "previous": "each step's query predicts the next step's blocks, fetched on a side stream",
             "eagle3": "a draft token rides beside the real one and predicts the next step's blocks"}
    why = cache.why.get("lookahead", "yours")
    lines.append(f"- lookahead {cfg.lookahead!r} ({why}): {modes[cfg.lookahead]}"
                 + ("; attended blocks chosen by the real query, misses repaired" if cfg.exact else ""))
    if cache.ride_along is not None:
        lines.append(f"- draft: an EAGLE-3 head reading layers {cache.ride_along.aux_ids}"
                     + ("; chained drafts (the target's own next token where the draft was right)"
                        if cache.ride_along.lm_head is not None else ""))
    fp8, channels = summary_form(cache)
    form = "key channels chosen at the first forward" if channels is None else \
        f"{channels:.0%} of the key channels{', fp8 levels' if fp8 else ''}"
    lines.append(f"- block summaries: {cfg.scorer!r} scorer on {form}")
    if cache.transfer is None:
        lines.append(f"- transfers: backend {cfg.backend!r}, decided at the first forward (Triton kernels on CUDA)")
    else:
        engine = cache.transfer
        programs = ("one per block" if engine.gather_programs == 0 else f"{engine.gather_programs}"
                    ) if engine.gather_programs is not None else (
            f"{engine.side_programs} for prefetches, one per block on the critical path"
            if engine.side_programs else "one per block")
        lines.append(f"- transfers: {engine.backend} backend; gather programs: {programs}")
    if cache.captured_steps is not None:
        steps = cache.captured_steps
        lines.append(f"- decode steps: replayed as CUDA graphs where the shapes allow ({steps.replays} replays, "
                     f"{steps.captures} captures so far)")
    elif "cuda_graph" in cache.why:
        lines.append(f"- decode steps: eager ({cache.why['cuda_graph']})")
    else:
        lines.append("- decode steps: eager (captured CUDA graphs need one CUDA device, a checked architecture and "
                     "the Triton backend, or cuda_graph=True)")
    if replay.compiles_decode(cache):
        lines.append("- the layers' own work in decode steps: torch.compile'd (compile_decode)")
    elif cache._compile_later:
        model = cache._model()
        done = compiled_layers.decoded_steps(model) if model is not None else 0
        lines.append(f"- the layers' own work in decode steps: eager; torch.compile'd once the model has decoded "
                     f"{cache.config.compile_after_steps} steps in this process ({done} so far; compile_decode)")
    if cache.get_seq_length(cache._first_oasis_layer):
        lines.append(f"- memory: {sum(cache.device_nbytes().values()) / 2**20:.1f} MiB on the device, "
                     f"{cache.host_nbytes() / 2**20:.1f} MiB of host memory")
    return "\n".join(lines)


def summary_form(cache) -> tuple[bool | None, float | None]:
    """`(fp8_levels, summary_channels)`: whether the bits levels are kept in fp8 and the share of key channels
    the summaries cover, as resolved when the layers initialize (per device; every layer in the same forward,
    so the first tells); `(None, None)` before."""
    layer = cache.layers[cache._first_oasis_layer]
    if not layer.is_initialized:
        return None, None
    summaries = layer.summaries
    return summaries.scales is not None, summaries.kept_channels / summaries.head_dim


def remote_stats(cache) -> dict:
    """What an admitted cache read from its store (`oasis_cache.remote.admit`)."""
    tier, repairs = cache.remote_tier, cache.remote_tier.repairs
    links = [layer.pool.remote for layer in cache.layers
             if isinstance(layer, OasisLayer) and layer.is_initialized and layer.pool.remote is not None]
    return dict(
        remote_request=tier.request, remote_bytes_fetched=tier.bytes_got,
        remote_units_fetched=sum(link.units_fetched for link in links),
        remote_units_evicted=sum(link.units_evicted for link in links),
        remote_units_published=sum(link.published * link.batch_size * link.num_kv_heads for link in links),
        remote_local_cache_bytes=sum(link.nbytes for link in links),
        remote_repair_ms_per_step=1e3 * tier.repair_seconds / repairs if repairs else 0.0,
        remote_repair_exposed_ms_per_step=(1e3 * tier.repair_exposed_seconds / repairs
                                           if tier.overlap and repairs else None),
        remote_repair_phases_ms=dict(zip(("copy_back", "plan", "store_reads", "maps_and_gathers"),
                                         (1e3 * tier.repair_phases / max(1, repairs)).tolist())))
