"""A markdown table of `eval/report.py` results (its JSON files, or the JSON lines its log prints as it runs): per
task and length, how many of the samples dense answers each mode and budget also answers (`kept/dense-solved`), or,
for tasks scored by partial credit (no sample fully solved by dense), the mode's accuracy beside dense's.

    python eval/report_table.py eval/results/suite-h200-2026-12-03/report-qwen*.json --modes none previous \\
        eagle3-exact --fractions 16 32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return json.loads(path.read_text())["tasks"]


def cell(row: dict) -> str:
    if row.get("dense_solved"):
        return f"{row['kept']}/{row['dense_solved']}"
    return f"{row['accuracy']:.2f}"


def table(rows: list[dict], modes: list[str] | None = None, fractions: list[int] | None = None) -> str:
    """One row per (task, length), one column per (mode, fraction) present (only `modes` / `fractions` if given,
    in that order)."""
    order = {m: i for i, m in enumerate(modes or [])}
    columns = sorted({(r["mode"], r["fraction"]) for r in rows if r["mode"] != "dense"
                      and (modes is None or r["mode"] in modes) and (fractions is None or r["fraction"] in fractions)},
                     key=lambda c: (order.get(c[0], 0), c[0], c[1]))
    cells, dense = {}, {}
    for r in rows:
        key = (r["task"], r["length"])
        if r["mode"] == "dense":
            dense[key] = r["accuracy"]
        else:
            cells.setdefault(key, {})[(r["mode"], r["fraction"])] = cell(r)
    lines = ["| task | length | dense accuracy | " + " | ".join(f"`{m}` 1/{f}" for m, f in columns) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in columns) + " |"]
    for key in sorted(cells, key=lambda k: (k[0], k[1])):
        accuracy = f"{dense[key]:.2f}" if key in dense else "–"
        length = f"{key[1] // 1024}K" if key[1] >= 1024 else str(key[1])
        lines.append(f"| {key[0]} | {length} | {accuracy} | "
                     + " | ".join(cells[key].get(c, "–") for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--modes", nargs="+", default=None, help="only these modes' columns, in this order")
    parser.add_argument("--fractions", type=int, nargs="+", default=None, help="only these budgets (1/F)")
    parser.add_argument("--tasks", nargs="+", default=None, help="only these tasks' rows")
    args = parser.parse_args(argv)
    rows = [r for path in args.files for r in read_rows(path) if args.tasks is None or r["task"] in args.tasks]
    if not rows:
        raise SystemExit(f"no rows of tasks {args.tasks} in {', '.join(map(str, args.files))}")
    print(table(rows, args.modes, args.fractions))


if __name__ == "__main__":
    main()
