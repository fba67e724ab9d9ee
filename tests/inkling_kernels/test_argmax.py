import pytest
import torch

from inkling_kernels import argmax
from inkling_kernels.argmax import argmax_rows, argmax_rows_reference


@pytest.fixture
def small_chunks(monkeypatch):
    """16-column chunks, 4 keys per reduce step: rows of a few dozen columns span several of both."""
    monkeypatch.setattr(argmax, "CHUNK", 16)
    monkeypatch.setattr(argmax, "_REDUCE_BLOCK", 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 16, 77, 300])
def test_argmax_rows_matches_torch_with_ties(cpu_interpreter, small_chunks, dtype, n):
    """Values on a coarse grid (many equal maxima, in one chunk and across chunks), a strided view of wider rows."""
    gen = torch.Generator().manual_seed(n)
    values = torch.randint(-3, 4, (5, n + 7), generator=gen).to(dtype)[:, :n]
    values[1] = 3  # every column equal: the first
    values[2, -1] = 9  # the last column alone
    assert torch.equal(argmax_rows(values), argmax_rows_reference(values))


def test_argmax_rows_orders_zeros_infinities_and_nan_like_torch(cpu_interpreter, small_chunks):
    inf, nan = float("inf"), float("nan")
    rows = [
        [-0.0, 0.0, -1.0] + [-2.0] * 30,  # -0 equals +0: the first
        [-inf] * 33,  # all -inf: the first
        [1.0] * 20 + [inf] + [2.0] * 5 + [inf] * 7,  # the first +inf
        [inf] * 17 + [nan] + [1.0] * 10 + [nan] * 5,  # the first NaN, past every +inf
        [-inf] * 32 + [-3.0],  # -inf below every value
    ]
    for dtype in (torch.float32, torch.float16):
        values = torch.tensor(rows, dtype=dtype)
        assert argmax_rows(values).tolist() == argmax_rows_reference(values).tolist() == [0, 0, 20, 17, 32]


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="unit last stride"):
        argmax_rows(torch.randn(8, 4).T)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        argmax_rows(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="columns"):
        argmax_rows(torch.randn(2, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 256])
def test_argmax_rows_gpu_bf16(cuda_device, m):
    """Inkling-Small's unpadded logits (a view of the padded product) in bf16, on a grid coarse enough for ties."""
    gen = torch.Generator(cuda_device).manual_seed(m)
    values = torch.randn(m, 201024, generator=gen, device=cuda_device).mul_(4).round_().to(torch.bfloat16)
    view = values[:, :200058]
    assert torch.equal(argmax_rows(view), argmax_rows_reference(view))
