import pytest
import torch

from inkling_kernels.rel_bias import rel_bias_table, rel_bias_table_reference


def strided_rows(n, nh, d_rel, extent, gen, dtype, device="cpu"):
    """r as the strided view of a projection's output (as `Attention.project` leaves it), and P."""
    proj = torch.randn(n, nh * (32 + d_rel) + 8, generator=gen).to(dtype)
    r = proj[:, nh * 32 : nh * (32 + d_rel)].view(n, nh, d_rel)
    rel_proj = (torch.randn(d_rel, extent, generator=gen) * 0.5).to(dtype)
    return r.to(device), rel_proj.to(device)


def check_rel_bias_table(r, rel_proj, extent):
    """The table against the float64 product of the same (rounded) inputs, within the error bound of a d_rel-term
    fp32 sum in any order with truncating adds (d_rel * 2^-23 * sum |r_k P_k|): the products themselves are exact."""
    out = rel_bias_table(r, rel_proj, extent)
    assert out.dtype == torch.float32 and out.shape == (*r.shape[:2], extent) and out.is_contiguous()
    exact = torch.matmul(r.double(), rel_proj[:, :extent].double())
    bound = r.shape[-1] * 2.0**-23 * torch.matmul(r.double().abs(), rel_proj[:, :extent].double().abs())
    assert ((out.double() - exact).abs() <= bound).all()
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,d_rel,extent", [(1, 16, 48), (37, 16, 200), (5, 8, 16)])
def test_rel_bias_table_is_the_exact_products_summed_in_fp32(cpu_interpreter, dtype, n, d_rel, extent):
    gen = torch.Generator().manual_seed(n + d_rel)
    r, rel_proj = strided_rows(n, 8, d_rel, extent + 9, gen, dtype)
    out = check_rel_bias_table(r, rel_proj, extent)
    assert torch.allclose(out, rel_bias_table_reference(r, rel_proj, extent), rtol=1e-5, atol=1e-5)


def test_rel_bias_table_rejects_bad_operands():
    gen = torch.Generator().manual_seed(0)
    r, rel_proj = strided_rows(2, 4, 16, 32, gen, torch.float16)
    with pytest.raises(ValueError, match="one dtype"):
        rel_bias_table(r, rel_proj.float(), 16)
    with pytest.raises(ValueError, match="extent 40"):
        rel_bias_table(r, rel_proj, 40)


@pytest.mark.gpu
def test_rel_bias_table_gpu_bf16(cuda_device):
    gen = torch.Generator().manual_seed(3)
    r, rel_proj = strided_rows(2048, 32, 16, 1024, gen, torch.bfloat16, cuda_device)
    for extent in (512, 1024):
        check_rel_bias_table(r, rel_proj, extent)
