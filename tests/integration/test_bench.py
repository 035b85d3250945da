"""The decode benchmark keeps working (tiny random model, CPU): each method's row, and `--interleave` (methods take
turns step by step) computes what one-after-the-other computes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_decode_bench(tmp_path, *extra):
    out = tmp_path / f"decode{len(extra)}.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode.py"), "--model", "tiny", "--device", "cpu", "--contexts", "512",
         "--batches", "2", "--steps", "3", "--warmup", "1", "--measure-steps", "2", "--budget", "256",
         "--methods", "dense", "oasis-none", "oasis-previous", "oasis-eagle3", *extra, "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.audit  # (20-40 s on 2 cores: CI runs it after the README's test command)
def test_interleaved_decode_bench_measures_what_sequential_measures(tmp_path):
    alone = run_decode_bench(tmp_path)
    turns = run_decode_bench(tmp_path, "--interleave")
    assert turns["meta"]["interleave"] and not alone["meta"]["interleave"]
    assert [r["method"] for r in turns["rows"]] == ["dense", "oasis-none", "oasis-previous", "oasis-eagle3"]
    for a, b in zip(alone["rows"], turns["rows"]):
        assert a["method"] == b["method"] and b["tpot_ms"] > 0
        for key in ("bytes_fetched_per_step", "hit_rate", "prediction_recall", "tokens_attended_per_step",
                    "kv_device_gib"):
            assert a.get(key) == b.get(key), (a["method"], key, a.get(key), b.get(key))
    assert turns["rows"][2]["prediction_recall"] is not None  # previous was measured


@pytest.mark.audit  # (20-40 s on 2 cores: CI runs it after the README's test command)
def test_compiled_dense_decodes_what_dense_decodes():
    """`dense-compiled` (a static cache and the compiled step: CUDA graphs on CUDA) decodes the tokens and logits that
    dense `DynamicCache` decodes; it refuses to share a process with oasis methods."""
    import types

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import decode

    model, vocab = decode.load_model("tiny", "cpu", torch.float32)
    args = types.SimpleNamespace(device="cpu", warmup=0, steps=5, prefill_chunk=64, budget=256, gather_programs=0,
                                 head=None, exact_slots=0, measure_steps=0)
    runs = [decode.MethodRun(model, vocab, m, 150, 2, args, 0) for m in ("dense", "dense-compiled")]
    tokens = [[], []]
    for _ in range(args.steps):
        for run, seen in zip(runs, tokens):
            run.step()
            seen.append(run.token)
    assert torch.equal(torch.cat(tokens[0], 1), torch.cat(tokens[1], 1))
    assert runs[1].cache.get_seq_length() == runs[0].cache.get_seq_length() == 150 + args.steps
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--model", "tiny", "--device", "cpu",
                              "--methods", "dense-compiled", "oasis-none"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "another process" in refused.stderr


def test_plot_draws_the_chosen_statistic(tmp_path):
    """`bench/plot.py --statistic mean` plots each row's `tpot_ms_mean` (what captured methods are compared by); a row
    without the chosen statistic (an older file) is left out instead of stopping the plot. `--methods` picks and orders
    what is drawn (a name no file has stops it, saying so), `--labels` names them in the legend, one each."""
    import pytest

    pytest.importorskip("matplotlib", reason="matplotlib is a test extra: pip install -e '.[test]'")
    meta = dict(model="tiny", dtype="float32", machine="cpu", budget=256, date="2026-11-30")
    rows = [dict(method="dense", context=512, batch=1, tpot_ms=2.0, tpot_ms_mean=2.5),
            dict(method="oasis-previous", context=512, batch=1, tpot_ms=1.0)]  # (an older row: no mean)
    results = tmp_path / "r.json"
    results.write_text(json.dumps(dict(meta=meta, rows=rows)))
    for statistic in ("median", "mean"):
        out = tmp_path / f"{statistic}.png"
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(results), "--statistic", statistic,
                              "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert out.stat().st_size > 1000
    plot = [sys.executable, str(ROOT / "bench" / "plot.py"), str(results), "--out", str(tmp_path / "chosen.png")]
    for extra, expected in ((["--methods", "dense", "offload"], "'offload'"),
                            (["--methods", "dense", "oasis-previous", "--labels", "dense eager"], "names 1 methods")):
        run = subprocess.run(plot + extra, capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and expected in run.stderr, run.stderr[-2000:]
    run = subprocess.run(plot + ["--methods", "oasis-previous", "--labels", "oasis"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and (tmp_path / "chosen.png").stat().st_size > 1000, run.stderr[-2000:]


def test_capacity_bench_climbs_batches_until_one_fails(tmp_path, monkeypatch):
    """`bench/capacity.py`: each method's batches tried in increasing order in one process, the largest that ran
    reported with its tokens per second (the median step); the first failure (here an out-of-memory error, made to by
    the test) ends the climb and is named in the row."""
    import contextlib
    import io
    import types

    sys.path.insert(0, str(ROOT / "bench"))
    import capacity

    def tries_here(args, context, cap, method, batches):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            capacity.run_batches(types.SimpleNamespace(
                model="tiny", device="cpu", dtype="float32", cap=cap, context=context, new_tokens=4, method=method,
                budget=128, try_batches=[b for b in batches if method != "dense" or b <= 2], prompt="random"))
        tries = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]
        if method == "dense":
            tries.append({"batch": 3, "ok": False, "error": "OutOfMemoryError: CUDA out of memory"})
        return tries

    monkeypatch.setattr(capacity, "tries_in_child", tries_here)
    out = tmp_path / "capacity.json"
    capacity.main(["--model", "tiny", "--device", "cpu", "--contexts", "200", "--caps", "0", "--methods", "dense",
                   "oasis", "--batches", "1", "2", "3", "--out", str(out)])
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["dense"]["max_batch"] == 2 and "batch 3: OutOfMemoryError" in rows["dense"]["stopped_by"]
    assert rows["oasis"]["max_batch"] == 3 and rows["oasis"]["stopped_by"] == "the largest batch tried"
    assert all(row["tok_s"] > 0 and row["step_ms"] > 0 for row in rows.values())
    assert [t["batch"] for t in rows["dense"]["tries"]] == [1, 2, 3]
    assert all(t["mean_step_ms"] > 0 for t in rows["oasis"]["tries"])


def test_capacity_bench_on_a_real_model_and_real_text(tmp_path, monkeypatch):
    """`bench/capacity.py --prompt code`: a real model (SmolLM2) on the standard library's code; oasis rows carry the
    steps' hit rate and what they fetched on the critical path (`none` fetches there, `previous` only on the side);
    a code prompt for random weights is refused before anything runs."""
    import contextlib
    import io
    import types

    sys.path.insert(0, str(ROOT / "bench"))
    import capacity

    def tries_here(args, context, cap, method, batches):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            capacity.run_batches(types.SimpleNamespace(
                model=args.model, device="cpu", dtype="float32", cap=cap, context=context, new_tokens=6,
                method=method, budget=128, try_batches=batches, prompt=args.prompt))
        return [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]

    monkeypatch.setattr(capacity, "tries_in_child", tries_here)
    out = tmp_path / "capacity.json"
    capacity.main(["--model", "smollm2", "--device", "cpu", "--contexts", "400", "--caps", "0", "--methods",
                   "oasis-none", "oasis-previous", "--batches", "1", "--prompt", "code", "--out", str(out)])
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"oasis-none", "oasis-previous"} and all(r["max_batch"] == 1 for r in rows.values())
    assert all(0.0 <= r["hit_rate"] <= 1.0 for r in rows.values())
    assert rows["oasis-none"]["critical_path_mb_per_step"] > 0 == rows["oasis-previous"]["critical_path_mb_per_step"]
    with pytest.raises(SystemExit):
        capacity.main(["--model", "tiny", "--device", "cpu", "--contexts", "200", "--methods", "oasis", "--prompt",
                       "code"])


def test_disaggregation_bench_reports_admission_and_fetches(tmp_path):
    """`bench/disagg.py` (a store of its own, one process in both roles): the remote and local runs decode the same
    tokens; admission moves less than the full KV; the decode side fetched some of the published blocks; with store
    reads deferred to after each step, the time they take is reported; a smaller local cache (one working set)
    decodes the same tokens and reads more units."""
    sys.path.insert(0, str(ROOT / "bench"))
    import disagg

    out = tmp_path / "disagg.json"
    disagg.main(["--context", "600", "--budget", "128", "--steps", "4", "--dtype", "float32", "--segment", "256MB",
                 "--measure", "--deferred", "on", "--local-cache-sets", "1", "--out", str(out)])
    row = json.loads(out.read_text())["row"]
    # measurement mode: the exposed wait per step of both runs (0 on the CPU, where transfers run inline)
    assert row["exposed_wait_ms_per_step_remote"] == 0 and row["exposed_wait_ms_per_step_local"] == 0
    assert row["same_tokens"] and 0 < row["admission_bytes"] < row["full_kv_bytes"]
    assert 0 < row["remote_units_fetched"] < row["remote_units_published"] == 2 * (599 // 16) * 8  # 8 KV heads
    # (at 600 tokens the decode side's pool chunk for the blocks it completes outweighs the rest: 32K in the bench)
    assert 0 < row["local_cache_bytes"] < row["full_kv_bytes"] / 2.2
    assert row["tpot_remote_ms"] > 0 and row["tpot_local_ms"] > 0
    assert row["repair_ms_per_step"] > 0 and row["warm_tpot_remote_ms"] > 0 and row["warm_units_per_step"] >= 0
    assert set(row["repair_phases_ms"]) == {"copy_back", "plan", "store_reads", "maps_and_gathers"}
    # how the decode's reads would group: every unit read once, in runs of adjacent blocks or objects of a block
    shapes = row["read_shapes"]
    assert shapes["units"] == row["remote_units_fetched"] == sum(int(n) * c for n, c in shapes["run_lengths"].items())
    assert shapes["transfers_with_gaps"] <= shapes["transfers_adjacent"] <= shapes["units"]
    assert 0 < shapes["blocks"] <= shapes["units"] and shapes["calls"] >= 1
    (sized,) = row["local_cache_sweep"]
    assert sized["same_tokens"] and sized["working_sets"] == 1
    assert set(sized["repair_phases_ms"]) == set(row["repair_phases_ms"])  # each local cache size by phase too
    assert sized["units_fetched_per_step"] >= row["remote_units_fetched"] / 4  # (4 steps; no larger cache, no fewer)


@pytest.mark.audit  # (20-40 s on 2 cores: CI runs it after the README's test command)
def test_prefill_bench_times_every_method_on_the_same_prompt(tmp_path):
    """`bench/prefill.py`: dense (whole and in the cache's chunks) and the chunked oasis prefills (past resident on
    the device, past from the host pool, resident with the chunk's past by SDPA's mask) timed in turns on one prompt;
    their last logits agree; `--profile` writes each method's top ops beside the JSON."""
    sys.path.insert(0, str(ROOT / "bench"))
    import prefill

    from oasis_cache.compute import dense

    out = tmp_path / "prefill.json"
    prefill.main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "600", "--batch", "2",
                  "--chunk-tokens", "256", "--repeats", "1", "--profile", "5", "--out", str(out)])
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {"dense", "dense-chunked", "oasis-resident", "oasis-host", "oasis-masked"}
    assert record["machine"] and dense.SPLIT_PAST  # (`oasis-masked` turned it off for its calls only)
    for row in record["rows"].values():
        assert len(row["runs_s"]) == 1 and row["median_s"] > 0 and row["max_logit_diff_to_dense"] < 1e-4
    for method in record["rows"]:
        table = (tmp_path / f"prefill.{method}.profile.txt").read_text()
        assert "under the profiler" in table and "aten::" in table
    # through model.generate (its all-ones mask; no dense-chunked call): the same last logits
    prefill.main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "600", "--batch", "2",
                  "--chunk-tokens", "256", "--repeats", "1", "--generate", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"dense", "oasis-resident", "oasis-host", "oasis-masked"}
    assert all(row["max_logit_diff_to_dense"] < 1e-4 for row in rows.values())


def test_install_head_joins_the_parts_checks_them_and_replaces_only_then(tmp_path):
    """`bench/install_head.py`: a run's head/ folder (safetensors pieces, metrics) becomes a shipped head with its
    provenance; a head over the size limit, or pieces that do not make a head, leave the installed one untouched."""
    import pytest
    import torch

    from oasis_cache.draft import load_eagle3, save_eagle3

    from conftest import random_head, tiny_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from install_head import install

    head = random_head(tiny_model("qwen3", num_hidden_layers=4)).to(torch.bfloat16)
    trained, parts = save_eagle3(head, tmp_path / "trained"), tmp_path / "run" / "head"
    parts.mkdir(parents=True)
    blob = (trained / "model.safetensors").read_bytes()
    for i, start in enumerate(range(0, len(blob), len(blob) // 3 + 1)):  # cut as `split -b` does
        (parts / f"parta{chr(97 + i)}").write_bytes(blob[start : start + len(blob) // 3 + 1])
    (parts / "config.json").write_text((trained / "config.json").read_text())
    (parts / "metrics.json").write_text(json.dumps({"top1_agreement": 0.5, "steps": 10}))
    heads = tmp_path / "heads"
    with pytest.raises(SystemExit, match="target.json"):  # none in the run, no head to keep it from
        install(parts, "h", {"trained": "today"}, heads=heads)
    (parts / "target.json").write_text("{}")
    installed = install(parts, "h", {"trained": "today", "data": None}, heads=heads)
    loaded = load_eagle3(installed)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].to(value.dtype), value), name
    metrics = json.loads((installed / "metrics.json").read_text())
    assert metrics["trained"] == "today" and "data" not in metrics and metrics["steps"] == 10
    before = {p.name: p.read_bytes() for p in installed.iterdir()}
    with pytest.raises(SystemExit, match="over --max-mb"):
        install(parts, "h", {"trained": "later"}, max_mb=0.001, heads=heads)
    (parts / "partab").write_bytes(b"not a piece")
    with pytest.raises(Exception):
        install(parts, "h", {"trained": "later"}, heads=heads)
    assert {p.name: p.read_bytes() for p in installed.iterdir()} == before


def test_first_call_bench_gives_its_children_every_option_but_its_own():
    """`bench/first_call.py`'s children parse what the parent was given (a new option reaches them without being
    listed twice), the parent's own options left out and `--profile` a file per child."""
    sys.path.insert(0, str(ROOT / "bench"))
    import first_call

    parser = first_call.build_parser()
    given = ["--model", "tiny", "--context", "300", "--dense", "--warm-parts", "",
             "--compile-after-steps", "5", "--processes", "3", "--out", "x.json",
             "--fresh-kernel-cache", "--profile", "/tmp/p", "--profile-call", "2", "--warm-first"]
    args = parser.parse_args(given)
    command = first_call.child_command(parser, args, 1)
    assert command[:3] == [sys.executable, first_call.__file__, "--child"]
    child = parser.parse_args(command[2:])
    for name, value in vars(args).items():
        if name in ("processes", "out", "fresh_kernel_cache", "profile", "child", "warm_first"):
            continue
        assert getattr(child, name) == value, name
    assert child.child and child.profile == "/tmp/p.1" and child.out == "" and not child.fresh_kernel_cache
    assert args.warm_first and not child.warm_first  # (the parent warms the kernel cache before the first child)
    assert child.processes == parser.get_default("processes")


@pytest.mark.audit  # (20-40 s on 2 cores: CI runs it after the README's test command)
def test_first_call_bench_times_each_call_with_oasis_and_dense(tmp_path):
    """`bench/first_call.py` on a tiny model, CPU: a child's calls, their
    first tokens and decode steps, for oasis and for the dense baseline (`--dense`: no OasisCache, no dry step), and
    whether each call's cache outlived it."""
    rows = {}
    for mode in ("oasis", "dense"):
        out = tmp_path / f"{mode}.json"
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "first_call.py"), "--model", "tiny", "--device",
                              "cpu", "--context", "256", "--new-tokens", "6", "--calls", "2", "--processes", "1",
                              "--out", str(out)] + (["--dense"] if mode == "dense" else []),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(out.read_text())
        assert ("dense (no OasisCache)" in result["header"]) == (mode == "dense")
        rows[mode] = result["rows"][0]
    for row in rows.values():
        assert len(row["generate_s"]) == 2 and len(row["first_token_s"]) == 2 and min(row["generate_s"]) > 0, row
    assert rows["dense"]["dry_step"] is None
    # the previous call's cache is gone when the next call starts (a cycle would keep it, and its pools, alive)
    assert [seen["previous_alive"] for seen in rows["oasis"]["pinned"]] == [False, False]
    assert rows["oasis"]["routed"] == [[], []]  # (no captured steps on the CPU: the router is never asked)



@pytest.mark.audit  # (35 s on 2 cores: with the long checks CI runs after the README's test command)
def test_the_host_pools_representation_side_by_side_and_the_requests_a_host_holds(tmp_path):
    """`@fp8` / `@int4` rows of `bench/decode.py` run with that host pool and report its bytes; `bench/host_capacity.py`
    sizes the requests a host holds by the pools' own arithmetic (more of them the narrower the form)."""
    out = tmp_path / "decode.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode.py"), "--model", "tiny", "--device", "cpu", "--contexts", "512",
         "--batches", "1", "--steps", "2", "--warmup", "1", "--measure-steps", "0", "--budget", "256", "--methods",
         "oasis-none", "oasis-none@fp8", "oasis-none@int4", "--interleave", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    wide, fp8, int4 = (rows[f"oasis-none{v}"] for v in ("", "@fp8", "@int4"))
    assert (wide["host_dtype"], fp8["host_dtype"], int4["host_dtype"]) == (None, "fp8", "int4")
    per_token = wide["host_bytes_per_token"]  # (heads of 32 channels: the scales weigh more than at 128)
    assert fp8["host_bytes_per_token"] / per_token < 0.52 and int4["host_bytes_per_token"] / per_token < 0.32
    out = tmp_path / "capacity.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "host_capacity.py"), "--context", "131072",
                          "--host-gib", "120", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    sized = {r["host_dtype"]: r for r in json.loads(out.read_text())["rows"]}
    assert [sized[d]["sequences"] for d in ("bf16", "fp8", "int4")] == [6, 12, 24]  # (18.6 / 9.6 / 5.1 GiB each)
