import pytest
import torch

from inkling_kernels.swiglu import swiglu, swiglu_reference


def assert_within_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Triton's exp and torch's may differ in the last fp32 bit, which can flip a rounding of silu, then of the
    product (and of the gamma product) by one unit each: at most three units in the last place of the output."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=3 * torch.finfo(out.dtype).eps, atol=1e-6)


def inputs(t, groups, width, dtype, gen, device="cpu"):
    gate_up = (torch.randn(t, groups * 2 * width, generator=gen) * 3).to(dtype)
    gammas = torch.rand(t, groups, generator=gen) + 0.25
    return gate_up.to(device), gammas.to(device)


@pytest.mark.parametrize(
    "t,groups,width,dtype",
    [
        (3, 1, 48, torch.float32),  # width not a power of two
        (5, 2, 64, torch.float16),  # two groups (shared experts)
        (2, 3, 700, torch.float16),  # a group across the program's column block, a partial last block
        (4, 1, 1500, torch.float32),
    ],
)
@pytest.mark.parametrize("with_gammas", [False, True])
def test_swiglu_matches_reference(cpu_interpreter, t, groups, width, dtype, with_gammas):
    gate_up, gammas = inputs(t, groups, width, dtype, torch.Generator().manual_seed(t + groups + width))
    gammas = gammas if with_gammas else None
    assert_within_rounding(swiglu(gate_up, width, gammas), swiglu_reference(gate_up, width, gammas))


def test_swiglu_reads_strided_rows(cpu_interpreter):
    gate_up, _ = inputs(4, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    wide = torch.cat([gate_up, torch.zeros(4, 8)], dim=1)[:, :128]  # row stride 136
    assert_within_rounding(swiglu(wide, 32), swiglu_reference(gate_up, 32))


def test_swiglu_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gate_up"):
        swiglu(torch.zeros(2, 10), 4)
    with pytest.raises(ValueError, match="gammas"):
        swiglu(torch.zeros(2, 16), 4, torch.zeros(2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("t,groups,width", [(2048, 1, 16384), (2048, 2, 2048), (1, 2, 2048)])
@pytest.mark.parametrize("with_gammas", [False, True])
def test_swiglu_gpu(cuda_device, t, groups, width, with_gammas):
    gate_up, gammas = inputs(t, groups, width, torch.bfloat16, torch.Generator().manual_seed(t + groups), cuda_device)
    gammas = gammas if with_gammas else None
    assert_within_rounding(swiglu(gate_up, width, gammas), swiglu_reference(gate_up, width, gammas))
