import pytest
import torch

from inkling_kernels.fp8_head import (
    FP8,
    FP8_MAX,
    Fp8HeadConfig,
    default_config,
    fp8_logits,
    fp8_logits_reference,
    quantize_rows_fp8,
    uses_wgmma,
)

DOT = Fp8HeadConfig(block_n=16, block_k=32)
NAN_CODES = (0x7F, 0xFF)  # e4m3fn's NaNs, which quantize_rows_fp8 never writes


def operands(m, n, k, dtype, gen):
    """x strided (a slice of wider rows) and an fp8 copy of W ~ 1/sqrt(K), on the generator's device."""
    x = torch.randn(m, k + 8, generator=gen, device=gen.device).to(dtype)[:, :k]
    weight = torch.randn(n, k, generator=gen, device=gen.device) * k**-0.5
    return x, *quantize_rows_fp8(weight)


def every_code_operands(m, n, k, dtype, device):
    """W8 [n, k] whose column j holds code (i + 7j) % 256 in row i (n >= 256: every finite e4m3 code, subnormals and
    -0 included, in every column), random row scales, and x [m, k] with one non-zero per row (column m * k // m_rows),
    a value of <= 8 significant bits: each logit is s[n] * x * W8[n, j] with an exact product, one rounding."""
    gen = torch.Generator(device).manual_seed(n + k)
    codes = (torch.arange(n, device=device)[:, None] + 7 * torch.arange(k, device=device)[None, :]) % 256
    codes[(codes == NAN_CODES[0]) | (codes == NAN_CODES[1])] = 0
    w8 = codes.to(torch.uint8).view(FP8)
    scale = torch.rand(n, generator=gen, device=device) + 0.5
    x = torch.zeros(m, k, device=device)
    x[torch.arange(m), torch.arange(m) * k // m] = torch.randn(m, generator=gen, device=device).bfloat16().float()
    return x.to(dtype), w8, scale


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 48, 64),  # N a multiple of BLOCK_N, K of BLOCK_K
        (2, 40, 80),  # a partial last column block and a partial last K block
        (3, 64, 32),  # an 8-row tensor-core block, 5 rows of it padding
        (5, 32, 64),  # several column blocks of a padded block
        (20, 24, 96),  # a 32-row tensor-core block
        (40, 24, 64),  # a 64-row tensor-core block, 24 rows of it padding
    ],
)
def test_fp8_logits_matches_reference(cpu_interpreter, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w8, scale = operands(m, n, k, dtype, gen)
    out = fp8_logits(x, w8, scale, divisor=24.0, config=DOT)
    assert_logits_close(out, fp8_logits_reference(x, w8, scale, divisor=24.0))
    assert_logits_close(fp8_logits(x, w8, scale, config=DOT), fp8_logits_reference(x, w8, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k", [(3, 40, 96), (12, 24, 64)])  # a partial K block; several K blocks
def test_fp8_logits_exact_on_integer_operands(cpu_interpreter, dtype, m, n, k):
    """Small integers times e4m3 integers with power-of-two scales and divisor: every product and partial sum is
    exact in fp32, so the kernel equals the reference bitwise whatever order it sums in."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randint(-8, 9, (m, k), generator=gen).to(dtype)
    w8 = torch.randint(-16, 17, (n, k), generator=gen).float().to(FP8)
    scale = 2.0 ** torch.randint(-4, 5, (n,), generator=gen).float()
    out = fp8_logits(x, w8, scale, divisor=4.0, config=DOT)
    assert torch.equal(out, fp8_logits_reference(x, w8, scale, divisor=4.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m", [4, 32])
def test_fp8_logits_every_e4m3_code_exact(cpu_interpreter, dtype, m):
    """Every finite e4m3 code reaches the logits with its exact value (the conversion to x's dtype is exact)."""
    x, w8, scale = every_code_operands(m, 256, 64, dtype, torch.device("cpu"))
    assert torch.equal(fp8_logits(x, w8, scale, config=DOT), fp8_logits_reference(x, w8, scale))


def test_fp8_logits_divides_in_x_dtype(cpu_interpreter):
    """The muP division rounds to x's dtype before the product, as the bf16 head's `hidden / mup` does."""
    gen = torch.Generator().manual_seed(3)
    x, w8, scale = operands(2, 16, 32, torch.float16, gen)
    out = fp8_logits(x, w8, scale, divisor=3.0, config=DOT)
    assert_logits_close(out, fp8_logits_reference((x / 3.0).half(), w8, scale))
    assert not torch.allclose(out, fp8_logits_reference(x.float() / 3.0, w8, scale), rtol=1e-7, atol=0)


@pytest.mark.parametrize("m", [1, 2, 3, 64, 65])
def test_default_config_runs(cpu_interpreter, m):
    gen = torch.Generator().manual_seed(m)
    x, w8, scale = operands(m, 72, 128, torch.float32, gen)
    assert min(default_config(m).block_n, default_config(m).block_k) >= 16  # tensor-core tiles at every M
    config = Fp8HeadConfig(block_n=16, block_k=64)  # the interpreter's pace
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
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 33, 64])
def test_fp8_logits_gpu_bf16(cuda_device, m):
    """Inkling-Small's unpadded lm_head rows, bf16 activations, the default tiles."""
    gen = torch.Generator(cuda_device).manual_seed(m)
    x, w8, scale = operands(m, 200058, 4096, torch.bfloat16, gen)
    out = fp8_logits(x, w8, scale, divisor=24.0)
    assert_logits_close(out, fp8_logits_reference(x, w8, scale, divisor=24.0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64])
def test_fp8_logits_gpu_every_e4m3_code_exact(cuda_device, m):
    """bf16 on the GPU (the inline-PTX conversion, 4 weights a call under mma.sync, 2 under wgmma): every finite
    e4m3 code exact, at the default tiles."""
    x, w8, scale = every_code_operands(m, 4096 + 40, 4096, torch.bfloat16, cuda_device)
    config = default_config(m)
    if m == 64:
        assert uses_wgmma(config, 64) and not uses_wgmma(default_config(8), 8)  # both conversions are covered
    assert torch.equal(fp8_logits(x, w8, scale, config=config), fp8_logits_reference(x, w8, scale))
