"""`OasisConfig`: every option of an `OasisCache`, validated once, and the one home of defaults.

Dimension names used across the package (documented once, here):

    B    batch size (sequences)
    Hq   query heads            Hkv  key/value heads          G = Hq // Hkv (GQA group)
    Qn   query tokens in one forward
    N    tokens in the cache    NB   complete blocks in the cache (N // T)
    T    tokens per block (`block_size`)
    K    blocks attended per step per KV head (`num_selected_blocks`)
    S    working-set slots per KV head (`num_slots`, >= K)
    D    head dimension

A `block_id` is a logical block of the host pool (tokens [block_id*T, block_id*T + T)); a `slot` is a physical
place in the device working set. The two are never called by one name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# `compile_decode=None` compiles a model's decode steps from its this-many-th in a process (docs/performance.md:
# the compilation's seconds repaid within about as many steps again).
COMPILE_AFTER_STEPS = 2048

LOOKAHEAD_MODES = ("none", "previous", "eagle3")
BACKENDS = ("auto", "torch", "triton")
SCORERS = ("bits", "bound")
HOST_DTYPES = (None, "fp8", "int4")  # the host pool's units (`memory/representation.py`)
# Architectures whose decode steps the CUDA suite runs captured (tests/gpu/test_cuda.py, `gpu_run.sh tests`): where
# `cuda_graph=None` turns captured steps on. Another one's forward may do what a graph cannot record (a host read of
# a routing decision, a shape that depends on data): it opts in with cuda_graph=True.
# Beyond the four: linear-attention hybrids (Qwen3.5, Qwen3-Next), sliding windows in rings with learned sinks
# (gpt-oss), soft-capping (Gemma 2), latent attention (DeepSeek-V2/V3), keys with a Mamba state (Falcon-H1): their
# captured steps gave eager's tokens and logits on the H200, and a step of the real shapes ran
# 5.9-7.9x faster captured than eager (gpt-oss-20b 32K 9.3 vs 73.5 ms, Gemma-2-2B 8K 10.3 vs 72.9, DeepSeek-V2-Lite
# 32K 23.2 vs 137.3; docs/performance.md). Then Gemma 3, prompted with an image too (its 4D mask),
# and Zamba2 (shared attention blocks beside Mamba states).
CAPTURE_CHECKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "qwen3_next", "gpt_oss",
                               "gemma2", "deepseek_v2", "deepseek_v3", "falcon_h1", "gemma3_text", "zamba2")


@dataclass(frozen=True)
class OasisConfig:
    """Options of an `OasisCache`.

    Args:
        token_budget: tokens each query attends to per decode step and KV head, all included: sink, recent window,
            selected blocks and the partial block being filled. With `token_budget` >= context (every token the
            step's query sees), decoding equals dense attention, at any budget, block multiple or not
            (`blocks_for_step`).
        block_size: tokens per block (T); a positive power of two.
        sink_tokens: the first tokens of every sequence (after left padding), always attended. Rounded up to blocks.
        recent_tokens: the newest complete tokens, always attended, besides the partial block. Rounded up to blocks.
        lookahead: how the next step's blocks are predicted: "none" (select with the real query, then fetch, on the
            critical path); "previous" (this step's query selects the next step's blocks, whose gather runs on a
            side stream behind the rest of the step); "eagle3" (an EAGLE-3 head drafts the next token, which rides
            through the layers beside the real one: its queries select the next step's blocks).
        exact: with a predictor, attend to the real query's top-K anyway: the prediction only prefetches (into all
            `num_slots` slots), and the blocks it missed are fetched on the critical path (miss repair).
        fetch_ratio: at most `ceil(fetch_ratio * NB)` newly fetched blocks per step and KV head (NB = complete blocks
            in the context); selected blocks beyond the cap are skipped, best-ranked first kept. None = no cap.
        num_slots: working-set slots per KV head; defaults to the number of selected blocks (twice that with
            `exact`). More slots keep more blocks resident between steps (fewer transfers). A layer allocates no
            more slots than its context has blocks (memory follows the context, not the budget).
        max_decode_tokens: forwards of at most this many new tokens on a non-empty cache decode sparsely (assisted
            decoding verifies a few tokens at once); longer ones attend densely (prefill, chunked prefill).
        host_chunk_blocks: blocks per allocation of the host pool, at least; the pool grows by such chunks (pinned
            ones hold as many blocks as fill the power-of-two allocation torch's pinned allocator makes).
        backend: "triton" (CUDA kernels: block scores, slot assignment, and a gather that reads pinned host memory
            directly), "torch" (plain tensor ops; on CUDA the gather stages through host memory), or "auto"
            (triton on CUDA when available, else torch).
        gather_programs: programs of the gather kernel per K/V. None (default): chosen by the package — a prefetch
            on the side stream runs on the largest power of two <= a sixteenth of the device's SMs (8 on an H200),
            a gather that compute waits for (on the critical path) on one program per block
            (`memory.transfer.side_stream_programs`); 0: one program per block everywhere (the default before the
            before); n: n programs everywhere. A gather's programs mostly wait on PCIe while holding SMs
            that the compute running beside a prefetch needs: H200, Qwen3-8B shape, budget 2048, a captured
            `previous` step at 32K x 1 took 12.7 ms with 32 programs against 17.4 with one per block (docs/performance.md).
        scorer: how blocks are ranked (`control.selection`): "bits" (1 bit per key channel kept on the device —
            above the block's mean key or not — read back as the mean of the keys on that side; a block scores its
            best coarse key: it ranks like the exact max of q.k) or "bound" (the min/max upper bound of q.k,
            Quest's; a third less summary memory, much worse selection).
        fp8_levels: with the bits scorer, keep its levels in fp8 (e4m3) with a power-of-two scale per block and KV
            head: the summaries then take the bytes of a bf16 min/max (1/16 of K+V at T=16) instead of 3/32. None
            (default): fp8 wherever it runs — CPU, and CUDA unless the Triton kernels meet a GPU below compute
            capability 8.9, which cannot convert fp8 (`pools.summaries.fp8_levels_for`); True there is an error.
        summary_channels: with the bits scorer, the fraction of key channels its summaries cover. None (default):
            0.5 with the bits scorer (1.0 with "bound", and where half the head would be an odd number of channels):
            per sequence and KV head, the rotary pairs of largest mean |k| over the prompt's real tokens (chosen at
            the first decode step: the same whatever the batch, its padding and the prefill's chunks), the others
            left out of the ranking (`pools/summaries.py`); the summaries then take 3.1% of
            K+V per block with fp8 levels instead of 6.25%, which keeps the device's KV within 10% of dense at 32K
            with a 2048-token budget (on SmolLM2's six tasks: equal retention but one sample).
            1.0: every channel. An explicit fraction must keep an even number of the head's channels.
        chain_drafts: with eagle3, the draft row also goes through the model's LM head (one more row of the real
            row's product: its weights are read once) and its most likely next token is kept. At the next step, where
            the draft was right (the token that came is the one that rode), that token is the target's own prediction
            of the step after — it becomes the draft instead of the head's guess; where it was wrong, the head
            drafts (`draft/lookahead.py`). False: the head drafts every step.
        attention_kernel: decode attention over the working set by the Triton kernel
            (`kernels/decode_attention.py`: no mask tensor, no query or output copy) instead of SDPA with an additive
            mask (`compute/sparse.py`); same result within floating-point rounding. None (default): the kernel
            wherever the Triton backend runs. True: the kernel (an error unless the backend is Triton on CUDA).
            False: SDPA.
        cuda_graph: replay one-token decode steps as CUDA graphs (`runtime/captured_step.py`; a left-padded batch's too):
            one graph for the steps that complete no block, one for those that complete one, recaptured when a pool's
            capacity grows; every lookahead (with eagle3, once the head's attention window has filled). None
            (default): on for models on one CUDA device with the Triton backend whose architecture the CUDA suite
            checks captured (`CAPTURE_CHECKED_MODEL_TYPES`), off elsewhere. True: on wherever it can run (a model on
            one CUDA device, the Triton backend; an error elsewhere). False: every step runs eagerly. Never for a
            rotary scaling by length ("dynamic", "longrope": transformers picks the frequencies on the host).
        compile_decode: run each decoder layer's own work (norms, rotary, activations, residuals) `torch.compile`d
            in decode steps (`runtime/compiled_layers.py`; the cache's update and the oasis attention as opaque custom
            ops in the graph, `compute/compiled_ops.py`): fewer, fused kernels per layer (H200, a 32K x 1 step of an
            8B model: 11.2 -> 8.5 ms). Same tokens as eager within floating-point rounding. Compiling costs seconds
            once per process (~2-7 s with the kernels on disk, ~10-20 s on a new machine), so None (default):
            automatic, where steps are captured (`cuda_graph`) and every attention layer is an oasis layer — the
            steps run uncompiled until the model has decoded `compile_after_steps` steps in this process (over all
            its caches and calls), then the next step compiles (a pause of those seconds, once) and the steps are
            captured anew with the compiled kernels: short runs never pay for it, long ones get the faster step for
            all but their first steps (a compilation that fails warns once; the steps go on uncompiled). True:
            compiled from the first decode step (the first `generate` of a process 2.7-3.2x a later one with the
            kernels on disk, docs/performance.md). False: never. Where steps are captured, the steps outside the captured
            path (a cache's first, steps that cannot be replayed) run uncompiled either way.
        compile_after_steps: research, with `compile_decode=None`: decode steps of a model in a process before its
            steps are compiled (2048: at ~2.7 ms saved a step the compilation's seconds are repaid within about as many
            steps again; docs/performance.md). 0 compiles at the first decode step.
        fuse_projections: research, with `compile_decode=True`: each decoder layer's q/k/v projections computed as one
            product inside compiled decode steps, and the MLP's gate/up as one (`runtime/fused_projections.py`: the
            weights re-homed once into one buffer per group, each parameter its rows of it; `save_pretrained`
            unchanged; `fused_projections.unfuse(model)` undoes it). H200, a 32K x 1 decode step of an 8B model
            with `compile_decode`: 8.5 -> 7.8 ms (docs/performance.md). Off.
        compile_ahead: with the Triton backend: before a cache's first decode step (once per process for each
            configuration and batch shape), the same step runs on a read-only copy of the cache with every kernel
            launch made a compilation, the compilations in parallel (`runtime/ahead.py`); the real step then finds
            its kernels compiled instead of compiling them one after another. None (default): on a CUDA device (on
            a new machine's H200, Qwen3-8B at 32K x 1: the first `generate` 14.1-16.1 -> 11.3-11.8 s, no change
            once the kernels are on disk; docs/performance.md). True: on any device (the CPU tests run
            it under Triton's interpreter). False: never.
        ahead_at_prefill: with `compile_ahead` on: the dry step runs during the prefill instead — one decode token
            at the first attention layer of a read-only copy, once the whole prompt is in that layer — and its
            compilations go on while the prefill's other layers run; the first decode step waits for what is left
            (`compute/ahead.at_prefill`). Not with a ride-along draft, nor without room for the copy beside the
            prefill's activations (the dry step runs before the first decode step then). On by default since the
            measured on the H200, Qwen3-8B at 32K x 1, new kernel and JIT caches, alternating, the first
            `generate` 6.62-7.05 -> 5.36-5.82 s (it gained nothing while the trace took every layer and the
            prefill was not yet device-bound; docs/performance.md).
        fast_pinning: before a CUDA cache pins its first host chunk, once per process, extend torch's allocator
            settings with `pinned_use_cuda_host_register:True,pinned_num_register_threads:8` (pinned memory taken by
            malloc, its pages touched by 8 threads, then registered, instead of `cudaHostAlloc`), keeping the
            process's other settings; left alone where they name `pinned_use_cuda_host_register` (the user's choice).
            H200 host, 5 GiB in 16 MiB chunks: 1.9-2.2 -> 0.72 s; Qwen3-8B at 32K x 1, the first token 3.0-3.2 ->
            2.0-2.7 s in every call of a process (`memory/host_memory.py`, docs/performance.md).
            True (default); False leaves torch's settings as they are.
        top_k_kernel: with the Triton backend, choose each KV head's k best blocks in one launch of the package's
            threshold select (`kernels/top_k.py`) instead of `torch.topk` and the sort of its results: the same
            blocks (ties: the lower block ids, where torch leaves them unspecified), listed in block order rather
            than best first. None (default): the kernel wherever the Triton backend runs, unless `fetch_ratio` is set
            (its cap keeps the best first: `torch.topk`). True: the kernel (an error beside `fetch_ratio`). False:
            `torch.topk`. H200, a replayed 32K step of an 8B model: 8.4 -> 8.1 ms (docs/performance.md).
            Rows past 4,096 blocks run in two launches (segments of the row, then their best; exact),
            up to 16 segments of 16,384 blocks; longer rows go through `torch.topk`.
        host_dtype: how the host pool holds keys and values. None (default): the model's dtype (decoding equals dense
            attention with `token_budget` >= context). "fp8": e4m3 with a scale per block, K or V, sequence and KV
            head (half of bf16's bytes); "int4": 4 bits with a scale and minimum per token (about a quarter). Each
            step moves that many fewer bytes and a request holds that much less host memory. A step attends the
            complete blocks widened back to the model's dtype (`memory/representation.py`), but the sink blocks and
            the newest `recent_tokens` complete blocks as the model made them (`SlotMap.hold_newest`); block
            summaries are made from the keys before they are narrowed, and the incomplete block stays in the model's
            dtype.
        prefill_chunk_tokens: a forward through the cache that writes more tokens than this (new tokens x batch)
            and keeps the logits of its last positions only (what `generate` asks for) runs as forwards of at most
            this many tokens (`runtime/prefill.py`; a tail of at most `max_decode_tokens` joins the last chunk): the
            prompt's activations stay bounded, so a long prompt fits a small card without `prefill_chunk_size`; 0:
            off. Same result as the whole forward (the cache's prefill is dense attention either way; the summaries'
            channels are the whole prompt's, not the first chunk's). A model whose
            rotary scaling follows the length a forward reaches ("dynamic", "longrope") is prefilled whole: chunks
            would rotate the early tokens by a shorter length than dense's one forward.
        resident_prefill: during a chunked prefill, keep the prompt's keys and values on the device until its last
            chunk, where every full-attention layer's fit in half the device memory the process may still take
            (`OasisLayer._attend_resident`): a chunk reads the past there instead of bringing it back from host
            memory (the past's traffic over PCIe grows with the square of the chunk count). False: every chunk reads
            the past from the host pool. Same attention either way.
        progress: show a progress bar (tqdm) over a chunked prefill's tokens.
        measure: also time how long compute waits on prefetches and, for predictions, their recall against the
            real query's top-K (extra events and selections per layer: for analysis, not for speed).
    """

    token_budget: int
    block_size: int = 16
    sink_tokens: int = 16
    recent_tokens: int = 64
    lookahead: str = "none"
    exact: bool = False
    fetch_ratio: float | None = None
    num_slots: int | None = None
    max_decode_tokens: int = 16
    host_chunk_blocks: int = 256
    backend: str = "auto"
    gather_programs: int | None = None
    scorer: str = "bits"
    fp8_levels: bool | None = None
    summary_channels: float | None = None
    chain_drafts: bool = True
    attention_kernel: bool | None = None
    cuda_graph: bool | None = None
    compile_decode: bool | None = None
    compile_after_steps: int = COMPILE_AFTER_STEPS
    fuse_projections: bool = False
    compile_ahead: bool | None = None
    ahead_at_prefill: bool = True
    fast_pinning: bool = True
    top_k_kernel: bool | None = None
    prefill_chunk_tokens: int = 8192
    host_dtype: str | None = None
    resident_prefill: bool = True
    progress: bool = False
    measure: bool = False

    def __post_init__(self):
        _check_types(self)  # (types first: a bool is not taken for an int, nor None for a bool)
        self._check_sizes()
        self._check_modes()
        self._check_switches()

    def _check_sizes(self) -> None:
        T = self.block_size
        if T <= 0 or T & (T - 1):
            raise ValueError(f"block_size must be a positive power of two (e.g. 16), got {T!r}.")
        for name in ("sink_tokens", "recent_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}.")
        if self.token_budget <= 0:
            raise ValueError(f"token_budget must be a positive int (tokens per step), got {self.token_budget!r}.")
        needed = (self.num_sink_blocks + self.num_recent_blocks + 1) * T
        if self.token_budget < needed:
            raise ValueError(
                f"token_budget={self.token_budget} is below what sink and recent tokens always take: "
                f"sink {self.num_sink_blocks * T} + recent {self.num_recent_blocks * T} + the partial block {T} "
                f"= {needed} tokens (block_size={T}). Raise token_budget to at least {needed}, or lower "
                f"sink_tokens / recent_tokens."
            )
        if self.fetch_ratio is not None and not 0 < self.fetch_ratio <= 1:
            raise ValueError(f"fetch_ratio must be in (0, 1] (a fraction of the context's blocks), got {self.fetch_ratio!r}.")
        if self.num_slots is not None and self.num_slots < self.min_slots:
            raise ValueError(
                f"num_slots={self.num_slots!r} is below the {self.min_slots} blocks a step may attend: "
                f"{self.num_selected_blocks} selected (token_budget // block_size - 1), or every complete block of "
                f"a context that fits token_budget ({self.num_fitting_blocks}); leave num_slots=None or raise it."
            )
        for name, least in (("max_decode_tokens", 1), ("host_chunk_blocks", 1), ("prefill_chunk_tokens", 0),
                            ("compile_after_steps", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be an int >= {least}, got {getattr(self, name)!r}.")
        if self.gather_programs is not None and self.gather_programs < 0:
            raise ValueError(f"gather_programs must be None (chosen by the package), 0 (one program per block) or a "
                             f"positive int, got {self.gather_programs!r}.")
        if self.summary_channels is not None and not 0 < self.summary_channels <= 1:
            raise ValueError(f"summary_channels must be None (automatic) or in (0, 1] (a fraction of the key "
                             f"channels), got {self.summary_channels!r}.")

    def _check_modes(self) -> None:
        for name, modes in (("lookahead", LOOKAHEAD_MODES), ("scorer", SCORERS), ("backend", BACKENDS)):
            if getattr(self, name) not in modes:
                raise ValueError(f"{name} must be one of {modes}, got {getattr(self, name)!r}.")
        if self.host_dtype not in HOST_DTYPES:
            raise ValueError(f"host_dtype must be None (the model's dtype), 'fp8' or 'int4', got {self.host_dtype!r}.")
        if self.exact and self.lookahead == "none":
            raise ValueError("exact=True repairs the misses of a prediction: use it with lookahead='previous' or "
                             "'eagle3'.")
        if self.fp8_levels and self.scorer != "bits":
            raise ValueError("fp8_levels=True is for scorer='bits' (a rounded min/max would no longer bound q.k).")
        if self.summary_channels is not None and self.summary_channels < 1 and self.scorer != "bits":
            raise ValueError("summary_channels < 1 is for scorer='bits' (a min/max over some channels would no "
                             "longer bound q.k).")

    def _check_switches(self) -> None:
        if self.attention_kernel and self.backend == "torch":
            raise ValueError("attention_kernel=True runs a Triton kernel: it needs backend='triton' (or 'auto' on "
                             "CUDA).")
        if self.compile_after_steps != COMPILE_AFTER_STEPS and self.compile_decode is not None:
            raise ValueError(f"compile_after_steps={self.compile_after_steps} sets when compile_decode=None (automatic) "
                             f"compiles; with compile_decode={self.compile_decode} it would do nothing: drop it, or "
                             f"pass compile_decode=None.")
        if self.fuse_projections and self.compile_decode is not True:
            raise ValueError("fuse_projections=True fuses the projections inside compiled decode steps: pass "
                             "compile_decode=True with it.")
        if self.top_k_kernel and self.fetch_ratio is not None:
            raise ValueError("top_k_kernel=True lists the chosen blocks in block order, but fetch_ratio's cap keeps "
                             "the best ones first: pass one of top_k_kernel=True and fetch_ratio, not both.")

    def kept_channels(self, head_dim: int) -> int:
        """The key channels the summaries cover for a head of `head_dim` channels (`summary_channels`)."""
        if self.summary_channels is None:  # automatic: half the rotary pairs with the bits scorer
            half = head_dim // 2
            return half if self.scorer == "bits" and half >= 2 and half % 2 == 0 else head_dim
        kept = self.summary_channels * head_dim
        if kept != int(kept) or int(kept) % 2 or kept < 2:
            raise ValueError(
                f"summary_channels={self.summary_channels} keeps {kept:g} of this model's {head_dim} key channels per "
                f"head: it must keep an even number (rotary pairs), e.g. 0.5 ({head_dim // 2}) or 0.25 "
                f"({head_dim // 4}), or 1.0 (all).")
        return int(kept)

    @property
    def num_sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    @property
    def num_recent_blocks(self) -> int:
        return -(-self.recent_tokens // self.block_size)

    @property
    def num_selected_blocks(self) -> int:
        """K: complete blocks attended per step and KV head (sink and recent included) by a context longer than the
        budget; one block of the budget is kept for the partial block being filled."""
        return self.token_budget // self.block_size - 1

    @property
    def num_fitting_blocks(self) -> int:
        """The most complete blocks a context within the budget holds (with at least one token in the partial
        block): ceil(token_budget / T) - 1 — one more than K when the budget is not a multiple of T."""
        return -(-self.token_budget // self.block_size) - 1

    @property
    def min_slots(self) -> int:
        return max(self.num_selected_blocks, self.num_fitting_blocks)

    def blocks_for_step(self, num_blocks: int, recent_tokens: int) -> int:
        """Complete blocks a query attends to when the context is `num_blocks` complete blocks plus `recent_tokens`
        (the partial block and the new token; a multi-token forward passes its first new token's): all of them while
        that context fits the budget (budget >= context: dense attention, exactly), else K (`num_selected_blocks`),
        so that K * T + recent <= budget."""
        if num_blocks * self.block_size + recent_tokens <= self.token_budget:
            return max(num_blocks, self.num_selected_blocks)
        return self.num_selected_blocks

    def max_fetch(self, num_blocks: int) -> int:
        """Newly fetched blocks allowed per step and KV head."""
        if self.fetch_ratio is None:
            return self.slots
        return max(1, math.ceil(self.fetch_ratio * num_blocks))

    @property
    def slots(self) -> int:
        """S: working-set slots per KV head at most (default: the selected blocks, or every block of a context that
        fits the budget; twice the selected blocks with `exact`, which prefetches into the extra slots). A layer
        allocates only as many as its context can fill (`OasisLayer.reserve_slots`)."""
        if self.num_slots is not None:
            return self.num_slots
        return max(self.num_selected_blocks * (2 if self.exact else 1), self.num_fitting_blocks)


_ALLOWED = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),)}


class OptionTypeError(TypeError, ValueError):
    """An option of another type than it takes (a TypeError, and a ValueError as any bad option is)."""


def _check_types(config: OasisConfig) -> None:
    """A TypeError for an option of another type than its annotation says, before anything else reads it: a bool is
    not taken for an int (`block_size=True` is not 1), nor an int for a bool."""
    import dataclasses

    for field in dataclasses.fields(config):
        value, kinds = getattr(config, field.name), [kind.strip() for kind in str(field.type).split("|")]
        allowed = tuple(t for kind in kinds for t in _ALLOWED.get(kind, (object,)))
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and "bool" not in kinds):
            raise OptionTypeError(f"OasisCache option {field.name} must be {' or '.join(kinds)}, got {value!r} "
                                  f"({type(value).__name__}).")
