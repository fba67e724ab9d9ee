import pytest
import torch

from inkling_kernels.float_rows import BLOCK, float_rows, float_rows_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,pad", [(1, 5, 3), (3, BLOCK + 37, 64), (2, 2 * BLOCK, 0)])
def test_float_rows_is_the_exact_cast_of_a_row_slice(cpu_interpreter, dtype, m, n, pad):
    x = torch.randn(m, n + pad, generator=torch.Generator().manual_seed(n)).to(dtype)[:, :n]  # padded columns cut
    out = float_rows(x)
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out, float_rows_reference(x))


def test_float_rows_rejects_other_layouts():
    with pytest.raises(ValueError, match="unit last stride"):
        float_rows(torch.zeros(4, 6).T)
    with pytest.raises(ValueError, match="unit last stride"):
        float_rows(torch.zeros(4, dtype=torch.int32)[None])


@pytest.mark.gpu
def test_float_rows_gpu_lm_head_shape(cuda_device):
    x = torch.randn(256, 201024, device=cuda_device).to(torch.bfloat16)[:, :200058]
    assert torch.equal(float_rows(x), float_rows_reference(x))
