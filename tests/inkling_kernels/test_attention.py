import pytest
import torch

from inkling_kernels.attention import (
    DecodeConfig,
    attention_reference,
    decode_attention,
    default_config,
    paged_attention_reference,
    paged_decode_attention,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(b, nh, nkv, hd, d_rel, extent, s_max, gen, dtype, device="cpu"):
    q = torch.randn(b, nh, hd, generator=gen).to(dtype)
    r = torch.randn(b, nh, d_rel, generator=gen).to(dtype)
    rel_proj = (torch.randn(d_rel, extent, generator=gen) * 0.5).to(dtype)
    kc = torch.randn(b, s_max, nkv, hd, generator=gen).to(dtype)
    vc = torch.randn(b, s_max, nkv, hd, generator=gen).to(dtype)
    return [t.to(device) for t in (q, r, rel_proj, kc, vc)]


def paged_layout(kc, vc, lens, page_size, window, gen, padding=(), spare_pages=2):
    """Scatter the visible keys of contiguous caches ``[B, S, nKV, hd]`` into one layer of a paged pool.

    Returns (k_pool, v_pool, block_table): the pools are layer 1 of ``[2, slots, nKV, hd]`` tensors (first-dim
    stride nKV*hd, as in the engine), NaN except at visible keys, with page ids shuffled. Table entries of pages
    holding no visible key (wholly before the window or beyond the length, one spare column) and every entry of
    the ``padding`` rows point at a scratch page whose only finite row is its first (a padding row's own key).
    """
    b, s_max, nkv, hd = kc.shape
    max_pages = -(-s_max // page_size) + 1
    n = torch.tensor(lens)[:, None]
    lo = (n - window).clamp(min=0) if window is not None else torch.zeros_like(n)
    real = torch.ones(b, 1, dtype=torch.bool)
    real[list(padding)] = False
    page = torch.arange(max_pages)[None, :]
    needed = real & ((page + 1) * page_size > lo) & (page * page_size < n)  # [B, max_pages]
    num_pages = int(needed.sum()) + 1 + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((b, max_pages), int(perm[0]), dtype=torch.int32)
    table[needed] = perm[1 : 1 + int(needed.sum())].int()
    pos = torch.arange(s_max)[None, :]
    visible = real & (pos >= lo) & (pos < n)  # [B, S]
    rows = table.long()[torch.arange(b)[:, None], pos // page_size] * page_size + pos % page_size
    pools = torch.full((2, 2, num_pages * page_size, nkv, hd), float("nan"), dtype=kc.dtype, device=kc.device)
    pools[0, 1, rows[visible].to(kc.device)] = kc[visible.to(kc.device)]
    pools[1, 1, rows[visible].to(kc.device)] = vc[visible.to(kc.device)]
    pools[:, 1, int(perm[0]) * page_size] = torch.randn(2, nkv, hd, generator=gen).to(kc.dtype).to(kc.device)
    return pools[0, 1], pools[1, 1], table.to(kc.device)


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


@pytest.mark.parametrize(
    "page_size,window,log_scaling,lens,num_splits,max_seq_len,dtype",
    [
        (16, None, (0.5, 20.0), [1, 77, 150], None, None, torch.float32),  # global + tau, several splits
        (4, None, None, [33, 150], 3, 150, torch.float32),  # bias beyond R cut off, tight max_seq_len
        (5, 40, None, [1, 39, 40, 41, 130], None, None, torch.float32),  # window, early pages released
        (5, 40, None, [60, 130], 1, None, torch.float16),
        (4, 40, None, [41, 97], 3, 100, torch.float16),
        (16, None, (0.5, 20.0), [5, 100], 3, None, torch.float16),
    ],
)
def test_paged_decode_attention_matches_reference(
    cpu_interpreter, page_size, window, log_scaling, lens, num_splits, max_seq_len, dtype
):
    gen = torch.Generator().manual_seed(page_size + len(lens))
    q, r, rel_proj, kc, vc = inputs(len(lens), 8, 2, 32, 16, window or 48, max(lens), gen, dtype)
    kp, vp, table = paged_layout(kc, vc, lens, page_size, window, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(
        q, r, rel_proj, kp, vp, table, seq_lens, page_size, window, log_scaling, max_seq_len, num_splits
    )
    ref = paged_attention_reference(q, r, rel_proj, kp, vp, table, seq_lens, page_size, window, log_scaling)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(ref).all()  # the reference, too, never sees the NaN rows
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize(
    "config,window,rows,dtype",
    [
        (DecodeConfig(32, 2, 3, num_splits=1), 40, 1, torch.float32),  # one split: output from the split kernel
        (DecodeConfig(32, 2, 2, num_splits=3), None, 1, torch.float16),
        (DecodeConfig(64, 4, 2, num_splits=2), 40, 3, torch.float16),
        (DecodeConfig(16, 1, 3, num_splits=1), None, 2, torch.float32),
        (DecodeConfig(32, 2, 3, num_splits=1, bias_table=True), 40, 5, torch.float32),  # the bias from its table
        (DecodeConfig(64, 4, 2, num_splits=3, bias_table=True), None, 3, torch.float16),
        (DecodeConfig(16, 1, 3, num_splits=2, bias_table=True), None, 1, torch.float32),
    ],
)
def test_paged_decode_attention_tiles(cpu_interpreter, config, window, rows, dtype):
    """Every tile shape and split count gives the reference, one row or W rows per sequence, the bias formed in the
    kernel or read from the rows' table."""
    gen = torch.Generator().manual_seed(config.block_n + rows)
    firsts = [0, 38, 77, 150]
    q, r, rel_proj, kp, vp, table, seq_lens = verify_rows(firsts, rows, 8, 2, 16, window, gen, dtype)
    ls = None if window else (0.5, 20.0)
    out = paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, 16, window, ls, rows_per_seq=rows,
                                 config=config)  # fmt: skip
    ref = paged_attention_reference(q, r, rel_proj, kp, vp, table.repeat_interleave(rows, 0), seq_lens, 16, window,
                                    ls)  # fmt: skip
    assert out.dtype == dtype and torch.isfinite(ref).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_decode_attention_rejects_bias_dtypes():
    gen = torch.Generator().manual_seed(0)
    q, r, rel_proj, kc, vc = inputs(1, 8, 2, 32, 16, 16, 8, gen, torch.float16)
    with pytest.raises(ValueError, match="share a float dtype"):
        decode_attention(q, r, rel_proj.float(), kc, vc, torch.tensor([3]))


def test_paged_decode_attention_padding_rows(cpu_interpreter):
    """CUDA-graph padding rows (seq_len 1, whole table on the scratch page) next to real ones."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 70, 1, 45]
    q, r, rel_proj, kc, vc = inputs(len(lens), 8, 2, 32, 16, 48, 70, gen, torch.float32)
    kp, vp, table = paged_layout(kc, vc, lens, 16, 40, gen, padding=(0, 2))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, 16, 40)
    ref = paged_attention_reference(q, r, rel_proj, kp, vp, table, seq_lens, 16, 40)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-5
    # A padding row attends to its own (scratch) key only: the output is that value row.
    scratch_row = table[0, 0].item() * 16
    torch.testing.assert_close(out[0], vp[scratch_row].repeat_interleave(4, dim=0), rtol=1e-6, atol=1e-6)


def verify_rows(firsts, width, nh, nkv, page_size, window, gen, dtype, device="cpu", hd=32):
    """An MTP verify's query rows: sequence b at positions firsts[b] .. firsts[b] + width - 1 (row-major) over a
    paged layout holding every key its first row can see."""
    b, last = len(firsts), max(firsts) + width
    q, r, rel_proj, kc, vc = inputs(b * width, nh, nkv, hd, 16, window or 48, last, gen, dtype, device)
    kc, vc = kc[::width].contiguous(), vc[::width].contiguous()  # one cache per sequence
    layout_window = None if window is None else window + width - 1  # from the first row's window on
    kp, vp, table = paged_layout(kc, vc, [f + width for f in firsts], page_size, layout_window, gen)
    seq_lens = (torch.tensor(firsts)[:, None] + torch.arange(1, width + 1)).flatten().int().to(device)
    return q, r, rel_proj, kp, vp, table, seq_lens


@pytest.mark.parametrize(
    "firsts,width,nh,window,log_scaling,num_splits,dtype",
    [
        ([0, 76, 199], 3, 8, None, None, None, torch.float32),  # global, several splits, bias beyond R
        ([3, 38, 41, 150], 5, 8, 40, None, None, torch.float32),  # sliding, W x group = 20 rows of a 32-row tile
        ([5, 150], 2, 4, None, (0.5, 20.0), 1, torch.float32),  # tau per row
        ([60, 129], 4, 8, 40, None, 3, torch.float16),
    ],
)
def test_paged_decode_attention_rows_per_sequence(
    cpu_interpreter, firsts, width, nh, window, log_scaling, num_splits, dtype
):
    """One program for the W rows of a sequence equals each row as a sequence of its own (the reference, and the
    one-row kernel over the table repeated per row), whatever each row's length."""
    gen = torch.Generator().manual_seed(width + len(firsts))
    q, r, rel_proj, kp, vp, table, seq_lens = verify_rows(firsts, width, nh, 2, 16, window, gen, dtype)
    lens = seq_lens.view(-1, width)
    lens[1::2, -1] = lens[1::2, 0]  # a padded row (as DecodeGraphs leaves them) sees only the first row's keys
    out = paged_decode_attention(
        q, r, rel_proj, kp, vp, table, seq_lens, 16, window, log_scaling, num_splits=num_splits, rows_per_seq=width
    )
    per_row = table.repeat_interleave(width, 0)
    ref = paged_attention_reference(q, r, rel_proj, kp, vp, per_row, seq_lens, 16, window, log_scaling)
    rows = paged_decode_attention(q, r, rel_proj, kp, vp, per_row, seq_lens, 16, window, log_scaling,
                                  num_splits=num_splits)  # fmt: skip
    assert out.shape == q.shape and torch.isfinite(ref).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    assert rel_err(out, rows) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [2, 5])
@pytest.mark.parametrize("window,log_scaling", [(512, None), (None, (0.1, 100.0))])
def test_paged_decode_attention_rows_per_sequence_gpu(cuda_device, width, window, log_scaling):
    gen = torch.Generator().manual_seed(width)
    firsts = [0, 510, 1023, 1500, 77, 600]
    q, r, rel_proj, kp, vp, table, seq_lens = verify_rows(
        firsts, width, 32, 8, 16, window, gen, torch.bfloat16, cuda_device, hd=128
    )
    out = paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, 16, window, log_scaling, 1500 + width,
                                 rows_per_seq=width)  # fmt: skip
    per_row = table.repeat_interleave(width, 0)
    ref = paged_attention_reference(q, r, rel_proj, kp, vp, per_row, seq_lens, 16, window, log_scaling)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2


def test_paged_decode_attention_rows_per_sequence_rejects_bad_layout():
    gen = torch.Generator().manual_seed(1)
    q, r, rel_proj, kp, vp, table, seq_lens = verify_rows([4, 9], 3, 8, 2, 16, None, gen, torch.float32)
    with pytest.raises(ValueError, match="rows_per_seq"):
        paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, 16, rows_per_seq=4)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, r, rel_proj, kp, vp, table.repeat_interleave(3, 0), seq_lens, 16, rows_per_seq=3)


@pytest.mark.parametrize("page_size,window,dtype", [(16, None, torch.float32), (5, 40, torch.float16)])
def test_paged_decode_attention_equals_contiguous(cpu_interpreter, page_size, window, dtype):
    gen = torch.Generator().manual_seed(11)
    lens = [1, 38, 41, 64, 129]
    q, r, rel_proj, kc, vc = inputs(len(lens), 8, 2, 32, 16, 48, 130, gen, dtype)
    kp, vp, table = paged_layout(kc, vc, lens, page_size, window, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ls = None if window else (0.5, 20.0)
    paged = paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, page_size, window, ls, max_seq_len=130)
    contiguous = decode_attention(q, r, rel_proj, kc, vc, seq_lens, window, ls, max_seq_len=130)
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=0)  # same blocks, same order: bitwise


def test_paged_decode_attention_rejects_bad_layout():
    gen = torch.Generator().manual_seed(0)
    q, r, rel_proj, kc, vc = inputs(1, 8, 2, 32, 16, 16, 8, gen, torch.float32)
    pool = kc.reshape(8, 2, 32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_size"):
        paged_decode_attention(q, r, rel_proj, pool, pool, table, torch.tensor([3]), 3)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, r, rel_proj, pool, pool, table.float(), torch.tensor([3]), 4)


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


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("window,log_scaling", [(512, None), (None, (0.1, 100.0))])
def test_paged_decode_attention_gpu_full_heads(cuda_device, b, window, log_scaling):
    gen = torch.Generator().manual_seed(b)
    s_max = 8192
    fixed = [8192, 1, 511, 512, 513, 1024, 1025, 4096]
    lens = (fixed + torch.randint(1, s_max + 1, (b,), generator=gen).tolist())[:b] if b > 1 else [s_max]
    extent = window or 1024
    q, r, rel_proj, kc, vc = inputs(b, 32, 8, 128, 16, extent, s_max, gen, torch.bfloat16, cuda_device)
    kp, vp, table = paged_layout(kc, vc, lens, 16, window, gen)
    del kc, vc
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=cuda_device)
    out = paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, 16, window, log_scaling, s_max)
    ref = paged_attention_reference(q, r, rel_proj, kp, vp, table, seq_lens, 16, window, log_scaling)
    err = rel_err(out, ref)
    print(f"paged_decode_attention B={b} window={window} tau={log_scaling}: rel {err:.2e}")
    assert torch.isfinite(out).all() and err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window,log_scaling", [(512, None), (None, (0.1, 100.0))])
def test_paged_decode_attention_gpu_default_tiles(cuda_device, window, log_scaling):
    """Every tile ``default_config`` picks for the Inkling shapes (one row and an MTP verify's five), at one and at
    three splits, bf16 on the GPU against the reference."""
    tiles = {
        (c.block_n, c.num_warps, c.num_stages, c.bias_table)
        for b in (1, 8, 64, 256)
        for n_kv in (2, 8, 16)
        for keys in (1024, 8192, 32768)
        for rows in (1, 5)
        if (c := default_config(b, n_kv, keys, window, 32 // n_kv, rows))
    }
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 5):
        firsts = [0, 510, 1023, 1500, 3000]
        q, r, rel_proj, kp, vp, table, seq_lens = verify_rows(
            firsts, rows, 32, 8, 16, window, gen, torch.bfloat16, cuda_device, hd=128
        )
        per_row = table.repeat_interleave(rows, 0)
        ref = paged_attention_reference(q, r, rel_proj, kp, vp, per_row, seq_lens, 16, window, log_scaling)
        for block_n, warps, stages, bias_table in sorted(tiles):
            for splits in (1, 3):
                config = DecodeConfig(block_n, warps, stages, num_splits=splits, bias_table=bias_table)
                out = paged_decode_attention(q, r, rel_proj, kp, vp, table, seq_lens, 16, window, log_scaling,
                                             3000 + rows, rows_per_seq=rows, config=config)  # fmt: skip
                err = rel_err(out, ref)
                assert torch.isfinite(out).all() and err < 1e-2, f"{config} rows={rows}: rel err {err:.2e}"
