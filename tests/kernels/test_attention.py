import math

import pytest
import torch

from kernels.attention import (
    PrefillConfig,
    attention_reference,
    decode_attention,
    paged_attention_reference,
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_attention,
    prefill_attention_reference,
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


# -- prefill: several queries of one sequence -------------------------------------------------------------------


def prefill_inputs(n, m, nh, nkv, hd, d_rel, extent, gen, dtype, device="cpu", stacked=False):
    """q, r, P, keys, values for n queries against m keys. ``stacked``: q and r are views of one ``[n, ...]``
    projection output (as `Attention.project` leaves them) and keys/values views of one ``[2, m, nKV, hd]`` tensor."""
    if stacked:
        proj = torch.randn(n, nh * (hd + d_rel) + 8, generator=gen).to(dtype)
        q = proj[:, : nh * hd].view(n, nh, hd)
        r = proj[:, nh * hd : nh * (hd + d_rel)].view(n, nh, d_rel)
        kv = torch.randn(m, 2, nkv, hd, generator=gen).to(dtype)
        k, v = kv[:, 0], kv[:, 1]
    else:
        q = torch.randn(n, nh, hd, generator=gen).to(dtype)
        r = torch.randn(n, nh, d_rel, generator=gen).to(dtype)
        k = torch.randn(m, nkv, hd, generator=gen).to(dtype)
        v = torch.randn(m, nkv, hd, generator=gen).to(dtype)
    rel_proj = (torch.randn(d_rel, extent, generator=gen) * 0.5).to(dtype)
    return [t.to(device) for t in (q, r, rel_proj, k, v)]


# (q_start, k_first, window, extent, log_scaling): the keys always end with the chunk's own.
PREFILL_LAYOUTS = {
    "fresh": (0, 0, None, 48, None),  # global, first chunk; bias cut off beyond R = 48 once n > 48
    "later-global-tau": (50, 0, None, 48, (0.5, 20.0)),  # tau active (p + 1 > n_floor), distances up to 149 > R
    "later-window": (50, 11, 40, 40, None),  # keys from the window start of the chunk's first query
    "window-keys-from-0": (120, 0, 40, 40, None),  # blocks wholly before every window are skipped
    "window-short-extent": (70, 31, 40, 16, None),  # R < W: the farther visible keys get no bias
}


def check_prefill(n, layout, nkv, dtype, stacked=False, seed=0, config=None):
    q_start, k_first, window, extent, log_scaling = PREFILL_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    m = q_start + n - k_first
    q, r, rel_proj, k, v = prefill_inputs(n, m, 8, nkv, 32, 16, extent, gen, dtype, stacked=stacked)
    out = prefill_attention(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling, config)
    ref = prefill_attention_reference(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
@pytest.mark.parametrize("n", [1, 7, 64, 100])
def test_prefill_attention_matches_reference(cpu_interpreter, n, layout):
    check_prefill(n, layout, nkv=2, dtype=torch.float32)  # GQA group 4


@pytest.mark.parametrize(
    "n,layout,nkv,dtype,stacked",
    [
        (64, "fresh", 8, torch.float32, False),  # group 1
        (100, "later-window", 8, torch.float32, True),  # strided q/r and k/v views
        (100, "later-global-tau", 2, torch.float16, False),
        (7, "window-keys-from-0", 2, torch.float16, True),
        (64, "later-window", 8, torch.float16, False),
    ],
)
def test_prefill_attention_groups_dtypes_strides(cpu_interpreter, n, layout, nkv, dtype, stacked):
    check_prefill(n, layout, nkv, dtype, stacked, seed=n + nkv)


@pytest.mark.parametrize(
    "config",
    [
        PrefillConfig(32, 16, 4, 2, bias="rank1"),
        PrefillConfig(16, 32, 4, 2, bias="gather"),  # key blocks wider than query blocks
        PrefillConfig(32, 16, 4, 2, bias="gather"),
        PrefillConfig(32, 32, 4, 3),
    ],
)
@pytest.mark.parametrize("layout", ["later-global-tau", "later-window", "window-short-extent"])
def test_prefill_attention_configs(cpu_interpreter, layout, config):
    check_prefill(45, layout, 2, torch.float32, seed=3, config=config)


def paged_keys(keys, values, k_first, page_size, gen):
    """Keys/values ``[m, nKV, hd]`` from position k_first scattered into shuffled pages of a NaN-filled pool
    ``[pages * page_size, nKV, hd]`` (a few spare pages) -> (k_pool, v_pool, pages of the visible positions)."""
    m = keys.shape[0]
    page0, last = k_first // page_size, (k_first + m - 1) // page_size
    n_pages = last - page0 + 1
    perm = torch.randperm(n_pages + 3, generator=gen)
    pages = perm[:n_pages].int()
    pos = torch.arange(k_first, k_first + m)
    rows = pages.long()[pos // page_size - page0] * page_size + pos % page_size
    pools = torch.full((2, (n_pages + 3) * page_size, *keys.shape[1:]), float("nan"), dtype=keys.dtype)
    pools[0, rows], pools[1, rows] = keys, values
    return pools[0], pools[1], pages


@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_prefill_attention_packs_sequences_over_one_pool(cpu_interpreter, page_size):
    """Four sequences (one of a single token) in one launch over one shuffled pool: each equals `prefill_attention`
    over its own contiguous keys exactly, and the reference gathers the same keys."""
    gen = torch.Generator().manual_seed(page_size)
    window, extent = 40, 40
    spans = [(45, 50, 11), (30, 120, 81), (1, 70, 31), (20, 0, 0)]  # (n, q_start, k_first): keys from the window
    inputs = [prefill_inputs(n, q_start + n - k_first, 8, 2, 32, 16, extent, gen, torch.float32)
              for n, q_start, k_first in spans]  # fmt: skip
    rel_proj = inputs[0][2]
    num_pages = sum(k.shape[0] for *_, k, _ in inputs) // page_size + 2 * len(spans) + 3
    pool = torch.full((2, num_pages * page_size, 2, 32), float("nan"))
    perm, used, tables = torch.randperm(num_pages, generator=gen), 0, []
    for (n, q_start, k_first), (*_, k, v) in zip(spans, inputs, strict=True):
        n_pages = (q_start + n - 1) // page_size - k_first // page_size + 1
        pages = perm[used : used + n_pages]
        used += n_pages
        pos = torch.arange(k_first, q_start + n)
        slots = pages[pos // page_size - k_first // page_size] * page_size + pos % page_size
        pool[0, slots], pool[1, slots] = k, v
        tables.append(pages)
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).int()
    lengths, q_starts, k_firsts = zip(*spans, strict=True)
    q, r = torch.cat([x[0] for x in inputs]), torch.cat([x[1] for x in inputs])
    args = (q, r, rel_proj, pool[0], pool[1], table, page_size, lengths, q_starts, k_firsts, window)
    config = PrefillConfig(64, 32, 4, 2)  # the same tiles for each sequence alone: the same sums
    out = paged_prefill_attention(*args, config=config)
    ref = paged_prefill_attention_reference(*args)
    assert torch.isfinite(out).all()
    row = 0
    for (n, q_start, k_first), (q1, r1, _, k, v) in zip(spans, inputs, strict=True):
        alone = prefill_attention(q1, r1, rel_proj, k, v, q_start, k_first, window, config=config)
        assert torch.equal(out[row : row + n], alone)
        alone = prefill_attention_reference(q1, r1, rel_proj, k, v, q_start, k_first, window)
        torch.testing.assert_close(ref[row : row + n], alone, rtol=0, atol=0)
        row += n


def test_paged_prefill_attention_global_tau_and_a_pool_of_another_dtype(cpu_interpreter):
    q_start, k_first, window, extent, log_scaling = PREFILL_LAYOUTS["later-global-tau"]
    gen = torch.Generator().manual_seed(9)
    n = 20
    q, r, rel_proj, k, v = prefill_inputs(n, q_start + n - k_first, 8, 2, 32, 16, extent, gen, torch.float16)
    k_pool, v_pool, pages = paged_keys(k.float(), v.float(), k_first, 8, gen)  # an fp32 pool
    out = paged_prefill_attention(
        q, r, rel_proj, k_pool, v_pool, pages[None], 8, [n], [q_start], [k_first], window, log_scaling
    )
    assert torch.equal(out, prefill_attention(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling))


def dense_attention(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling):
    """The spec's formula pair by pair: logit = tau(p) * (q.k / hd + L(p, p - s) [p - s < R]), masked, softmax."""
    n, nh, hd = q.shape
    m, group, extent = k.shape[0], nh // k.shape[1], rel_proj.shape[1]
    table = torch.einsum("nhd,dr->hnr", r.double(), rel_proj.double())  # [nH, n, R]
    logits = torch.einsum("nhd,mhd->hnm", q.double(), k.double().repeat_interleave(group, 1)) / hd
    for i in range(n):
        p = q_start + i
        tau = 1.0 if log_scaling is None else 1.0 + log_scaling[0] * math.log(max((p + 1) / log_scaling[1], 1.0))
        for j in range(m):
            dist = p - (k_first + j)
            if dist < 0 or (window is not None and dist >= window):
                logits[:, i, j] = -math.inf
                continue
            if dist < extent:
                logits[:, i, j] += table[:, i, dist]
            logits[:, i, j] *= tau
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v.double().repeat_interleave(group, 1))


@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
def test_prefill_attention_reference_is_the_dense_formula(layout):
    q_start, k_first, window, extent, log_scaling = PREFILL_LAYOUTS[layout]
    n = 9
    m = q_start + n - k_first
    q, r, rel_proj, k, v = prefill_inputs(n, m, 4, 2, 16, 16, extent, torch.Generator().manual_seed(5), torch.float32)
    ref = prefill_attention_reference(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling)
    dense = dense_attention(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-5, atol=1e-5)
    if k_first == 0:  # each query is also one decode step over the keys up to its own
        for i in range(n):
            lens = torch.tensor([q_start + i + 1])
            step = attention_reference(
                q[i : i + 1], r[i : i + 1], rel_proj, k[None], v[None], lens, window, log_scaling
            )
            torch.testing.assert_close(ref[i : i + 1], step, rtol=1e-5, atol=1e-5)


def test_prefill_attention_rejects_bad_key_range():
    gen = torch.Generator().manual_seed(0)
    q, r, rel_proj, k, v = prefill_inputs(4, 10, 8, 2, 32, 16, 16, gen, torch.float32)
    with pytest.raises(ValueError, match="must end with the queries' own"):
        prefill_attention(q, r, rel_proj, k, v, 6, 1)  # keys 1..10, queries 6..9
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention(q, r[..., :12], rel_proj[:12], k, v, 6, 0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,q_start,k_first,window,log_scaling",
    [
        (2048, 0, 0, 512, None),  # first chunk
        (2048, 0, 0, None, (0.1, 100.0)),
        (2048, 6144, 5633, 512, None),  # later chunk, keys from the window start
        (2048, 6144, 0, 512, None),  # later chunk, all 8192 keys (most blocks skipped)
        (2048, 6144, 0, None, (0.1, 100.0)),  # global + tau over 8192 keys, bias cut off beyond 1024
    ],
)
def test_prefill_attention_gpu_full_heads(cuda_device, n, q_start, k_first, window, log_scaling):
    gen = torch.Generator().manual_seed(n + q_start + k_first)
    m = q_start + n - k_first
    extent = window or 1024
    q, r, rel_proj, k, v = prefill_inputs(n, m, 32, 8, 128, 16, extent, gen, torch.bfloat16, cuda_device, True)
    out = prefill_attention(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling)
    ref = prefill_attention_reference(q, r, rel_proj, k, v, q_start, k_first, window, log_scaling)
    err = rel_err(out, ref)
    print(f"prefill_attention n={n} q_start={q_start} m={m} window={window} tau={log_scaling}: rel {err:.2e}")
    assert torch.isfinite(out).all() and err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,q_start,k_first,window", [(2048, 6144, 5633, 512), (2048, 6144, 0, None)])
def test_paged_prefill_attention_gpu_equals_contiguous(cuda_device, n, q_start, k_first, window):
    gen = torch.Generator().manual_seed(n + q_start)
    m = q_start + n - k_first
    q, r, rel_proj, k, v = prefill_inputs(n, m, 32, 8, 128, 16, 1024, gen, torch.bfloat16, cuda_device, True)
    k_pool, v_pool, pages = (t.to(cuda_device) for t in paged_keys(k.cpu(), v.cpu(), k_first, 16, gen))
    out = paged_prefill_attention(q, r, rel_proj, k_pool, v_pool, pages[None], 16, [n], [q_start], [k_first], window)
    assert torch.equal(out, prefill_attention(q, r, rel_proj, k, v, q_start, k_first, window))
