"""The EAGLE-3 head: checkpoints written in both published formats load back to the same function; a head for
another target is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oasis_cache.draft import load_eagle3, save_eagle3
from oasis_cache.draft.eagle3 import windowed_attention

from conftest import random_head as _random_head
from conftest import tiny_model


def random_head(model, seed=0):
    return _random_head(model, draft_vocab=32, scale=0.2, seed=seed)


def run(head, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = head.config
    aux = torch.randn(2, 5, 3 * c.target_hidden_size, generator=g)
    embeds = torch.randn(2, 5, c.hidden_size, generator=g)
    positions = torch.arange(5).expand(2, 5)
    logits, hidden, _ = head(aux, embeds, positions)
    return logits, hidden


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_checkpoint_roundtrip(tmp_path, fmt):
    model = tiny_model("llama", num_hidden_layers=6)
    head = random_head(model)
    save_eagle3(head, tmp_path, fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3"
    loaded = load_eagle3(tmp_path, target_model=model)
    assert loaded.config.aux_hidden_state_ids == [2, 3, 3]
    for a, b in zip(run(head), run(loaded)):
        torch.testing.assert_close(a, b)
    draft = torch.tensor([0, 5, 31])
    assert torch.equal(loaded.to_target_ids(draft), head.to_target_ids(draft))
    assert loaded.t2d.sum() == 32 and loaded.t2d[head.to_target_ids(torch.arange(32))].all()


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("window, keep", [(None, None), (3, 3), (3, 2), (1, 0)])
def test_incremental_attention_equals_full(window, keep, layers):
    """Feeding rows one by one with the returned (k, v) (`[L, B, Hkv, rows, Dh]`), trimmed to the last `keep` rows,
    equals one pass over all rows: with `window - 1` kept (what the ride-along keeps) a decode row attends without
    a mask, with `window` kept the mask drops the oldest row. A deeper head (ours) alike."""
    head = random_head(tiny_model("qwen3"))
    if layers > 1:
        head = _deepened(head, layers)
    head.config.attention_window = window
    c = head.config
    g = torch.Generator().manual_seed(0)
    aux, embeds = torch.randn(1, 7, 3 * c.target_hidden_size, generator=g), torch.randn(1, 7, c.hidden_size, generator=g)
    positions = torch.arange(7)[None]
    full, _, _ = head(aux, embeds, positions)
    past, steps = None, []
    for t in range(7):
        logits, _, kv = head(aux[:, t : t + 1], embeds[:, t : t + 1], positions[:, t : t + 1], past)
        assert kv[0].shape[:2] == (layers, 1) and kv[0].shape[-2] == 1
        past = kv if past is None else tuple(torch.cat((a, b), -2) for a, b in zip(past, kv))
        if keep is not None:
            past = tuple(x[..., max(0, x.shape[-2] - keep) :, :] for x in past)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, window", [(37, 8), (40, 8), (17, 1), (9, 4)])
def test_windowed_attention_by_chunks_equals_the_full_mask(n, window):
    """`windowed_attention` (chunks of `window` rows seeing their own and the previous chunk: how the head trains over
    long texts) gives the full causal-window attention's output and gradients, texts not a multiple of the window."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, n, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    rows = torch.arange(n)
    mask = (rows[None] <= rows[:, None]) & (rows[None] > rows[:, None] - window)
    full = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                            attn_mask=mask)
    chunked = windowed_attention(q, k, v, window, 3)
    torch.testing.assert_close(chunked, full)
    weights = torch.randn(full.shape, generator=g, dtype=torch.float64)
    expected = torch.autograd.grad((full * weights).sum(), (q, k, v))
    torch.testing.assert_close(torch.autograd.grad((chunked * weights).sum(), (q, k, v)), expected)


def _deepened(head, layers, scale=0.2, seed=3):
    """`head` deepened to `layers` decoder layers, the new ones random (not the identity)."""
    deeper = head.deepen(layers)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in deeper.post_layers.parameters():
            p.normal_(0, scale)
    return deeper


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_a_deeper_head_starts_as_its_source_and_round_trips(tmp_path, fmt):
    """`deepen` adds layers that change nothing until trained; a deeper head's checkpoint (ours: `post_layers.*`,
    speculators `layers.1.*`) loads back to the same function with its layer count; fewer layers are refused."""
    model = tiny_model("llama", num_hidden_layers=6)
    head = random_head(model)
    deeper = head.deepen(3)
    assert deeper.config.num_hidden_layers == 3 and head.config.num_hidden_layers == 1
    for a, b in zip(run(head), run(deeper)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="cannot deepen"):
        deeper.deepen(2)
    deeper = _deepened(head, 3)
    save_eagle3(deeper, tmp_path, fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config.get("transformer_layer_config") or config)["num_hidden_layers"] == 3
    if fmt == "speculators":
        from safetensors.torch import load_file

        assert any(k.startswith("layers.2.") for k in load_file(str(tmp_path / "model.safetensors")))
    loaded = load_eagle3(tmp_path, target_model=model)
    assert loaded.config.num_hidden_layers == 3
    for a, b in zip(run(deeper), run(loaded)):
        torch.testing.assert_close(a, b)


def test_head_for_another_target_is_refused(tmp_path):
    head = random_head(tiny_model("llama", num_hidden_layers=6))
    save_eagle3(head, tmp_path)
    other = tiny_model("llama", hidden_size=128, num_hidden_layers=2)
    with pytest.raises(ValueError, match="does not fit LlamaForCausalLM: it reads hidden states of size 64"):
        load_eagle3(tmp_path, target_model=other)


def test_missing_or_foreign_checkpoints_say_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_eagle3(tmp_path / "nothing-here")
    (tmp_path / "config.json").write_text("{}")
    from safetensors.torch import save_file

    save_file({"model.layers.0.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="neither an EAGLE/SpecForge"):
        load_eagle3(tmp_path)


class _Tok:
    """Just enough tokenizer for the trainer's generation step on a tiny random model."""

    eos_token_id = 2
    pad_token_id = 0
    pad_token = "<pad>"
    eos_token = "</s>"
    padding_side = "left"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return messages[0]["content"]

    def __call__(self, texts, return_tensors="pt", padding=True):
        from transformers import BatchEncoding

        ids = [[3 + (ord(c) % 90) for c in t][:24] for t in texts]
        width = max(len(x) for x in ids)
        return BatchEncoding({
            "input_ids": torch.tensor([[0] * (width - len(x)) + x for x in ids]),
            "attention_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]),
        })


def test_batched_distillation_loss_is_the_mean_of_each_text_alone():
    """The trainer runs a step's texts as one right-padded batch: its loss, gradients and agreement are those of
    the texts run one by one (each text's rows only see its own earlier rows), training-time test steps included."""
    from oasis_cache.draft.train import distill_loss

    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=4)
    head = _random_head(model, draft_vocab=32, scale=0.3)
    head.config.attention_window = 6  # shorter than the texts: the window's mask is exercised too
    embed = model.get_input_embeddings()
    draft_ids = head.to_target_ids(torch.arange(32))
    H = model.config.hidden_size
    texts = [(torch.randint(0, model.config.vocab_size, (n,)), torch.randn(n, 3 * H), torch.randn(n, 32),
              torch.randint(0, model.config.vocab_size, (n,))) for n in (11, 4, 17, 2)]  # the last has no row
    for ttt, gamma in ((1, 0.0), (3, 0.0), (3, 2.0)):
        head.zero_grad()
        loss, hits, rows = distill_loss(head, embed, texts, draft_ids, ttt, gamma)
        loss.backward()
        batched = [p.grad.clone() for p in head.parameters()]
        head.zero_grad()
        alone = [distill_loss(head, embed, [t], draft_ids, ttt, gamma) for t in texts[:3]]
        assert distill_loss(head, embed, [texts[3]], draft_ids, ttt, gamma) == (None, None, 0)
        mean = torch.stack([a[0] for a in alone]).mean()
        mean.backward()
        torch.testing.assert_close(loss, mean, atol=1e-5, rtol=1e-5)
        for a, b in zip(batched, (p.grad for p in head.parameters())):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert rows == 9 + 2 + 15 and int(hits) == sum(int(a[1]) for a in alone)


def test_confidence_weight_leans_the_loss_toward_sure_rows():
    """`distill_loss(..., confidence_weight=γ)`: one step's loss is the rows' cross-entropies averaged with weights
    p_max^γ (the target's top-1 probability on the draft vocabulary); γ = 0 is the plain mean."""
    import torch.nn.functional as F

    from oasis_cache.draft.train import distill_loss

    torch.manual_seed(1)
    model = tiny_model("llama", num_hidden_layers=4)
    head = _random_head(model, draft_vocab=32, scale=0.3)
    embed = model.get_input_embeddings()
    draft_ids = head.to_target_ids(torch.arange(32))
    n, H = 9, model.config.hidden_size
    target_logits = torch.randn(n, 32) * torch.linspace(0.1, 8.0, n)[:, None]  # from near-uniform rows to sure ones
    text = (torch.randint(0, model.config.vocab_size, (n,)), torch.randn(n, 3 * H), target_logits,
            torch.randint(0, model.config.vocab_size, (n,)))
    with torch.no_grad():
        logits, _, _ = head(text[1][None, : n - 2], embed(text[0][None, 1 : n - 1]), torch.arange(n - 2)[None])
        target = F.softmax(target_logits[1 : n - 1], -1)
        cross = -(target * F.log_softmax(logits[0].float(), -1)).sum(-1)  # [n - 2]
        sure = target.max(-1).values
        for gamma in (0.0, 1.0, 3.0):
            loss, _, _ = distill_loss(head, embed, [text], draft_ids, 1, gamma)
            expected = (cross * sure**gamma).sum() / (sure**gamma).sum()
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        assert not torch.isclose(distill_loss(head, embed, [text], draft_ids, 1, 3.0)[0], cross.mean())


def test_a_cropped_text_trains_its_rows_as_the_whole_text_does():
    """`crop_text`: with the head's attention window as the crop's history, the counted rows' loss and agreement are
    those of the same rows in the whole text (the head sees no further back); the history rows are not counted."""
    import random

    from oasis_cache.draft.train import crop_text, distill_loss

    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=4)
    head = _random_head(model, draft_vocab=32, scale=0.3)
    head.config.attention_window = 6
    embed = model.get_input_embeddings()
    draft_ids = head.to_target_ids(torch.arange(32))
    H, n = model.config.hidden_size, 40
    text = (torch.randint(0, model.config.vocab_size, (n,)), torch.randn(n, 3 * H), torch.randn(n, 32),
            torch.randint(0, model.config.vocab_size, (n,)))
    for end_share, seed in ((1.0, 0), (0.0, 3)):
        crop = crop_text(text, 10, 6, random.Random(seed), end_share)
        start_skip = crop[4]
        kept = crop[0].shape[0] - 2  # rows in the crop
        assert kept - start_skip == 10 and start_skip == 6
        # the same rows counted in the whole text: the text up to the crop's end, its earlier rows not counted
        offset = next(o for o in range(n) if torch.equal(text[1][o : o + kept + 2], crop[1]))
        if end_share == 1.0:
            assert offset + kept == n - 2
        whole = (*(t[: offset + kept + 2] for t in text), offset + start_skip)
        loss_crop, hits_crop, rows_crop = distill_loss(head, embed, [crop], draft_ids, 1)
        loss_whole, hits_whole, rows_whole = distill_loss(head, embed, [whole], draft_ids, 1)
        torch.testing.assert_close(loss_crop, loss_whole, atol=1e-5, rtol=1e-5)
        assert rows_crop == rows_whole == 10 and int(hits_crop) == int(hits_whole)
        assert distill_loss(head, embed, [crop], draft_ids, 2)[0].isfinite()
    assert crop_text(text, 50, 6, random.Random(0))[4] == 0  # a text shorter than the crop stays whole


def test_trainer_learns_and_resumes(tmp_path):
    from oasis_cache.draft.train import evaluate, train

    model = tiny_model("llama", num_hidden_layers=4)
    prompts = [f"prompt number {i} about topic {i % 7}" for i in range(24)]
    kw = dict(draft_vocab=48, ttt=2, lr=3e-3, seq_per_step=4, max_new_tokens=24, save_every=10, progress=False,
              prompts=prompts)
    first = train(model, _Tok(), tmp_path, steps=10, cache_features=True, **kw)
    assert (tmp_path / "head" / "model.safetensors").exists() and (tmp_path / "data.pt").exists()
    resumed = train(model, _Tok(), tmp_path, steps=60, resume=True, **kw)
    assert 0.0 <= first["top1_agreement"] <= 1.0
    assert resumed["top1_agreement"] > first["top1_agreement"], (first, resumed)
    head = load_eagle3(tmp_path / "head", target_model=model)
    texts = torch.load(tmp_path / "data.pt")
    assert evaluate(head, model, texts[:3])["top1_agreement"] >= 0.0
    # a run started from that head on that data (copied, not generated again) begins where the head is
    start = train(model, _Tok(), tmp_path / "init", steps=0, init_head=tmp_path / "head", data=tmp_path / "data.pt",
                  **kw)
    assert start["top1_agreement"] == pytest.approx(resumed["top1_agreement"])
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "init" / "data.pt"), texts))
    assert torch.equal(load_eagle3(tmp_path / "init" / "head", target_model=model).d2t, head.d2t)
    # deepened from that head: the same drafts before training; two layers train (training-time test included)
    deep = train(model, _Tok(), tmp_path / "deep", steps=0, init_head=tmp_path / "head", data=tmp_path / "data.pt",
                 layers=2, **kw)
    assert deep["layers"] == 2 and deep["top1_agreement"] == pytest.approx(resumed["top1_agreement"])
    deep = train(model, _Tok(), tmp_path / "deep", steps=3, resume=True, layers=2, **kw)
    assert deep["steps"] == 3 and load_eagle3(tmp_path / "deep" / "head").config.num_hidden_layers == 2
    # cropped texts train too (windows of 8 rows with the head's window as history); a crop under one row is refused
    cropped = train(model, _Tok(), tmp_path / "crop", steps=3, crop=8, data=tmp_path / "data.pt", **kw)
    assert cropped["steps"] == 3 and 0.0 <= cropped["top1_agreement"] <= 1.0
    # a narrower MLP than the target's (what keeps a shipped head small) trains, saves and loads with its width
    narrow = train(model, _Tok(), tmp_path / "narrow", steps=2, intermediate_size=24, data=tmp_path / "data.pt", **kw)
    assert narrow["steps"] == 2 and load_eagle3(tmp_path / "narrow" / "head").config.intermediate_size == 24
    with pytest.raises(ValueError, match="crop"):
        train(model, _Tok(), tmp_path / "crop0", steps=1, crop=0, data=tmp_path / "data.pt", **kw)
    # a cosine schedule ends near 0 (the last step's rate is what the saved optimizer holds); a wrong name fails
    cosine = train(model, _Tok(), tmp_path / "cosine", steps=10, lr_schedule="cosine", data=tmp_path / "data.pt",
                   **kw)
    last = torch.load(tmp_path / "cosine" / "trainer.pt")["optimizer"]["param_groups"][0]["lr"]
    assert cosine["lr_schedule"] == "cosine" and 0.0 < last < 0.01 * kw["lr"]
    with pytest.raises(ValueError, match="schedule"):
        train(model, _Tok(), tmp_path / "bad", steps=1, lr_schedule="linear", data=tmp_path / "data.pt", **kw)
    # a time limit stops at a step boundary, still saves and evaluates
    stopped = train(model, _Tok(), tmp_path / "limited", steps=50, time_limit=0.0, **kw)
    assert stopped["steps"] == 0 and (tmp_path / "limited" / "head" / "model.safetensors").exists()


def test_learning_rate_schedules():
    from oasis_cache.draft.train import learning_rate

    assert learning_rate(1e-3, "constant", 0.7, 3) == 1e-3
    rates = [learning_rate(1.0, "cosine", p, s) for p, s in [(0.0, 0), (0.0, 49), (0.5, 500), (1.0, 1000), (2.0, 9)]]
    assert rates[0] == pytest.approx(1 / 50) and rates[1] == pytest.approx(1.0)  # the warm-up, then the peak
    assert rates[2] == pytest.approx(0.5) and rates[3] == pytest.approx(0.0, abs=1e-12) and rates[4] < 1e-12


def test_texts_of_several_runs_keep_their_own_held_out_split(tmp_path):
    from oasis_cache.draft.train import train
    from oasis_cache.draft.training_data import load_texts, split_texts

    a = [torch.full((5,), i) for i in range(40)]
    b = [torch.full((5,), 40 + i % 50) for i in range(60)]
    held_a, train_a = split_texts([a], 0.05, seed=0)
    held, train_ids = split_texts([a, b], 0.05, seed=0)
    assert len(held_a) == 2 and held[:2] == held_a and train_ids[:38] == train_a
    assert len(held) == 2 + 3 and len(train_ids) == 38 + 57 and all(int(t[0]) >= 40 for t in held[2:])
    # the trainer reads several data files that way
    torch.save([t.to(torch.int32) for t in a], tmp_path / "a.pt")
    torch.save([t.to(torch.int32) for t in b], tmp_path / "b.pt")
    model = tiny_model("llama", num_hidden_layers=4)
    metrics = train(model, _Tok(), tmp_path / "out", steps=0, draft_vocab=48, progress=False,
                    data=[tmp_path / "a.pt", tmp_path / "b.pt"])
    assert metrics["held_out"] == 5 and metrics["sequences"] == 95
    # their texts are kept as two parts: the same split when the run is resumed (or its data.pt reused)
    parts = load_texts(tmp_path / "out" / "data.pt")
    assert [len(part) for part in parts] == [40, 60] and torch.equal(parts[1][7], b[7])
    again = train(model, _Tok(), tmp_path / "again", steps=0, draft_vocab=48, progress=False,
                  data=tmp_path / "out" / "data.pt")
    assert again["held_out"] == 5 and again["sequences"] == 95
    held_again = split_texts(load_texts(tmp_path / "again" / "data.pt"), 0.05, seed=0)[0]
    assert len(held_again) == 5 and all(torch.equal(x, y) for x, y in zip(held_again, held))
    with pytest.raises(ValueError, match="documents"):
        train(model, _Tok(), tmp_path / "none", steps=0, draft_vocab=48, progress=False, chats=False)


def test_document_prompts_are_long_windows_with_a_question():
    from oasis_cache.draft.training_data import DOCUMENT_QUESTIONS, document_prompts
    from oasis_cache.loaders import load_smollm2

    tokenizer = load_smollm2()[1]
    prompts = document_prompts(tokenizer, 3, 300, seed=1)
    assert prompts == document_prompts(tokenizer, 3, 300, seed=1) and len(set(prompts)) == 3
    for prompt in prompts:
        assert any(prompt.endswith(q) for q in DOCUMENT_QUESTIONS)
        assert 290 <= len(tokenizer(prompt)["input_ids"]) <= 340
    # to be continued as plain text: the same windows, no question
    plain = document_prompts(tokenizer, 3, 300, seed=1, question=False)
    for window, prompt in zip(plain, prompts):
        assert prompt.startswith(window + "\n\n") and not any(window.endswith(q) for q in DOCUMENT_QUESTIONS)


def test_documents_continued_as_plain_text(tmp_path, monkeypatch):
    """`continue_documents`: the long windows (no question) are continued without a chat turn; the seed prompts stay
    chats. Without it, windows with a question are chats among the seed prompts."""
    import oasis_cache.draft.train as trainer

    class ChatTok(_Tok):
        chat_template = "#"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return "#" + messages[0]["content"]  # a chat turn starts with '#': token 3 + ord('#') % 90

    calls = []
    real = trainer.generate_corpus

    def spy(model, tokenizer, prompts, chat=None, greedy=False, **kw):
        calls.append((list(prompts), chat) + (("greedy",) if greedy else ()))
        return real(model, tokenizer, prompts, chat=chat, greedy=greedy, **kw)

    monkeypatch.setattr(trainer, "generate_corpus", spy)
    monkeypatch.setattr(trainer, "held_out_document", lambda tokenizer, tokens: torch.arange(3, 40))
    monkeypatch.setattr(trainer, "document_prompts", lambda tokenizer, count, tokens, seed, source, question=True: [
        f"window {i}" + (" ask" if question else "") for i in range(count)])
    model = tiny_model("llama", num_hidden_layers=4)
    kw = dict(steps=0, draft_vocab=48, progress=False, documents=2, prompts=["p one", "p two"], max_new_tokens=4)
    trainer.train(model, ChatTok(), tmp_path / "plain", continue_documents=True, **kw)
    assert calls == [(["p one", "p two"], None), (["window 0", "window 1"], False)]
    texts = torch.load(tmp_path / "plain" / "data.pt")
    assert [int(t[0]) for t in texts] == [3 + ord("#") % 90] * 2 + [3 + ord("w") % 90] * 2
    calls.clear()
    trainer.train(model, ChatTok(), tmp_path / "chat", **kw)
    assert calls == [(["p one", "p two", "window 0 ask", "window 1 ask"], None)]
    # greedy responses: the same texts whatever the seed (sampled ones differ)
    texts = {}
    for greedy in (False, True):
        for seed in (0, 1):
            calls.clear()
            out = tmp_path / f"greedy-{greedy}-{seed}"
            trainer.train(model, ChatTok(), out, continue_documents=True, greedy=greedy, seed=seed, **kw)
            assert all(c[-1] == "greedy" for c in calls) == greedy
            texts[greedy, seed] = torch.load(out / "data.pt")
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert same(texts[True, 0], texts[True, 1]) and not same(texts[False, 0], texts[False, 1])


def _save_tiny_target(directory: Path) -> None:
    """A tiny random Llama and a word-level tokenizer (no chat template: a base model), saved as a model directory
    as `transformers` writes one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from oasis_cache.draft.training_data import seed_prompts

    words = sorted({w for p in seed_prompts() for w in p.lower().split()})[: 96 - 3]
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    tokenizer.save_pretrained(directory)
    model = tiny_model("llama", num_hidden_layers=4)
    model.config.eos_token_id, model.config.pad_token_id = 2, 1
    model.save_pretrained(directory)


@pytest.mark.audit  # (20-40 s on 2 cores: CI runs it after the README's test command)
def test_trainer_command_trains_a_head_for_a_model_directory(tmp_path):
    """`python -m oasis_cache.draft.train --target DIR`: any causal LM saved as a directory (here a tiny random one
    with a base tokenizer: the prompts are continued as they are), offline; the head it writes loads for that model
    and records it as its target."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from oasis_cache.draft import bundled

    target, out = tmp_path / "model", tmp_path / "head-run"
    _save_tiny_target(target)
    run = subprocess.run([sys.executable, "-m", "oasis_cache.draft.train", "--target", str(target), "--out", str(out),
                          "--steps", "3", "--max-new-tokens", "4", "--draft-vocab", "32", "--device", "cpu", "--quiet"],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads(run.stdout.strip().splitlines()[-1])
    assert metrics["steps"] == 3 and 0.0 <= metrics["top1_agreement"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(target)
    head = load_eagle3(out / "head", target_model=model)
    assert head.config.draft_vocab_size == 32
    assert bundled.matches(json.loads((out / "head" / "target.json").read_text()), model)
    bad = subprocess.run([sys.executable, "-m", "oasis_cache.draft.train", "--target", str(tmp_path / "missing"),
                          "--out", str(out), "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "a local directory with config.json" in bad.stderr


class _CharTokenizer:
    """One id per character: enough for the document corpus functions."""

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_document_sources_are_large_distinct_and_deterministic():
    from oasis_cache.draft.training_data import HELD_OUT_DOCUMENT_TOKENS, _documentation_ids, document_ids, document_prompts
    from oasis_cache.draft.training_data import stdlib_docstrings

    tok = _CharTokenizer()
    docs, docstrings, mixed = (document_ids(tok, source) for source in ("docs", "docstrings", "mixed"))
    assert docs == _documentation_ids(tok)[HELD_OUT_DOCUMENT_TOKENS:]  # the held-out start stays out
    assert mixed == docs + docstrings
    texts = stdlib_docstrings()
    assert len(docstrings) > len(docs) and all(len(t) >= 200 for t in texts)  # more text than the documentation
    import sysconfig

    tests = Path(sysconfig.get_paths()["stdlib"]) / "test" / "support" / "__init__.py"
    if tests.exists():  # the regression tests' own docstrings stay out
        import ast

        own = [ast.get_docstring(n) for n in ast.walk(ast.parse(tests.read_text())) if isinstance(
            n, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n) and len(ast.get_docstring(n)) >= 200]
        assert own and not set(own) & set(texts)
    prompts = document_prompts(tok, 4, 500, seed=2, source="docstrings")
    assert prompts == document_prompts(tok, 4, 500, seed=2, source="docstrings") and len(set(prompts)) == 4
    assert all(p[:500] in tok.decode(docstrings) for p in prompts)
    with pytest.raises(ValueError, match="document source"):
        document_ids(tok, "web")


def test_mixed_and_code_windows_come_from_each_source_alike():
    """"mixed+code" (the Qwen head's data): windows from the documentation, the docstrings and the package code in
    about equal numbers (not by length: the code is ~72% of the tokens), deterministic by seed."""
    from oasis_cache.draft.training_data import document_ids, document_prompts

    tok = _CharTokenizer()
    texts = {part: tok.decode(document_ids(tok, part)) for part in ("docs", "docstrings", "code")}
    prompts = document_prompts(tok, 60, 300, seed=4, source="mixed+code", question=False)
    assert prompts == document_prompts(tok, 60, 300, seed=4, source="mixed+code", question=False)
    counts = {part: sum(p in text for p in prompts) for part, text in texts.items()}
    assert sum(counts.values()) == 60 and all(12 <= n <= 28 for n in counts.values()), counts


def test_code_source_is_the_packages_code_without_docstrings_and_never_the_held_out_modules():
    """`--document-source code`: the code of the standard library's packages, docstrings removed (training text for
    a coder model's head); `eval/recall.py --text code` reads the top-level modules, which never appear in it."""
    from oasis_cache.draft.training_data import document_ids, stdlib_code

    tok = _CharTokenizer()
    code = document_ids(tok, "code")
    assert document_ids(tok, "mixed+code") == document_ids(tok, "mixed") + code
    text = tok.decode(code)
    headers = [line[2:] for line in text.splitlines() if line.startswith("# ") and line.endswith(".py")]
    assert len(headers) > 100 and all("/" in h for h in headers)  # packages' modules only
    assert not any(h.startswith(("test/", "lib2to3/")) or "/tests/" in h for h in headers)
    held_out = {t.split("\n", 1)[0][2:] for t in stdlib_code(top_level=True)}
    assert held_out and not held_out & set(headers)
    assert "# json/decoder.py" in text and "class JSONDecoder" in text
    assert "Simple JSON <https://json.org> decoder" not in text  # json.decoder's class docstring is gone


def test_head_kv_ring_gives_the_last_rows_in_order():
    """`HeadKV` with a window of 4: after a prompt and single-row writes that wrap the ring, `past()` is the last 3
    rows in order and `valid` marks what is filled (the new row itself last)."""
    from oasis_cache.draft.head_window import HeadKV

    rows = torch.arange(20.0).view(1, 1, 20, 1)  # row i holds the value i
    kv = HeadKV(window=4)
    kv.store(rows[:, :, :2], -rows[:, :, :2])  # a 2-row prompt: the ring is not full
    assert kv.past()[0].flatten().tolist() == [0, 1] and kv.valid.tolist() == [[True, True, False, True]]
    for i in range(2, 9):
        kv.write_one(rows[:, :, i : i + 1], -rows[:, :, i : i + 1])
        assert kv.past()[0].flatten().tolist() == list(range(max(0, i - 2), i + 1))
        assert torch.equal(kv.past()[1], -kv.past()[0])
    assert kv.valid.all()
    kv.store(rows[:, :, 9:11], -rows[:, :, 9:11])  # an extend of two rows
    assert kv.past()[0].flatten().tolist() == [8, 9, 10]
