import pytest
import torch

import inkling_kernels.moe_align as align_module
from inkling_kernels.moe import MASKED_ROUTE
from inkling_kernels.moe_align import align_tiles, moe_align, moe_align_grid, moe_align_reference
from tests.inkling_kernels.moe_routes import masked, routing, skewed_ids


@pytest.mark.parametrize("align", [moe_align, moe_align_reference])
def test_moe_align_groups_pairs_by_expert(cpu_interpreter, align):
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    sorted_pairs, block_expert, block_rank = align(ids, num_experts=5, block_m=2)
    n_pairs = ids.numel()
    seen = []
    assert not block_rank.any()  # one block per expert
    for b, e in enumerate(block_expert.tolist()):
        rows = [p for p in sorted_pairs[b * 2 : b * 2 + 2].tolist() if p < n_pairs]
        if e < 0:
            assert not rows
            continue
        assert rows and all(ids.view(-1)[p].item() == e for p in rows)
        seen += rows
    assert sorted(seen) == list(range(n_pairs))


@pytest.mark.parametrize("align", [moe_align, moe_align_reference])
def test_moe_align_ranks_the_blocks_of_each_expert(cpu_interpreter, align):
    ids = torch.tensor([[3, 3], [3, 1], [3, 3]])  # expert 3: 5 pairs, three blocks of 2
    _, block_expert, block_rank = align(ids, num_experts=5, block_m=2)
    assert block_expert.tolist() == [1, 3, 3, 3, -1, -1, -1, -1]
    assert block_rank.tolist() == [0, 0, 1, 2, 0, 0, 0, 0]


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 8), (37, 16, 3, 4), (70, 256, 6, 8), (9, 12, 4, 16)])
def test_moe_align_equals_the_torch_sort(cpu_interpreter, t, e, k, block_m):
    """Every output element equal to the stable torch sort's (pads and unused blocks included)."""
    gen = torch.Generator().manual_seed(t * e + k)
    for ids in (routing(t, e, k, gen)[0], skewed_ids(t, e, k, gen)):
        got = moe_align(ids, e, block_m)
        ref = moe_align_reference(ids, e, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_moe_align_takes_its_grid_tiles_by_size(cpu_interpreter, monkeypatch):
    """Small grids' programs take few pairs, large ones more (each program reads the whole count table)."""
    assert [align_tiles(n) for n in (1, 2048, 2049, 6144, 6145, 24576, 24577)] == [
        (32, 32), (32, 32), (64, 64), (64, 64), (128, 64), (128, 64), (256, 32)
    ]  # fmt: skip
    calls = []
    monkeypatch.setattr(align_module, "moe_align_grid", lambda *a: calls.append(a[3:]) or moe_align_grid(*a))
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    got = moe_align(ids, 5, 2)
    assert calls == [(32, 32)]
    assert all(torch.equal(a, b) for a, b in zip(got, moe_align_reference(ids, 5, 2), strict=True))


@pytest.mark.parametrize(
    "t,e,k,block_m,chunk,sub",
    [
        (37, 16, 3, 4, 64, 8),
        (70, 256, 6, 8, 32, 16),
        (70, 256, 6, 8, 32, 32),
        (9, 12, 4, 16, 8, 8),
        (200, 5, 2, 2, 16, 16),
        (200, 16, 3, 4, 64, 64),
        (1, 8, 2, 8, 32, 8),
    ],
)
def test_moe_align_grid_equals_the_torch_sort(cpu_interpreter, t, e, k, block_m, chunk, sub):
    """Several programs (chunk < pairs; their pairs of one expert follow each other), every output element equal
    to the stable torch sort's (pads, unused blocks, more blocks than one pass of the grid fills)."""
    gen = torch.Generator().manual_seed(t * e + k + 1)
    for ids in (
        routing(t, e, k, gen)[0],
        skewed_ids(t, e, k, gen).long(),
        masked(routing(t, e, k, gen)[0], gen),
        masked(skewed_ids(t, e, k, gen), gen, 0.9),
        torch.full((t, k), MASKED_ROUTE, dtype=torch.int32),
    ):
        got = moe_align_grid(ids, e, block_m, chunk=chunk, sub=sub)
        ref = moe_align_reference(ids, e, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_moe_align_rejects_bad_arguments():
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align(torch.zeros(2, 2), 4, 8)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(torch.zeros(2, 2, dtype=torch.int32), 4, 6)
    for chunk, sub in ((32, 64), (48, 16), (32, 0)):  # a step past its program's pairs would place them twice
        with pytest.raises(ValueError, match="sub <= chunk"):
            moe_align_grid(torch.zeros(2, 2, dtype=torch.int32), 4, 8, chunk, sub)


def expert_counts(sorted_pairs, block_expert, n_pairs, num_experts, block_m):
    """Pairs per expert as moe_align's blocks hold them."""
    counts = [0] * num_experts
    for b, e in enumerate(block_expert.tolist()):
        rows = [p for p in sorted_pairs[b * block_m : (b + 1) * block_m].tolist() if p < n_pairs]
        assert e >= 0 or not rows
        counts[e] += len(rows) if e >= 0 else 0
    return counts


@pytest.mark.parametrize("align", [moe_align, moe_align_reference])
def test_moe_align_puts_masked_routes_in_no_block(cpu_interpreter, align):
    ids = torch.tensor([[3, MASKED_ROUTE], [MASKED_ROUTE, 0], [3, MASKED_ROUTE], [MASKED_ROUTE, MASKED_ROUTE]])
    sorted_pairs, block_expert, _ = align(ids, num_experts=5, block_m=2)
    assert expert_counts(sorted_pairs, block_expert, ids.numel(), 5, 2) == [1, 0, 0, 2, 0]
    placed = {p for p in sorted_pairs.tolist() if p < ids.numel()}
    assert placed == {0, 3, 4}  # the unmasked pairs, each once


@pytest.mark.parametrize("t,e,k,block_m", [(37, 16, 3, 4), (70, 256, 6, 8)])
def test_moe_align_kernel_equals_the_torch_sort_with_masked_routes(cpu_interpreter, t, e, k, block_m):
    gen = torch.Generator().manual_seed(t + e)
    for ids in (masked(routing(t, e, k, gen)[0], gen), masked(skewed_ids(t, e, k, gen), gen, 0.9)):
        got = moe_align(ids, e, block_m)
        ref = moe_align_reference(ids, e, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        kept = torch.bincount(ids[ids >= 0].long(), minlength=e).tolist()
        assert expert_counts(*got[:2], ids.numel(), e, block_m) == kept


@pytest.mark.gpu
@pytest.mark.parametrize("t,block_m", [(1024, 64), (2048, 64), (8192, 64), (8192, 8)])
def test_moe_align_grid_gpu(cuda_device, t, block_m):
    """Prefill sizes (6144-49152 pairs at E=256, k=6) through moe_align's grid path, masked routes included."""
    gen = torch.Generator().manual_seed(t + block_m)
    ids = routing(t, 256, 6, gen)[0]
    for case in (ids, ids.long(), skewed_ids(t, 256, 6, gen), masked(ids, gen)):
        case = case.to(cuda_device)
        got = moe_align(case, 256, block_m)
        ref = moe_align_reference(case, 256, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [11, 64, 256, 320, 600])
def test_moe_align_decode_sizes_gpu(cuda_device, t):
    gen = torch.Generator().manual_seed(t)
    for ids in (routing(t, 256, 6, gen, cuda_device)[0], skewed_ids(t, 256, 6, gen, cuda_device)):
        got = moe_align(ids, 256, 8)
        ref = moe_align_reference(ids, 256, 8)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
