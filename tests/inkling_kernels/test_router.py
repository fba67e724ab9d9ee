from types import SimpleNamespace

import pytest
import torch

from decode_service.model.layers import Router
from inkling_kernels.router import GateTiles, route, route_reference

# Ids are compared exactly (order included: descending selection score, like torch.topk), so the inputs must
# not hold near-ties around the top k: rows whose sorted top-(k+1) scores are closer than this are excluded
# on the GPU, and must not occur in the CPU cases.
TIE_GAP = 1e-5


def separated(x, weight, bias, k, gap=TIE_GAP):
    """Rows whose top-(k+1) selection scores are pairwise further apart than ``gap`` (order is well defined)."""
    e = bias.shape[0]
    choice = torch.sigmoid(x.float() @ weight.float()[:e].T) + bias
    top = torch.topk(choice, min(k + 1, e), dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(dim=-1).values > gap


def gate_inputs(t, h, e, s, gen, dtype=torch.float32, w_dtype=None, device="cpu", untied_k=None):
    """Random gate inputs; with ``untied_k``, rows of x are redrawn until no row has a near-tie in its top k."""
    weight = (torch.randn(e + s, h, generator=gen) * h**-0.5).to(w_dtype or dtype)
    bias = torch.randn(e, generator=gen) * 0.1
    x = torch.randn(t, h, generator=gen).to(dtype)
    for _ in range(20 if untied_k else 0):
        tied = ~separated(x, weight, bias, untied_k)
        if not tied.any():
            break
        x[tied] = torch.randn(int(tied.sum()), h, generator=gen).to(dtype)
    else:
        assert untied_k is None, "could not draw untied inputs"
    return x.to(device), weight.to(device), bias.to(device), torch.tensor([1.7], device=device)


def assert_matches(out, ref, rows=None, rtol=1e-5, atol=1e-6):
    if rows is not None:
        out, ref = [o[rows] for o in out], [r[rows] for r in ref]
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1], rtol=rtol, atol=atol)
    torch.testing.assert_close(out[2], ref[2], rtol=rtol, atol=atol)


def test_reference_is_router_forward():
    gen = torch.Generator().manual_seed(0)
    e, s, k, h = 16, 2, 4, 32
    config = SimpleNamespace(
        n_routed_experts=e, n_shared_experts=s, num_experts_per_tok=k, route_scale=2.5, hidden_size=h
    )
    router = Router(config)
    x, weight, bias, global_scale = gate_inputs(7, h, e, s, gen)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.bias.copy_(bias)
        router.global_scale.copy_(global_scale)
        expected = router(x)
    got = route_reference(x, weight, bias, k, 2.5, global_scale)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 6])
@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("e", [8, 40, 256])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_route_matches_reference(cpu_interpreter, t, e, s, k):
    gen = torch.Generator().manual_seed(1000 * t + 10 * e + s + k)
    x, weight, bias, global_scale = gate_inputs(t, 64, e, s, gen, untied_k=k)
    out = route(x, weight, bias, k, 8.0, global_scale)
    ref = route_reference(x, weight, bias, k, 8.0, global_scale)
    assert [o.dtype for o in out] == [torch.int64, torch.float32, torch.float32]
    assert [o.shape for o in out] == [(t, k), (t, k), (t, s)]
    assert_matches(out, ref)


@pytest.mark.parametrize(
    "t,tiles",
    [
        (3, GateTiles(block_t=4, block_n=4, block_k=16, split_k=3)),  # broadcast GEMV, H split, ragged tail
        (20, GateTiles(block_t=16, block_n=16, block_k=16, split_k=3)),  # tensor-core tiles, H split
        (20, GateTiles(block_t=16, block_n=16, block_k=32)),  # default split: as many as H allows
    ],
)
@pytest.mark.parametrize("dtype,w_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32)])
def test_route_split_k_and_dtypes(cpu_interpreter, t, tiles, dtype, w_dtype):
    gen = torch.Generator().manual_seed(t)
    e, s, k, h = 24, 2, 6, 80  # H=80 is not a multiple of block_k
    x, weight, bias, global_scale = gate_inputs(t, h, e, s, gen, dtype, w_dtype, untied_k=k)
    out = route(x, weight, bias, k, 8.0, global_scale, tiles=tiles)
    assert_matches(out, route_reference(x, weight, bias, k, 8.0, global_scale))


def test_route_ties_pick_lowest_id(cpu_interpreter):
    gen = torch.Generator().manual_seed(5)
    e, s, k, h = 16, 1, 3, 32
    x, weight, bias, global_scale = gate_inputs(2, h, e, s, gen)
    weight[[3, 9, 12]] = weight[7].clone()  # experts 3, 7, 9, 12 score exactly alike
    bias[[3, 7, 9, 12]] = 10.0  # ... and above every other expert
    ids, weights, _ = route(x, weight, bias, k, 1.0, global_scale)
    assert ids.tolist() == [[3, 7, 9], [3, 7, 9]]
    assert torch.allclose(weights, weights[:, :1].expand_as(weights))


def test_route_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(6)
    x, weight, bias, global_scale = gate_inputs(2, 32, 8, 2, gen)
    with pytest.raises(ValueError, match="weight"):
        route(x, weight[:, :16], bias, 2, 1.0, global_scale)
    with pytest.raises(ValueError, match="top_k"):
        route(x, weight, bias, 9, 1.0, global_scale)
    with pytest.raises(ValueError, match="fp32"):
        route(x, weight, bias.half(), 2, 1.0, global_scale)
    with pytest.raises(ValueError, match="unit last stride"):
        route(x.T.contiguous().T, weight, bias, 2, 1.0, global_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 256, 4096])
def test_route_gpu_production_shape(cuda_device, t):
    gen = torch.Generator().manual_seed(t)
    e, s, k, h = 256, 2, 6, 4096
    x, weight, bias, global_scale = gate_inputs(t, h, e, s, gen, torch.bfloat16, device=cuda_device)
    out = route(x, weight, bias, k, 8.0, global_scale)
    ref = route_reference(x, weight, bias, k, 8.0, global_scale)
    rows = separated(x, weight, bias, k, gap=1e-4)
    mismatched = (out[0] != ref[0]).any(dim=-1)
    print(f"route T={t}: {int(rows.sum())}/{t} rows without near-ties, {int(mismatched.sum())} rows differ in ids")
    assert rows.float().mean() > 0.95
    assert_matches(out, ref, rows, rtol=1e-4, atol=1e-5)  # H=4096 fp32 sums in another order
