import pytest
import torch

from inkling_kernels.token_mask import apply_token_mask, token_mask_reference, unpack_bitmask


def random_bitmask(n: int, v: int, gen: torch.Generator, words: int | None = None) -> torch.Tensor:
    words = words or -(-v // 32)
    return torch.randint(-(2**31), 2**31, (n, words), generator=gen, dtype=torch.int64).to(torch.int32)


def test_unpack_bitmask_bit_order():
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0 and 2; token 63 (the sign bit)
    allowed = unpack_bitmask(bitmask, 64)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.parametrize(
    "n,v,dtype,extra_words",
    [
        (1, 33, torch.float32, 0),  # one token in the second word
        (3, 200, torch.float32, 2),  # padded bitmask rows (xgrammar may allocate more words)
        (4, 5000, torch.bfloat16, 0),  # two column blocks, a partial last one
        (2, 100, torch.float16, 0),
    ],
)
def test_token_mask_matches_reference(cpu_interpreter, n, v, dtype, extra_words):
    gen = torch.Generator().manual_seed(n * v)
    logits = torch.randn(n, v + 7, generator=gen).to(dtype)[:, :v]  # strided rows, a slice of padded logits
    bitmask = random_bitmask(n, v, gen, -(-v // 32) + extra_words)
    out, ref = logits.clone(), logits.clone()
    apply_token_mask(out, bitmask)
    token_mask_reference(ref, bitmask)
    assert torch.equal(out, ref)
    allowed = unpack_bitmask(bitmask, v)
    assert torch.equal(out[allowed], logits[allowed])  # allowed logits untouched
    assert bool(torch.isneginf(out[~allowed]).all())


def test_token_mask_rejects_bad_shapes():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="words per row"):
        token_mask_reference(logits, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        token_mask_reference(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[N, W\]"):
        token_mask_reference(logits, torch.zeros(3, 2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("n,v", [(1, 201024), (64, 201024), (3, 5000)])
def test_token_mask_matches_reference_gpu(cuda_device, n, v):
    """The compiled kernel on fp32 logits of the real vocabulary width (what the sampler masks), with and without
    a row index (every other row unmasked, the rest from a larger buffer in reverse order)."""
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(n, v, generator=gen).to(cuda_device)
    bitmask = random_bitmask(2 * n, v, gen).to(cuda_device)
    index = torch.tensor([2 * n - 1 - r if r % 2 else -1 for r in range(n)], dtype=torch.int32, device=cuda_device)
    for rows, mask in ((None, bitmask[:n]), (index, bitmask)):
        out, ref = logits.clone(), logits.clone()
        apply_token_mask(out, mask, rows)
        token_mask_reference(ref, mask, rows)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("n,v,rows", [(3, 200, [2, -1, 0]), (4, 5000, [-1, -1, 3, 1]), (2, 100, [0, 0])])
def test_token_mask_rows_match_reference(cpu_interpreter, n, v, rows):
    """Logits row r takes bitmask row rows[r] (-1: unmasked); the bitmask may hold more rows than the logits."""
    gen = torch.Generator().manual_seed(v)
    logits = torch.randn(n, v, generator=gen)
    bitmask = random_bitmask(5, v, gen)
    index = torch.tensor(rows, dtype=torch.int32)
    out, ref = logits.clone(), logits.clone()
    apply_token_mask(out, bitmask, index)
    token_mask_reference(ref, bitmask, index)
    assert torch.equal(out, ref)
    for r, b in enumerate(rows):
        expected = logits[r] if b < 0 else logits[r].masked_fill(~unpack_bitmask(bitmask[b : b + 1], v)[0], -torch.inf)
        assert torch.equal(out[r], expected)


def test_token_mask_rejects_bad_rows():
    logits, bitmask = torch.zeros(2, 64), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows must be"):
        token_mask_reference(logits, bitmask, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows must be"):
        token_mask_reference(logits, bitmask, torch.zeros(2, dtype=torch.int64))
