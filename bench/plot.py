"""Plot TPOT by method for each (context, batch) of one or more bench/decode.py JSON files.

    python bench/plot.py bench/results/decode-*.json --out bench/results/decode.png [--statistic mean]
        [--methods dense dense-compiled oasis-previous-captured] [--labels "dense eager" "dense compiled" oasis]

A method met in several files is plotted from the first file that has it at that (context, batch).
"""

from __future__ import annotations

import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="bench/results/decode.png")
    parser.add_argument("--statistic", choices=["median", "mean"], default="median",
                        help="which TPOT of the rows (mean: captured methods, whose recaptures only a mean shows)")
    parser.add_argument("--methods", nargs="+", help="only these methods, in this order (default: every one found)")
    parser.add_argument("--labels", nargs="+", help="the legend's names for --methods, one each (default: the methods)")
    args = parser.parse_args()
    key = "tpot_ms" if args.statistic == "median" else "tpot_ms_mean"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta = [], None
    for path in args.results:
        data = json.load(open(path))
        meta = meta or data["meta"]
        rows += [r for r in data["rows"] if key in r]
    settings = sorted({(r["context"], r["batch"]) for r in rows})
    present = list(dict.fromkeys(r["method"] for r in rows))  # first-seen order, then the usual order below
    usual = ("dense", "offload", "oasis-none", "oasis-previous", "oasis-exact", "oasis-eagle3-plain", "oasis-eagle3",
             "oasis-eagle3-graph")
    methods = [m for m in usual if m in present] + [m for m in present if m not in usual]
    if args.methods:
        missing = [m for m in args.methods if m not in present]
        if missing:
            raise SystemExit(f"--methods names {missing}, not in the files (found: {present})")
        methods = list(args.methods)
    if args.labels and len(args.labels) != len(methods):
        raise SystemExit(f"--labels names {len(args.labels)} methods, the plot has {len(methods)}: {methods}")
    labels = dict(zip(methods, args.labels or methods))
    fig, ax = plt.subplots(figsize=(2.2 * len(settings) + 2, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next((r[key] for r in rows if r["method"] == method and (r["context"], r["batch"]) == s),
                       float("nan")) for s in settings]  # nan: not run at that setting (no bar, no label)
        bars = ax.bar([x + i * width for x in range(len(settings))], values, width, label=labels[method])
        ax.bar_label(bars, labels=["" if v != v else f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(settings))])
    ax.set_xticklabels([f"{c // 1024}K x {b}" for c, b in settings])
    ax.set_ylabel(f"TPOT (ms, {args.statistic})")
    measured = [r[key] for r in rows if r["method"] in methods]
    if max(measured) > 10 * min(measured):  # a log axis only where the spread needs it (offload vs the rest)
        ax.set_yscale("log")
    ax.set_title(f"{meta['model']} {meta['dtype']}, {meta['machine']}, budget {meta.get('budget', '?')}, {meta['date'][:10]}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
