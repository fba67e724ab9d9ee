import pytest
import torch

from inkling_kernels.skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    default_config,
    skinny_argmax,
    skinny_argmax_reference,
    skinny_linear,
    skinny_linear_reference,
    skinny_swiglu,
    skinny_swiglu_reference,
)

GEMV = SkinnyConfig(block_n=16, block_k=32)
WIDE_K = SkinnyConfig(block_n=4, block_k=64)  # fewer weight rows over longer K blocks, as the one-row defaults


def assert_rounded_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: another summation order. fp16/bf16: that order can flip a rounding by one unit in the last place, and
    the SwiGLU's chained roundings can carry it through two more (3 units)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 1e-6
    torch.testing.assert_close(out, ref, rtol=3 * eps, atol=3 * eps)


def operands(m, n, k, dtype, gen):
    """x strided (a slice of wider rows, as of a wider activation) and W ~ 1/sqrt(K), on the generator's device."""
    x = torch.randn(m, k + 8, generator=gen, device=gen.device).to(dtype)[:, :k]
    weight = (torch.randn(n, k, generator=gen, device=gen.device) * k**-0.5).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 48, 64),  # N a multiple of BLOCK_N, K of BLOCK_K
        (2, 40, 80),  # a partial last column block and a partial last K block
        (3, 64, 32),  # GEMV over 4 rows with one masked
        (5, 32, 64),  # several GEMV row blocks
        (16, 24, 96),  # MAX_ROWS: four full GEMV row blocks
    ],
)
@pytest.mark.parametrize("config", [GEMV, WIDE_K])
def test_skinny_linear_matches_reference(cpu_interpreter, dtype, m, n, k, config):
    gen = torch.Generator().manual_seed(m * n + k)
    x, weight = operands(m, n, k, dtype, gen)
    assert_rounded_close(skinny_linear(x, weight, config=config), skinny_linear_reference(x, weight))


def test_skinny_linear_epilogues(cpu_interpreter):
    """The dense MLP's global scale and the lm_head's muP division with fp32 logits of the rounded values."""
    gen = torch.Generator().manual_seed(1)
    x, weight = operands(3, 40, 64, torch.float16, gen)
    scale = torch.tensor([1.37], dtype=torch.float16)
    out = skinny_linear(x, weight, scale=scale, config=GEMV)
    assert_rounded_close(out, skinny_linear_reference(x, weight, scale=scale))
    logits = skinny_linear(x, weight[:37], divisor=24.0, out_dtype=torch.float32, config=GEMV)
    ref = skinny_linear_reference(x, weight[:37], divisor=24.0, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, logits.half().float())  # fp16 values, stored as fp32
    assert_rounded_close(logits.half(), ref.half())


@pytest.mark.parametrize("divisor", [16.0, 0.25, 3.0, -24.0])  # powers of two: a multiplication by the reciprocal
@pytest.mark.parametrize("config", [GEMV, WIDE_K])
def test_divisor_rounds_x_like_torch(cpu_interpreter, divisor, config):
    """The fused division gives exactly the products of x divided by torch first (the rounded quotient)."""
    gen = torch.Generator().manual_seed(3)
    x, weight = operands(1, 40, 64, torch.float16, gen)
    x = x * 7.1  # quotients off the representable grid
    got = skinny_linear(x, weight, divisor=divisor, config=config)
    assert torch.equal(got, skinny_linear((x / divisor).contiguous(), weight, config=config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups,with_gammas,config", [(1, False, GEMV), (2, True, GEMV), (2, True, WIDE_K)])
def test_skinny_swiglu_matches_reference(cpu_interpreter, dtype, groups, with_gammas, config):
    gen = torch.Generator().manual_seed(groups)
    width, m, k = 24, 3, 48  # BLOCK_N=16 does not divide I: column blocks straddle the groups
    x, w13 = operands(m, groups * 2 * width, k, dtype, gen)
    gammas = torch.rand(m, groups, generator=gen) + 0.5 if with_gammas else None
    out = skinny_swiglu(x, w13, width, gammas=gammas, config=config)
    assert_rounded_close(out, skinny_swiglu_reference(x, w13, width, gammas=gammas))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_default_tiles_match_reference(cpu_interpreter, dtype):
    """One row of x on ``default_config``'s one-row tiles (a single masked K block here): the plain product over a
    partial column block, the epilogues, the SwiGLU with gammas, the argmax."""
    gen = torch.Generator().manual_seed(7)
    x, weight = operands(1, 44, 80, dtype, gen)
    config = default_config(1, 44, 80)
    assert_rounded_close(skinny_linear(x, weight, config=config), skinny_linear_reference(x, weight))
    scale = torch.tensor([1.37], dtype=dtype)
    assert_rounded_close(skinny_linear(x, weight, scale=scale, config=config),
                         skinny_linear_reference(x, weight, scale=scale))  # fmt: skip
    gammas = torch.rand(1, 2, generator=gen) + 0.5
    assert_rounded_close(skinny_swiglu(x, weight[:40], 10, gammas=gammas, config=config),
                         skinny_swiglu_reference(x, weight[:40], 10, gammas=gammas))  # fmt: skip
    logits = skinny_linear(x, weight, divisor=3.0, out_dtype=torch.float32, config=config)
    assert torch.equal(skinny_argmax(x, weight, divisor=3.0, config=config), logits.argmax(-1))


def tied_weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """W ~ 1/sqrt(K) whose rows repeat: row 5's copies within its program, in later programs (GEMV's 16 columns)
    and in the last column, so every row of x meets ties at its maximum wherever that falls."""
    weight = (torch.randn(n, k, generator=gen, device=gen.device) * k**-0.5).to(dtype)
    for copy in (9, 21, 40, n - 1):
        weight[copy] = weight[5]
    return weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 77, 64), (3, 50, 80), (6, 64, 96)])
@pytest.mark.parametrize("config", [GEMV, WIDE_K])
def test_skinny_argmax_is_the_argmax_of_the_logits(cpu_interpreter, dtype, m, n, k, config):
    """The tokens of `skinny_linear(..., out_dtype=fp32).argmax(-1)` exactly (the same products: what the fast
    path's greedy head replaces), and the reference's; x made of rows 5 and 21 of W so that the maximum is the
    tied row for most rows of x."""
    gen = torch.Generator().manual_seed(m + n)
    weight = tied_weight(n, k, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[: m // 2 + 1] = weight[5] * 8  # these rows' maximum is at the five copies of row 5: the first one wins
    logits = skinny_linear(x, weight, divisor=3.0, out_dtype=torch.float32, config=config)
    tokens = skinny_argmax(x, weight, divisor=3.0, config=config)
    assert tokens.dtype == torch.int64 and tokens.shape == (m,)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(tokens, skinny_argmax_reference(x, weight, divisor=3.0))
    assert (tokens[: m // 2 + 1] == 5).all()


def test_skinny_argmax_orders_like_torch(cpu_interpreter):
    """Equal values, infinities and NaN as torch.argmax takes them: the first of equal values, NaN above +inf (the
    first NaN), -inf below everything else."""
    x = torch.stack([torch.ones(32), torch.zeros(32), -torch.ones(32)]).half()
    weight = torch.full((40, 32), -1e-3, dtype=torch.float16)  # every column the same value for each row of x
    weight[[3, 20], 0] = 6e4  # 6e4 * 1 + 31 * 1e-3 rounds to +inf in fp16 (the last row of x: -inf)
    with_nan = weight.clone()
    with_nan[[25, 33], 1] = float("nan")
    for w, want in ((weight, [3, 0, 0]), (with_nan, [25, 25, 25])):  # +inf first at 3; all equal; NaN past all
        got = skinny_argmax(x, w, config=GEMV)
        assert got.tolist() == want
        assert torch.equal(got, skinny_linear(x, w, out_dtype=torch.float32, config=GEMV).argmax(-1))
        assert torch.equal(got, skinny_argmax_reference(x, w))


@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1, 5))
def test_default_config_runs(cpu_interpreter, m):
    gen = torch.Generator().manual_seed(m)
    x, weight = operands(m, 64, 128, torch.float32, gen)
    assert default_config(m, 64, 128).num_warps > 0
    assert_rounded_close(skinny_linear(x, weight), skinny_linear_reference(x, weight))


@pytest.mark.parametrize("k", [4096, 6144])  # K a multiple of the 2048/4096-column blocks; halved to divide 6144
def test_one_row_default_tiles_take_long_k_blocks(cpu_interpreter, k):
    """One row: the long K blocks of the measured defaults (4 rows x 2048 columns on small weights, 2 x 4096 over 8
    warps on large ones), halved until they divide K; they give the reference's rounded products."""
    small, large = default_config(1, 4096, k), default_config(1, 32768, k)
    assert (small.block_n, small.block_k, small.num_warps) == (4, 2048, 4)
    assert (large.block_n, large.block_k, large.num_warps) == (2, 4096 if k == 4096 else 2048, 8)
    gen = torch.Generator().manual_seed(k)
    x, weight = operands(1, 12, k, torch.float16, gen)
    for config in (small, large):
        assert_rounded_close(skinny_linear(x, weight, config=config), skinny_linear_reference(x, weight))


def test_empty_batch(cpu_interpreter):
    assert skinny_linear(torch.empty(0, 32), torch.randn(16, 32)).shape == (0, 16)


def test_rejects_bad_operands():
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(x, torch.randn(16, 8))
    with pytest.raises(ValueError, match="share"):
        skinny_linear(x, w.half())
    with pytest.raises(ValueError, match="stride"):
        skinny_linear(x, torch.randn(32, 16).T)
    with pytest.raises(ValueError, match="MAX_ROWS"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="scale"):
        skinny_linear(x, w, scale=torch.ones(2))
    with pytest.raises(ValueError, match="groups"):
        skinny_swiglu(x, w, 5)
    with pytest.raises(ValueError, match="gammas"):
        skinny_swiglu(x, w, 4, gammas=torch.ones(2, 3))
    with pytest.raises(ValueError, match="K > 0"):
        skinny_argmax(torch.randn(2, 0), torch.randn(16, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize(
    "n,k",
    [(6656, 4096), (4096, 16384), (200058, 4096)],  # Inkling-Small's qkvr, dense down, unpadded lm_head rows
)
def test_skinny_linear_gpu_bf16(cuda_device, m, n, k):
    gen = torch.Generator(cuda_device).manual_seed(m)
    x, weight = operands(m, n, k, torch.bfloat16, gen)
    assert_rounded_close(skinny_linear(x, weight), skinny_linear_reference(x, weight))
    for tile in (SkinnyConfig(block_n=4, block_k=1024), SkinnyConfig(8, 512)):
        assert_rounded_close(skinny_linear(x, weight, config=tile), skinny_linear_reference(x, weight))
    logits = skinny_linear(x, weight, divisor=16.0, out_dtype=torch.float32)
    ref = skinny_linear_reference(x, weight, divisor=16.0, out_dtype=torch.float32)
    assert_rounded_close(logits.bfloat16(), ref.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,config",
    [(1, None), (3, None), (3, SkinnyConfig(8, 512)), (1, SkinnyConfig(2, 4096, num_warps=8))],
)
def test_skinny_argmax_gpu_bf16(cuda_device, m, config):
    """Inkling-Small's unpadded lm_head rows: the argmax of the GEMV's own logits, ties included."""
    gen = torch.Generator(cuda_device).manual_seed(m)
    weight = tied_weight(200058, 4096, torch.bfloat16, gen)
    x = torch.randn(m, 4096, generator=gen, device=cuda_device).to(torch.bfloat16)
    x[0] = weight[5] * 8
    tokens = skinny_argmax(x, weight, divisor=16.0, config=config)
    logits = skinny_linear(x, weight, divisor=16.0, out_dtype=torch.float32, config=config)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[0] == 5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("groups,width", [(1, 16384), (2, 2048)])  # the dense MLP, the two shared experts
def test_skinny_swiglu_gpu_bf16(cuda_device, m, groups, width):
    gen = torch.Generator(cuda_device).manual_seed(m + groups)
    x, w13 = operands(m, groups * 2 * width, 4096, torch.bfloat16, gen)
    gammas = torch.rand(m, groups, generator=gen, device=cuda_device) + 0.5 if groups > 1 else None
    out = skinny_swiglu(x, w13, width, gammas=gammas)
    assert_rounded_close(out, skinny_swiglu_reference(x, w13, width, gammas=gammas))
