import pytest
import torch

from kernels.fp8_head import (
    FP8,
    FP8_MAX,
    Fp8HeadConfig,
    default_config,
    fp8_logits,
    fp8_logits_reference,
    quantize_rows_fp8,
)

GEMV = Fp8HeadConfig(dot=False, block_n=16, block_k=32)
DOT = Fp8HeadConfig(dot=True, block_n=16, block_k=32)


def operands(m, n, k, dtype, gen):
    """x strided (a slice of wider rows) and an fp8 copy of W ~ 1/sqrt(K), on the generator's device."""
    x = torch.randn(m, k + 8, generator=gen, device=gen.device).to(dtype)[:, :k]
    weight = torch.randn(n, k, generator=gen, device=gen.device) * k**-0.5
    return x, *quantize_rows_fp8(weight)


def assert_logits_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Exact products summed in fp32 in another order: a few fp32 ulps of the row's magnitude."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_quantize_rows_fp8():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 40, generator=gen)
    weight[3] = 0.0
    w8, scale = quantize_rows_fp8(weight.half())
    assert w8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert scale[3] == 1.0 and not w8[3].float().any()
    assert torch.equal(w8.float().abs().amax(1)[[0, 1, 2, 4, 5]], torch.full((5,), FP8_MAX))  # each row's amax
    # e4m3 keeps 3 mantissa bits: every weight within half a unit of its binade (2^-4 relative)
    torch.testing.assert_close(w8.float() * scale[:, None], weight.half().float(), rtol=2**-4, atol=0.0)


@pytest.mark.parametrize("config", [GEMV, DOT], ids=["gemv", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 48, 64),  # N a multiple of BLOCK_N, K of BLOCK_K
        (2, 40, 80),  # a partial last column block and a partial last K block
        (3, 64, 32),  # GEMV over 4 rows with one masked
        (5, 32, 64),  # several GEMV row blocks; a padded tensor-core block
        (20, 24, 96),  # a 32-row tensor-core block
    ],
)
def test_fp8_logits_matches_reference(cpu_interpreter, config, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w8, scale = operands(m, n, k, dtype, gen)
    out = fp8_logits(x, w8, scale, divisor=24.0, config=config)
    assert_logits_close(out, fp8_logits_reference(x, w8, scale, divisor=24.0))
    assert_logits_close(fp8_logits(x, w8, scale, config=config), fp8_logits_reference(x, w8, scale))


def test_fp8_logits_divides_in_x_dtype(cpu_interpreter):
    """The muP division rounds to x's dtype before the product, as the bf16 head's `hidden / mup` does."""
    gen = torch.Generator().manual_seed(3)
    x, w8, scale = operands(2, 16, 32, torch.float16, gen)
    out = fp8_logits(x, w8, scale, divisor=3.0, config=GEMV)
    assert_logits_close(out, fp8_logits_reference((x / 3.0).half(), w8, scale))
    assert not torch.allclose(out, fp8_logits_reference(x.float() / 3.0, w8, scale), rtol=1e-7, atol=0)


@pytest.mark.parametrize("m", [1, 4, 5, 64, 65])
def test_default_config_runs(cpu_interpreter, m):
    gen = torch.Generator().manual_seed(m)
    x, w8, scale = operands(m, 72, 128, torch.float32, gen)
    assert default_config(m).num_warps > 0
    config = None if m <= 4 else Fp8HeadConfig(dot=True, block_n=16, block_k=64)  # the interpreter's pace
    assert_logits_close(fp8_logits(x, w8, scale, config=config), fp8_logits_reference(x, w8, scale))


def test_empty_batch(cpu_interpreter):
    w8, scale = quantize_rows_fp8(torch.randn(16, 32))
    assert fp8_logits(torch.empty(0, 32), w8, scale).shape == (0, 16)


def test_rejects_bad_operands():
    x = torch.randn(2, 32)
    w8, scale = quantize_rows_fp8(torch.randn(16, 32))
    with pytest.raises(ValueError, match="weight"):
        fp8_logits(x, w8[:, :8], scale)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_logits(x, w8.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_logits(x, w8, scale[:8])
    with pytest.raises(ValueError, match="scale"):
        fp8_logits(x, w8, scale.half())
    with pytest.raises(ValueError, match="divisor"):
        fp8_logits(x, w8, scale, divisor=0.0)
    with pytest.raises(ValueError, match="weight"):
        quantize_rows_fp8(torch.randn(4))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_fp8_logits_gpu_bf16(cuda_device, m):
    """Inkling-Small's unpadded lm_head rows, bf16 activations, the default tiles."""
    gen = torch.Generator(cuda_device).manual_seed(m)
    x, w8, scale = operands(m, 200058, 4096, torch.bfloat16, gen)
    out = fp8_logits(x, w8, scale, divisor=16.0)
    assert_logits_close(out, fp8_logits_reference(x, w8, scale, divisor=16.0))
