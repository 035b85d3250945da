"""Plot TPOT by method for each (context, batch) of one or more bench/decode.py JSON files.

    python bench/plot.py bench/results/decode-*.json --out bench/results/decode.png
"""

from __future__ import annotations

import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="bench/results/decode.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta = [], None
    for path in args.results:
        data = json.load(open(path))
        meta = meta or data["meta"]
        rows += [r for r in data["rows"] if "tpot_ms" in r]
    settings = sorted({(r["context"], r["batch"]) for r in rows})
    methods = [m for m in ("dense", "offload", "oasis-none", "oasis-previous", "oasis-exact")
               if any(r["method"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(2.2 * len(settings) + 2, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next((r["tpot_ms"] for r in rows if r["method"] == method and (r["context"], r["batch"]) == s), 0)
                  for s in settings]
        bars = ax.bar([x + i * width for x in range(len(settings))], values, width, label=method)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(settings))])
    ax.set_xticklabels([f"{c // 1024}K x {b}" for c, b in settings])
    ax.set_ylabel("TPOT (ms, median)")
    ax.set_yscale("log")
    ax.set_title(f"{meta['model']} {meta['dtype']}, {meta['machine']}, budget {meta.get('budget', '?')}, {meta['date'][:10]}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
