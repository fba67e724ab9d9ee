import pytest
import torch

from decode_service.model.layers import RMSNorm, ShortConv
from inkling_kernels.short_conv import conv_decode, conv_decode_reference, kv_prologue, kv_prologue_reference

EPS = 1e-6


def assert_within_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: 1e-6 relative; fp16/bf16: one unit in the last place (the fp32 norm statistics may differ in their
    last bit; the conv itself is the same fp32 arithmetic in the same order)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=max(torch.finfo(out.dtype).eps, 1e-6), atol=1e-6)


def values(shape, dtype, gen, device="cpu", exact=True):
    """Random values; ``exact``: on a grid that bf16 and fp16 hold exactly, so that the casts between them are
    exact in Triton's CPU interpreter (which truncates fp32 -> bf16). Rounding casts are tested with fp16 and on GPU."""
    v = torch.randn(shape, generator=gen)
    if exact:
        v = (v * 64).round().div(64).clamp(-4, 4)
    return v.to(dtype).to(device)


def conv_inputs(b, c, k, dtype, state_dtype, gen, device="cpu", exact=True):
    x = values((b, c + 16), dtype, gen, device, exact)[:, :c]  # strided rows, as a slice of a wider output
    states = values((b + 3, k - 1, c), state_dtype, gen, device, exact)  # a pool with 3 slots not in the batch
    slots = torch.randperm(b + 3, generator=gen)[:b].to(device)  # distinct, shuffled
    weight = torch.randn(k, c, generator=gen).T.to(device)  # fp32 [C, K], not contiguous
    residual = values((b, c), dtype, gen, device, exact)
    norm_weight = (torch.rand(c, generator=gen) + 0.5).to(dtype).to(device)
    return x, states, slots, weight, residual, norm_weight


def untouched(states: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> bool:
    others = torch.ones(states.shape[0], dtype=torch.bool, device=states.device)
    others[slots] = False
    return torch.equal(states[others], before[others])


CONV_CASES = [
    (1, 48, 4, torch.float32, torch.float32),
    (3, 64, 2, torch.float32, torch.bfloat16),  # bf16 pool with fp32 activations
    (8, 256, 4, torch.float16, torch.float16),
    (3, 48, 3, torch.float16, torch.float32),  # fp32 pool, fp16 activations: the shifted state rounds to fp16
]


@pytest.mark.parametrize("b,c,k,dtype,state_dtype", CONV_CASES)
@pytest.mark.parametrize("variant", ["plain", "residual", "norm", "residual+norm"])
@pytest.mark.parametrize("tiles", [None, (2, 512, 2), (4, 32, 1)])  # None: as built; 2 or 4 rows per program
def test_conv_decode_matches_reference(cpu_interpreter, b, c, k, dtype, state_dtype, variant, tiles):
    gen = torch.Generator().manual_seed(b * c + k)
    exact = torch.bfloat16 in (dtype, state_dtype)
    x, states, slots, weight, residual, norm_weight = conv_inputs(b, c, k, dtype, state_dtype, gen, exact=exact)
    residual = residual if "residual" in variant else None
    norm_weight = norm_weight if "norm" in variant else None
    before, ref_states = states.clone(), states.clone()
    out, normed = conv_decode(x, states, slots, weight, residual, norm_weight, EPS, tiles)
    ref, ref_normed = conv_decode_reference(x, ref_states, slots, weight, residual, norm_weight, EPS)
    assert torch.equal(out, ref)
    assert torch.equal(states, ref_states) and untouched(states, before, slots)
    assert (normed is None) == (norm_weight is None)
    if normed is not None:
        assert_within_rounding(normed, ref_normed)


@pytest.mark.parametrize("with_norm", [False, True])
def test_conv_decode_several_channel_blocks(cpu_interpreter, with_norm):
    """Channel blocks narrower than C: several programs per row group (of 2 rows, the last one partial), or one
    normalising program per row group looping over the blocks."""
    gen = torch.Generator().manual_seed(5)
    x, states, slots, weight, residual, norm_weight = conv_inputs(3, 80, 4, torch.float32, torch.float32, gen)
    norm_weight = norm_weight if with_norm else None
    ref_states = states.clone()
    out, normed = conv_decode(x, states, slots, weight, residual, norm_weight, EPS, (2, 32 if with_norm else 16, 1))
    ref, ref_normed = conv_decode_reference(x, ref_states, slots, weight, residual, norm_weight, EPS)
    assert torch.equal(out, ref) and torch.equal(states, ref_states)
    if with_norm:
        assert_within_rounding(normed, ref_normed)


def test_conv_decode_padding_rows_share_a_scratch_slot(cpu_interpreter):
    """A CUDA-graph bucket pads with rows that all point at one scratch slot: the real rows are unaffected."""
    gen = torch.Generator().manual_seed(6)
    x, states, _, weight, residual, _ = conv_inputs(5, 48, 4, torch.float32, torch.float32, gen)
    slots = torch.tensor([4, 1, 7, 0, 0])  # rows 3 and 4 are padding on scratch slot 0
    ref_states = states.clone()
    out, _ = conv_decode(x, states, slots, weight, residual)
    ref, _ = conv_decode_reference(x[:3], ref_states, slots[:3], weight, residual[:3])
    assert torch.equal(out[:3], ref)
    assert torch.equal(states[1:], ref_states[1:])
    assert torch.equal(states[0, -1], x[3]) or torch.equal(states[0, -1], x[4])


def test_conv_decode_rejects_bad_operands():
    gen = torch.Generator().manual_seed(7)
    x, states, slots, weight, _, _ = conv_inputs(2, 48, 4, torch.float32, torch.float32, gen)
    with pytest.raises(ValueError, match="kernel size"):
        conv_decode(x, states[:, :2], slots, weight)
    with pytest.raises(ValueError, match="slots"):
        conv_decode(x, states, slots.int(), weight)
    with pytest.raises(ValueError, match="stride"):
        conv_decode(x, states.transpose(1, 2).contiguous().transpose(1, 2), slots, weight)
    with pytest.raises(ValueError, match="norm_weight"):
        conv_decode(x, states, slots, weight, norm_weight=torch.ones(32))


def prologue_inputs(b, n_kv, hd, k, dtype, state_dtype, pool_dtype, gen, device="cpu", exact=True):
    width = n_kv * hd
    projection = values((b, 3 * width), dtype, gen, device, exact)  # [q | k | v] of a fused projection
    k0, v0 = projection[:, width : 2 * width], projection[:, 2 * width :]
    k_states = values((b + 3, k - 1, width), state_dtype, gen, device, exact)
    v_states = values((b + 3, k - 1, width), state_dtype, gen, device, exact)
    slots = torch.randperm(b + 3, generator=gen)[:b].to(device)
    k_weight = torch.randn(k, width, generator=gen).T.to(device)
    v_weight = torch.randn(width, k, generator=gen).to(device)
    k_norm_weight = (torch.rand(hd, generator=gen) + 0.5).to(dtype).to(device)
    pool = values((2 * b + 3, 2, n_kv, hd), pool_dtype, gen, device, exact)  # [rows, k|v, nKV, hd]
    kv_rows = torch.randperm(2 * b + 3, generator=gen)[:b].to(device)
    return k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, pool, kv_rows


@pytest.mark.parametrize(
    "b,n_kv,hd,k,dtype,state_dtype,pool_dtype",
    [
        (1, 2, 16, 4, torch.float32, torch.float32, torch.float32),
        (3, 4, 32, 2, torch.float32, torch.bfloat16, torch.float32),
        (8, 2, 64, 4, torch.float16, torch.float16, torch.float16),
        (3, 1, 32, 4, torch.float16, torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("tiles", [None, (2, 1)])  # None: as built; 2 rows per program
def test_kv_prologue_matches_reference(cpu_interpreter, b, n_kv, hd, k, dtype, state_dtype, pool_dtype, tiles):
    gen = torch.Generator().manual_seed(b * hd + k)
    exact = torch.bfloat16 in (dtype, state_dtype, pool_dtype)
    k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, pool, kv_rows = prologue_inputs(
        b, n_kv, hd, k, dtype, state_dtype, pool_dtype, gen, exact=exact
    )
    before, ref_pool = pool.clone(), pool.clone()
    ref_k_states, ref_v_states = k_states.clone(), v_states.clone()
    kv_prologue(
        k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, EPS, pool[:, 0], pool[:, 1], kv_rows,
        tiles=tiles,
    )  # fmt: skip
    kv_prologue_reference(
        k0, v0, ref_k_states, ref_v_states, slots, k_weight, v_weight, k_norm_weight, EPS,
        ref_pool[:, 0], ref_pool[:, 1], kv_rows,
    )  # fmt: skip
    assert torch.equal(k_states, ref_k_states) and torch.equal(v_states, ref_v_states)
    assert torch.equal(pool[:, 1], ref_pool[:, 1])  # values: the conv output, cast
    assert_within_rounding(pool[:, 0], ref_pool[:, 0])  # keys: normalised
    assert untouched(pool, before, kv_rows)


def query_inputs(b, n_heads, hd, dtype, gen, device="cpu", exact=True):
    """Queries as a strided [B, nH, hd] view of a wider projection row (as `Attention.project` splits them)."""
    projection = values((b, n_heads * hd + 48), dtype, gen, device, exact)
    q = projection[:, : n_heads * hd].view(b, n_heads, hd)
    q_norm_weight = (torch.rand(hd, generator=gen) + 0.5).to(dtype).to(device)
    return q, q_norm_weight


@pytest.mark.parametrize(
    "b,n_kv,group,hd,dtype",
    [(1, 2, 1, 16, torch.float32), (3, 2, 4, 32, torch.float16), (2, 1, 3, 16, torch.float32)],  # 3: padded rows
)
@pytest.mark.parametrize("tiles", [None, (2, 1)])
def test_kv_prologue_norms_the_queries(cpu_interpreter, b, n_kv, group, hd, dtype, tiles):
    """With q: the same launch returns `q_norm(q)` `[B, nH, hd]`, and the pools and states are as without q."""
    gen = torch.Generator().manual_seed(b * group + hd)
    k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, pool, kv_rows = prologue_inputs(
        b, n_kv, hd, 4, dtype, dtype, dtype, gen
    )
    q, q_norm_weight = query_inputs(b, n_kv * group, hd, dtype, gen)
    q_before, ref_pool = q.clone(), pool.clone()
    ref_k_states, ref_v_states = k_states.clone(), v_states.clone()
    q_eps = 1e-5
    normed = kv_prologue(
        k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, EPS, pool[:, 0], pool[:, 1], kv_rows,
        q, q_norm_weight, q_eps, tiles,
    )  # fmt: skip
    ref = kv_prologue_reference(
        k0, v0, ref_k_states, ref_v_states, slots, k_weight, v_weight, k_norm_weight, EPS,
        ref_pool[:, 0], ref_pool[:, 1], kv_rows, q, q_norm_weight, q_eps,
    )  # fmt: skip
    assert normed.is_contiguous() and torch.equal(q, q_before)
    assert_within_rounding(normed, ref)
    assert torch.equal(k_states, ref_k_states) and torch.equal(v_states, ref_v_states)
    assert torch.equal(pool[:, 1], ref_pool[:, 1])
    assert_within_rounding(pool[:, 0], ref_pool[:, 0])


def test_kv_prologue_rejects_bad_queries():
    gen = torch.Generator().manual_seed(11)
    b, n_kv, hd = 2, 2, 16
    args = prologue_inputs(b, n_kv, hd, 4, torch.float32, torch.float32, torch.float32, gen)
    operands = (*args[:8], EPS, args[8][:, 0], args[8][:, 1], args[9])
    q, q_norm_weight = query_inputs(b, 4, hd, torch.float32, gen)
    with pytest.raises(ValueError, match="q_norm_weight: give both"):
        kv_prologue(*operands, q)
    with pytest.raises(ValueError, match="multiple of nKV"):
        kv_prologue(*operands, q[:, :3], q_norm_weight)
    with pytest.raises(ValueError, match="q must be"):
        kv_prologue(*operands, q[:1], q_norm_weight)
    with pytest.raises(ValueError, match="q_norm_weight must be"):
        kv_prologue(*operands, q, torch.ones(8))


def test_reference_is_the_model_q_norm():
    """`kv_prologue_reference`'s queries = `Attention.q_norm` (a per-head `RMSNorm`), bit for bit."""
    gen = torch.Generator().manual_seed(12)
    b, n_kv, hd = 3, 2, 16
    args = prologue_inputs(b, n_kv, hd, 4, torch.bfloat16, torch.bfloat16, torch.bfloat16, gen, exact=False)
    q, _ = query_inputs(b, 4, hd, torch.bfloat16, gen, exact=False)
    q_norm = RMSNorm(hd, EPS)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(hd, generator=gen) + 0.5)
        q_norm.to(torch.bfloat16)
        ref = kv_prologue_reference(*args[:8], EPS, args[8][:, 0], args[8][:, 1], args[9], q, q_norm.weight, q_norm.eps)
        assert torch.equal(ref, q_norm(q))


def test_reference_is_the_model_short_conv():
    """`conv_decode_reference` = `ShortConv.step` per sequence (+ residual, then `RMSNorm`), bit for bit."""
    gen = torch.Generator().manual_seed(8)
    b, c, k = 3, 48, 4
    for dtype, state_dtype in [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]:
        x, states, slots, _, residual, _ = conv_inputs(b, c, k, dtype, state_dtype, gen, exact=False)
        conv, norm = ShortConv(c, k, layer=0, index=0), RMSNorm(c, EPS)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(c, 1, k, generator=gen))
            norm.weight.copy_(torch.rand(c, generator=gen) + 0.5)
            norm.to(dtype)
            before = states.clone()
            out, normed = conv_decode_reference(x, states, slots, conv.weight[:, 0, :], residual, norm.weight, EPS)
            for i, slot in enumerate(slots.tolist()):
                y, state = conv.step(x[i : i + 1], before[slot])
                assert torch.equal(out[i], residual[i] + y[0])
                assert torch.equal(states[slot], state.to(state_dtype))
            assert torch.equal(normed, norm(out))


def test_reference_is_the_model_store_kv():
    """`kv_prologue_reference` = `Attention.store_kv`'s k/v `ShortConv.step`s and per-head k `RMSNorm`."""
    gen = torch.Generator().manual_seed(9)
    b, n_kv, hd, k = 3, 2, 16, 4
    k0, v0, k_states, v_states, slots, _, _, _, pool, kv_rows = prologue_inputs(
        b, n_kv, hd, k, torch.bfloat16, torch.float32, torch.bfloat16, gen, exact=False
    )
    k_conv, v_conv, k_norm = ShortConv(n_kv * hd, k, 0, 0), ShortConv(n_kv * hd, k, 0, 1), RMSNorm(hd, EPS)
    with torch.no_grad():
        for conv in (k_conv, v_conv):
            conv.weight.copy_(torch.randn(n_kv * hd, 1, k, generator=gen))
        k_norm.weight.copy_(torch.rand(hd, generator=gen) + 0.5)
        k_norm.to(torch.bfloat16)
        k_before, v_before = k_states.clone(), v_states.clone()
        kv_prologue_reference(
            k0, v0, k_states, v_states, slots, k_conv.weight[:, 0, :], v_conv.weight[:, 0, :], k_norm.weight, EPS,
            pool[:, 0], pool[:, 1], kv_rows,
        )  # fmt: skip
        for i, (slot, row) in enumerate(zip(slots.tolist(), kv_rows.tolist(), strict=True)):
            key, k_state = k_conv.step(k0[i : i + 1], k_before[slot])
            value, v_state = v_conv.step(v0[i : i + 1], v_before[slot])
            assert torch.equal(pool[row, 0], k_norm(key.view(n_kv, hd)))
            assert torch.equal(pool[row, 1], value.view(n_kv, hd))
            assert torch.equal(k_states[slot], k_state.float()) and torch.equal(v_states[slot], v_state.float())


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 37, 64, 101, 256])  # 37, 101: a partial last row group
@pytest.mark.parametrize("variant", ["plain", "residual+norm", "norm"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_conv_decode_gpu_bf16(cuda_device, b, variant, state_dtype):
    gen = torch.Generator().manual_seed(b)
    c, k = 4096, 4
    x, states, slots, weight, residual, norm_weight = conv_inputs(
        b, c, k, torch.bfloat16, state_dtype, gen, cuda_device, exact=False
    )
    residual = residual if "residual" in variant else None
    norm_weight = norm_weight if "norm" in variant else None
    ref_states = states.clone()
    out, normed = conv_decode(x, states, slots, weight, residual, norm_weight, EPS)
    ref, ref_normed = conv_decode_reference(x, ref_states, slots, weight, residual, norm_weight, EPS)
    assert_within_rounding(out, ref)
    assert torch.equal(states, ref_states)
    if norm_weight is not None:
        assert_within_rounding(normed, ref_normed)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 37, 64, 256])
def test_kv_prologue_gpu_bf16(cuda_device, b):
    gen = torch.Generator().manual_seed(b)
    n_kv, hd, k = 8, 128, 4
    k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, pool, kv_rows = prologue_inputs(
        b, n_kv, hd, k, torch.bfloat16, torch.bfloat16, torch.bfloat16, gen, cuda_device, exact=False
    )
    ref_pool, ref_k_states, ref_v_states = pool.clone(), k_states.clone(), v_states.clone()
    kv_prologue(
        k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, EPS, pool[:, 0], pool[:, 1], kv_rows
    )
    kv_prologue_reference(
        k0, v0, ref_k_states, ref_v_states, slots, k_weight, v_weight, k_norm_weight, EPS,
        ref_pool[:, 0], ref_pool[:, 1], kv_rows,
    )  # fmt: skip
    assert torch.equal(k_states, ref_k_states) and torch.equal(v_states, ref_v_states)
    assert torch.equal(pool[:, 1], ref_pool[:, 1])  # the values: the conv alone, the same bits
    assert_norm_within_rounding(pool[:, 0], ref_pool[:, 0], k_norm_weight)  # the k-norm, like the q-norm


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 37, 64, 256])
def test_kv_prologue_with_queries_gpu_bf16(cuda_device, b):
    gen = torch.Generator().manual_seed(b + 1)
    n_kv, hd, k = 8, 128, 4
    k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, pool, kv_rows = prologue_inputs(
        b, n_kv, hd, k, torch.bfloat16, torch.bfloat16, torch.bfloat16, gen, cuda_device, exact=False
    )
    q, q_norm_weight = query_inputs(b, 32, hd, torch.bfloat16, gen, cuda_device, exact=False)
    ref_pool, ref_k_states, ref_v_states = pool.clone(), k_states.clone(), v_states.clone()
    normed = kv_prologue(
        k0, v0, k_states, v_states, slots, k_weight, v_weight, k_norm_weight, EPS, pool[:, 0], pool[:, 1], kv_rows,
        q, q_norm_weight, EPS,
    )  # fmt: skip
    ref = kv_prologue_reference(
        k0, v0, ref_k_states, ref_v_states, slots, k_weight, v_weight, k_norm_weight, EPS,
        ref_pool[:, 0], ref_pool[:, 1], kv_rows, q, q_norm_weight, EPS,
    )  # fmt: skip
    assert_norm_within_rounding(normed, ref, q_norm_weight)
    assert torch.equal(k_states, ref_k_states) and torch.equal(v_states, ref_v_states)
    assert torch.equal(pool[:, 1], ref_pool[:, 1])  # the values: the conv alone, the same bits
    assert_norm_within_rounding(pool[:, 0], ref_pool[:, 0], k_norm_weight)  # the k-norm, like the q-norm


def assert_norm_within_rounding(out: torch.Tensor, ref: torch.Tensor, weight: torch.Tensor) -> None:
    """bf16 RMSNorm over many rows: one unit in the last place, except where a last-bit difference of the fp32
    statistics (another summation order) flips the rounding of ``x * rstd``: there at most one bf16 unit of that
    normalised value, times the weight, plus the product's own rounding; such flips stay rare (< 1e-5 of the
    elements; a 1M-element GPU run saw 2)."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    one_ulp = ref.float().abs() * torch.finfo(torch.bfloat16).eps + 1e-6
    flipped = diff > one_ulp
    normed = ref.float() / weight.float()  # ~ round(x * rstd)
    bound = torch.finfo(torch.bfloat16).eps * (normed.abs() * weight.float().abs() + ref.float().abs()) + 1e-6
    assert flipped.float().mean().item() < 1e-5, f"{int(flipped.sum())} elements off by more than one ulp"
    assert bool((diff[flipped] <= bound[flipped]).all()), f"largest difference {diff.max().item()}"


@pytest.mark.gpu
def test_conv_decode_and_reference_replay_in_a_cuda_graph(cuda_device):
    """Both the kernel and the torch fallback capture: replays advance the pool in place, like eager steps."""
    gen = torch.Generator().manual_seed(10)
    b, c, k = 8, 4096, 4
    x, states, slots, weight, residual, norm_weight = conv_inputs(
        b, c, k, torch.bfloat16, torch.bfloat16, gen, cuda_device, exact=False
    )
    eager_states = states.clone()
    results = {}
    for fn in (conv_decode, conv_decode_reference):
        pool = states.clone()
        fn(x, pool.clone(), slots, weight, residual, norm_weight, EPS)  # warm up (compile) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, normed = fn(x, pool, slots, weight, residual, norm_weight, EPS)
        graph.replay()
        graph.replay()
        results[fn] = (out.clone(), normed.clone(), pool)
    for _ in range(2):
        ref, ref_normed = conv_decode_reference(x, eager_states, slots, weight, residual, norm_weight, EPS)
    for out, normed, pool in results.values():
        assert torch.equal(pool, eager_states)
        assert_within_rounding(out, ref)
        assert_within_rounding(normed, ref_normed)
