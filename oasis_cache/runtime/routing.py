"""The model's forward with an OasisCache, routed (`runtime/install.py` installs the router on the model): all or
nothing (a forward that fails midway is undone, `undo.py`), a long prefill in chunks of `prefill_chunk_tokens` over
the batch with a retry at half the size where a chunk runs out of device memory (`runtime/prefill.py`), the first
decode step's kernels compiled ahead (`runtime/ahead.py`), and decode steps to the captured steps where there are
any."""

from __future__ import annotations

import inspect
import warnings

import torch

from .. import compat
from ..compat import generate_cache_argument
from . import ahead, compiled_layers, prefill
from ..compute.dense import chunks_follow
from .captured_step import ModelState, module_settings, weights_where_they_are
from .prefill import prefill_chunks
from ..layer import OasisLayer
from ..memory.device_memory import device_room
from ..undo import ForwardMarks


class CapturedForward:
    """Installed once per model instance as `model.forward` (an instance attribute, same signature) while an
    OasisCache for it lives (`runtime/install.py`); hands each call with an OasisCache to `runtime/routing.py` (a long prefill in chunks,
    `runtime/prefill.py`; a decode step to the cache's `CapturedSteps` where it has them), every other call to the
    model's own forward."""

    def __init__(self, model):
        self.eager_forward = model.forward  # the bound class forward (its `__self__`: the model, also in a deepcopy)
        self.__signature__ = inspect.signature(self.eager_forward)  # generate inspects forward's parameters
        self.__doc__ = self.eager_forward.__doc__
        self.cache_argument = generate_cache_argument(model)

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        route = getattr(cache, "route_forward", None)  # an OasisCache: chunked prefill, captured steps
        if args or route is None:
            return self.eager_forward(*args, **kwargs)
        return route(self, kwargs)


def route_forward(cache, runner, kwargs: dict):
    """`_route_forward`, all or nothing: a forward that fails midway leaves the cache as before it, or refusing to
    serve (`oasis_cache/undo.py`)."""
    cache._refuse_if_broken()
    if cache._routed:  # (a forward inside a routed one: a dry step's; the outer one's marks hold)
        return _route_forward(cache, runner, kwargs)
    if cache._unchecked:  # (after a forward the model's forward did not route: the layers may disagree)
        cache._check_lengths()
    cache._marks, cache._routed = ForwardMarks(cache), True
    try:
        return _route_forward(cache, runner, kwargs)
    except BaseException:
        if cache._marks is not None:  # (not undone already, by the error's own path)
            cache._undo_failed_forward()
        raise
    finally:
        cache._routed, cache._marks = False, None


def _route_forward(cache, runner, kwargs: dict):
    """A call of the model's forward with this cache (`CapturedForward`): a long prefill in chunks of
    `config.prefill_chunk_tokens` tokens over the batch (`runtime/prefill.py`), a decode step to the captured
    steps where there are any, else the model's own forward. Running out of device memory in a prefill raises a
    MemoryError that names the sizes and what to lower."""
    model, running = cache._model(), getattr(getattr(runner, "eager_forward", None), "__self__", None)
    if running is not None and model is not None and running is not model:
        raise ValueError(f"This OasisCache was made for another model instance ({type(model).__name__} at "
                         f"{id(model):#x}) than the one running it: make one per model, OasisCache(model, ...).")
    tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[1] == 0:
        held = cache.get_seq_length(cache._first_oasis_layer)
        raise ValueError(f"This OasisCache holds {held} tokens and the forward brings no new one: generate was "
                         f"given a prompt no longer than what the cache holds. Pass the conversation so far "
                         f"followed by new tokens, or call cache.reset() (or make a new cache) for a new prompt.")
    first = cache.layers[cache._first_oasis_layer]
    if (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and first.is_initialized
            and first.get_seq_length() > 0 and tokens.shape[0] != first.batch_size):  # (before any layer or hook)
        raise ValueError(f"This OasisCache holds {first.get_seq_length()} tokens for a batch of "
                         f"{first.batch_size}, but got a batch of {tokens.shape[0]}. Call cache.reset() (or make "
                         f"a new OasisCache) for a new batch.")
    if (cache.captured_steps is not None and model is not None and isinstance(tokens, torch.Tensor)
            and tokens.dim() >= 2):
        # (a prefill, or the model changed since: steps captured before a rebinding, or an adapter or flag
        # switched by then, capture anew)
        state = cache._model_state
        if (tokens.shape[1] > max(compiled_layers.COMPILED_QUERY_LENGTHS) or state is None
                or not state.unchanged()):
            cache._model_state = ModelState(model)
            cache._model_as_run = (weights_where_they_are(model), module_settings(model))
    if cache.context.streams is not None:
        cache.context.streams.finish_held()  # (an admitted cache's store reads of the step before: `remote/repair.py`)
    spans = prefill_chunks(kwargs, cache.config.prefill_chunk_tokens, cache.config.block_size,
                           cache.config.max_decode_tokens)
    if spans is not None and any(compat.records_state_history(layer) for layer in cache.layers):
        spans = None  # (assisted decoding on a linear-attention hybrid: its layers' history wants whole forwards)
    if spans is not None and cache._length_scaled_rotary:
        spans = None  # (a rotary scaled by the length a forward reaches: the prompt whole, as dense rotates it)
    past = cache.get_seq_length(cache._first_oasis_layer)
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
            and tokens.shape[1] > cache.config.max_decode_tokens):
        return _route(cache, runner, kwargs, tokens, spans, past)
    ahead.beside_prefill(cache, tokens.device)  # (a prefill: Triton's start-up, any compile workers, beside it)
    return _route(cache, runner, kwargs, tokens, spans, past)


def _route(cache, runner, kwargs, tokens, spans, past):
    """`route_forward`'s way: the prefill's chunks (`spans`), a dry step first where one is wanted, one forward."""
    try:
        if spans is not None:
            cache.context.prefill_tokens = past + spans[-1][1]  # (tokens: `_start_forward` decides on residency)
            try:
                with chunks_follow():  # (the first chunk warms the later ones' attention kernels)
                    return _run_chunks(cache, runner, kwargs, spans, past)
            finally:
                cache.context.prefill_tokens = cache.context.prefill_resident = cache.context.prefill_past = None
                for layer in cache.layers:
                    if isinstance(layer, OasisLayer):
                        layer.resident_kv = None
        if ahead.PENDING:  # (compilations a prefill started: done before a step launches their kernels)
            ahead.finish_pending()
        if ahead.wanted(cache, tokens):  # a first decode step: its kernels compiled in parallel first
            ahead.dry_step(cache, lambda dry, args: forward_one(dry, runner, args), kwargs, tokens)
        return forward_one(cache, runner, kwargs)
    except torch.OutOfMemoryError as error:
        if tokens is None or tokens.shape[1] <= cache.config.max_decode_tokens:
            raise
        raise _prefill_out_of_memory(cache, tokens, spans) from error


def _prefill_out_of_memory(cache, tokens, spans) -> MemoryError:
    """What a prefill that ran out of device memory tells: the sizes, what holds the room, and what to lower."""
    B, N = tokens.shape[:2]
    device = tokens.device
    held = sum(cache.device_nbytes().values()) / 2**30
    room = (f" ({device_room(device) / 2**30:.1f} GiB left to this process now; the cache holds {held:.1f} "
            "GiB on the device)") if device.type == "cuda" else ""
    chunk = (spans[0][1] - spans[0][0]) if spans else N
    smaller = cache._failed_chunk or chunk
    tried = f" (and of {B} x {smaller} after it)" if spans and smaller < chunk else ""
    least = prefill.least_span(cache.config.block_size, cache.config.max_decode_tokens)
    half = smaller // 2 // cache.config.block_size * cache.config.block_size
    holders = (f"the weights and the decode working set (token_budget {cache.config.token_budget} x batch {B}) "
               "hold the room")
    if cache._length_scaled_rotary:  # (prefilled whole on purpose: chunks would rotate it otherwise)
        fix = (f"{type(cache._model()).__name__}'s rotary scaling ({cache._length_scaled_rotary!r}) follows the "
               "length a forward reaches, so its prompt is prefilled whole, never in chunks: lower the batch "
               "or the prompt's length")
    elif half < least:  # (no smaller chunk would prefill: what holds the room is not the chunk)
        fix = f"Even the least chunk did not fit: {holders}. Lower the batch or token_budget"
    elif smaller < chunk:  # (halved already: the chunk's activations were not what filled the room)
        fix = (f"Smaller chunks did not fit either: {holders}. Lower the batch or token_budget (or "
               f"prefill_chunk_tokens further, e.g. {B * half})")
    else:
        fix = (f"Lower prefill_chunk_tokens (now {cache.config.prefill_chunk_tokens}; e.g. OasisCache(model, "
               f"token_budget=..., prefill_chunk_tokens={B * half})), the batch, or token_budget")
    return MemoryError(
        f"OasisCache: the prefill of {B} x {N} tokens ran out of device memory in forwards of {B} x {chunk} "
        f"tokens{tried}{room}. {fix}. The cache keeps what it held before this call."
    )


def _run_chunks(cache, runner, kwargs, spans, past):
    """The prefill's chunks (`compute/prefill.run_chunks`). A chunk that runs out of device memory is undone
    (`ChunkMarks`) and the prompt goes on from its start in chunks of half as many tokens, with a warning, up to
    `prefill.SHRINK_RETRIES` times; then the error goes on (to `_route`'s MemoryError). Models whose every layer
    is this cache's only: another layer (a sliding window's) cannot be cropped back."""
    marks, cache._failed_chunk = prefill.ChunkMarks(cache, past), None
    T, shortest, shrinks = cache.config.block_size, cache.config.max_decode_tokens, 0
    while True:
        try:
            return prefill.run_chunks(lambda **chunk: forward_one(cache, runner, chunk), kwargs, spans, past,
                                      cache.config.progress, before_chunk=marks)
        except torch.OutOfMemoryError:
            start, end = marks.span or (0, 0)
            length = (end - start) // 2 // T * T
            if (shrinks == prefill.SHRINK_RETRIES or not cache.all_oasis_layers
                    or length < prefill.least_span(T, shortest) or not marks.undoable()):
                cache._failed_chunk = end - start  # (for `_route`'s message)
                raise
        # (out of the except clause: the error's frames, which hold the chunk's activations, are gone)
        shrinks += 1
        marks.undo()
        device = cache.layers[cache._first_oasis_layer].device
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # (what the failed chunk left cached goes back, whole segments)
        B = next(v for v in (kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if v is not None).shape[0]
        warnings.warn(f"OasisCache: a prefill chunk of {B} x {end - start} tokens ran out of device memory; "
                      f"going on from token {past + start} in chunks of {B} x {length} (set prefill_chunk_tokens="
                      f"{B * length} to start there).", RuntimeWarning, stacklevel=2)
        spans = prefill.spans_from(start, spans[-1][1], length, shortest)

def forward_one(cache, runner, kwargs: dict):
    if cache._compile_later:  # (counted before the step: its layers all run compiled or all not)
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if (isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
                and tokens.shape[1] in compiled_layers.COMPILED_QUERY_LENGTHS
                and cache.get_seq_length(cache._first_oasis_layer) > 0):
            compiled_layers.count_decoded_step(cache._model())
    if cache.captured_steps is not None:
        out = cache.captured_steps.forward(runner, cache, kwargs)
    else:
        out = runner.eager_forward(**kwargs)
    for listener in tuple(cache._after_forward):
        listener()
    return out
