"""The quality suite in one command: `eval/report.py` over both real models, every task (the held-out forms too), the
lengths each model reaches, modes `none` / `previous` / `eagle3` / the default (`eagle3-exact`), budgets 1/8, 1/16
and 1/32 of the context, with the shipped heads. One process per (model, length) and `--tasks-per-process` tasks
(4: a process takes ~11 s to start on the H200, so 42 of them, one per task, cost ~2.5 min of a three-wide run's
wall time; 4 tasks keep a 32K process under a third of the whole), at most `--parallel` at once, decode-mode NLL in
one process per model; the processes that took longest in the last run (`--durations`) start first, so that the
run ends soon after its longest process; a process that ran out of GPU or host memory beside others runs again
alone at the end. Prints each process's time, the whole run's wall time and the tables (`eval/report_table.py`);
writes `suite.json` beside the reports in `--out`.

    python eval/suite.py --out eval/results/suite          # the whole suite (an H200: `bash bench/gpu_run.sh suite`)
    python eval/suite.py --plan                            # the processes it would run, nothing run
    python eval/suite.py --models qwen25-coder-0.5b --lengths 32768 --tasks multikey --out /tmp/s
    python eval/suite.py --tiny --out /tmp/suite           # CI size: random weights, the plumbing only

Where the time goes: the prefill (the reports' rows carry `seconds`, `prefill_seconds` and the shared prefill's
`shared_prefill_seconds`). Each report process prefills its samples once, but their last tokens, with HF's model:
dense continues that cache, and every (mode, budget) runs the last tokens and its decode from a fork of an
OasisCache made of it (`report.py --shared-prefill`, `run_shared`: the tokens of its own `generate`); all samples of
a cell in one batch (one fork, one captured decode per row; a left-padded batch shares too). Measured on the H200
(2026-12-02): batches of 8, nothing shared, two processes at once: 69-137 s per 32K report, of which dense 29 s;
batches of 24 whose padding then kept every row on its own prefill (~40 s a row), three at once: 520-590 s;
padded batches shared, 4 tasks per process, three at once: the whole suite in 837 s (32K processes 210-277 s,
SmolLM2's 8K ones 357-370 s, of which ~150 s outside any row: its forks copied a whole host chunk each, 4.2 GiB,
until `HostKVPool._own_copy`; `fork_seconds` in the rows since); with it, three at once: 626 s (SmolLM2's 8K
processes 308-328 s, of which ~115 s their shared prefills: `shared_prefill_base_seconds` splits those since). The
processes then summed 1870 s and the run had no idle slot, so four at once (the default since; pinned memory per
process <= 22.5 GiB, four fit the 125 GiB host) predicted ~485 s if they did not slow each other; measured 542 s
(2026-12-03: they did, summing 2149 s — the GPU and its PCIe link are shared, so more at once would not help).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.report_table import table  # noqa: E402
from eval.tasks import HELD_OUT_TASKS  # noqa: E402

HEADS = ROOT / "oasis_cache" / "draft" / "heads"
# Per model: the lengths it reaches, its shipped head, dtype and batch (a cell's 24 samples in one batch: dense
# prefills each prompt alone, the oasis caches in chunks, so a 32K batch of 24 holds ~10 GB of KV on the device).
MODELS = {
    "smollm2": dict(lengths=[4096, 8192], head="smollm2-135m-instruct", dtype="float32", batch=24),
    "qwen25-coder-0.5b": dict(lengths=[8192, 16384, 32768], head="qwen2.5-coder-0.5b-instruct", dtype="bfloat16",
                              batch=24),
}
TINY = dict(lengths=[512], head=None, dtype="float32", batch=2)  # `--tiny`: report.py's random-weight model
TASKS = ["single_needle", "multikey", "multivalue", "variable_tracking", "frequent_words", *HELD_OUT_TASKS]
MODES = ["none", "previous", "eagle3", "eagle3-exact"]
FRACTIONS = [8, 16, 32]
NLL_PREFILL, NLL_TOKENS = 7936, 256
LAST_RUN = ROOT / "eval" / "results" / "suite-h200-2026-12-03" / "suite.json"
# The report processes' environment: several share one GPU, so their allocators keep few reserved-but-unused bytes
# (three 32K processes of earlier ran out of memory with 40 GiB of each reserved, not allocated).
ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ, "PYTHONUNBUFFERED": "1"}


def plan(args) -> list[dict]:
    """The processes: each model's decode-mode NLL rows (a process of their own) and one per (model, length) and
    `args.tasks_per_process` tasks, those expected to take longest first (`expected_seconds`: the last run's)."""
    jobs = []
    for model in args.models:
        spec = MODELS.get(model, TINY)
        lengths = [n for n in spec["lengths"] if args.lengths is None or n in args.lengths]
        modes = [m for m in args.modes if spec["head"] or not m.startswith("eagle3")]

        def job(name, length, task, nll_tokens):
            command = [sys.executable, str(ROOT / "eval" / "report.py"), "--model", model, "--tasks", *task,
                       "--filler", "noise", "--lengths", str(length), "--samples", str(args.samples),
                       "--batch-size", str(min(spec["batch"], args.samples)), "--fractions", *map(str, args.fractions),
                       "--modes", *modes, "--dtype", spec["dtype"], "--nll-prefill", str(NLL_PREFILL),
                       "--nll-tokens", str(nll_tokens), "--out", str(Path(args.out or "OUT") / f"{name}.json")]
            if spec["head"] and any(m.startswith("eagle3") for m in modes):
                command += ["--head", str(HEADS / spec["head"])]
            if args.shared_prefill:
                command.append("--shared-prefill")  # (report.py: one prefill per batch, forked per mode and budget)
            if args.tiny:
                command.append("--tiny")  # (report.py's CI size: 2 samples at 512 tokens, budget 1/4)
            if args.device:
                command += ["--device", args.device]
            return dict(model=model, length=length, task=" ".join(task) or "nll", name=name, command=command)

        if args.nll and lengths:
            jobs.append(job(f"nll-{model}", NLL_PREFILL + NLL_TOKENS, [], NLL_TOKENS))
        per = max(1, args.tasks_per_process)
        for length in sorted(lengths, reverse=True):
            for i in range(0, len(args.tasks), per):
                tasks = args.tasks[i : i + per]
                jobs.append(job(f"report-{model}-{length}-{'+'.join(tasks)}", length, tasks, 0))
    seconds = last_seconds(args.durations)
    for job in jobs:  # (a process not in the last run: ~1 s per 100 tokens of its length, as the H200 ran them)
        job["expected_seconds"] = seconds.get(job["name"], job["length"] / 100)
    return sorted(jobs, key=lambda j: -j["expected_seconds"])  # (the longest first: no long one starts last)


def last_seconds(path: Path | None) -> dict[str, float]:
    """Each process's seconds in an earlier run (its `suite.json`), by name; {} without one."""
    if path is None or not Path(path).exists():
        return {}
    return {j["name"]: j["seconds"] for j in json.loads(Path(path).read_text())["processes"] if "seconds" in j}


def prepare(models: list[str]) -> dict[str, float]:
    """Seconds each real model took to leave its plain checkpoint, for those without one (at once, a process each):
    the first load of a machine dequantizes the GGUF (~40 s for Qwen2.5-Coder-0.5B alone on a CPU core). Done inside
    the report processes, the first ones of a model start together, one dequantizes and the others wait on its lock
    (the H200, 2026-12-03: 70 s "load" in each 32K process, 25 s in SmolLM2's 8K ones, the four longest). A missing
    model's error (its install command) stops the suite here, before any report runs."""
    from oasis_cache.loaders import has_plain_copy

    todo = [m for m in models if m in MODELS and not has_plain_copy(m)]
    started = time.perf_counter()
    procs = {m: subprocess.Popen([sys.executable, "-c", "import sys; from oasis_cache.loaders import load_offline; "
                                  "load_offline(sys.argv[1])", m], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for m in todo}
    seconds = {}
    for model, proc in procs.items():
        output, _ = proc.communicate()
        seconds[model] = round(time.perf_counter() - started, 1)
        if proc.returncode != 0:
            raise SystemExit(f"loading {model} failed:\n{output[-3000:]}")
    return seconds


def run(jobs: list[dict], out: Path, parallel: int) -> None:
    """Run `jobs` at most `parallel` at once; each gets `seconds`, `returncode` and its log in `out`. A job that ran
    out of GPU or host memory beside others runs again alone once the rest have ended (`retried`: its first exit
    status)."""
    _run(jobs, out, parallel)
    again = [j for j in jobs if j["returncode"] != 0 and parallel > 1 and _out_of_memory(out / f"{j['name']}.log")]
    for job in again:
        print(f"{job['name']:60} ran out of memory beside others: again, alone", flush=True)
        job["retried"] = job["returncode"]
        (out / f"{job['name']}.log").rename(out / f"{job['name']}.first.log")
    _run(again, out, 1)


def _out_of_memory(log: Path) -> bool:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "CUDA out of memory" in text or "OutOfMemoryError" in text or "of host memory" in text  # (host: the
    # cache's own MemoryError, raised before anything is written)


def _run(jobs: list[dict], out: Path, parallel: int) -> None:
    waiting, running = list(jobs), []
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                job = waiting.pop(0)
                log = open(out / f"{job['name']}.log", "w")
                job["started"] = time.perf_counter()
                job["process"] = subprocess.Popen(job["command"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                  env=ENV)
                job["log"] = log
                running.append(job)
            time.sleep(0.5)
            for job in [j for j in running if j["process"].poll() is not None]:
                running.remove(job)
                job["log"].close()
                job["seconds"] = round(time.perf_counter() - job.pop("started"), 1)
                job["returncode"] = job.pop("process").returncode
                del job["log"]
                state = "ok" if job["returncode"] == 0 else f"FAILED (exit {job['returncode']}; {job['name']}.log)"
                print(f"{job['name']:60} {job['seconds']:8.1f} s  {state}", flush=True)
    finally:  # (interrupted: no report process goes on holding the GPU)
        for job in running:
            job["process"].terminate()
        for job in running:
            job["process"].wait()
            job["log"].close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for the reports, their logs and suite.json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, "tiny"])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="only these of each model's lengths")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--fractions", type=int, nargs="+", default=FRACTIONS)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--no-nll", dest="nll", action="store_false", help="no decode-mode NLL rows")
    parser.add_argument("--no-shared-prefill", dest="shared_prefill", action="store_false",
                        help="every (mode, budget) row prefills its prompts itself (default: once, every mode and "
                        "budget forked from it; the same tokens)")
    parser.add_argument("--parallel", type=int, default=None, help="processes at once (default: 4 with CUDA, else 1)")
    parser.add_argument("--tasks-per-process", type=int, default=4,
                        help="tasks one report process runs one after the other (each process loads the model)")
    parser.add_argument("--durations", type=Path, default=LAST_RUN,
                        help="an earlier run's suite.json: its processes' seconds order this run's, the longest first "
                        "(default: the last committed run)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--plan", action="store_true", help="print the processes and stop")
    parser.add_argument("--tiny", action="store_true", help="CI size: the random-weight model, two tasks, two modes")
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.modes = ["tiny"], [m for m in args.modes if not m.startswith("eagle3")] or ["none"]
        args.tasks = args.tasks if args.tasks != TASKS else ["single_needle", "multikey"]
    unknown = [t for t in args.tasks if t not in TASKS and t not in ("multi_needle", "passkey")]
    if unknown:
        raise SystemExit(f"unknown task(s) {unknown}: one of {', '.join(TASKS)}, multi_needle, passkey")
    if not args.plan and not args.out:
        raise SystemExit("--out FOLDER is needed (the reports, their logs and suite.json go there); --plan runs nothing")
    reached = {n for model in args.models for n in MODELS.get(model, TINY)["lengths"]}
    if args.lengths and not set(args.lengths) <= reached:
        raise SystemExit(f"--lengths {sorted(set(args.lengths) - reached)}: not a suite length of "
                         f"{', '.join(args.models)} (theirs: {sorted(reached)})")
    jobs = plan(args)
    if args.plan:
        for job in jobs:
            print(f"# expected {job['expected_seconds']:.0f} s\n" + " ".join(job["command"]))
        print(f"{len(jobs)} processes")
        return
    import torch

    parallel = args.parallel or (4 if torch.cuda.is_available() else 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = prepare(args.models)
    prepare_seconds = max(prepared.values(), default=0.0)  # (at once: the longest)
    if prepared:
        print("plain checkpoints made (once per machine): " + ", ".join(f"{m} {s:.1f} s" for m, s in prepared.items()),
              flush=True)
    started = time.perf_counter()
    run(jobs, out, parallel)
    seconds = round(time.perf_counter() - started, 1)
    failed = [j["name"] for j in jobs if j["returncode"] != 0]
    meta = dict(command="python " + " ".join(sys.argv if argv is None else ["eval/suite.py", *argv]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.machine()} CPU",
                seconds=seconds, prepare_seconds=prepare_seconds, parallel=parallel,
                processes=len(jobs), failed=failed)
    for job in jobs:
        job["command"] = " ".join(job["command"][1:])
    (out / "suite.json").write_text(json.dumps(dict(meta=meta, processes=jobs), indent=1))
    for model in args.models:
        rows = [r for j in jobs if j["model"] == model and j["returncode"] == 0
                for r in json.loads((out / f"{j['name']}.json").read_text())["tasks"]]
        if rows:
            print(f"\n{model}\n{table(rows)}")
    print("\nwhere each process's time went (seconds; report.py's meta[\"phases\"]):")
    for job in jobs:
        if job["returncode"] == 0:
            meta = json.loads((out / f"{job['name']}.json").read_text())["meta"]
            phases = dict(meta.get("phases", {}))  # (imports and plot: outside the report's own seconds)
            phases["start_and_exit"] = (job["seconds"] - meta["seconds"] - phases.get("imports", 0.0)
                                        - phases.get("plot", 0.0))
            print(f"{job['name'][:60]:60} {job['seconds']:7.1f}  "
                  + " ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    made = f" (and {prepare_seconds:.1f} s before, making plain checkpoints)" if prepared else ""
    print(f"\nsuite: {len(jobs)} processes, {parallel} at once, {seconds:.1f} s wall{made}; wrote {out / 'suite.json'}")
    if failed:
        raise SystemExit(f"{len(failed)} process(es) failed: {', '.join(failed)} (their logs are in {out})")


if __name__ == "__main__":
    main()
