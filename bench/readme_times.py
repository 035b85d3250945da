"""What the README's commands take on this machine: the demo (several runs), the lm-eval example with a small
`--limit`, and optionally the test command; each with the machine's load average while it ran.

    python bench/readme_times.py --demo-runs 3 --lm-eval-limit 2 [--tests] --out bench/results/readme-times-cpu.json

Run from a clone whose README commands have been run once (the models unpacked, the packages installed): it times
the commands as a newcomer runs them after that, not the installation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(command: list[str], cwd: Path = ROOT) -> dict:
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return {"seconds": round(seconds, 1), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2), "tail": done.stdout.strip().splitlines()[-30:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-runs", type=int, default=3)
    parser.add_argument("--lm-eval-limit", type=int, default=2, help="0: skip the lm-eval example")
    parser.add_argument("--tests", action="store_true", help="also time the README's test command (pytest -n 2)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = {"demo": [timed([sys.executable, "examples/demo.py"]) for _ in range(args.demo_runs)]}
    if args.lm_eval_limit:
        with tempfile.TemporaryDirectory() as tasks:
            subprocess.run([sys.executable, "eval/lm_eval_tasks/build.py", "--tasks", "single_needle",
                            "--lengths", "2048", "--samples", "20", "--filler", "noise", "--out", tasks],
                           cwd=ROOT, check=True, capture_output=True)
            rows["lm_eval"] = timed([sys.executable, "-m", "oasis_cache.integrations.lm_eval", "--model", "oasis",
                                     "--model_args", "pretrained=smollm2,token_budget=256",
                                     "--tasks", "oasis_single_needle", "--include_path", tasks,
                                     "--apply_chat_template", "--limit", str(args.lm_eval_limit)])
    if args.tests:
        rows["tests"] = timed([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"])
    header = (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
              f"{datetime.date.today().isoformat()}")
    print(header)
    for name, runs in rows.items():
        runs = runs if isinstance(runs, list) else [runs]
        print(f"{name}: " + ", ".join(f"{r['seconds']:.0f} s (load {r['load_before']:.1f}-{r['load_after']:.1f})"
                                      for r in runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": header, "command": "python " + " ".join(sys.argv),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
