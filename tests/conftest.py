"""Shared fixtures: tiny random models of the supported architectures, and a generate helper that returns tokens and
per-step logits for a given cache."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: the cores shared among the workers (and their children)
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import oasis_cache  # noqa: F401  (registers "oasis")
from oasis_cache import OasisCache
from oasis_cache.compat import generate_cache_argument
from oasis_cache.runtime.build import cache_kwargs

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Spread the logits so that greedy choices are not near-ties of random weights.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


LINEAR = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
HYBRIDS = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=64)),
}


def tiny_hybrid(name: str):
    """A linear-attention layer (gated delta net) then a full-attention one, random weights, SDPA."""
    config_name, model_name, extra = HYBRIDS[name]
    config = getattr(transformers, config_name)(**{**_COMMON, **LINEAR, **extra})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # (greedy choices away from near-ties)
    return model


def prompt_ids(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def left_padded(lengths: list[int], seed: int = 1) -> dict:
    """A left-padded batch: `{"input_ids", "attention_mask"}`."""
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = prompt_ids(n, seed=seed + row)[0]
        mask[row, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, cache, inputs: dict, seed: int = 0, **kwargs):
    """Run `model.generate` with `cache`; returns the output (sequences, logits)."""
    torch.manual_seed(seed)
    arg = generate_cache_argument(model)
    if cache is not None:
        kwargs[arg] = cache
    return model.generate(
        **inputs,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
        eos_token_id=None,
        **kwargs,
    )


def random_head(model, draft_vocab: int = 64, scale: float = 0.1, seed: int = 0):
    """An untrained EAGLE-3 head shaped for `model` (random weights, random draft vocabulary)."""
    from oasis_cache.draft import Eagle3Config, Eagle3Head

    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, scale)
    head.set_vocab_map(torch.randperm(model.config.vocab_size)[:draft_vocab])
    return head


def drafts_of_two_generates(model, cache, prompt: torch.Tensor, extend: torch.Tensor) -> torch.Tensor:
    """Generate 12 tokens after `prompt`, then 12 more after (that + `extend`), through `cache` (eagle3): the drafts
    the ride-along made at the 22 decode steps, `[B, 22]`."""
    import types

    ride, drafts, draft = cache.ride_along, [], type(cache.ride_along)._draft

    def recording(self, token, rode):  # (a bound method: a dry step's copy of the cache binds it to its own copy of
        out = draft(self, token, rode)  # the ride-along, whose drafts are not this cache's: `runtime/ahead.py`)
        if self is ride:
            drafts.append(out.clone())
        return out
    ride._draft = types.MethodType(recording, ride)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    first = model.generate(input_ids=prompt, past_key_values=cache, **kw)
    model.generate(input_ids=torch.cat((first, extend), 1), past_key_values=cache, **kw)
    return torch.cat(drafts, 1)


def dense_cache(model):
    model.set_attn_implementation("sdpa")
    return DynamicCache(config=model.config)


def oasis_cache_for(model, **kwargs):
    kwargs.setdefault("token_budget", 1024)
    return OasisCache(model, **cache_kwargs(kwargs))


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request):
    return request.param


@pytest.fixture(autouse=True)
def _eager_steps_everywhere(monkeypatch):
    """`OASIS_TEST_CUDA_GRAPH=0`: every OasisCache runs its decode steps eagerly (`cuda_graph=False` unless the test
    passes it) — the whole CUDA suite on the eager path, which the default (captured steps on CUDA) leaves to the
    first steps and to what cannot be replayed (`bash bench/gpu_run.sh testseager`)."""
    if os.environ.get("OASIS_TEST_CUDA_GRAPH") != "0":
        return
    made = OasisCache.__init__

    def eager(self, model, **kwargs):
        kwargs.setdefault("cuda_graph", False)
        made(self, model, **kwargs)

    monkeypatch.setattr(OasisCache, "__init__", eager)


_CUDART = []  # [the CUDA runtime torch loaded, or None], found once


def cuda_runtime():
    """The CUDA runtime library torch loaded (ctypes; the same instance, so the same per-thread "last error"), None
    without CUDA or where torch links it statically (not in /proc/self/maps)."""
    if not _CUDART:
        found = None
        if torch.cuda.is_available():
            import ctypes

            torch.cuda.init()
            try:
                with open("/proc/self/maps") as f:
                    paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
            except OSError:
                paths = []
            if paths:  # (torch's own where several are loaded: its lib folder's, then the CUDA wheels')
                paths.sort(key=lambda path: ("/torch/" not in path, "/nvidia/" not in path))
                found = ctypes.CDLL(paths[0])
                found.cudaGetLastError.restype = found.cudaPeekAtLastError.restype = ctypes.c_int
                found.cudaGetErrorString.restype = ctypes.c_char_p
        _CUDART.append(found)
    return _CUDART[0]


@pytest.fixture(autouse=True)
def _no_cuda_error_left(request):
    """GPU tests: a failed CUDA runtime call that nobody checked leaves its error in the thread's "last error", and
    torch's next kernel-launch check raises it wherever that is — in a later test (the H200, 2026-12-03: 12 tests
    failed with "CUDA error: invalid argument" at their first kernel; that one was a bad event in torch's host
    allocator, not a pending error: `memory.streams.no_collection_while_capturing`). Here the test that leaves
    one fails itself, naming it (and clears it: the tests after it run as if it had not happened); one found before a
    test started was left between tests (an object collected late). `OASIS_TEST_GC_CHECK=1`: the test's garbage is
    collected at its end and checked apart ("when its garbage was collected": a destructor's call)."""
    runtime = cuda_runtime() if request.node.get_closest_marker("gpu") is not None else None
    if runtime is None:
        yield
        return
    before = runtime.cudaGetLastError()
    yield
    after = runtime.cudaGetLastError()
    collected = 0
    if os.environ.get("OASIS_TEST_GC_CHECK") == "1":
        import gc

        gc.collect()
        collected = runtime.cudaGetLastError()
    found = [(when, code) for when, code in (("before it started", before), ("when it ended", after),
                                             ("when its garbage was collected", collected)) if code]
    if found:
        pytest.fail("a CUDA error was pending " + "; ".join(
            f"{when}: {runtime.cudaGetErrorString(code).decode()} ({code})" for when, code in found), pytrace=False)


@pytest.fixture
def one_thread():
    """CPU kernels on one thread for the test: a multithreaded sum rounds differently from run to run, and where two
    caches are compared below the context's budget a near tie in the block selection may flip (the fork test: logits
    3.6e-4 apart in 2 of 16 single-process runs on two threads, 0 of 16 on one; `-n 2` runs every test on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def mooncake_master():
    """A Mooncake Store for the whole run (`oasis_cache.remote.local_store`: `mooncake_master` and one 512 MB storage
    process on free localhost ports, started here and stopped at the end); yields the master's "host:port"."""
    from oasis_cache.remote import local_store

    with local_store("512MB") as master:
        yield master


# The suite's longest tests (seconds on a 2-core CPU, 2026-12-07: ~65, ~47, ~47, ~38, ~30, ~27, ~27, ~26), started
# first: with `-n 2` the workers then finish together rather than one waiting out a long test it picked up last. The
# other tests keep their order.
LONGEST_FIRST = (
    "test_kernels.py::test_kernels_in_triton_interpreter",
    "test_kernels.py::test_decode_pipeline_with_kernels_in_triton_interpreter[dense]",
    "test_lm_eval.py::test_lm_eval_oasis_model_offline",
    "test_examples.py::test_notebook_runs_every_cell",
    "test_examples.py::test_batch_and_pipeline_examples_run",
    "test_warm.py::test_the_command_reads_a_config_folder_and_names_what_is_wrong",
    "test_smollm2.py::test_left_padded_batch_and_chunked_prefill_match_dense",
    "test_bench.py::test_first_call_bench_times_each_call_with_oasis_and_dense",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.rsplit("/", 1)[-1], len(rank)))  # stable sort
