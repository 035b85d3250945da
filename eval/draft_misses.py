"""Where the head's draft misses, by how sure the target itself was: on the trajectories `eval/recall.py` measures
(held-out documentation windows continued greedily, document or chat prompt), the share of steps whose draft is the
target's next token, bucketed by the target's own top-1 probability at that step (the token the draft must guess).

A miss at a step where the target's top-1 probability is low is a near-tie: the target's choice there hangs on
details that a one-token guess made before the target ran is unlikely to recover. If most misses are near-ties,
recall ≥ 90% at K = 20 needs more than a better single draft. A second table splits the steps by whether the token
continues a trigram seen earlier in the context — within the head's attention window, only beyond it, or not at all
(copying from far back is what the target can do and a head with a short window cannot see).

    python eval/draft_misses.py --prompt document --sequences 4 --context 4000 --steps 64 [--head DIR]

Teacher-forced (dense attention, fp32 on CPU): the trajectory is generated greedily first, then the target runs once
over prompt + trajectory with hidden states and the head drafts every generated position from the previous
position's features (as the ride-along does). Prints a table, writes JSON.
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
from oasis_cache.draft.bundled import bundled_head_for
from oasis_cache.loaders import load_smollm2
from recall import held_out_prompts  # (eval/, the script's directory)

BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)  # edges of the target's top-1 probability


def trajectory_prompts(tok, prompt: str, sequences: int, context: int) -> list:
    """The prompts `eval/recall.py` decodes, as token tensors `[n]` (chat turns tokenized one by one: unpadded)."""
    prompts = held_out_prompts(tok, prompt, sequences, context)
    return prompts if prompt == "document" else [tok(c, return_tensors="pt").input_ids[0] for c in prompts]


@torch.no_grad()
def draft_rows(model, head, ids: torch.Tensor, first: int):
    """For a sequence `ids` `[n]`: per position p >= `first` (a generated token), whether the head's draft for p —
    made from position p-2's features and token p-1, as the ride-along drafts — equals the target's greedy token at p
    (= ids[p] on a greedy trajectory), and the target's top-1 probability there. Returns two `[n - first]` tensors."""
    aux_ids = head.config.aux_hidden_state_ids
    out = model(input_ids=ids[None], output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1)[None].float()  # [1, n, 3H]
    top_p = out.logits[0].float().softmax(-1).amax(-1)  # [n]: position j's top-1 probability (for token j + 1)
    greedy = out.logits[0].argmax(-1)  # [n]
    emb = model.get_input_embeddings()(ids[None]).float()  # [1, n, H]
    n = ids.shape[0]
    positions = torch.arange(n - 1)[None]
    logits, _, _ = head(aux[:, : n - 1], emb[:, 1:], positions)  # row j: features j, token j+1 -> token j+2
    drafts = head.to_target_ids(logits[0].argmax(-1))  # [n - 1]
    rows = torch.arange(first - 2, n - 2)  # row j drafts position j + 2
    right = drafts[rows] == greedy[rows + 1]
    window = head.config.attention_window or n
    head_p = logits[0, rows].float().softmax(-1).amax(-1)  # the head's confidence in its draft
    copies = {(order, reach): copy_candidates(ids.tolist(), first, reach or n, order)
              for order in (2, 3, 4) for reach in (window, None)}
    copies.update({("3 else 2", reach): torch.where(copies[(3, reach)] >= 0, copies[(3, reach)], copies[(2, reach)])
                   for reach in (window, None)})
    with_copy = {f"{order}-gram copy within {reach or 'the context'}{'' if bar is None else f' when head p < {bar}'}":
                 (torch.where((cand >= 0) & (head_p < (bar or 2.0)), cand, drafts[rows]) == greedy[rows + 1])
                 for (order, reach), cand in copies.items() for bar in (None, 0.8)}
    return right, top_p[rows + 1], copy_kinds(ids.tolist(), first, window), with_copy


def copy_candidates(ids: list, first: int, window: int, order: int) -> torch.Tensor:
    """Per position p >= `first`: the token that followed the latest earlier occurrence, within the last `window`
    tokens, of the `order` tokens before p (what prompt-lookup decoding would propose), or -1."""
    last: dict[tuple, int] = {}  # n-gram -> the position right after its latest occurrence
    out = []
    for p in range(order, len(ids)):
        gram = tuple(ids[p - order : p])
        if p >= first:
            after = last.get(gram, -1)
            out.append(ids[after] if after >= 0 and after >= p - window else -1)
        last[gram] = p
    return torch.tensor(out)


def copy_kinds(ids: list, first: int, window: int) -> torch.Tensor:
    """Per position p >= `first`: 0 if the trigram ending at p occurred earlier within the last `window` tokens,
    1 if only further back, 2 if never."""
    seen: dict[tuple, list] = {}
    kinds = []
    for p in range(2, len(ids)):
        gram = (ids[p - 2], ids[p - 1], ids[p])
        if p >= first:
            ends = seen.get(gram, [])
            kinds.append(2 if not ends else (0 if ends[-1] >= p - window else 1))
        seen.setdefault(gram, []).append(p)
    return torch.tensor(kinds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", choices=["document", "chat"], default="document")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--head", default=None, help="head directory (default: the head shipped for SmolLM2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tok = load_smollm2(device="cpu")
    head_dir = args.head or bundled_head_for(model)
    head = load_eagle3(head_dir, target_model=model, dtype=torch.float32).eval()
    rights, probs, kinds, copied = [], [], [], {}
    for prompt in trajectory_prompts(tok, args.prompt, args.sequences, args.context):
        ids = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False,
                             max_new_tokens=args.steps, pad_token_id=tok.eos_token_id)[0]
        right, p, kind, with_copy = draft_rows(model, head, ids, first=prompt.shape[0] + 1)  # drafts from step 2 on
        for name, hits in with_copy.items():
            copied.setdefault(name, []).append(hits)
        rights.append(right)
        probs.append(p)
        kinds.append(kind)
    right, p, kind = torch.cat(rights), torch.cat(probs), torch.cat(kinds)
    rows = []
    for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:]):
        inside = (p >= lo) & (p < hi)
        n = int(inside.sum())
        rows.append(dict(top1_probability=[lo, min(hi, 1.0)], steps=n, share=n / len(p),
                         draft_right=float(right[inside].float().mean()) if n else None,
                         share_of_misses=int((~right & inside).sum()) / max(1, int((~right).sum()))))
    copies = []
    for value, name in enumerate(("trigram seen within the head's window", "trigram seen only beyond it",
                                  "trigram not seen before")):
        inside = kind == value
        n = int(inside.sum())
        copies.append(dict(kind=name, steps=n, share=n / len(p),
                           draft_right=float(right[inside].float().mean()) if n else None,
                           target_top1_probability=float(p[inside].mean()) if n else None))
    lookup = {name: float(torch.cat(hits).float().mean()) for name, hits in copied.items()}
    meta = dict(command="python " + " ".join(sys.argv), head=str(head_dir), prompt=args.prompt, steps=len(p),
                draft_right=float(right.float().mean()),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=platform.machine() + " CPU")
    print(f"{args.prompt} prompt, {args.sequences} x {args.context} tokens, {len(p)} drafted steps: draft right "
          f"{meta['draft_right']:.1%}")
    print(f"{'target top-1 p':>15} {'steps':>6} {'share':>6} {'draft right':>11} {'of the misses':>13}")
    for r in rows:
        lo, hi = r["top1_probability"]
        right_s = f"{r['draft_right']:11.1%}" if r["draft_right"] is not None else f"{'-':>11}"
        print(f"{f'[{lo:.1f}, {hi:.1f})':>15} {r['steps']:6d} {r['share']:6.1%} {right_s} {r['share_of_misses']:13.1%}")
    for c in copies:
        right_s = f"{c['draft_right']:.1%}" if c["draft_right"] is not None else "-"
        prob_s = f"{c['target_top1_probability']:.2f}" if c["target_top1_probability"] is not None else "-"
        print(f"  {c['kind']:<40} {c['steps']:4d} steps ({c['share']:.0%}): draft right {right_s}, "
              f"target top-1 p {prob_s}")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"draft-misses-smollm2-{args.prompt}-{meta['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, share in lookup.items():
        print(f"  draft right with a {name}: {share:.1%} (head alone {meta['draft_right']:.1%})")
    out.write_text(json.dumps(dict(meta=meta, rows=rows, copies=copies, draft_right_with_lookup=lookup), indent=1))


if __name__ == "__main__":
    main()
