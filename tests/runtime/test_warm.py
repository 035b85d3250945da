"""`python -m oasis_cache.warm`: a machine's kernels compiled ahead of a process's first `generate`. The
CUDA test that a warmed machine's first generate compiles nothing is in test_cuda.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from oasis_cache.warm import first_layers, warm

from conftest import HYBRIDS, LINEAR, _COMMON


def test_first_layers_keep_one_of_each_kind_and_at_least_two():
    llama = transformers.LlamaConfig(num_hidden_layers=6)
    assert first_layers(llama).num_hidden_layers == 2 and llama.num_hidden_layers == 6  # (a copy)
    config_name, _, extra = HYBRIDS["qwen3_5"]
    hybrid = getattr(transformers, config_name)(**{**_COMMON, **LINEAR, **extra, "num_hidden_layers": 8,
                                                   "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                                                   + ["linear_attention"] * 3 + ["full_attention"]})
    small = first_layers(hybrid)
    assert small.num_hidden_layers == 4 and small.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    one = transformers.LlamaConfig(num_hidden_layers=1)
    assert first_layers(one).num_hidden_layers == 1


def test_warm_runs_a_generate_of_the_first_layers_on_the_cpu():
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    done = warm(config, context=[200, 90], token_budget=64, device="cpu", dtype=torch.float32,
                advanced=dict(sink_tokens=16, recent_tokens=16))
    assert done["layers"] == 2 and done["seconds"] > 0
    with pytest.raises(ValueError, match="context, batch and new_tokens must be positive"):
        warm(config, context=0, device="cpu")


def test_the_command_reads_a_config_folder_and_names_what_is_wrong(tmp_path):
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    run = [sys.executable, "-m", "oasis_cache.warm", str(tmp_path)]
    done = subprocess.run(run + ["--context", "100", "60", "--device", "cpu", "--dtype", "float32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "warmed LlamaConfig (2 of 3 layers run) at 1 x 100 / 60, token_budget 2048, on cpu" in done.stdout
    done = subprocess.run(run + ["--context", "100", "--device", "cpu", "--dtype", "int"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--dtype 'int' is not a floating-point torch dtype" in done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run(run + ["--context", "100"], capture_output=True, text=True)
        assert done.returncode == 2 and "no CUDA device" in done.stderr and "Traceback" not in done.stderr


def test_warm_takes_a_multimodal_config_s_text_model():
    """A config with a text config inside (Qwen3.5's, with its vision tower): its text model's first layers run."""
    text = {**_COMMON, **LINEAR, "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2}
    config = transformers.Qwen3_5Config(text_config=text)
    small = first_layers(config)
    assert small.get_text_config().num_hidden_layers == 2 and config.get_text_config().num_hidden_layers == 4
    done = warm(config, context=120, token_budget=64, device="cpu", dtype=torch.float32,
                advanced=dict(sink_tokens=16, recent_tokens=16))
    assert done["layers"] == 2
