"""The first `generate` of a process against a later one.

    python bench/first_call.py --model qwen3-8b --context 32768 --new-tokens 32
    python bench/first_call.py --model tiny --device cpu --context 256 --new-tokens 8   # smoke
    python bench/first_call.py --model qwen3-8b --context 32768 --compile-decode   # with OasisConfig.compile_decode

Runs `--processes` fresh child processes one after another (the first one starts with empty Triton and inductor
kernel caches and an empty driver JIT cache, where cuDNN's runtime-compiled attention kernels land, when
`--fresh-kernel-cache` is given: what a new machine pays, but for its cold disk; the later ones find the kernels on
disk, as every later process on that machine does; the JIT cache). Each child loads the
model, then calls `model.generate` `--calls` times, each with a fresh `OasisCache(model, token_budget=--budget)` on
the same random prompt, and reports each call's wall time. Prints a table (ratio = a call's time / the child's last
call) and writes JSON (`--out`).

Where a first call's extra time goes: each call's time to its first new token (the prefill) and the decode after it;
with `--compile-decode`, dynamo's and inductor's own phases of the child's first call (`torch._dynamo.utils.
compile_times`, the largest); with `--fresh-kernel-cache`, the Triton kernels the first child compiled, by name and
count of specializations (from the cache's metadata), and the span of their files' times. With `--stall-monitor`,
where the process's threads stood when a watcher thread (waking every 2 ms) woke late by 20 ms or more: the GIL was
held that long by one thread (a long call into C that does not let it go) — the frames of each thread at that moment,
the longest stalls and the sum by the main thread's innermost frame.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

HERE = Path(__file__).resolve().parent


class StallMonitor:
    """A daemon thread that sleeps 2 ms at a time; when it wakes `threshold_s` late, the GIL was held that long by
    another thread: records the delay and every other thread's innermost frames (a thread's name, then `file:line
    function` from the outermost shown to the innermost)."""

    def __init__(self, threshold_s: float = 0.02, frames: int = 5):
        self.threshold_s, self.frames, self.events, self.t0 = threshold_s, frames, [], time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-monitor", daemon=True)
        self._thread.start()

    def _run(self):
        me = threading.get_ident()
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(0.002)
            late = time.perf_counter() - start - 0.002
            if late < self.threshold_s:
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    stack = traceback.extract_stack(frame)[-self.frames:]
                    where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack]
                    stacks[names.get(ident, str(ident))] = where
            self.events.append({"at_s": round(start - self.t0, 3), "late_ms": round(late * 1e3, 1), "stacks": stacks})

    def summary(self, top: int = 12) -> dict:
        self._stop.set()
        self._thread.join()
        by_frame: dict = {}
        for event in self.events:
            stack = event["stacks"].get("MainThread")
            if stack:
                by_frame[stack[-1]] = by_frame.get(stack[-1], 0.0) + event["late_ms"]
        longest = sorted(self.events, key=lambda e: -e["late_ms"])[:top]
        return {"stalls": len(self.events), "stalled_s": round(sum(e["late_ms"] for e in self.events) / 1e3, 3),
                "main_frames_ms": dict(sorted(by_frame.items(), key=lambda kv: -kv[1])[:top]),
                "longest": longest}


def child(args) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from models import load_model

    from oasis_cache import OasisCache
    from oasis_cache.runtime.build import cache_kwargs

    cuda = torch.device(args.device).type == "cuda"
    t0 = time.perf_counter()
    model, vocab = load_model(args.model, args.device, getattr(torch, args.dtype))
    load_s = time.perf_counter() - t0
    from transformers import StoppingCriteria

    class Stamps(StoppingCriteria):  # the host clock at each new token (`generate` syncs at each one anyway)
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores, **kwargs):
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (1, args.context), device=args.device)
    options = dict(compile_decode=True, fuse_projections=args.fuse_projections) if args.compile_decode else {}
    if args.compile_after_steps:  # (the default compile_decode=None, switching sooner)
        options["compile_after_steps"] = args.compile_after_steps
    if args.compile_ahead or args.no_compile_ahead:  # (default: a dry first decode step on CUDA, runtime/ahead.py)
        options["compile_ahead"] = bool(args.compile_ahead)
    if args.ahead_at_prefill or args.no_ahead_at_prefill:  # (the dry step's compilations during the prefill: default)
        options["ahead_at_prefill"] = bool(args.ahead_at_prefill)
    if args.warm_parts is not None:  # (research: which parts of Triton's start-up the prefill's thread pays)
        from oasis_cache.runtime import ahead

        ahead.WARM_PARTS = tuple(part for part in args.warm_parts.split(",") if part)
    if args.split_warm_queries is not None:  # (the first chunk's warm-up of the later chunks' attention kernels)
        from oasis_cache.compute import dense

        dense.SPLIT_WARM_QUERIES = args.split_warm_queries
    times, first_token, steps, starts = [], [], [], []
    compile_phases = {}
    monitor = StallMonitor() if args.stall_monitor else None
    profile = None
    from torch._dynamo.utils import counters

    kernel_dir = triton_cache_dir()
    dry_step = None  # `compile_ahead`'s dry step in the first call (runtime/ahead.py's LAST)
    compiled_per_call = []  # per call: dynamo graphs (recompilations included: why, `--child-stderr` with
    # TORCH_LOGS=recompiles), Triton kernels written to the cache
    routed = trace_captured_steps()  # per forward: which way the captured steps' router went, its host ms
    branches = []  # per call: `routed` of its forwards
    pinned = []  # per call: the previous call's cache still alive at this call's start, and torch's pinned pool
    previous = None  # (a weak reference to the previous call's cache)
    for call in range(args.calls):
        cache = None if args.dense else OasisCache(model, **cache_kwargs(dict(token_budget=args.budget, **options)))
        alive = previous is not None and previous() is not None
        before = host_pinned_stats() if cuda else {}
        clock = Stamps()
        graphs, wall = counters["stats"]["unique_graphs"], time.time()
        if args.profile and call == args.profile_call:
            import cProfile
            profile = cProfile.Profile()
            profile.enable()
        routed.clear()
        t0 = time.perf_counter()
        starts.append(t0)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, stopping_criteria=[clock],
                       **(cache.generate_kwargs() if cache is not None else {}))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if profile is not None and call == args.profile_call:
            profile.disable()
            profile.dump_stats(args.profile)
        first_token.append(clock.stamps[0] - t0)
        steps.append([round((b - a) * 1e3, 2) for a, b in zip(clock.stamps, clock.stamps[1:])])  # decode steps, ms
        if call == 0 and cache is not None:  # `compile_ahead`'s dry step: its phases (None: it did not run)
            from oasis_cache.runtime import ahead

            dry_step = {k: round(v, 3) for k, v in ahead.LAST.items()} or None
        compiled_per_call.append({"graphs": counters["stats"]["unique_graphs"] - graphs,
                                  "triton": triton_kernels(kernel_dir, since=wall)["kernels"] if kernel_dir else {}})
        branches.append(list(routed))
        after = host_pinned_stats() if cuda else {}
        pinned.append({"previous_alive": alive, **{k: round(v - before[k], 3) if k.startswith("new_") else v
                                                   for k, v in after.items()}})  # (`new_*`: pinned by this call)
        previous = weakref.ref(cache) if cache is not None else None
        del cache
    if any(c["graphs"] for c in compiled_per_call):  # (the compilation's phases once it is done)
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        compile_phases = {n: round(float(v), 3) for n, v in zip(names, values) if float(v) >= 0.05}
    stalls = monitor.summary() if monitor else None
    if stalls:
        for event in stalls["longest"]:
            event["at_s"] = round(event["at_s"] - (starts[0] - monitor.t0), 3)  # (from the first call's start)
    return {"load_s": load_s, "generate_s": times, "first_token_s": first_token, "compile_phases": compile_phases,
            "steps_ms": steps, "call_starts_s": [round(t - starts[0], 3) for t in starts],
            "stalls": stalls, "dry_step": dry_step,
            "compiled_per_call": compiled_per_call, "pinned": pinned, "routed": branches}


def trace_captured_steps() -> list:
    """Record, for every forward the captured steps' router takes (`CapturedSteps.forward`: prefill chunks and
    decode steps), which way it went — `eager` (not replayable), `first` (a cache's first eager step on the capture
    stream), `capture` (captured, then replayed once), `replay` — and its host milliseconds (launches; the device's
    own time shows in the token clock). Returns the list the records go to (the caller clears it per call)."""
    from oasis_cache.runtime import captured_step

    records: list = []
    forward = captured_step.CapturedSteps.forward

    def traced(self, runner, cache, kwargs):
        had_stream, captures, replays = self.stream is not None, self.captures, self.replays
        start = time.perf_counter()
        out = forward(self, runner, cache, kwargs)
        kind = ("capture" if self.captures > captures else "replay" if self.replays > replays
                else "first" if not had_stream and self.stream is not None else "eager")
        records.append((kind, round((time.perf_counter() - start) * 1e3, 1)))
        return out

    captured_step.CapturedSteps.forward = traced
    return records


PARENT_ONLY = ("processes", "fresh_kernel_cache", "child_stderr", "out", "child", "profile",
               "warm_first")  # (the parent's own)


def child_command(parser, args, index: int) -> list[str]:
    """The command of child `index`: every option the parent was given, but its own (`PARENT_ONLY`), as parsed (a
    new option reaches the children without being listed here); `--profile` to a file of the child's."""
    command = [sys.executable, __file__, "--child"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest in PARENT_ONLY or not action.option_strings or value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            command += [action.option_strings[0]] if value else []
        else:
            command += [action.option_strings[0], str(value)]
    return command + (["--profile", f"{args.profile}.{index}"] if args.profile else [])


def host_pinned_stats() -> dict:
    """torch's pinned host pool now: `new_*` counters (a call's difference is what it pinned anew) and the pool's
    size (GiB it owns: handed out and cached)."""
    import torch

    stats = torch.cuda.host_memory_stats()
    return {"new_blocks": stats.get("num_host_alloc", 0),
            "new_gib": stats.get("allocated_bytes.allocated", 0) / 2**30,
            "new_pin_s": stats.get("host_alloc_time.total", 0) / 1e6,
            "owned_gib": round(stats.get("allocated_bytes.current", 0) / 2**30, 2)}


def triton_cache_dir() -> str:
    """The folder Triton writes compiled kernels to (TRITON_CACHE_DIR, else its default)."""
    try:
        import triton

        return str(triton.knobs.cache.dir)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR", "")


def triton_kernels(cache_dir: str, since: float = 0.0) -> dict:
    """`{kernel name: specializations}` compiled into a Triton cache folder (those written at or after `since`, a
    `time.time()`), and the span of their files' times."""
    names, stamps = {}, []
    for meta in Path(cache_dir).glob("*/*.json"):
        if meta.name.startswith("__grp__") or meta.stat().st_mtime < since:
            continue
        try:
            name = json.loads(meta.read_text()).get("name")
        except (OSError, ValueError):
            continue
        if name:
            names[name] = names.get(name, 0) + 1
            stamps.append(meta.stat().st_mtime)
    span = max(stamps) - min(stamps) if stamps else 0.0
    return {"kernels": dict(sorted(names.items(), key=lambda kv: -kv[1])), "files_span_s": round(span, 2)}


def print_profile(path: str, top: int = 25) -> None:
    """The profiled call's functions with the most cumulative time (where it went) and own time (what ran)."""
    import io
    import pstats

    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(path, stream=out).sort_stats(order).print_stats(top)
        lines = [line for line in out.getvalue().splitlines() if line.strip()]
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        print(f"   profile by {order}:", flush=True)
        for line in lines[start:start + top + 1]:
            print("     " + line.strip()[:200], flush=True)


def warm_kernel_cache(args, env: dict, kernel_cache: str | None) -> dict:
    """`python -m oasis_cache.warm` on the benchmark model's config (written to a folder of the kernel cache's) at
    this context, budget and dtype, in a process of `env` (the first child's kernel caches): its wall time, what it
    printed, the Triton kernels it compiled."""
    sys.path.insert(0, str(HERE))
    from models import SHAPES

    if args.model not in SHAPES or not kernel_cache:
        raise SystemExit("--warm-first needs --fresh-kernel-cache and a random-weight shape (bench/models.py SHAPES)")
    folder = os.path.join(kernel_cache, "config")
    SHAPES[args.model]().save_pretrained(folder)
    command = [sys.executable, "-m", "oasis_cache.warm", folder, "--context", str(args.context),
               "--token-budget", str(args.budget), "--dtype", args.dtype, "--device", args.device]
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(HERE.parent))
    if done.returncode:
        raise SystemExit(f"python -m oasis_cache.warm failed (exit {done.returncode}): {done.stderr[-2000:]}")
    said = (done.stdout.strip().splitlines() or [""])[-1]
    return {"wall_s": round(time.time() - start, 2), "said": said, "triton": triton_kernels(kernel_cache)["kernels"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--fresh-kernel-cache", action="store_true",
                        help="the first child starts with empty Triton, inductor and driver JIT caches "
                             "(TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH in a new folder)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="OasisCache(..., compile_decode=True): the layers' own work compiled (its first call)")
    parser.add_argument("--fuse-projections", action="store_true", help="with --compile-decode: fuse_projections")
    parser.add_argument("--compile-ahead", action="store_true",
                        help="advanced compile_ahead=True: a dry first decode step compiles its kernels in "
                             "parallel before the real one, on any device (default: None, on CUDA)")
    parser.add_argument("--no-compile-ahead", action="store_true",
                        help="advanced compile_ahead=False: each kernel compiles at its first launch")
    parser.add_argument("--ahead-at-prefill", action="store_true",
                        help="advanced ahead_at_prefill=True: the dry step's compilations start during the "
                             "prefill, at its first attention layer (the default; its "
                             "phases print as the dry step's)")
    parser.add_argument("--no-ahead-at-prefill", action="store_true",
                        help="advanced ahead_at_prefill=False: the dry step runs before the first decode step")
    parser.add_argument("--dense", action="store_true",
                        help="no OasisCache: generate's own dense cache (DynamicCache), the baseline's first call "
                             "against its later ones (a process's first CUDA work, which oasis pays too)")
    parser.add_argument("--warm-parts", default=None,
                        help="runtime/ahead.WARM_PARTS: the parts of Triton's start-up the first prefill's thread "
                             "pays, comma-separated (key,driver,ptxas; '' none)")
    parser.add_argument("--split-warm-queries", type=int, default=None,
                        help="compute/dense.SPLIT_WARM_QUERIES: queries of the first chunk's warm-up of the later "
                             "chunks' cuDNN kernels, in a thread (0: none)")
    parser.add_argument("--stall-monitor", action="store_true",
                        help="record where the threads stood whenever the GIL was held 20 ms or more (see above)")
    parser.add_argument("--profile", default="", help="cProfile one call of each child (its thread; "
                        "--profile-call) into PATH.<process> (pstats; the parent prints the top functions by "
                        "cumulative and own time)")
    parser.add_argument("--profile-call", type=int, default=0,
                        help="with --profile: which call of each child to profile (0: the first; e.g. 2 for a later "
                             "call's prefill, whose first token still fell with fast_pinning: earlier)")
    parser.add_argument("--compile-after-steps", type=int, default=0,
                        help="the default compile_decode=None with compile_after_steps=N (research): its switch sooner")
    parser.add_argument("--child-stderr", default="", help="each child's stderr into DIR/child-<i>.log (e.g. with "
                        "TORCH_LOGS=recompiles: why a graph compiles)")
    parser.add_argument("--warm-first", action="store_true",
                        help="with --fresh-kernel-cache: `python -m oasis_cache.warm` for the model's config at this "
                             "context, budget and dtype before the first child (its kernel caches), timed")
    parser.add_argument("--out", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    header = (f"{args.model} {args.dtype} on {device}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}; context "
              f"{args.context} x 1, {args.new_tokens} new tokens, budget {args.budget}"
              + (", compile_decode" if args.compile_decode else "") + (", compile_ahead" if args.compile_ahead else "")
              + (", compile_ahead=False" if args.no_compile_ahead else "")
              + (", ahead_at_prefill" if args.ahead_at_prefill else "")
              + (", ahead_at_prefill=False" if args.no_ahead_at_prefill else "")

              + (f", warm parts '{args.warm_parts}'" if args.warm_parts is not None else "")
              + (f", split warm-up {args.split_warm_queries}" if args.split_warm_queries is not None else "")
              + (", dense (no OasisCache)" if args.dense else "")
              + (", fuse_projections" if args.compile_decode and args.fuse_projections else "")
              + (f", compile_after_steps={args.compile_after_steps}" if args.compile_after_steps else "")
              + (", python -m oasis_cache.warm first" if args.warm_first else ""))
    print(header, flush=True)
    kernel_cache = tempfile.mkdtemp(prefix="oasis-triton-") if args.fresh_kernel_cache else None
    rows, warmed = [], None
    for index in range(args.processes):
        env = dict(os.environ)
        if kernel_cache:
            env["TRITON_CACHE_DIR"] = kernel_cache  # empty for the first child, filled by it for the later ones
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(kernel_cache, "inductor")  # (compile_decode's kernels)
            env["CUDA_CACHE_PATH"] = os.path.join(kernel_cache, "nv")  # the driver's JIT cache (cuDNN's kernels)
        if index == 0 and args.warm_first:
            warmed = warm_kernel_cache(args, env, kernel_cache)
            print(f"python -m oasis_cache.warm: {warmed['wall_s']:.1f} s (its own: {warmed['said']}); Triton "
                  "kernels it compiled: " + (", ".join(f"{n} x{c}" for n, c in warmed["triton"].items()) or "none"),
                  flush=True)
        command = child_command(parser, args, index)
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if args.child_stderr:
            Path(args.child_stderr, f"child-{index}.log").write_text(done.stderr)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise SystemExit(f"child {index} failed (exit {done.returncode}): {done.stderr[-2000:]}")
        result = json.loads(lines[-1])
        times = result["generate_s"]
        row = dict(process=index, fresh_kernel_cache=bool(kernel_cache) and index == 0 and not args.warm_first,
                   warmed_first=warmed if index == 0 else None, load_s=result["load_s"],
                   generate_s=times, first_over_last=times[0] / times[-1], first_token_s=result["first_token_s"],
                   compile_phases=result["compile_phases"], steps_ms=result["steps_ms"],
                   call_starts_s=result["call_starts_s"], stalls=result["stalls"], dry_step=result.get("dry_step"),
                   compiled_per_call=result["compiled_per_call"], pinned=result.get("pinned"),
                   routed=result.get("routed"))
        if row["fresh_kernel_cache"]:
            row["triton"] = triton_kernels(kernel_cache)
        rows.append(row)
        print(f"process {index}{' (empty kernel cache)' if row['fresh_kernel_cache'] else ''}: load "
              f"{row['load_s']:.1f} s; generate " + " / ".join(f"{t:.2f}" for t in times)
              + f" s; first / last {row['first_over_last']:.2f}x; to the first token "
              + " / ".join(f"{t:.2f}" for t in row["first_token_s"]) + " s", flush=True)
        medians = [sorted(steps)[len(steps) // 2] for steps in row["steps_ms"] if steps]
        print("   median decode step (ms) per call: " + " / ".join(f"{m:.1f}" for m in medians), flush=True)
        for call, intervals in enumerate(row["steps_ms"]):
            slow = sorted(range(len(intervals)), key=lambda i: -intervals[i])[:6]
            print(f"   call {call} decode {sum(intervals) / 1e3:.2f} s; slowest steps (index: ms) "
                  + ", ".join(f"{i + 1}: {intervals[i]:.0f}" for i in sorted(slow)), flush=True)
        for call, done in enumerate(row["compiled_per_call"]):
            if done["graphs"] or done["triton"]:
                print(f"   call {call} compiled: {done['graphs']} dynamo graphs, "
                      "Triton kernels " + (", ".join(f"{n} x{c}" for n, c in done["triton"].items()) or "none"),
                      flush=True)
        for call, routed in enumerate(row["routed"] or []):  # (the prompt's forwards, then one per decode step)
            decode = routed[-len(row["steps_ms"][call]):] if routed and row["steps_ms"][call] else []
            shown = [(i + 1, r) for i, r in enumerate(decode) if i < 4 or 15 <= i <= 16 or r[1] >= 50]
            if shown:
                print(f"   call {call} router (decode step: way, host ms): "
                      + ", ".join(f"{i}: {kind} {ms:.0f}" for i, (kind, ms) in shown[:10]), flush=True)
        for call, seen in enumerate(row["pinned"] or []):
            print(f"   call {call} pinned: " + ", ".join(f"{k} {v}" for k, v in seen.items()), flush=True)
        if row["dry_step"]:
            print("   compile_ahead's dry step (call 0): " + ", ".join(f"{k} {v}" for k, v in row["dry_step"].items()),
                  flush=True)
        phases = sorted(row["compile_phases"].items(), key=lambda kv: -kv[1])[:8]
        if phases:
            print("   compile phases (s): " + ", ".join(f"{n} {v:.2f}" for n, v in phases), flush=True)
        if row["stalls"]:
            st = row["stalls"]
            print(f"   GIL stalls >= 20 ms: {st['stalls']}, {st['stalled_s']:.2f} s in all; by the main thread's "
                  "innermost frame (ms): " + "; ".join(f"{k} {v:.0f}" for k, v in st["main_frames_ms"].items()),
                  flush=True)
            for event in st["longest"][:6]:
                print(f"     {event['late_ms']:.0f} ms at {event['at_s']:.2f} s: " + " | ".join(
                    f"{name}: {' < '.join(reversed(stack[-3:]))}" for name, stack in event["stacks"].items()),
                    flush=True)
        if args.profile:
            print_profile(f"{args.profile}.{index}")
        if "triton" in row:
            print(f"   Triton kernels compiled ({row['triton']['files_span_s']:.1f} s from first to last): "
                  + ", ".join(f"{n} x{c}" for n, c in row["triton"]["kernels"].items()), flush=True)
    if kernel_cache:
        shutil.rmtree(kernel_cache, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(header=header, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
