"""The in-decode workload (issue 22): prompts that make the model write long outputs, so that most of the KV is
written *during decode* — blocks completed while generating are offloaded, summarized and selected like prompt
blocks. The paper's own scenario (long reasoning, AIME); ours is long programs and explanations from a coder model.

For a batch of prompts (chat turns, left-padded), dense greedy writes exactly `--new-tokens` tokens each (its
trajectory; EOS suppressed). Then, per mode and budget:
  (a) `nll_delta`: the decode-mode NLL of dense's trajectory teacher-forced through an OasisCache (the prompt
      prefilled, then one token per forward), minus the same through a `DynamicCache` (nats per token);
  (b) `prefix`: how many of the mode's own greedy tokens equal dense's before the first difference (mean over
      prompts, and the share of prompts that match to the end);
  (c) `compiles`: the share of outputs whose first ```python block (or whole text, without one) compiles
      (`compile()`), dense's beside it — a task score the prompts state ("a complete Python module").
Budgets are fractions of the final context (prompt + new tokens), at least `--min-budget`.

    python eval/in_decode.py --model qwen25-coder-0.5b --new-tokens 4096 --fractions 8 16 --modes none previous
    python eval/in_decode.py --tiny      # CI size: random weights (plumbing only), two prompts, 96 new tokens

Several processes can share the work (each (mode, budget) pass is independent; `bench/gpu_run.sh qwenindecodepar`
runs them side by side on one GPU): `--dense FILE` keeps dense's trajectory, NLL and scores in FILE (made by the
first process that finds it missing, read by the others); each process writes its rows to `--out` after every row;
`--merge A.json B.json ...` prints and writes (with `--out`) the rows of several such files as one table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.nll import teacher_forced_nll  # noqa: E402
from eval.report import load, make_cache  # noqa: E402
from oasis_cache.compat import generate_cache_argument  # noqa: E402
from oasis_cache.loaders import OFFLINE_MODELS, load_offline  # noqa: E402

PROMPTS = [  # long outputs with a checkable form; held out of any head's training text (draft/seed_prompts.txt)
    "Write a complete Python module that implements an LRU cache with time-to-live expiry, thread safety, statistics "
    "and a command-line demo. Include docstrings for every function and a set of unittest test cases.",
    "Write a complete Python module implementing a tokenizer, a recursive-descent parser and an evaluator for "
    "arithmetic expressions with variables, functions and error messages. Include docstrings and unittest tests.",
    "Write a complete Python module for a small in-memory key-value database with transactions (begin, commit, "
    "rollback), snapshots and a query language over keys. Include docstrings and unittest tests.",
    "Write a complete Python module that simulates a bank with accounts, transfers, interest, an audit log and "
    "report generation, with a class hierarchy and full docstrings. Include unittest tests.",
    "Write a complete Python module implementing Dijkstra's, A* and Bellman-Ford shortest paths over a graph class "
    "with weighted edges, with docstrings, input validation and unittest tests for each algorithm.",
    "Write a complete Python module for a text adventure game engine: rooms, items, an inventory, a command parser "
    "and save/load to JSON, with docstrings and unittest tests.",
    "Write a complete Python module that implements a Markdown-to-HTML converter for headings, lists, emphasis, code "
    "blocks and links, with docstrings and unittest tests covering each feature.",
    "Write a complete Python module implementing a job scheduler with priorities, dependencies between jobs, retries "
    "and a thread pool, with docstrings and unittest tests.",
]


def first_python_block(text: str) -> str:
    """The first ```python (or ```) fenced block of `text`, or `text` when it has none (an unclosed fence: to the end)."""
    match = re.search(r"```(?:python|py)?\n(.*?)(?:```|$)", text, re.S)
    return match.group(1) if match else text


def compiles(text: str) -> bool:
    try:
        compile(first_python_block(text), "<generated>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def encode(tokenizer, prompts, device):
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in enc.items()}


@torch.no_grad()
def greedy(model, enc, cache, new_tokens: int, pad_token_id) -> torch.Tensor:
    """`[B, new_tokens]`: exactly `new_tokens` greedy tokens per prompt (EOS suppressed)."""
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=pad_token_id, **{generate_cache_argument(model): cache})
    return out[:, enc["input_ids"].shape[1]:]


def equal_prefix(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per row: the number of leading tokens where `a` and `b` (`[B, n]`) agree."""
    differ = a != b
    first = torch.where(differ.any(1), differ.float().argmax(1), torch.full_like(differ[:, 0], a.shape[1],
                                                                                  dtype=torch.long))
    return first.tolist()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen25-coder-0.5b", choices=sorted(OFFLINE_MODELS) + ["tiny"],
                        help="an offline model, or 'tiny' (random weights, SmolLM2's tokenizer: CI plumbing only)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--modes", nargs="*", default=["none", "previous"],
                        help="OasisCache modes as eval/report.py names them (none, previous, previous-exact, ...)")
    parser.add_argument("--fractions", type=int, nargs="+", default=None,
                        help="budgets as fractions of the final context (default 8 16; --tiny: 4)")
    parser.add_argument("--min-budget", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the loader's, fp32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="CI size: random weights (plumbing only), two prompts, 96 new tokens, budget 96")
    parser.add_argument("--head", default=None, help="an EAGLE-3 head directory, for the eagle3 modes")
    parser.add_argument("--dense", default=None,
                        help="a file for dense's trajectory: written when missing, else read (skips the dense passes)")
    parser.add_argument("--merge", nargs="+", default=None, help="JSON files of earlier runs: one table of their rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.tiny:
        args.model, args.prompts, args.new_tokens, args.min_budget = "tiny", 2, 96, 96
    args.fractions = args.fractions or ([4] if args.tiny else [8, 16])
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts: 1 to {len(PROMPTS)}")
    started = time.time()
    if args.model == "tiny":
        model, tokenizer = load(args)
    else:
        model, tokenizer = load_offline(args.model, args.device, getattr(torch, args.dtype) if args.dtype else None)
    if args.head:
        import eval.report
        from oasis_cache.draft import load_eagle3

        eval.report.HEAD = load_eagle3(args.head, target_model=model)  # what make_cache's eagle3 modes draft with
    enc = encode(tokenizer, PROMPTS[: args.prompts], args.device)
    context = enc["input_ids"].shape[1] + args.new_tokens
    pad = tokenizer.pad_token_id
    dense_tokens, dense_nll, dense_row = dense_pass(model, tokenizer, enc, args)
    rows = [dense_row]
    meta = dict(command="python " + " ".join(sys.argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
                machine=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or
                platform.machine(), model=args.model, prompts=args.prompts, new_tokens=args.new_tokens,
                context=context, dtype=str(next(model.parameters()).dtype))

    def write():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(dict(meta=dict(meta, seconds=time.time() - started), rows=rows),
                                                 indent=1))

    print(f"{args.model}, {args.prompts} prompts x {args.new_tokens} new tokens (context {context}) on {args.device}")
    print_header()
    print_row(dense_row)
    write()
    for mode in args.modes:
        for fraction in args.fractions:
            budget = max(args.min_budget, context // fraction)
            nll, agree = teacher_forced_nll(model, enc, dense_tokens, make_cache(model, mode, budget))
            tokens = greedy(model, enc, make_cache(model, mode, budget), args.new_tokens, pad)
            prefix = equal_prefix(tokens, dense_tokens)
            done = [compiles(tokenizer.decode(row, skip_special_tokens=True)) for row in tokens]
            row = dict(mode=mode, budget=budget, fraction=fraction, nll=nll.mean().item(),
                       nll_delta=(nll - dense_nll).mean().item(), argmax_agreement=agree.float().mean().item(),
                       prefix=sum(prefix) / len(prefix),
                       prefixes=prefix, full_match=sum(p == args.new_tokens for p in prefix) / len(prefix),
                       compiles=sum(done) / len(done))
            rows.append(row)
            print_row(row)
            write()


def dense_pass(model, tokenizer, enc, args):
    """`(tokens [B, N], nll [B, N], row)`: dense's greedy trajectory, its teacher-forced NLL and its table row; read
    from `args.dense` when that file exists (made by a run with the same model, prompts and length), else computed
    (and saved there when given)."""
    key = dict(model=args.model, prompts=args.prompts, new_tokens=args.new_tokens)
    if args.dense and Path(args.dense).exists():
        saved = torch.load(args.dense)
        if saved["key"] != key:
            raise SystemExit(f"--dense {args.dense} holds {saved['key']}, not {key}: give another file")
        return saved["tokens"].to(args.device), saved["nll"].to(args.device), saved["row"]
    tokens = greedy(model, enc, make_cache(model, "dense", None), args.new_tokens, tokenizer.pad_token_id)
    nll, agree = teacher_forced_nll(model, enc, tokens, make_cache(model, "dense", None))
    if agree.float().mean().item() < 0.99:  # positions or masks differ from generate's: every figure would be off
        raise SystemExit(f"teacher forcing does not reproduce dense's greedy tokens ({int((~agree).sum())} differ)")
    done = [compiles(tokenizer.decode(row, skip_special_tokens=True)) for row in tokens]
    row = dict(mode="dense", budget=None, nll=nll.mean().item(), nll_delta=0.0, prefix=float(args.new_tokens),
               full_match=1.0, argmax_agreement=agree.float().mean().item(), compiles=sum(done) / len(done))
    if args.dense:
        Path(args.dense).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(f"{args.dense}.partial")
        torch.save(dict(key=key, tokens=tokens.cpu(), nll=nll.cpu(), row=row), partial)
        partial.replace(args.dense)  # whole or absent: a process reading it never sees half a file
    return tokens, nll, row


def print_header():
    print(f"{'mode':<18} {'budget':>6} {'NLL delta':>10} {'greedy prefix':>14} {'full match':>10} {'compiles':>9}")


def print_row(row):
    print(f"{row['mode']:<18} {str(row['budget'] or '-'):>6} {row['nll_delta']:>+10.4f} {row['prefix']:>14.1f} "
          f"{row['full_match']:>10.2f} {row['compiles']:>9.2f}", flush=True)


def merge(paths, out):
    """One table (and, with `out`, one file) of the rows of several runs' files (dense's row once)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    metas = [r["meta"] for r in runs]
    shape = {(m["model"], m["prompts"], m["new_tokens"]) for m in metas}
    if len(shape) != 1:
        raise SystemExit(f"--merge: the files are of different runs (model, prompts, new tokens): {sorted(shape)}")
    rows = [runs[0]["rows"][0]] + [r for run in runs for r in run["rows"] if r["mode"] != "dense"]
    meta = dict(metas[0], command=[m["command"] for m in metas], seconds=max(m["seconds"] for m in metas),
                processes=len(runs))
    print(f"{meta['model']}, {meta['prompts']} prompts x {meta['new_tokens']} new tokens (context {meta['context']}), "
          f"{meta['machine']}, {len(runs)} processes, {meta['seconds']:.0f} s")
    print_header()
    for row in rows:
        print_row(row)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
