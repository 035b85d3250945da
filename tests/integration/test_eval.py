"""The offline evaluation suite: seeded task generators, decode-mode NLL (exact with a full budget), and the report
at CI size (`eval/report.py --tiny`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from eval.nll import decode_nll
from eval.tasks import TASKS, generate_samples, score
from oasis_cache import OasisCache
from oasis_cache.loaders import load_smollm2
from oasis_cache.runtime.build import cache_kwargs

from conftest import dense_cache, prompt_ids, random_head, tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2()[1]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generators_are_seeded_and_plant_the_answers(tokenizer, task):
    first = generate_samples(tokenizer, task, 1024, 3, seed=1)
    again = generate_samples(tokenizer, task, 1024, 3, seed=1)
    other = generate_samples(tokenizer, task, 1024, 3, seed=2)
    assert first == again and first != other
    for sample in first:
        assert all(answer in sample["context"] for answer in sample["answers"])
        n = len(tokenizer(sample["context"])["input_ids"])
        assert 0.9 * 1024 <= n <= 1.1 * 1024, n
    assert [s["depth"] for s in first] == pytest.approx([1 / 6, 1 / 2, 5 / 6])


def test_score_is_the_share_of_answers_found():
    assert score("the numbers are 12 and 34", ["12", "34", "56"]) == pytest.approx(2 / 3)
    assert score("Dolores PARK", ["dolores park"]) == 1.0


def test_decode_mode_nll_with_full_budget_equals_dense():
    model = tiny_model("llama")
    ids = prompt_ids(260)
    dense = decode_nll(model, ids, 200, dense_cache(model))
    oasis = decode_nll(model, ids, 200, OasisCache(model, token_budget=1024))
    assert dense.shape == (60,)
    torch.testing.assert_close(oasis, dense, atol=1e-4, rtol=1e-4)
    sparse = decode_nll(model, ids, 200, OasisCache(model, token_budget=64, advanced=dict(sink_tokens=16,
                                                                                          recent_tokens=16)))
    assert not torch.allclose(sparse, dense)  # a small budget is measured, not hidden by a dense forward


def test_dense_teacher_forcing_in_chunks_equals_one_token_per_forward():
    """`teacher_forced_nll(chunk=...)` (what `eval/in_decode.py` uses for dense's trajectory): a left-padded batch's
    NLL and argmax agreement as with one token per forward, chunks not dividing the length; refused for an
    OasisCache, whose decode path is what is measured."""
    from conftest import left_padded

    from eval.nll import teacher_forced_nll

    model = tiny_model("llama")
    prompt = left_padded([40, 25])
    trajectory = prompt_ids(37, batch=2, seed=5)
    one, agree_one = teacher_forced_nll(model, prompt, trajectory, dense_cache(model))
    for chunk in (8, 64):
        chunked, agree = teacher_forced_nll(model, prompt, trajectory, dense_cache(model), chunk=chunk)
        assert chunked.shape == one.shape == (2, 37)
        torch.testing.assert_close(chunked, one, atol=1e-4, rtol=1e-4)
        assert torch.equal(agree, agree_one)
    with pytest.raises(ValueError, match="one token per forward"):
        teacher_forced_nll(model, prompt, trajectory, OasisCache(model, token_budget=256), chunk=8)


def _run_eval_script(script: str, out, *args: str) -> dict:
    """Run `eval/<script>` at CI size, writing `out`; its JSON."""
    run = subprocess.run([sys.executable, str(ROOT / "eval" / script), "--tiny", *args, "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_report_runs_at_ci_size(tmp_path):
    """The report's plumbing on random weights (SmolLM2's own quality runs in tests/integration/test_smollm2.py)."""
    report = _run_eval_script("report.py", tmp_path / "report.json", "--model", "tiny", "--tasks", "single_needle",
                              "--modes", "none@full", "previous-exact")
    assert {"command", "date", "machine"} <= set(report["meta"]) and report["meta"]["model"] == "tiny"
    modes = {(r["mode"], r["budget"]) for r in report["tasks"]}
    assert modes == {("dense", None), ("none@full", 256), ("previous-exact", 256)}
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in report["tasks"])
    assert all(0.0 < r["prefill_seconds"] <= r["seconds"] for r in report["tasks"])  # where the suite's time goes
    assert [r["mode"] for r in report["nll"]] == ["dense", "none@full", "previous-exact"]


@pytest.mark.audit
def test_shared_prefill_generates_what_each_mode_and_budget_generates(tokenizer):
    """`report.py --shared-prefill`: a batch's prompts prefilled once (but their last tokens) by HF's model; dense
    continuing that cache and each (mode, budget) forked from an OasisCache made of it gives each the tokens of its own
    `generate` (random weights, a random head, every option variant sharing the one prefix; the draft head's window
    run by each fork itself; its past read from the prefix's own tensors, `past_on_device`), a left-padded batch too
    (its padding weighs in no summary: HF's padding keys and the prefix's zeros alike; the suite's batches of prompts
    of a task are padded: unshared, every 32K report took ~9 minutes on the H200, 2026-12-02)."""
    import eval.report as report
    from eval.report import encoded_batches, run_generation, run_shared

    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=4096, num_hidden_layers=4)
    options = dict(prefill_chunk_tokens=512, host_chunk_blocks=4)
    modes = ["none", "previous-exact", "eagle3", "none@full"]
    same = [generate_samples(tokenizer, "multikey", 1024, 1, seed=n, filler="noise")[0] for n in (1024, 900, 960)]
    padded = [generate_samples(tokenizer, "multikey", n, 1, seed=n, filler="noise")[0] for n in (1024, 900)]
    report.HEAD = random_head(model)
    try:
        for samples, sharing in ((same, 1), (padded, 1)):
            (enc,) = encoded_batches(model, tokenizer, samples, 3)
            assert bool((enc["attention_mask"] == 0).any()) == (samples is padded)
            assert report.HEAD.config.attention_window < enc["input_ids"].shape[1] - 512  # a prefix to share
            report.past_on_device.reads = 0
            shared = run_shared(model, tokenizer, samples, modes, [256, 128, 256], 6, 3, dense=True, **options)
            assert report.past_on_device.reads >= 8 * 4  # (the forks' past read from the prefix on the device)
            assert sorted(shared, key=str) == sorted([("dense", None)] + [(m, b) for m in modes for b in (128, 256)],
                                                     key=str)
            for (mode, budget), (outputs, timing) in shared.items():
                own = run_generation(model, tokenizer, samples, mode, budget, 6, 3, **options)
                assert outputs == own, (mode, budget, sharing)
                assert timing["shared_prefill_batches"] == sharing
                assert 0 <= timing["prefill_seconds"] <= timing["seconds"]  # (rounded to 10 ms: 0 here)
                assert (timing["shared_prefill_seconds"] > 0) == bool(sharing)
                assert 0 <= timing["shared_prefill_base_seconds"] <= timing["shared_prefill_seconds"]
    finally:
        report.HEAD = None


def test_a_cache_rebuilt_from_its_dynamic_copy_decodes_as_the_one_that_prefilled(tokenizer):
    """`OasisCache.from_dynamic_cache` lays the tokens out as a prefill of them does, in its chunks (the summaries'
    key channels come from the first chunk's blocks): at a small budget, every pool and summary equal and the same
    tokens decoded, whatever the chunk size.
    (A lookahead's first prediction, made by the prefill's last query, comes with the next forward instead.)"""
    from eval.report import encoded_batches

    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=4096, num_hidden_layers=2)
    samples = [generate_samples(tokenizer, "multikey", 1024, 1, seed=n, filler="noise")[0] for n in (1024, 900, 960)]
    (enc,) = encoded_batches(model, tokenizer, samples, 3)
    kw = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for chunk in (512, 0):
        options = dict(token_budget=128, lookahead="none", prefill_chunk_tokens=chunk, host_chunk_blocks=4)
        cache = OasisCache(model, **cache_kwargs(options))
        model.generate(**enc, max_new_tokens=1, **kw, **cache.generate_kwargs())
        rebuilt = OasisCache.from_dynamic_cache(model, cache.to_dynamic_cache(), **cache_kwargs(options))
        for a, b in zip(cache.layers, rebuilt.layers):
            assert all(torch.equal(x, y) for x, y in zip(a.state_tensors(), b.state_tensors())), chunk
        decoded = [model.generate(**enc, max_new_tokens=8, **kw, **c.generate_kwargs()).tolist()
                   for c in (cache, rebuilt)]
        assert decoded[0] == decoded[1], chunk


def test_the_padding_of_a_batch_weighs_in_no_summary(tokenizer):
    """A left-padded batch's padding keys (what the cache's prefill made of them, or zeros: `report.dense_prefilled`
    pads with zeros) change no block summary: `from_dynamic_cache(attention_mask=...)` of the prefilled cache with
    its padding keys zeroed summarizes every block as the prefill did (bits and bound scorers, half and all
    channels), and decodes the same tokens at a small budget. Old code: the mixed blocks' levels held the padding."""
    from eval.report import encoded_batches

    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=4096, num_hidden_layers=2)
    samples = [generate_samples(tokenizer, "multikey", n, 1, seed=n, filler="noise")[0] for n in (1024, 700, 850)]
    (enc,) = encoded_batches(model, tokenizer, samples, 3)
    mask = enc["attention_mask"]
    assert (mask[:, :16] == 0).any() and (mask[:, 16:] == 0).any()  # padding within blocks, not only whole blocks
    kw = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for scorer, channels in (("bits", 0.5), ("bound", 1.0)):
        options = dict(token_budget=128, lookahead="none", prefill_chunk_tokens=512, host_chunk_blocks=4,
                       scorer=scorer, summary_channels=channels)
        cache = OasisCache(model, **cache_kwargs(options))
        model.generate(**enc, max_new_tokens=1, **kw, **cache.generate_kwargs())
        dynamic = cache.to_dynamic_cache()
        N = dynamic.get_seq_length()
        for layer in dynamic.layers:
            layer.keys.mul_(mask[:, None, :N, None].to(layer.keys.dtype))  # the padding's keys: zeros
            layer.values.mul_(mask[:, None, :N, None].to(layer.values.dtype))
        rebuilt = OasisCache.from_dynamic_cache(model, dynamic, attention_mask=mask[:, :N], **cache_kwargs(options))
        for a, b in zip(cache.layers, rebuilt.layers):
            a.summaries.fix_channels()
            b.summaries.fix_channels()
            assert all(torch.equal(x, y) for x, y in zip(a.summaries.view(), b.summaries.view())), scorer
            if a.summaries.codes is not None:
                assert torch.equal(a.summaries.codes[:, :, : a.summaries.num_blocks],
                                   b.summaries.codes[:, :, : b.summaries.num_blocks])
        decoded = [model.generate(**enc, max_new_tokens=8, **kw, **c.generate_kwargs()).tolist()
                   for c in (cache, rebuilt)]
        assert decoded[0] == decoded[1], scorer
    with pytest.raises(ValueError, match="attention_mask"):
        OasisCache.from_dynamic_cache(model, dynamic, attention_mask=mask[:, 1:], token_budget=128)


def test_dense_reference_prefilled_alone_generates_what_the_padded_batch_generates(tokenizer):
    """The report's dense rows prefill each prompt alone (no padding mask) and decode the batch: the tokens of HF's
    own `generate` on the left-padded batch (random weights, prompts of different lengths, real and tiny models'
    layouts); a batch it cannot take (one-token prompts) falls back to HF's own prefill."""
    from eval.report import dense_prefilled, encoded_batches, run_generation

    samples = [generate_samples(tokenizer, "multikey", n, 1, seed=n)[0] for n in (512, 384, 448)]
    for model in (tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048),
                  tiny_model("qwen2", vocab_size=len(tokenizer), max_position_embeddings=2048)):
        (enc,) = encoded_batches(model, tokenizer, samples, 3)
        assert len(set(enc["attention_mask"].sum(1).tolist())) == 3  # three lengths: real padding
        cache = dense_prefilled(model, enc)
        assert cache.get_seq_length() == enc["input_ids"].shape[1] - 1
        alone = run_generation(model, tokenizer, samples, "dense", None, 8, 3)
        padded = run_generation(model, tokenizer, samples, "dense", None, 8, 3, dense_prefill_alone=False)
        assert alone == padded
        one = dict(input_ids=enc["input_ids"][:, -1:], attention_mask=enc["attention_mask"][:, -1:])
        assert dense_prefilled(model, one) is None


def test_fp32_fast_path_repeats_the_kv_heads_and_gives_the_same_logits(monkeypatch):
    """`sdpa_fp32_fast_path`: inside it HF's SDPA repeats the key / value heads instead of asking torch for GQA (the
    switch the report's dense prefill uses in fp32 on CUDA), outside nothing changed; the logits are the same within
    fp tolerance (GQA model: 4 query heads on 2 KV heads). A bf16 model, or fp32 on the CPU, keeps HF's own path."""
    from transformers.integrations import sdpa_attention

    from eval.report import sdpa_fp32_fast_path

    model, ids = tiny_model("qwen2"), prompt_ids(96)
    choose = sdpa_attention.use_gqa_in_sdpa
    sdpa, key_heads = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(query, key, value, *args, **kwargs):
        key_heads.append((key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        assert set(key_heads) == {(2, True)}  # HF's own path here: torch's GQA over the 2 KV heads
        key_heads.clear()
        with sdpa_fp32_fast_path(model, on_cpu=True):
            fast = model(input_ids=ids).logits
        assert set(key_heads) == {(4, False)}  # the heads repeated, one per query head
        assert sdpa_attention.use_gqa_in_sdpa is choose  # restored
        with sdpa_fp32_fast_path(model):  # fp32 on the CPU: HF's own path
            assert sdpa_attention.use_gqa_in_sdpa is choose
        with sdpa_fp32_fast_path(tiny_model("qwen2").to(torch.bfloat16), on_cpu=True):
            assert sdpa_attention.use_gqa_in_sdpa is choose
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.audit
def test_suite_runs_its_processes_and_tables_them(tmp_path):
    """eval/suite.py at CI size: the NLL rows in a process of their own, the report processes by (model, length)
    and tasks per process, two at once, suite.json with each process's time and exit status, the reports beside
    it, one table per model."""
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "suite.py"), "--tiny", "--parallel", "2",
                          "--tasks-per-process", "1", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["meta"]["processes"] == 3 and suite["meta"]["failed"] == [] and suite["meta"]["seconds"] > 0
    assert [p["task"] for p in suite["processes"]] == ["nll", "single_needle", "multikey"]
    assert all(p["returncode"] == 0 and p["seconds"] > 0 for p in suite["processes"])
    for process in suite["processes"]:
        report = json.loads((tmp_path / f"{process['name']}.json").read_text())
        if process["task"] == "nll":
            assert report["tasks"] == [] and [r["mode"] for r in report["nll"]] == ["dense", "none", "previous"]
        else:
            assert {r["mode"] for r in report["tasks"]} == {"dense", "none", "previous"} and report["nll"] == []
            phases = report["meta"]["phases"]  # where the process's time went (the rows' generate calls and the rest)
            assert phases["generate"] > 0 and phases["load"] > 0 and phases["samples"] >= 0
            assert phases["imports"] > 0 and phases["plot"] >= 0  # (outside the report's own seconds)
            # disjoint phases: together never more than the process's time (what they leave is "unaccounted")
            assert -0.1 * len(phases) <= phases["unaccounted"] <= report["meta"]["seconds"]
    assert "| multikey | 512 |" in run.stdout and "| single_needle | 512 |" in run.stdout


def test_suite_makes_the_plain_checkpoints_first(tmp_path, monkeypatch):
    """Before its report processes, the suite loads each real model that has no plain checkpoint yet (a process
    each, at once): their first loads then take seconds instead of waiting on one another's dequantization. A model
    that cannot load stops it there, named."""
    import eval.suite as suite

    assert suite.prepare(["tiny"]) == {}  # (random weights: nothing to make)
    monkeypatch.setattr("oasis_cache.loaders.has_plain_copy", lambda name: name == "qwen25-coder-0.5b")
    assert set(suite.prepare(["smollm2", "qwen25-coder-0.5b"])) == {"smollm2"}  # (its copy exists: loaded only)
    monkeypatch.setattr("oasis_cache.loaders.has_plain_copy", lambda name: False)
    monkeypatch.setattr(suite, "ENV", dict(suite.ENV, OASIS_CACHE_HOME=str(tmp_path),
                                           OASIS_QWEN05_GGUF=str(tmp_path / "missing.gguf")))
    with pytest.raises(SystemExit, match="loading qwen25-coder-0.5b failed"):
        suite.prepare(["qwen25-coder-0.5b"])


def test_suite_plans_the_issue_matrix_and_names_a_failed_process(tmp_path):
    """The whole suite's plan: both models at their lengths, every task (held-out forms too), four modes at three
    budgets, the shipped heads, NLL rows once per model (their own process), the longest processes first. A process
    that fails is named, and the suite fails; one that ran out of GPU memory beside others runs again alone."""
    from eval.suite import LAST_RUN, MODELS, TASKS, main, plan

    args = SimpleNamespace(models=list(MODELS), lengths=None, tasks=TASKS, modes=["none", "previous", "eagle3",
                           "eagle3-exact"], fractions=[8, 16, 32], samples=24, nll=True, tiny=False, device=None,
                           out=str(tmp_path), shared_prefill=True, tasks_per_process=1, durations=LAST_RUN)
    assert len(plan(args)) == (2 + 3) * len(TASKS) + 2 and {"multikey_uuids", "frequent_words_close"} <= set(TASKS)
    args.tasks_per_process = 4  # the default: every task once, in 2 processes per (model, length)
    jobs = plan(args)
    assert len(jobs) == (2 + 3) * 2 + 2
    for model, spec in MODELS.items():
        for length in spec["lengths"]:
            mine = [j["command"] for j in jobs if (j["model"], j["length"]) == (model, length) and j["task"] != "nll"]
            tasks = [t for c in mine for t in c[c.index("--tasks") + 1 : c.index("--filler")]]
            assert sorted(tasks) == sorted(TASKS) and all(len(c[c.index("--tasks") + 1 : c.index("--filler")]) == 4
                                                          for c in mine)
    assert sum(j["task"] == "nll" for j in jobs) == 2
    expected = [j["expected_seconds"] for j in jobs]  # the last committed run's seconds order the processes
    assert expected == sorted(expected, reverse=True) and len(set(expected)) > 2
    (tmp_path / "last.json").write_text(json.dumps(dict(processes=[dict(name=jobs[-1]["name"], seconds=9999.0)])))
    args.durations = tmp_path / "last.json"
    again = plan(args)
    assert again[0]["name"] == jobs[-1]["name"]  # what took longest last time starts first
    lengths = [j["length"] for j in again[1:]]
    assert lengths == sorted(lengths, reverse=True)  # (unknown processes: by length)
    for model, spec in MODELS.items():
        mine = [j["command"] for j in jobs if j["model"] == model]
        assert sorted({int(c[c.index("--lengths") + 1]) for c in mine}) == spec["lengths"]
        assert sum(c[c.index("--nll-tokens") + 1] != "0" for c in mine) == 1
        assert all(c[c.index("--batch-size") + 1] == "24" for c in mine)  # a cell's samples in one batch
        assert all(Path(c[c.index("--head") + 1]).is_dir() for c in mine)
        assert all(c[c.index("--fractions") + 1 : c.index("--modes")] == ["8", "16", "32"] for c in mine)
        assert all("--shared-prefill" in c for c in mine)
    with pytest.raises(SystemExit, match="1 process.*failed: report-tiny-512-single_needle"):
        main(["--tiny", "--no-nll", "--tasks", "single_needle", "--modes", "sideways", "--out", str(tmp_path / "bad")])
    assert "unknown mode 'sideways'" in (tmp_path / "bad" / "report-tiny-512-single_needle.log").read_text()
    with pytest.raises(SystemExit, match="not a suite length"):
        main(["--plan", "--models", "smollm2", "--lengths", "32768"])


def test_suite_runs_a_process_out_of_memory_again_alone(tmp_path):
    """A report process that ran out of GPU memory, or of host memory (the cache's own MemoryError), beside others
    runs again alone at the end (its first log kept); one that failed otherwise is not run again."""
    from eval.suite import run

    errors = {"oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB",
              "host": "MemoryError: OasisCache: the host pool of 30 layers for 8192 tokens x 24 sequences needs "
                      "8.44 GiB of host memory, but 3.10 GiB are available"}
    script = ("import pathlib, sys; m = pathlib.Path(sys.argv[1]); first = not m.exists(); m.touch(); "
              "print(sys.argv[2] if first else 'ok'); sys.exit(1 if first else 0)")
    jobs = [dict(name=name, command=[sys.executable, "-c", script, str(tmp_path / f"{name}.tried"), error])
            for name, error in errors.items()]
    jobs.append(dict(name="broken", command=[sys.executable, "-c", "raise SystemExit(3)"]))
    run(jobs, tmp_path, parallel=3)
    for job, name in zip(jobs, errors):
        assert job["returncode"] == 0 and job["retried"] == 1, name
        assert errors[name] in (tmp_path / f"{name}.first.log").read_text()
        assert "ok" in (tmp_path / f"{name}.log").read_text()
    assert jobs[2]["returncode"] == 3 and "retried" not in jobs[2]


def test_suite_interrupted_leaves_no_process_running(tmp_path, monkeypatch):
    """Ctrl-C in eval/suite.py: the report processes it started are stopped, not left holding the device."""
    import eval.suite as suite

    jobs = [dict(name=f"sleeper{i}", command=[sys.executable, "-c", "import time; time.sleep(120)"]) for i in range(2)]

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        suite.run(jobs, tmp_path, parallel=2)
    assert all(job["process"].poll() is not None for job in jobs)  # stopped (a sleeper alone runs 120 s)


def test_scorers_order_bound_half_bound_and_exact_max():
    """The shipped min/max bound and the half-block bound are upper bounds of the exact max q.k, the finer one
    tighter: exact max <= half_bound <= bound, block by block."""
    from eval.scoring import SCORERS, _quantized
    from oasis_cache.control.selection import score_blocks

    torch.manual_seed(0)
    q, keys = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 16, 8)  # [B, H, R, D], [B, H, NB, T, D]
    exact = SCORERS["max"](q, keys)
    brute = torch.stack([(q[:, :, :, None] * keys[:, :, n, None]).sum(-1).amax(-1).amax(-1) for n in range(5)], -1)
    torch.testing.assert_close(exact, brute)
    bound = score_blocks(q, keys.amin(-2), keys.amax(-2))
    half = SCORERS["half_bound"](q, keys)
    assert (exact <= half + 1e-5).all() and (half <= bound + 1e-5).all() and (half < bound - 1e-3).any()
    torch.testing.assert_close(_quantized(q, keys, bits=16), exact, atol=1e-3, rtol=0)  # fine codes: exact max
    mass = SCORERS["mass"](q, keys)
    torch.testing.assert_close(mass.sum(-1), torch.full((2, 3), 4.0))  # each row's softmax sums to 1
    # The simulated 1-bit code with least-squares levels is what the shipped bits scorer computes.
    from oasis_cache.control import rank_blocks
    from oasis_cache.pools import BlockSummaries

    summaries = BlockSummaries(2, 3, 8, torch.float32, "cpu", 16, key_bits=True)
    summaries.append(keys)
    shipped = rank_blocks(q, summaries, torch.zeros(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool), 16)
    torch.testing.assert_close(SCORERS["centroid1"](q, keys), shipped)
    # ... and on half the channels (summary_channels=0.5), what `centroid1_half` simulates.
    half = BlockSummaries(2, 3, 8, torch.float32, "cpu", 16, key_bits=True, kept_channels=4)
    half.append(keys)
    half.fix_channels()  # (what the first decode step does)
    shipped = rank_blocks(q, half, torch.zeros(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool), 16)
    torch.testing.assert_close(SCORERS["centroid1_half"](q, keys), shipped)


def test_scoring_comparison_runs_at_ci_size(tmp_path):
    rows = _run_eval_script("scoring.py", tmp_path / "scoring.json", "--model", "tiny",
                            "--scorers", "bits", "bound", "max")["rows"]
    assert [r["scorer"] for r in rows] == ["dense", "bits", "bound", "max"]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)




def test_in_decode_workload_at_ci_size(tmp_path):
    """eval/in_decode.py --tiny: dense's trajectory teacher-forced through each cache (the script checks that dense
    reproduces its own greedy tokens that way: positions of left-padded prompts as generate sets them); a budget at
    the final context equals dense (NLL delta 0, the whole trajectory matched), a smaller one runs. Two runs share
    dense's passes through `--dense` (the second reads them) and `--merge` joins their rows; one prompt as its own
    batch (`--per-prompt --only 1`) equals dense too. (In this process: the script's `main`, as its CLI calls it.)"""
    from eval.in_decode import main as in_decode

    def run(name, *args):
        in_decode(["--tiny", *args, "--out", str(tmp_path / name)])
        return json.loads((tmp_path / name).read_text())

    dense = tmp_path / "dense.pt"
    whole_run = run("whole.json", "--modes", "previous", "--fractions", "1", "--dense", str(dense))
    written = dense.stat().st_mtime_ns
    run("sparse.json", "--modes", "previous", "--fractions", "4", "--dense", str(dense))
    assert dense.stat().st_mtime_ns == written  # read, not made again
    in_decode(["--merge", str(tmp_path / "whole.json"), str(tmp_path / "sparse.json"), "--out",
               str(tmp_path / "in_decode.json")])
    report = json.loads((tmp_path / "in_decode.json").read_text())
    assert report["rows"][0] == whole_run["rows"][0] and report["meta"]["processes"] == 2
    rows = {(r["mode"], r.get("fraction")): r for r in report["rows"]}
    assert len(rows) == len(report["rows"]) == 3
    assert report["meta"]["new_tokens"] == 96 and report["meta"]["context"] > 96 + 20
    whole = rows[("previous", 1)]
    assert whole["budget"] >= report["meta"]["context"] and whole["prompt_indexes"] == [0, 1]
    assert abs(whole["nll_delta"]) < 1e-4 and whole["prefix"] == 96 and whole["full_match"] == 1.0
    assert whole["argmax_agreement"] == 1.0
    sparse = rows[("previous", 4)]
    assert sparse["budget"] < report["meta"]["context"] and 0 <= sparse["prefix"] <= 96
    assert all(0.0 <= r["compiles"] <= 1.0 for r in report["rows"])
    alone = run("alone.json", "--modes", "previous", "--fractions", "1", "--per-prompt", "--only", "1")
    (dense_row, row) = alone["rows"]
    assert alone["meta"]["per_prompt"] and row["prompt_indexes"] == dense_row["prompt_indexes"] == [1]
    assert abs(row["nll_delta"]) < 1e-4 and row["prefixes"] == [96] and row["argmax_agreement"] == 1.0


def test_in_decode_merge_joins_prompts_and_modes(tmp_path):
    """`--merge`: processes that ran other prompts of a mode and budget join that row (its figures recomputed over
    all prompts); other modes add rows; the same prompts again (dense's row in every file) are taken once; a row
    that shares some but not all of its prompts with another file's is refused."""
    from eval.in_decode import merge, summarize

    def run(name, indexes, rows):
        meta = dict(model="m", prompts=4, new_tokens=10, per_prompt=True, context=50, machine="x", command=name,
                    seconds=1.0)
        made = [summarize(dict(r, prompt_indexes=indexes, budgets=[r["budget"]] * len(indexes),
                               nll_per_prompt=[r["nll"]] * len(indexes), dense_nll_per_prompt=[1.0] * len(indexes),
                               agreement_per_prompt=[1.0] * len(indexes), prefixes=[r["prefix"]] * len(indexes),
                               compiled=[True] * len(indexes)), 10) for r in rows]
        (tmp_path / name).write_text(json.dumps(dict(meta=meta, rows=made)))
        return str(tmp_path / name)

    dense = dict(mode="dense", budget=None, nll=1.0, prefix=10)
    a = run("a.json", [0, 1], [dense, dict(mode="none", fraction=8, budget=16, nll=1.5, prefix=4)])
    b = run("b.json", [2], [dense, dict(mode="none", fraction=8, budget=32, nll=1.2, prefix=10)])
    c = run("c.json", [0, 1], [dense, dict(mode="previous", fraction=8, budget=16, nll=1.1, prefix=10)])
    merge([a, b, c], str(tmp_path / "all.json"))
    rows = {r["mode"]: r for r in json.loads((tmp_path / "all.json").read_text())["rows"]}
    assert rows["dense"]["prompt_indexes"] == [0, 1, 2] and rows["dense"]["nll_delta"] == 0.0
    assert rows["none"]["prompt_indexes"] == [0, 1, 2] and rows["none"]["budget"] == round((16 + 16 + 32) / 3)
    assert rows["none"]["nll_delta"] == pytest.approx((0.5 + 0.5 + 0.2) / 3)
    assert rows["none"]["prefix"] == pytest.approx(6.0) and rows["none"]["full_match"] == pytest.approx(1 / 3)
    assert rows["previous"]["prompt_indexes"] == [0, 1]
    with pytest.raises(SystemExit, match="some of them"):
        merge([a, run("d.json", [1, 3], [dense])], None)


def test_in_decode_helpers():
    from eval.in_decode import compiles, equal_prefix, first_python_block

    text = "Here it is:\n```python\ndef f(x):\n    return x + 1\n```\nDone."
    assert first_python_block(text) == "def f(x):\n    return x + 1\n" and compiles(text)
    assert not compiles("```python\ndef f(:\n```") and compiles("x = 1")
    a = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert equal_prefix(a, torch.tensor([[1, 2, 9, 4], [1, 2, 3, 4]])) == [2, 4]


def test_report_table_reads_json_and_log_lines(tmp_path, capsys):
    """eval/report_table.py: kept/dense-solved per mode and budget, a task dense never fully solves as accuracies;
    rows from a report's JSON and from the JSON lines of a run's log land in one table; `--tasks` keeps those rows."""
    from eval.report_table import read_rows, table

    full = [dict(task="multikey", length=8192, mode="dense", budget=None, accuracy=0.5),
            dict(task="multikey", length=8192, mode="none", budget=512, fraction=16, accuracy=0.5, kept=11,
                 dense_solved=12)]
    (tmp_path / "a.json").write_text(json.dumps(dict(tasks=full)))
    (tmp_path / "b.jsonl").write_text("noise\n" + json.dumps(dict(task="variable_tracking", length=16384, mode="none",
                                                                   budget=1024, fraction=16, accuracy=0.71,
                                                                   kept=0, dense_solved=0)) + "\n")
    rows = read_rows(tmp_path / "a.json") + read_rows(tmp_path / "b.jsonl")
    lines = table(rows).splitlines()
    assert lines[0] == "| task | length | dense accuracy | `none` 1/16 |"
    assert lines[2] == "| multikey | 8K | 0.50 | 11/12 |" and lines[3] == "| variable_tracking | 16K | – | 0.71 |"
    from eval.report_table import main

    main([str(tmp_path / "a.json"), str(tmp_path / "b.jsonl"), "--tasks", "variable_tracking"])
    assert capsys.readouterr().out.splitlines()[2:] == ["| variable_tracking | 16K | – | 0.71 |"]
    with pytest.raises(SystemExit, match="no rows of tasks"):
        main([str(tmp_path / "a.json"), "--tasks", "passkey"])


def test_held_out_code_is_long_and_has_no_docstrings():
    """`eval/recall.py --text code`: the standard library's code without docstrings (no shipped head trained on it:
    their documents are the documentation and the docstrings), as many tokens as asked (a 32K context and more),
    the same text each time; a known module docstring is gone, its code is there."""
    from eval.recall import held_out_code

    def characters(text):  # a tokenizer of one token per character
        return {"input_ids": [ord(c) for c in text]}

    ids = held_out_code(characters, 200_000)
    assert ids.shape == (200_000,) and torch.equal(ids, held_out_code(characters, 200_000))
    text = "".join(map(chr, ids.tolist()))
    assert "# __future__.py" in text and "class _Feature" in text
    assert "Record of phased-in incompatible language changes" not in text  # __future__'s docstring
    assert '"""' not in text


def test_recall_reads_another_pythons_documentation(tmp_path, monkeypatch):
    """`eval/recall.py --docs-from`: the held-out documentation is the running Python's `pydoc_data.topics`, and
    CPython 3.11 and 3.12 ship other text (the H200 runs 3.12; this CPU 3.11): the flag makes another Python's file the
    one every reader imports; a wrong path or file is refused by name."""
    import pydoc_data
    import pydoc_data.topics

    from eval.recall import use_documentation_from
    from oasis_cache.draft.training_data import _documentation_ids

    monkeypatch.setitem(sys.modules, "pydoc_data.topics", pydoc_data.topics)
    monkeypatch.setattr(pydoc_data, "topics", pydoc_data.topics)
    other = tmp_path / "topics.py"
    other.write_text("topics = {'a': 'first topic', 'b': 'second topic'}\n")
    use_documentation_from(str(other))
    import pydoc_data.topics as topics

    assert topics.topics == {"a": "first topic", "b": "second topic"}
    assert _documentation_ids(lambda text: {"input_ids": list(text)}) == list("first topic\n\nsecond topic")
    with pytest.raises(SystemExit, match="no such file"):
        use_documentation_from(str(tmp_path / "missing.py"))
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="no `topics` dict"):
        use_documentation_from(str(tmp_path / "empty.py"))
