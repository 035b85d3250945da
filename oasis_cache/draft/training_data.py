"""The texts an EAGLE-3 head is trained on (`draft/train.py`): the target's own answers to the shipped seed prompts,
long windows of Python's documentation, its standard library's docstrings or code with a question, split into training
and held-out texts; and the draft vocabulary they make."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

SEED_PROMPTS = Path(__file__).with_name("seed_prompts.txt")


def seed_prompts() -> list[str]:
    return [line.strip() for line in SEED_PROMPTS.read_text().splitlines() if line.strip()]


DOCUMENT_QUESTIONS = [
    "Explain in detail what the text above describes, section by section.",
    "Summarize the text above.",
    "What are the most important points of the text above?",
    "Write questions a student could ask about the text above, and answer them.",
    "Continue the text above in the same style.",
]


# The first tokens of Python's documentation are held out of training: eval/recall.py measures the head there.
HELD_OUT_DOCUMENT_TOKENS = 16384


DOCUMENT_SOURCES = ("docs", "docstrings", "mixed", "code", "mixed+code")


# Directories of the standard library left out of the docstring corpus: tests, and code that is not the library's.
_NOT_LIBRARY = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def _documentation_ids(tokenizer) -> list[int]:
    """Python's documentation (`pydoc_data.topics`, ships with CPython) as token ids (~113K for SmolLM2)."""
    import pydoc_data.topics as topics

    return tokenizer("\n\n".join(topics.topics.values()))["input_ids"]


@functools.lru_cache(maxsize=2)
def stdlib_docstrings(min_chars: int = 200) -> tuple[str, ...]:
    """The docstrings (modules, classes, functions) of at least `min_chars` characters of the standard library that
    ships with this Python, in file order, tests excluded: prose in the documentation's style, ~1.3 MB on CPython
    3.11 (about 3x the documentation), so long training windows need not repeat the same text."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if _NOT_LIBRARY.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    texts.append(doc)
    return tuple(texts)


def stdlib_code(top_level: bool):
    """The standard library's own code, module by module (name order), each as `# <path>\n<code>` with every
    docstring removed and comments dropped (`ast.unparse`): the top-level modules (`Lib/*.py`: `eval/recall.py
    --text code` holds them out, ~2.9 MB on CPython 3.11) or, `top_level=False`, the modules of its packages
    (`Lib/*/**.py`, tests and vendored code excluded: training text for a coder model's head). A generator."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py")) if top_level else sorted(
        p for p in root.glob("*/**/*.py") if not _NOT_LIBRARY.intersection(p.relative_to(root).parts))
    for path in paths:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                    isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        yield f"# {path.relative_to(root).as_posix()}\n{ast.unparse(tree)}\n\n"


@functools.lru_cache(maxsize=1)
def _package_code() -> str:
    """`stdlib_code(top_level=False)` as one text (~3.8 MB on CPython 3.11; ~6 s to build, once)."""
    return "".join(stdlib_code(top_level=False))


def document_ids(tokenizer, source: str = "docs") -> list[int]:
    """The token ids long training windows are drawn from: "docs" (Python's documentation without its first
    `HELD_OUT_DOCUMENT_TOKENS` tokens, which `eval/recall.py` and the held-out check read), "docstrings" (the
    standard library's, `stdlib_docstrings`), "mixed" (both, one after the other), "code" (the code of the standard
    library's packages, `stdlib_code(top_level=False)`: `eval/recall.py --text code` reads the top-level modules)
    or "mixed+code" (all three, one after the other; `document_prompts` draws its windows from each of the three in
    equal shares)."""
    if source not in DOCUMENT_SOURCES:
        raise ValueError(f"document source must be one of {DOCUMENT_SOURCES}, got {source!r}")
    ids = []
    if source in ("docs", "mixed", "mixed+code"):
        ids += _documentation_ids(tokenizer)[HELD_OUT_DOCUMENT_TOKENS:]
    if source in ("docstrings", "mixed", "mixed+code"):
        ids += tokenizer("\n\n".join(stdlib_docstrings()))["input_ids"]
    if source in ("code", "mixed+code"):
        ids += tokenizer(_package_code())["input_ids"]
    return ids


def document_prompts(tokenizer, count: int, tokens: int, seed: int = 0, source: str = "docs",
                     question: bool = True) -> list[str]:
    """`count` long prompts: a `tokens`-token window of `document_ids(tokenizer, source)` and a question about it
    (`question=False`: the window alone, to be continued as plain text), so that the head also sees the target's
    features deep into long contexts. "mixed+code" draws each window from the documentation, the docstrings or the
    package code with equal odds (by length, code would take ~72% of the windows and the documentation ~7%: a head
    for both kinds of text needs both)."""
    parts = [document_ids(tokenizer, part) for part in ("docs", "docstrings", "code")] if source == "mixed+code" \
        else [document_ids(tokenizer, source)]
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids = parts[0] if len(parts) == 1 else rng.choice(parts)
        start = rng.randrange(0, max(1, len(ids) - tokens))
        ask = rng.choice(DOCUMENT_QUESTIONS)  # drawn either way: the same windows for a seed
        prompts.append(tokenizer.decode(ids[start : start + tokens]) + ("\n\n" + ask if question else ""))
    return prompts


def held_out_document(tokenizer, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of Python's documentation (never trained on): the head's long-context check."""
    return torch.tensor(_documentation_ids(tokenizer)[:tokens])


@torch.no_grad()
def generate_corpus(model, tokenizer, prompts, max_new_tokens=256, batch_size=16, seed=0,
                    chat=None, greedy=False) -> list[torch.Tensor]:
    """The target's own chat transcripts (prompt + response sampled at temperature 0.7, top-p 0.95; `greedy`: the
    greedy response), one token tensor each. A tokenizer without a chat template (a base model), or `chat=False`,
    continues the plain prompts."""
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    texts = []
    for i in range(0, len(prompts), batch_size):
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) if chat else p
                 for p in prompts[i : i + batch_size]]
        enc = tokenizer(chats, return_tensors="pt", padding=True).to(model.device)
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
        width = enc["input_ids"].shape[1]
        for row, mask in zip(out, enc["attention_mask"]):
            prompt, response = row[:width][mask.bool()], row[width:]
            ends = (response == tokenizer.eos_token_id).nonzero()
            if len(ends):
                response = response[: int(ends[0]) + 1]
            texts.append(torch.cat((prompt, response)).cpu())
    return texts


def draft_vocabulary(texts: list[torch.Tensor], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target ids (ties: lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in texts:
        counts += torch.bincount(ids, minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)  # ties: the lower id first
    return order[:draft_vocab_size].sort().values


def load_texts(path) -> list[list[torch.Tensor]]:
    """A `data.pt`'s texts as parts, one per run that made them: a run's file holds its token tensors `[n]`; a run on
    several files (`train(data=[...])`) keeps a list per file, each of which `split_texts` splits on its own."""
    saved = torch.load(path)
    parts = saved if saved and isinstance(saved[0], list) else [saved]
    return [[t.long() for t in part] for part in parts]


HELD_OUT_SHARE = 0.05  # of each data file's texts, kept out of training (`split_texts`)


def split_texts(parts, held_out: float, seed: int):
    """`(held, train)` texts: each part (one run's texts) holds out its own `held_out` share (at least one), drawn
    with `seed` — the same texts whichever other parts come with it."""
    held, train_ids = [], []
    for part in parts:
        order = list(range(len(part)))
        random.Random(seed).shuffle(order)
        n_held = max(1, int(len(part) * held_out))
        held += [part[i] for i in order[:n_held]]
        train_ids += [part[i] for i in order[n_held:]]
    return held, train_ids
