import math

import pytest
import torch

from inkling_kernels.attention import attention_reference
from inkling_kernels.prefill_attention import (
    PrefillConfig,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_attention,
    prefill_attention_reference,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def on_grid(t: torch.Tensor, steps: int, bound: float) -> torch.Tensor:
    """t rounded to multiples of 1/steps within [-bound, bound]."""
    return (t * steps).round().clamp(-bound * steps, bound * steps) / steps


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
        PrefillConfig(32, 16, 4, 2),
        PrefillConfig(16, 32, 4, 2),  # key blocks wider than query blocks
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
    # The bias table is one launch over all sequences' rows, tiled across their boundaries; on the CPU the
    # interpreter's fp32 dot rounds a row by where it sits in its tile (OpenBLAS' kernels), so r and P lie on grids
    # whose products and d_rel-term sums are exact in fp32 in any order (multiples of 2^-5 below 2^5).
    inputs = [(q, on_grid(r, 4, 2.0), on_grid(p, 8, 1.0), k, v) for q, r, p, k, v in inputs]
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
