"""The Triton kernels (block gather, block scores, slot assignment) against their plain-PyTorch references over
grids of shapes and dtypes: on CPU through Triton's interpreter (raw host addresses for the gather, as on the GPU
through unified addressing), on CUDA for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasis_cache.kernels.gather import triton_available

from kernel_cases import ASSIGN_CASES, CASES, SCORE_CASES, check_assign, check_case, check_scores

HERE = Path(__file__).parent


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run([sys.executable, str(HERE / "kernel_cases.py"), "cpu"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("OK") == len(CASES) + 1 + len(SCORE_CASES) + len(ASSIGN_CASES), run.stdout


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_decode_pipeline_with_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run([sys.executable, str(HERE / "pipeline_with_kernels.py")], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])) + str(c[7]).split(".")[-1])
def test_gather_kernel_on_cuda(case):
    assert check_case(*case, device=torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_block_scores_kernel_on_cuda(case):
    assert check_scores(*case, device=torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", ASSIGN_CASES, ids=str)
def test_slot_assign_kernel_on_cuda(case):
    assert check_assign(*case, device=torch.device("cuda"))
