"""The Triton block-gather kernel against a plain-PyTorch expectation over a grid of shapes and dtypes: on CPU through
Triton's interpreter (raw host addresses, as on the GPU through unified addressing), on CUDA for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasis_cache.kernels.gather import triton_available

from gather_cases import CASES, check_case

HERE = Path(__file__).parent


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_gather_kernel_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run([sys.executable, str(HERE / "gather_cases.py"), "cpu"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("OK") == len(CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])) + str(c[7]).split(".")[-1])
def test_gather_kernel_on_cuda(case):
    assert check_case(*case, device=torch.device("cuda"))
