"""The verify-step convs: kernels against their torch references, and windows + commit against one-row steps."""

import pytest
import torch

from inkling_kernels.conv_verify import (
    ConvCommit,
    conv_commit_reference,
    conv_verify,
    conv_verify_reference,
    kv_prologue_verify,
    kv_prologue_verify_reference,
)
from inkling_kernels.short_conv import conv_decode_reference, kv_prologue_reference

EPS = 1e-6


def values(shape, dtype, gen, device="cpu"):
    """Random values on a grid that bf16 and fp16 hold exactly (the interpreter truncates fp32 -> bf16)."""
    return (torch.randn(shape, generator=gen) * 64).round().div(64).clamp(-4, 4).to(dtype).to(device)


def conv_case(b, width, c, k, dtype, gen, device="cpu", state_dtype=None):
    state_dtype = state_dtype or dtype
    x = values((b * width, c + 16), dtype, gen, device)[:, :c]  # strided rows
    states = values((b + 3, k - 1, c), state_dtype, gen, device)  # 3 slots outside the batch
    slots = torch.randperm(b + 3, generator=gen)[:b].to(device)
    weight = torch.randn(k, c, generator=gen).T.to(device)  # fp32 [C, K], not contiguous
    windows = torch.full((b, k - 1 + width + 2, c), 7.0, dtype=state_dtype, device=device)[:, : k - 1 + width]
    return x, states, slots, weight, windows


def one_row_steps(x, states, slots, weight, width, accepted, residual=None):
    """The reference the verify must equal: `accepted[b]` one-row `conv_decode` steps per sequence (outputs of all
    W rows; the states after the accepted ones)."""
    b = slots.shape[0]
    outs = torch.empty_like(x)
    final = states.clone()
    work = states.clone()
    for j in range(width):
        rows = torch.arange(b) * width + j
        res = None if residual is None else residual[rows]
        outs[rows], _ = conv_decode_reference(x[rows], work, slots, weight, res)
        done = [i for i in range(b) if accepted[i] == j + 1]
        final[slots[done]] = work[slots[done]]
    return outs, final


CASES = [  # b, W, C, K, dtype, state dtype
    (1, 2, 48, 4, torch.float32, torch.float32),
    (3, 5, 64, 4, torch.float16, torch.float16),
    (2, 2, 600, 4, torch.float32, torch.bfloat16),  # two channel blocks, W < K-1, a bf16 pool
    (4, 3, 32, 2, torch.float32, torch.float32),
    (3, 1, 48, 4, torch.float32, torch.float32),  # one row per sequence (the draft chain's one-row steps)
]


@pytest.mark.parametrize("b,width,c,k,dtype,state_dtype", CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_conv_verify_and_commit_equal_one_row_steps(cpu_interpreter, b, width, c, k, dtype, state_dtype, with_residual):
    gen = torch.Generator().manual_seed(b * width + c)
    x, states, slots, weight, windows = conv_case(b, width, c, k, dtype, gen, state_dtype=state_dtype)
    residual = values((b * width, c), dtype, gen) if with_residual else None
    before = states.clone()
    accepted = torch.randint(0, width + 1, (b,), generator=gen)  # 0: a sequence commits none of its rows
    want, want_states = one_row_steps(x, states, slots, weight, width, accepted.tolist(), residual)

    ref_windows = windows.clone()
    ref = conv_verify_reference(x, states, slots, weight, ref_windows, residual)
    out = conv_verify(x, states, slots, weight, windows, residual)
    assert torch.equal(states, before)  # the verify only reads the states
    assert torch.equal(out, ref) and torch.equal(windows, ref_windows)
    torch.testing.assert_close(out, want, rtol=0, atol=0)

    ref_states = states.clone()
    conv_commit_reference(ref_windows, ref_states, slots, accepted)
    ConvCommit([(windows, states)])(slots, accepted)
    assert torch.equal(states, ref_states) and torch.equal(states, want_states)


def test_commit_with_padding_rows_on_a_scratch_slot(cpu_interpreter):
    gen = torch.Generator().manual_seed(1)
    x, states, slots, weight, windows = conv_case(4, 3, 32, 4, torch.float32, gen)
    slots = torch.tensor([0, 5, 5, 5])  # three padding rows on the scratch slot 5
    conv_verify(x, states, slots, weight, windows)
    before = states.clone()
    ConvCommit([(windows, states)])(slots, torch.tensor([2, 1, 1, 1]))
    assert torch.equal(states[0], windows[0, 2:5])
    assert torch.equal(states[1:5], before[1:5])


def test_conv_verify_rejects_bad_operands():
    gen = torch.Generator().manual_seed(2)
    x, states, slots, weight, windows = conv_case(2, 3, 32, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="B\\*W"):
        conv_verify(x[:5], states, slots, weight, windows)
    with pytest.raises(ValueError, match="dtype"):
        conv_verify(x, states, slots, weight, windows.half())
    commit = ConvCommit([(windows, states)])
    with pytest.raises(ValueError, match="accepted"):
        commit(slots, torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="hold 2"):
        commit(torch.arange(3), torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="K-1=3"):
        ConvCommit([(windows, states), (windows, states[:, :2])])
    with pytest.raises(ValueError, match="pair 1: every window"):
        ConvCommit([(windows, states), (windows.half(), states.half())])
    with pytest.raises(ValueError, match="at least one"):
        ConvCommit([])


def test_one_launch_commits_convs_of_different_widths(cpu_interpreter):
    """Several (windows, states) pairs of different channel counts, windows buffers and pools, as the verify's layers
    hold them: one launch leaves every pool as the reference leaves it, each pair on its own."""
    gen = torch.Generator().manual_seed(3)
    b, width, k = 3, 4, 4
    pairs, refs = [], []
    for c, extra in ((96, 0), (600, 2), (32, 1)):  # 600: two channel blocks; the others exit in the second
        states = values((b + 2, k - 1, c), torch.float32, gen)
        windows = values((b + extra, k - 1 + width + extra, c), torch.float32, gen)  # the full buffers
        pairs.append((windows, states))
        refs.append((windows.clone(), states.clone()))
    slots = torch.tensor([4, 0, 2])
    accepted = torch.tensor([0, 4, 2])
    ConvCommit(pairs)(slots, accepted)
    for (_, states), (ref_windows, ref_states) in zip(pairs, refs, strict=True):
        conv_commit_reference(ref_windows, ref_states, slots, accepted)
        assert torch.equal(states, ref_states)
    assert torch.equal(pairs[0][1][4], refs[0][0][0, :3])  # accepted 0: the window's state rows, unchanged


def prologue_case(b, width, n_kv, group, hd, k, dtype, gen, device="cpu"):
    c = n_kv * hd
    k0 = values((b * width, 3 * c), dtype, gen, device)[:, :c]  # views of a wider projection
    v0 = values((b * width, c), dtype, gen, device)
    k_states, v_states = (values((b + 2, k - 1, c), dtype, gen, device) for _ in range(2))
    slots = torch.randperm(b + 2, generator=gen)[:b].to(device)
    k_windows, v_windows = (torch.zeros(b, k - 1 + width, c, dtype=dtype, device=device) for _ in range(2))
    k_weight, v_weight = (torch.randn(c, k, generator=gen).to(device) for _ in range(2))
    k_norm, q_norm = ((torch.rand(hd, generator=gen) + 0.5).to(dtype).to(device) for _ in range(2))
    k_pool, v_pool = (torch.zeros(4 * b * width, n_kv, hd, dtype=dtype, device=device) for _ in range(2))
    kv_rows = torch.randperm(4 * b * width, generator=gen)[: b * width].to(device)
    q = values((b * width, n_kv * group, hd), dtype, gen, device)
    return (k0, v0, k_states, v_states, slots, k_windows, v_windows, k_weight, v_weight, k_norm, EPS, k_pool, v_pool,
            kv_rows, q, q_norm, EPS)  # fmt: skip


def clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize(
    "b,width,n_kv,group,hd,dtype", [(1, 2, 1, 4, 16, torch.float32), (3, 4, 2, 3, 32, torch.float16)]
)
def test_kv_prologue_verify_equals_one_row_prologues(cpu_interpreter, b, width, n_kv, group, hd, dtype):
    gen = torch.Generator().manual_seed(b + width)
    args = prologue_case(b, width, n_kv, group, hd, 4, dtype, gen)
    ref_args = clone_args(args)
    q_out = kv_prologue_verify(*args)
    q_ref = kv_prologue_verify_reference(*ref_args)
    for got, want in zip(args, ref_args, strict=True):
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=1e-6)
    torch.testing.assert_close(q_out, q_ref, rtol=torch.finfo(dtype).eps, atol=1e-6)

    # The same rows one at a time through the one-row prologue reference write the same pools.
    k0, v0, k_states, v_states, slots, _, _, k_w, v_w, k_norm, _, k_pool, v_pool, kv_rows, _, _, _ = clone_args(
        prologue_case(b, width, n_kv, group, hd, 4, dtype, torch.Generator().manual_seed(b + width))
    )
    for j in range(width):
        rows = torch.arange(b) * width + j
        kv_prologue_reference(
            k0[rows], v0[rows], k_states, v_states, slots, k_w, v_w, k_norm, EPS, k_pool, v_pool, kv_rows[rows]
        )
    torch.testing.assert_close(args[11], k_pool, rtol=torch.finfo(dtype).eps, atol=1e-6)
    torch.testing.assert_close(args[12], v_pool, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("b,width", [(1, 2), (64, 5)])
def test_conv_verify_and_commit_gpu_bf16(cuda_device, b, width):
    gen = torch.Generator().manual_seed(b)
    x, states, slots, weight, windows = conv_case(b, width, 4096, 4, torch.bfloat16, gen, "cuda")
    x = torch.randn(x.shape, generator=gen).to(torch.bfloat16).cuda()  # rounding casts on the GPU
    residual = torch.randn(x.shape, generator=gen).to(torch.bfloat16).cuda()
    accepted = torch.randint(1, width + 1, (b,), generator=gen)
    want, want_states = one_row_steps(x.cpu(), states.cpu(), slots.cpu(), weight.cpu(), width, accepted.tolist(),
                                      residual.cpu())  # fmt: skip
    out = conv_verify(x, states, slots, weight, windows, residual)
    ConvCommit([(windows, states)])(slots, accepted.cuda())
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
    assert torch.equal(states.cpu(), want_states)


@pytest.mark.gpu
@pytest.mark.parametrize("b,width", [(1, 3), (64, 5)])
def test_kv_prologue_verify_gpu_bf16(cuda_device, b, width):
    args = prologue_case(b, width, 8, 4, 128, 4, torch.bfloat16, torch.Generator().manual_seed(b), "cuda")
    ref_args = clone_args(args)
    q_out = kv_prologue_verify(*args)
    q_ref = kv_prologue_verify_reference(*ref_args)
    for got, want in zip(args, ref_args, strict=True):
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-6)
    torch.testing.assert_close(q_out, q_ref, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-6)
