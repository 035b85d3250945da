"""The examples a user runs first: the notebook (executed headless, every cell) and the scripts under `examples/`,
on SmolLM2 with small sizes. A failing cell or script fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_script(name: str, *args: str) -> str:
    run = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.audit  # (20-40 s on 2 cores: CI runs it after the README's test command)
def test_notebook_runs_every_cell():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    env_before = os.environ.get("OASIS_NOTEBOOK_CONTEXT")
    os.environ["OASIS_NOTEBOOK_CONTEXT"] = "600"  # the kernel inherits it: a short document in CI
    try:
        nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("OASIS_NOTEBOOK_CONTEXT")
        else:
            os.environ["OASIS_NOTEBOOK_CONTEXT"] = env_before
    text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "OasisCache for LlamaForCausalLM" in text and "lookahead 'none' (picked: on the CPU" in text
    assert "Warning" not in text, text  # (tqdm's IProgress warning without ipywidgets, among others)
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in notebook.cells for o in c.get("outputs", []))  # the selection picture


def test_chat_example_reuses_the_cache():
    out = run_script("chat.py", "--max-new-tokens", "6")
    runs = [line for line in out.splitlines() if "prompt tokens run so far" in line]
    assert len(runs) == 3
    ran, fresh = (int(x.strip(")")) for x in runs[-1].split("so far ")[1].split(", with a new cache per turn "))
    assert ran < fresh  # the earlier turns were not run again


def test_batch_and_pipeline_examples_run():
    out = run_script("batch.py", "--lengths", "400", "300", "350", "--max-new-tokens", "6")
    assert out.count("(planted:") == 3 and "OasisCache for" in out
    out = run_script("pipeline.py", "--max-new-tokens", "6")
    assert "OasisCache for" in out


def test_selection_picture_example(tmp_path):
    out = run_script("selection.py", "--context", "600", "--budget", "256", "--max-new-tokens", "6", "--out",
                     str(tmp_path / "selection.png"))
    assert "the planted fact starts near token" in out and (tmp_path / "selection.png").stat().st_size > 10_000


def test_the_readmes_headline_line_runs_without_a_warning():
    """The README's first Python line, run as written (a tiny model and inputs in its place), on the installed
    transformers: no FutureWarning or DeprecationWarning (transformers 5.24+ warns for `past_key_values=`)."""
    import re
    import warnings

    import torch

    from conftest import prompt_ids, tiny_model

    readme = (ROOT / "README.md").read_text()
    line = re.search(r"```python\n(.*?)\n```", readme, re.S).group(1)
    assert "OasisCache(" in line and "generate_kwargs()" in line
    scope = {"model": tiny_model("llama"), "inputs": {"input_ids": prompt_ids(40)}, "torch": torch}
    exec("from oasis_cache import OasisCache", scope)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        exec(line.replace("max_new_tokens=512", "max_new_tokens=4, pad_token_id=0"), scope)
    assert scope["out"].shape[1] == 44
