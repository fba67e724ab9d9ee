import pytest
import torch

import inkling_kernels.rms_norm as rms_norm_module
from decode_service.model.layers import RMSNorm
from inkling_kernels.rms_norm import rms_norm, rms_norm_reference

EPS = 1e-6


def assert_within_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: 1e-6 relative. fp16/bf16: the fp32 statistics may differ in their last bit (another reduction order),
    which can flip the rounding of `normed` by one unit; times a weight up to 1.5 and rounded again, that is at
    most two units in the last place of the output (seen on an H200: 2 of 1M bf16 values)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=max(2 * torch.finfo(out.dtype).eps, 1e-6), atol=1e-6)


def inputs(n, c, dtype, weight_dtype, gen, device="cpu"):
    x = torch.randn(n, c + 16, generator=gen).to(dtype)[:, :c]  # strided rows, as a slice of a wider output
    residual = torch.randn(n, c, generator=gen).to(dtype)
    weight = (torch.rand(c, generator=gen) + 0.5).to(weight_dtype)
    return x.to(device), residual.to(device), weight.to(device)


@pytest.mark.parametrize(
    "n,c,dtype,weight_dtype,max_block",
    [
        (3, 48, torch.float32, torch.float32, None),  # C not a power of two
        (40, 64, torch.float32, torch.float32, None),  # several rows per program, a partial last program
        (2, 256, torch.float16, torch.float16, None),
        (5, 48, torch.float16, torch.float32, None),  # fp32 weight: the product is fp32
        (3, 48, torch.float32, torch.float32, 32),  # wide-row path: two passes over two column blocks
        (2, 80, torch.float16, torch.float16, 16),
    ],
)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(cpu_interpreter, monkeypatch, n, c, dtype, weight_dtype, max_block, with_residual):
    if max_block is not None:
        monkeypatch.setattr(rms_norm_module, "_MAX_BLOCK_C", max_block)
    gen = torch.Generator().manual_seed(n * c)
    x, residual, weight = inputs(n, c, dtype, weight_dtype, gen)
    if with_residual:
        summed, out = rms_norm(x, weight, EPS, residual)
        summed_ref, ref = rms_norm_reference(x, weight, EPS, residual)
        assert torch.equal(summed, summed_ref)
    else:
        out = rms_norm(x, weight, EPS)
        ref = rms_norm_reference(x, weight, EPS)
    assert out.dtype == torch.promote_types(weight_dtype, dtype)
    assert_within_rounding(out, ref)


def test_rms_norm_per_head_view(cpu_interpreter):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4 * 32 + 16, generator=gen)[:, : 4 * 32].view(3, 4, 32)  # [T, nH, hd] slice of a projection
    weight = torch.rand(32, generator=gen) + 0.5
    rows = q.reshape(-1, 32)  # a copy: the token stride is not nH * hd
    assert_within_rounding(rms_norm(rows, weight, EPS), rms_norm_reference(rows, weight, EPS))
    out = rms_norm(q, weight, EPS)  # the view read in place
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.equal(out, rms_norm(rows, weight, EPS).view(q.shape))


def test_rms_norm_empty_batch(cpu_interpreter):
    out = rms_norm(torch.empty(0, 64), torch.ones(64), EPS)
    assert out.shape == (0, 64)


def test_rms_norm_rejects_bad_operands():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="stride"):
        rms_norm(x.T, torch.ones(2), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64), EPS, residual=torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="without a residual"):
        rms_norm(x.view(2, 2, 32), torch.ones(32), EPS, residual=x.view(2, 2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_model_rms_norm(dtype):
    """The reference is `RMSNorm.forward` (and `h = residual + delta; norm(h)` with a residual), bit for bit."""
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(48, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    norm.to(dtype)
    x, residual, _ = inputs(5, 48, dtype, dtype, gen)
    with torch.no_grad():
        assert torch.equal(rms_norm_reference(x, norm.weight, EPS), norm(x))
        summed, out = rms_norm_reference(x, norm.weight, EPS, residual)
        assert torch.equal(summed, residual + x) and torch.equal(out, norm(residual + x))


@pytest.mark.gpu
@pytest.mark.parametrize("n,c", [(1, 4096), (64, 4096), (256, 4096), (256 * 32, 128), (3, 12288)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gpu_bf16(cuda_device, n, c, with_residual):
    gen = torch.Generator().manual_seed(n + c)
    x, residual, weight = inputs(n, c, torch.bfloat16, torch.bfloat16, gen, cuda_device)
    if with_residual:
        summed, out = rms_norm(x, weight, EPS, residual)
        summed_ref, ref = rms_norm_reference(x, weight, EPS, residual)
        assert torch.equal(summed, summed_ref)
    else:
        out = rms_norm(x, weight, EPS)
        ref = rms_norm_reference(x, weight, EPS)
    assert_within_rounding(out, ref)


@pytest.mark.gpu
def test_rms_norm_gpu_per_head_view_of_a_projection(cuda_device):
    proj = torch.randn(2048, 32 * (128 + 16) + 2048, device=cuda_device).to(torch.bfloat16)
    q = proj[:, : 32 * 128].view(2048, 32, 128)  # the q heads of the stacked qkvr output
    weight = (torch.rand(128, device=cuda_device) + 0.5).to(torch.bfloat16)
    assert torch.equal(rms_norm(q, weight, EPS), rms_norm(q.reshape(-1, 128), weight, EPS).view(q.shape))
