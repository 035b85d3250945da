"""Recall of predicted blocks: per decode step and layer, the share of the real query's top-K blocks (sink and recent
excluded) that the prediction had made resident (`previous`: this step's query; `eagle3`: the draft token's;
`eagle3-head`: the same with `chain_drafts=False`, the head drafting every step; `none`: no prediction — its attended
set is the real top-K, so 1.000, a check of the measure).

All rows run with `exact=True` and `num_slots` = K (`--slots`): every step attends to the real query's top-K, so
every row follows the same trajectory (that of `lookahead="none"`) and only the prediction differs — up to floating
point: a row's share of tokens equal to the first row's is reported (`same_tokens_as_first_row`; on the H200 rows
part at near-ties). The oracle row
drafts the token that trajectory actually produces next (read from a first `none` run): the ceiling of eagle3.

    python eval/recall.py --context 4000 --budget 512 --steps 24 [--head heads/smollm2/head]

Recall is counted per layer (`stats()["prediction_recall_per_layer"]`, in the JSON and printed) and pooled over layers
(the table's number). Runs SmolLM2-135M-Instruct (or `--model qwen25-coder-0.5b`) offline on Python's own
documentation (`pydoc_data.topics`): its first `HELD_OUT_DOCUMENT_TOKENS` tokens, which no shipped head was trained
on; `--text code` instead the standard library's own code without its docstrings (`held_out_code`: as long as a 32K
context needs). `--sequences N` decodes N disjoint windows of that text as one batch (N times the samples of one
window; of the documentation at most 4 at 4K, 2 at 8K). Both texts are the running Python's: CPython 3.11 and 3.12
differ (the H200 machine runs 3.12), so figures from two Pythons measure different text (`python` in the JSON).
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

import oasis_cache  # noqa: F401
from oasis_cache import OasisCache, OasisConfig
from oasis_cache.config import OasisConfig
from oasis_cache.draft.training_data import HELD_OUT_DOCUMENT_TOKENS, held_out_document
from oasis_cache.loaders import OFFLINE_MODELS, load_offline
from oasis_cache.runtime.build import cache_kwargs


CHAT_QUESTION = "\n\nExplain in detail what the text above describes, section by section."


def held_out_code(tokenizer, tokens: int) -> torch.Tensor:
    """`[tokens]`: the standard library's own top-level modules (`Lib/*.py` of this Python, in name order) with every
    docstring removed and comments dropped (`draft.training_data.stdlib_code`), each headed by its file name. No shipped
    head was trained on it — their documents are Python's documentation past its first `HELD_OUT_DOCUMENT_TOKENS`
    tokens, the standard library's docstrings and, with `--document-source code`, the code of its packages — and it
    is long enough for 32K contexts (the held-out documentation is 16K tokens). Code, for a coder model. (Another
    Python version gives another text.)"""
    from oasis_cache.draft.training_data import stdlib_code

    ids: list[int] = []
    for text in stdlib_code(top_level=True):
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= tokens:
            return torch.tensor(ids[:tokens])
    raise ValueError(f"the standard library's code has only {len(ids)} tokens; ask for fewer")


def use_documentation_from(path: str) -> None:
    """Make `pydoc_data.topics` the module at `path` (another CPython's `pydoc_data/topics.py`) for this process:
    every reader of the documentation (`held_out_document`, the tasks' filler) imports it from there."""
    import importlib.util

    import pydoc_data

    spec = importlib.util.spec_from_file_location("pydoc_data.topics", path)
    if spec is None or not Path(path).is_file():
        raise SystemExit(f"--docs-from {path}: no such file (give a CPython's Lib/pydoc_data/topics.py)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not isinstance(getattr(module, "topics", None), dict):
        raise SystemExit(f"--docs-from {path}: no `topics` dict in it (is it pydoc_data/topics.py?)")
    sys.modules["pydoc_data.topics"] = pydoc_data.topics = module


def held_out_prompts(tok, prompt: str, sequences: int, context: int, text: str = "docs") -> list:
    """The prompts this script decodes: `sequences` disjoint windows of `context` tokens of held-out text (what no
    shipped head was trained on: `text` "docs", the documentation's first 16K tokens, or "code", `held_out_code`), as
    token tensors `[context]` ("document") or as chat-turn strings asking about them ("chat")."""
    if text == "code":
        held_out = held_out_code(tok, sequences * context)
    else:
        held_out = held_out_document(tok, HELD_OUT_DOCUMENT_TOKENS)  # [16384]
    if sequences < 1 or sequences * context > held_out.shape[0]:
        raise SystemExit(f"--sequences {sequences} windows of {context} tokens do not fit the "
                         f"{held_out.shape[0]} held-out tokens: at most {held_out.shape[0] // context} (--text code "
                         f"holds more)")
    windows = held_out[: sequences * context].view(sequences, context)  # [N, context]
    if prompt == "document":
        return list(windows)
    return [tok.apply_chat_template([{"role": "user", "content": tok.decode(w) + CHAT_QUESTION}], tokenize=False,
                                    add_generation_prompt=True) for w in windows]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--head", default=None, help="an EAGLE-3 head for SmolLM2 (directory): adds an eagle3 row")
    parser.add_argument("--prompt", choices=["document", "chat"], default="document",
                        help="continue the document, or answer a question about it as a chat turn")
    parser.add_argument("--oracle", action="store_true",
                        help="with --head: also an eagle3 row whose draft is the true next token (the upper bound)")
    parser.add_argument("--scorer", choices=["bits", "bound"], default="bits", help="the block scorer (OasisConfig)")
    parser.add_argument("--summary-channels", type=float, default=None,
                        help="OasisConfig.summary_channels (default: the package's, half with the bits scorer)")
    parser.add_argument("--slots", type=int, default=0,
                        help="working-set slots the prediction fills (0: K, the recall of a top-K prediction; 2K is "
                             "what exact=True uses by default: the share of the real top-K already resident)")
    parser.add_argument("--sequences", type=int, default=1,
                        help="disjoint windows of the held-out text decoded as one batch")
    parser.add_argument("--text", choices=["docs", "code"], default="docs",
                        help="held-out text: the documentation's first 16K tokens, or the standard library's code "
                             "without docstrings (any length: 32K contexts)")
    parser.add_argument("--modes", nargs="+", default=None, choices=["none", "previous", "eagle3", "eagle3-head",
                                                                 "eagle3-oracle"],
                        help="the rows to run (default: all that apply)")
    parser.add_argument("--model", default="smollm2", choices=sorted(OFFLINE_MODELS),
                        help="the target (offline): smollm2, or qwen25-coder-0.5b (32K context)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the target's (and the head's) dtype; default: the loader's for the device")
    parser.add_argument("--docs-from", default=None, metavar="TOPICS_PY",
                        help="another CPython's pydoc_data/topics.py as the documentation (--text docs): the held-out "
                             "text is the running Python's, and 3.11 and 3.12 ship other text (the H200 runs 3.12)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.docs_from:
        use_documentation_from(args.docs_from)
    model, tok = load_offline(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    prompts = held_out_prompts(tok, args.prompt, args.sequences, args.context, args.text)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    if args.prompt == "chat":
        inputs = tok(prompts, return_tensors="pt", padding=True)
    else:
        windows = torch.stack(prompts)  # [N, context]
        inputs = {"input_ids": windows, "attention_mask": torch.ones_like(windows)}
    inputs = {k: v.to(args.device) for k, v in inputs.items()}
    rows = []
    modes = ["none", "previous"] + (["eagle3", "eagle3-head"] if args.head else []) + (
        ["eagle3-oracle"] if args.head and args.oracle else [])
    if args.modes:
        missing = [m for m in args.modes if m not in modes]
        if missing:
            raise SystemExit(f"--modes {' '.join(missing)}: eagle3 rows need --head, eagle3-oracle also --oracle")
        modes = [m for m in modes if m in args.modes]
    truth = None
    if "eagle3-oracle" in modes:  # the trajectory every row follows: what a perfect draft would propose
        truth = model.generate(**inputs, max_new_tokens=args.steps + 1, do_sample=False,
                               pad_token_id=tok.pad_token_id,
                               **OasisCache(model, token_budget=args.budget, advanced=dict(
                                   scorer=args.scorer, summary_channels=args.summary_channels)).generate_kwargs())
    # K: the blocks a step selects; the slots hold at least every block of a context that fits the budget
    # (`OasisConfig.min_slots`: one more than K when the budget is not a multiple of the block size)
    K = OasisConfig(token_budget=args.budget).num_selected_blocks
    min_slots = OasisConfig(token_budget=args.budget).min_slots
    first = None
    for mode in modes:
        lookahead = mode.split("-")[0]
        draft = dict(draft=args.head) if lookahead == "eagle3" else {}
        if mode == "eagle3-head":
            draft["chain_drafts"] = False
        predicting = dict(exact=True, num_slots=max(args.slots or K, min_slots)) if lookahead != "none" else {}
        cache = OasisCache(model, **cache_kwargs(dict(token_budget=args.budget, lookahead=lookahead, measure=True,
                                                      scorer=args.scorer,
                           summary_channels=args.summary_channels,
                           **predicting, **draft)))
        if mode == "eagle3-oracle":
            cache.ride_along.oracle = lambda position: truth[:, position, None]  # [N, 1]
        name = mode
        tokens = model.generate(**inputs, **cache.generate_kwargs(), max_new_tokens=args.steps, do_sample=False,
                                pad_token_id=tok.pad_token_id)[:, inputs["input_ids"].shape[1] :]
        first = tokens if first is None else first  # (the first row's tokens: every row should follow them)
        stats = cache.stats()
        row = dict(lookahead=name, recall=stats["prediction_recall"], hit_rate=stats["hit_rate"],
                   blocks_selected_per_step=stats["blocks_selected_per_step"],
                   recall_per_layer=stats["prediction_recall_per_layer"],
                   same_tokens_as_first_row=(tokens == first).float().mean().item())
        if mode in ("eagle3", "eagle3-head"):  # the drafts against the tokens that came (`stats()`)
            row["draft_accuracy"] = stats["draft_accuracy"]
        if mode == "eagle3-oracle":  # the head's drafts against the oracle's (the same trajectory)
            hits, made = cache.ride_along.draft_hits
            row["draft_accuracy"] = hits / max(made, 1)
        rows.append(row)
    meta = dict(command="python " + " ".join(sys.argv), slots=max(args.slots or K, min_slots), sequences=args.sequences,
                text=args.text, python=platform.python_version(),  # (the held-out text is this Python's)
                docs_from=args.docs_from,  # (... or that file's)
                dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=torch.cuda.get_device_name() if args.device == "cuda" else platform.machine() + " CPU",
                model=args.model, K=cache.config.num_selected_blocks, block_size=cache.config.block_size)
    print(f"{args.model}, {args.prompt} prompt ({args.text}), context {args.context}, budget {args.budget} "
          f"(K={meta['K']} blocks of 16), {args.steps} steps × {args.sequences} sequence(s), {args.scorer} scorer")
    for r in rows:
        extra = (f", the draft was right {r['draft_accuracy']:.0%} of steps"
                 if r.get("draft_accuracy") is not None else "")
        print(f"  {r['lookahead']:24} recall {r['recall']:.3f}  (working-set hit rate {r['hit_rate']:.3f}{extra}; "
              f"tokens as the first row's {r['same_tokens_as_first_row']:.0%})")
        layers = {i: v for i, v in (r["recall_per_layer"] or {}).items() if v is not None}
        if not layers:  # no decode step was measured
            continue
        low, high = min(layers, key=layers.get), max(layers, key=layers.get)
        print(f"  {'':14} per layer: lowest {layers[low]:.3f} (layer {low}), highest {layers[high]:.3f} "
              f"(layer {high}); " + " ".join(f"{v:.2f}" for v in layers.values()))
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"recall-{args.model}-{meta['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
