import pytest
import torch

from kernels.attention import attention_reference, decode_attention


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(b, nh, nkv, hd, d_rel, extent, s_max, gen, dtype, device="cpu"):
    q = torch.randn(b, nh, hd, generator=gen).to(dtype)
    r = torch.randn(b, nh, d_rel, generator=gen).to(dtype)
    rel_proj = (torch.randn(d_rel, extent, generator=gen) * 0.5).to(dtype)
    kc = torch.randn(b, s_max, nkv, hd, generator=gen).to(dtype)
    vc = torch.randn(b, s_max, nkv, hd, generator=gen).to(dtype)
    return [t.to(device) for t in (q, r, rel_proj, kc, vc)]


@pytest.mark.parametrize(
    "window,log_scaling,lens,num_splits,dtype",
    [
        (None, None, [1, 77, 200], None, torch.float32),  # global, bias beyond R cut off, several splits
        (40, None, [1, 39, 41, 200], None, torch.float32),  # sliding window, lengths around W
        (None, (0.5, 20.0), [5, 150], 1, torch.float32),  # tau active (p + 1 > n_floor), one split
        (40, None, [60, 130], 3, torch.float16),
    ],
)
def test_decode_attention_matches_reference(cpu_interpreter, window, log_scaling, lens, num_splits, dtype):
    gen = torch.Generator().manual_seed(len(lens))
    extent = window or 48
    q, r, rel_proj, kc, vc = inputs(len(lens), 8, 2, 32, 16, extent, 200, gen, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention(q, r, rel_proj, kc, vc, seq_lens, window, log_scaling, num_splits=num_splits)
    ref = attention_reference(q, r, rel_proj, kc, vc, seq_lens, window, log_scaling)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_decode_attention_rejects_mismatched_heads():
    gen = torch.Generator().manual_seed(0)
    q, r, rel_proj, kc, vc = inputs(1, 6, 4, 32, 16, 16, 8, gen, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, r, rel_proj, kc, vc, torch.tensor([3]))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "window,log_scaling,lens",
    [
        (512, None, [1, 300, 511, 512, 513, 3000]),
        (None, (0.1, 100.0), [1, 1023, 1024, 1025, 3000, 4096]),
    ],
)
def test_decode_attention_gpu_full_heads(cuda_device, window, log_scaling, lens):
    gen = torch.Generator().manual_seed(7)
    extent = window or 1024
    q, r, rel_proj, kc, vc = inputs(len(lens), 32, 8, 128, 16, extent, 4096, gen, torch.bfloat16, cuda_device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=cuda_device)
    out = decode_attention(q, r, rel_proj, kc, vc, seq_lens, window, log_scaling)
    ref = attention_reference(q, r, rel_proj, kc, vc, seq_lens, window, log_scaling)
    err = rel_err(out, ref)
    print(
        f"decode_attention window={window} tau={log_scaling}: rel {err:.2e}, "
        f"max_abs {(out.float() - ref.float()).abs().max().item():.3e}"
    )
    assert torch.isfinite(out).all() and err < 1e-2
