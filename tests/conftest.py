"""Root test options: `--run-slow` enables the soak/load tests marked `@pytest.mark.slow` (skipped by default).

Without CUDA, Triton kernels run in its CPU interpreter: TRITON_INTERPRET is set here, at configuration time,
before any test imports a private `inkling_kernels._triton_*` module (the public kernel functions import them lazily).
"""

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run tests marked slow (soak and load variants)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def cpu_interpreter():
    """Tests that run Triton kernels in the CPU interpreter (the default without CUDA)."""
    pytest.importorskip("triton")
    if not interpreted():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set automatically without CUDA)")


@pytest.fixture
def cuda_device():
    """Tests of compiled kernels on a CUDA device."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() or interpreted():
        pytest.skip("needs a CUDA device and compiled Triton")
    return torch.device("cuda")
