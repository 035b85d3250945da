"""Heads compared on the same held-out texts: top-1 agreement of each head's draft with SmolLM2's greedy next token.

    python eval/head_agreement.py --data run1/data.pt run2/data.pt --heads old_head new_head

Each data file (a trainer run's texts, `oasis_cache.draft.train`) gives its held-out texts exactly as the trainer
split them (`split_texts`, seed 0 unless `--seeds`), so a head is measured on texts it was not trained on as long
as it was trained on these files. Also the held-out start of Python's documentation (`held_out_document`).
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from oasis_cache.draft import load_eagle3
from oasis_cache.draft.train import evaluate
from oasis_cache.draft.training_data import HELD_OUT_SHARE, held_out_document, load_texts, split_texts
from oasis_cache.loaders import load_smollm2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", nargs="+", required=True, help="data.pt files of trainer runs")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="each file's split seed (default 0)")
    parser.add_argument("--heads", nargs="+", required=True, help="head directories")
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    seeds = args.seeds or [0] * len(args.data)
    if len(seeds) != len(args.data):
        raise SystemExit(f"--seeds: one per --data file ({len(args.data)}), got {len(seeds)}")
    model, tok = load_smollm2(device=args.device)
    sets = {}
    for path, seed in zip(args.data, seeds):
        held, _ = split_texts(load_texts(path), HELD_OUT_SHARE, seed)
        sets[f"held-out of {path}"] = held
    sets["documentation start"] = [held_out_document(tok, args.document_tokens)]
    rows = []
    for head_dir in args.heads:
        head = load_eagle3(head_dir, target_model=model, dtype=torch.float32).to(args.device)
        row = {"head": head_dir}
        for name, texts in sets.items():
            row[name] = evaluate(head, model, texts)["top1_agreement"]
        rows.append(row)
        print(head_dir, " ".join(f"{name}: {row[name]:.3f}" for name in sets), flush=True)
    meta = dict(command="python " + " ".join(sys.argv), texts={name: len(t) for name, t in sets.items()},
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=torch.cuda.get_device_name() if args.device == "cuda" else platform.machine() + " CPU")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"head-agreement-{meta['date'][:10]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
