"""The in-decode workload: prompts that make the model write long outputs, so that most of the KV is
written *during decode* — blocks completed while generating are offloaded, summarized and selected like prompt
blocks. The paper's own scenario (long reasoning, AIME); ours is long programs and explanations from a coder model.

For a batch of prompts (chat turns, left-padded), dense greedy writes exactly `--new-tokens` tokens each (its
trajectory; EOS suppressed). Then, per mode and budget:
  (a) `nll_delta`: the decode-mode NLL of dense's trajectory teacher-forced through an OasisCache (the prompt
      prefilled, then one token per forward), minus the same through a `DynamicCache` (nats per token; dense's fed
      `DENSE_CHUNK` tokens per forward: the same attention in far fewer forwards);
  (b) `prefix`: how many of the mode's own greedy tokens equal dense's before the first difference (mean over
      prompts, and the share of prompts that match to the end);
  (c) `compiles`: the share of outputs whose first ```python block (or whole text, without one) compiles
      (`compile()`), dense's beside it — a task score the prompts state ("a complete Python module").
Budgets are fractions of the final context (prompt + new tokens), at least `--min-budget`.

    python eval/in_decode.py --model qwen25-coder-0.5b --new-tokens 4096 --fractions 8 16 --modes none previous
    python eval/in_decode.py --tiny      # CI size: random weights (plumbing only), two prompts, 96 new tokens

The prompts run as one left-padded batch, or with `--per-prompt` each as its own batch of one (on CUDA both replay
their decode steps as graphs; before, a padded batch's ran eagerly). Several processes
can share the work (`bench/gpu_run.sh qwenindecodepar` runs them side by side on one GPU): by mode and budget, with
`--dense FILE` keeping dense's trajectories (made by the first process that finds them missing, read by the others),
or by prompt (`--only 0 3`). Each process writes its rows to `--out` after every row; `--merge A.json B.json ...`
prints and writes (with `--out`) one table of such files: rows of other modes are added, other prompts join the rows
of their mode and budget (each row keeps its per-prompt figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
    parser.add_argument("--only", type=int, nargs="+", default=None,
                        help="run only these of the first --prompts prompts (0-based; --merge joins the parts)")
    parser.add_argument("--per-prompt", action="store_true",
                        help="each prompt as its own batch of one (no padding; work split by prompt with --only)")
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--modes", nargs="*", default=["none", "previous"],
                        help="OasisCache modes as eval/report.py names them (none, previous, previous-exact, ...)")
    parser.add_argument("--fractions", type=int, nargs="+", default=None,
                        help="budgets as fractions of the final context (default 8 16; --tiny: 4)")
    parser.add_argument("--min-budget", type=int, default=256)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the offline model's dtype (default: the loader's, float32)")
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
    indexes = args.only if args.only is not None else list(range(args.prompts))
    if not indexes or any(not 0 <= i < args.prompts for i in indexes):
        raise SystemExit(f"--only: indexes among the first {args.prompts} prompts (0 to {args.prompts - 1})")
    groups = [[i] for i in indexes] if args.per_prompt else [indexes]
    encs = [encode(tokenizer, [PROMPTS[i] for i in group], args.device) for group in groups]
    contexts = [enc["input_ids"].shape[1] + args.new_tokens for enc in encs]
    dense_started = time.time()
    dense = [dense_pass(model, tokenizer, enc, group, args) for enc, group in zip(encs, groups)]
    dense_row = summarize(dict(mode="dense", budget=None, prompt_indexes=indexes, budgets=[None] * len(indexes),
                               seconds=time.time() - dense_started,
                               **{k: [v for d in dense for v in d[2][k]] for k in PER_PROMPT}), args.new_tokens)
    rows = [dense_row]
    command = " ".join(["python eval/in_decode.py", *(sys.argv[1:] if argv is None else argv)])
    meta = dict(command=command, date=datetime.datetime.now().isoformat(timespec="seconds"),
                machine=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or
                platform.machine(), model=args.model, prompts=args.prompts, new_tokens=args.new_tokens,
                context=max(contexts), per_prompt=args.per_prompt, dtype=str(next(model.parameters()).dtype))

    def write():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(dict(meta=dict(meta, seconds=time.time() - started), rows=rows),
                                                 indent=1))

    print(f"{args.model}, prompts {indexes} x {args.new_tokens} new tokens (context up to {max(contexts)}"
          f"{', one prompt per batch' if args.per_prompt else ''}) on {args.device}")
    print_header()
    print_row(dense_row)
    write()
    pad = tokenizer.pad_token_id
    for mode in args.modes:
        for fraction in args.fractions:
            lists = {k: [] for k in ("budgets", *PER_PROMPT)}
            row_started, steps = time.time(), dict(captures=0, replays=0)
            for enc, context, (dense_tokens, dense_nll, _) in zip(encs, contexts, dense):
                budget = max(args.min_budget, context // fraction)
                caches = [make_cache(model, mode, budget), make_cache(model, mode, budget)]
                nll, agree = teacher_forced_nll(model, enc, dense_tokens, caches[0])
                tokens = greedy(model, enc, caches[1], args.new_tokens, pad)
                for cache in caches:  # how many decode steps replayed a captured graph (none on CPU)
                    captured = getattr(cache, "captured_steps", None)
                    steps["captures"] += captured.captures if captured is not None else 0
                    steps["replays"] += captured.replays if captured is not None else 0
                lists["budgets"] += [budget] * len(tokens)
                lists["nll_per_prompt"] += nll.mean(1).tolist()
                lists["dense_nll_per_prompt"] += dense_nll.mean(1).tolist()
                lists["agreement_per_prompt"] += agree.float().mean(1).tolist()
                lists["prefixes"] += equal_prefix(tokens, dense_tokens)
                lists["compiled"] += [compiles(tokenizer.decode(row, skip_special_tokens=True)) for row in tokens]
            row = summarize(dict(mode=mode, fraction=fraction, prompt_indexes=indexes, seconds=time.time() - row_started,
                                 **steps, **lists), args.new_tokens)
            rows.append(row)
            print_row(row)
            write()


# Dense's teacher forcing feeds its trajectory this many tokens per forward (the same attention as one per forward;
# 8 x 4096 eager steps were half of dense's ~2 minutes on the H200). The cache's rows go one token per forward.
DENSE_CHUNK = 256

# What a row keeps per prompt (in `prompt_indexes` order), from which `summarize` computes its figures; `--merge`
# joins the lists of processes that ran different prompts.
PER_PROMPT = ("nll_per_prompt", "dense_nll_per_prompt", "agreement_per_prompt", "prefixes", "compiled")


def summarize(row: dict, new_tokens: int) -> dict:
    """`row` with its figures over its prompts: NLL and its delta to dense (nats per token, every prompt has
    `new_tokens`), argmax agreement, the mean greedy prefix equal to dense's, the share matched to the end, the share
    that compiles, and the budget (one value, or the mean of per-prompt budgets)."""
    n = len(row["prefixes"])
    budgets = [b for b in row["budgets"] if b is not None]
    return dict(
        row, budget=(round(sum(budgets) / len(budgets)) if budgets else None),
        nll=sum(row["nll_per_prompt"]) / n,
        nll_delta=sum(a - b for a, b in zip(row["nll_per_prompt"], row["dense_nll_per_prompt"])) / n,
        argmax_agreement=sum(row["agreement_per_prompt"]) / n, prefix=sum(row["prefixes"]) / n,
        full_match=sum(p == new_tokens for p in row["prefixes"]) / n, compiles=sum(row["compiled"]) / n)


def dense_pass(model, tokenizer, enc, group, args):
    """`(tokens [B, N], nll [B, N], per-prompt lists)`: dense's greedy trajectory for the prompts `group` (encoded as
    `enc`), its teacher-forced NLL, and the `PER_PROMPT` lists of its row; read from `args.dense` when that file holds
    them (a run with the same model, length and batching), else computed (and added there when given)."""
    key = f"{args.model}/{args.new_tokens}/{'-'.join(map(str, group))}"
    path = Path(args.dense) if args.dense else None
    if path is not None and path.exists() and key in (saved := torch.load(path)):
        tokens, nll, agree = (t.to(args.device) for t in saved[key])
    else:
        tokens = greedy(model, enc, make_cache(model, "dense", None), args.new_tokens, tokenizer.pad_token_id)
        nll, agree = teacher_forced_nll(model, enc, tokens, make_cache(model, "dense", None), chunk=DENSE_CHUNK)
        if agree.float().mean().item() < 0.99:  # positions or masks differ from generate's: every figure would be off
            raise SystemExit(f"teacher forcing does not reproduce dense's greedy tokens ({int((~agree).sum())} differ)")
        if path is not None:  # (processes that share a file run different modes of the same prompts: same keys)
            saved = torch.load(path) if path.exists() else {}
            saved[key] = (tokens.cpu(), nll.cpu(), agree.cpu())
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            torch.save(saved, partial)
            partial.replace(path)  # whole or absent: a process reading it never sees half a file
    lists = dict(nll_per_prompt=nll.mean(1).tolist(), dense_nll_per_prompt=nll.mean(1).tolist(),
                 agreement_per_prompt=agree.float().mean(1).tolist(), prefixes=[args.new_tokens] * len(tokens),
                 compiled=[compiles(tokenizer.decode(row, skip_special_tokens=True)) for row in tokens])
    return tokens, nll, lists


def print_header():
    print(f"{'mode':<18} {'budget':>6} {'NLL delta':>10} {'greedy prefix':>14} {'full match':>10} {'compiles':>9} "
          f"{'seconds':>8} {'replays':>8}")


def print_row(row):
    replays = f"{row['replays']}/{row['captures']}" if row.get("replays") is not None else "-"
    print(f"{row['mode']:<18} {str(row['budget'] or '-'):>6} {row['nll_delta']:>+10.4f} {row['prefix']:>14.1f} "
          f"{row['full_match']:>10.2f} {row['compiles']:>9.2f} {row.get('seconds', 0):>8.0f} {replays:>8}", flush=True)


def merge(paths, out):
    """One table (and, with `out`, one file) of several runs' files: runs of other modes add rows, runs of other
    prompts (`--only`) add their prompts to each row of the same mode and budget."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    metas = [r["meta"] for r in runs]
    shape = {(m["model"], m["prompts"], m["new_tokens"], m.get("per_prompt", False)) for m in metas}
    if len(shape) != 1:
        raise SystemExit(f"--merge: the files are of different runs (model, prompts, new tokens, per prompt): "
                         f"{sorted(shape)}")
    new_tokens = metas[0]["new_tokens"]
    joined: dict = {}
    for run in runs:
        for row in run["rows"]:
            key = (row["mode"], row.get("fraction"))
            have = joined.get(key)
            if have is None:
                joined[key] = dict(row)
                continue
            fresh = [i for i in row["prompt_indexes"] if i not in have["prompt_indexes"]]
            if len(fresh) not in (0, len(row["prompt_indexes"])):
                raise SystemExit(f"--merge: {key} ran prompts {row['prompt_indexes']} in one file and some of them "
                                 "in another")
            if fresh:  # the same mode and budget on other prompts
                for name in ("prompt_indexes", "budgets", *PER_PROMPT):
                    have[name] = have[name] + row[name]
                for name in ("seconds", "captures", "replays"):  # summed over the processes (seconds: process time)
                    if name in row:
                        have[name] = have.get(name, 0) + row[name]
    rows = [summarize(row, new_tokens) for row in joined.values()]
    meta = dict(metas[0], command=[m["command"] for m in metas], seconds=max(m["seconds"] for m in metas),
                context=max(m["context"] for m in metas), processes=len(runs))
    print(f"{meta['model']}, {meta['prompts']} prompts x {meta['new_tokens']} new tokens (context up to "
          f"{meta['context']}), {meta['machine']}, {len(runs)} processes, {meta['seconds']:.0f} s")
    print_header()
    for row in rows:
        print_row(row)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
