"""Kernel tests: Triton runs in its CPU interpreter when no CUDA device is present (the root conftest sets
TRITON_INTERPRET)."""

import os

import pytest
import torch


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def cpu_interpreter():
    pytest.importorskip("triton")
    if not interpreted():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set automatically without CUDA)")


@pytest.fixture
def cuda_device():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() or interpreted():
        pytest.skip("needs a CUDA device and compiled Triton")
    return torch.device("cuda")
