import pytest
import torch

from inkling_kernels.short_conv_prefill import conv_prefill, conv_prefill_reference


def packed(lengths, c, k, dtype, gen):
    t, b = sum(lengths), len(lengths)
    x = torch.randn(t, c, generator=gen).to(dtype)
    states = torch.randn(b, k - 1, c, generator=gen).to(dtype)
    weight = torch.randn(c, k, generator=gen) * 0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(b, dtype=torch.int32), torch.tensor(lengths))
    return x, states, seq_ids, cu, weight


@pytest.mark.parametrize(
    "lengths,c,k,dtype",
    [
        ([40], 96, 4, torch.float32),  # one chunk over several row blocks, a partial channel block
        ([1, 2, 37, 5], 64, 4, torch.float16),  # chunks shorter than K-1 keep old state rows
        ([3, 17], 300, 3, torch.float16),
    ],
)
def test_conv_prefill_matches_reference(cpu_interpreter, lengths, c, k, dtype):
    """Exactly equal: the same fp32 arithmetic in the same order (fp16, not bf16: Triton's CPU interpreter
    truncates fp32 -> bf16; the GPU test covers bf16)."""
    check_conv(lengths, c, k, dtype, "cpu")


def check_conv(lengths, c, k, dtype, device):
    gen = torch.Generator().manual_seed(sum(lengths))
    x, states, seq_ids, cu, weight = (t.to(device) for t in packed(lengths, c, k, dtype, gen))
    residual = torch.randn(x.shape, generator=gen).to(dtype).to(device)
    for kwargs in ({}, {"residual": residual}):
        before = states.clone()
        y, new = conv_prefill(x, states, seq_ids, cu, weight, **kwargs)
        y_ref, new_ref = conv_prefill_reference(x, states, seq_ids, cu, weight, **kwargs)
        assert torch.equal(states, before)  # out of place
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(new, new_ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_conv_prefill_gpu_bf16(cuda_device):
    check_conv([2048], 4096, 4, torch.bfloat16, cuda_device)
    check_conv([1, 700, 2, 1000], 1024, 4, torch.bfloat16, cuda_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_prefill_per_head_norm(cpu_interpreter, dtype):
    """Within one unit in the last place (the fp32 norm statistics may differ in their last bit)."""
    gen = torch.Generator().manual_seed(3)
    x, states, seq_ids, cu, weight = packed([5, 20], 64, 4, dtype, gen)
    norm_weight = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    y, new = conv_prefill(x, states, seq_ids, cu, weight, norm_weight=norm_weight, head_dim=32, eps=1e-6)
    y_ref, new_ref = conv_prefill_reference(x, states, seq_ids, cu, weight, norm_weight=norm_weight, head_dim=32)
    torch.testing.assert_close(y, y_ref, rtol=max(torch.finfo(dtype).eps, 1e-6), atol=1e-6)
    torch.testing.assert_close(new, new_ref, rtol=0, atol=0)


def test_conv_prefill_rejects_bad_metadata():
    gen = torch.Generator().manual_seed(0)
    x, states, seq_ids, cu, weight = packed([4, 4], 32, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="cu_seqlens"):
        conv_prefill(x, states, seq_ids.long(), cu, weight)
    with pytest.raises(ValueError, match="head_dim"):
        conv_prefill(x, states, seq_ids, cu, weight, norm_weight=torch.ones(12), head_dim=12)
