"""lm-eval-harness runs offline on the suite's tasks with the "oasis" model; with a budget covering the context it
generates exactly what the `hf` model generates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is a test extra: pip install -e '.[test]'")

from eval.lm_eval_tasks.build import build  # noqa: E402
from oasis_cache import OasisCache  # noqa: E402
from oasis_cache.loaders import load_smollm2  # noqa: E402
from oasis_cache.loaders.smollm2 import DEFAULT_CACHE_DIR  # noqa: E402
from oasis_cache.runtime.build import cache_kwargs


def run(tmp_path, model, model_args, name):
    from oasis_cache.integrations.lm_eval import main

    out = tmp_path / name
    main(["--model", model, "--model_args", model_args, "--tasks", "oasis_single_needle",
          "--include_path", str(tmp_path / "tasks"), "--apply_chat_template", "--batch_size", "2",
          "--device", "cpu", "--output_path", str(out), "--log_samples"])
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_*.jsonl")).read_text().splitlines()]
    return results["results"]["oasis_single_needle"], {s["doc_id"]: s["resps"] for s in samples}


@pytest.mark.audit  # (~60 s on 2 cores)
def test_lm_eval_oasis_model_offline(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_smollm2()[1]  # also writes the fp32 copy that `hf` loads below
    build(tmp_path / "tasks", ["single_needle"], [512], 2, "pydoc", tokenizer)

    import oasis_cache.integrations.lm_eval as integration

    made = []  # every model_args option reaches the cache (and the budget still covers the context)
    monkeypatch.setattr(integration, "OasisCache", lambda model, **options: made.append(options) or OasisCache(
        model, **cache_kwargs(options)))
    oasis, oasis_out = run(tmp_path, "oasis", "pretrained=smollm2,token_budget=2048,scorer=bits,fp8_levels=False,"
                           "exact=True,lookahead=previous,max_decode_tokens=8", "oasis")
    hf, hf_out = run(tmp_path, "hf", f"pretrained={DEFAULT_CACHE_DIR},dtype=float32", "hf")
    assert 0.0 <= oasis["string_match_all,none"] <= 1.0
    assert oasis_out == hf_out  # budget >= context: the same generations as HF's own model
    assert "not of type `str`" not in capfd.readouterr().err  # (lm-eval's warning for a model object passed as
    # `pretrained`: the offline models go by their checkpoint's path)
    assert made and all(o == dict(token_budget=2048, exact=True, lookahead="previous", advanced=dict(
        scorer="bits", fp8_levels=False, max_decode_tokens=8)) for o in made)
    assert {"cuda_graph", "draft", "chain_drafts", "measure", "token_budget"} <= set(integration.CACHE_OPTIONS)
