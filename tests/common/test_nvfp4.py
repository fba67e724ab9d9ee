"""NVFP4: reference dequantization vs an independent integer decode; quantizer round trips and bounds."""

from __future__ import annotations

import pytest
import torch

from common.nvfp4 import BLOCK_SIZE, dequant_nvfp4, pack_nvfp4

_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_by_hand(packed: torch.Tensor, scale: torch.Tensor, scale2: torch.Tensor) -> torch.Tensor:
    """Element by element with integer ops: low nibble = even column, bit 3 = sign (spec 6.4)."""
    *lead, half = packed.shape
    out = torch.empty(*lead, 2 * half, dtype=torch.float32)
    flat_packed = packed.reshape(-1, half).tolist()
    flat_scale = scale.float().reshape(-1, scale.shape[-1]).tolist()
    rows_per_expert = packed[0].numel() // half if packed.dim() > 2 else len(flat_packed)
    flat_out = out.view(-1, 2 * half)
    for row, (bytes_, scales) in enumerate(zip(flat_packed, flat_scale, strict=True)):
        s2 = float(scale2.reshape(-1)[row // rows_per_expert]) if scale2.dim() else float(scale2)
        for m, byte in enumerate(bytes_):
            for col, code in ((2 * m, byte % 16), (2 * m + 1, byte // 16)):
                value = _MAGNITUDES[code % 8] * (-1.0 if code >= 8 else 1.0)
                flat_out[row, col] = value * scales[col // BLOCK_SIZE] * s2
    return out


def test_dequant_matches_independent_decode() -> None:
    gen = torch.Generator().manual_seed(0)
    e, r, c = 3, 5, 64
    packed = torch.randint(0, 256, (e, r, c // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(e, r, c // BLOCK_SIZE, generator=gen) * 400).to(torch.float8_e4m3fn)
    scale2 = torch.rand(e, generator=gen) + 0.01
    assert torch.equal(dequant_nvfp4(packed, scale, scale2), decode_by_hand(packed, scale, scale2))


def test_nibble_order_and_sign() -> None:
    # byte 0x9A: low nibble 0xA = -1.0 (even column), high nibble 0x9 = -0.5 (odd column); 0x71: 0.5 then 6.0
    packed = torch.tensor([[0x9A, 0x71] + [0] * 6], dtype=torch.uint8)  # [1, 8] -> 16 columns
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = dequant_nvfp4(packed, scale, torch.tensor(0.5))
    assert out[0, :4].tolist() == [-1.0, -0.5, 0.5, 6.0]
    assert out[0, 4:].abs().sum() == 0


def test_pack_exact_for_representable_values() -> None:
    # scale2 = 2**-10 exactly when the expert's amax is 6 * 448 * 2**-10; every block holds a +-6 code so its
    # chosen block scale is exactly the e4m3 value used to build it.
    gen = torch.Generator().manual_seed(1)
    e, r, c = 2, 4, 32
    scale2 = 2.0**-10
    block_scales = torch.tensor([448.0, 1.0, 0.5, 3.0, 12.0, 0.125, 240.0, 26.0]).reshape(r, c // BLOCK_SIZE)
    codes = torch.randint(0, 16, (e, r, c), generator=gen)
    codes[..., ::BLOCK_SIZE] = 7  # +6 in every block
    values = torch.tensor(_MAGNITUDES + [-m for m in _MAGNITUDES])[codes]
    w = values * block_scales.repeat_interleave(BLOCK_SIZE, dim=-1) * scale2  # [E, R, C]
    packed, scale, s2 = pack_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (e, r, c // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (e, r, c // BLOCK_SIZE)
    assert s2.dtype == torch.float32 and s2.tolist() == [scale2, scale2]
    assert torch.equal(scale.float(), block_scales.expand(e, -1, -1))
    # -0.0 codes come back as +0.0 codes; the values are equal either way
    assert torch.equal(decode_by_hand(packed, scale, s2), w)


def test_pack_error_bound_and_scale2() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 8, 64, generator=gen) * torch.tensor([1.0, 0.01, 5.0, 1e-3])[:, None, None]
    w[1, 3] = 0.0  # an all-zero row (zero block scales)
    packed, scale, scale2 = pack_nvfp4(w.to(torch.bfloat16))
    assert torch.allclose(scale2, w.abs().amax(dim=(1, 2)).to(torch.bfloat16).float() / (6 * 448), rtol=0)
    deq = decode_by_hand(packed, scale, scale2)
    block_amax = w.unflatten(-1, (4, BLOCK_SIZE)).abs().amax(-1).repeat_interleave(BLOCK_SIZE, -1)
    # grid spacing is at most 2 of 6 block-scale steps, and e4m3 rounding of the block scale adds 1/16
    assert ((deq - w).abs() <= 0.2 * block_amax + 1e-6).all()
    assert deq[1, 3].abs().sum() == 0
    assert (deq.sign() * w.sign() >= 0).all()


def test_plain_matrix_has_scalar_scale2() -> None:
    w = torch.randn(3, 32)
    packed, scale, scale2 = pack_nvfp4(w)
    assert scale2.shape == () and dequant_nvfp4(packed, scale, scale2).shape == (3, 32)


@pytest.mark.parametrize(
    ("packed_shape", "scale_shape", "scale2_shape", "field"),
    [((2, 4, 8), (2, 4, 2), (2,), "scale"), ((2, 4, 8), (2, 4, 1), (3,), "scale2")],
)
def test_dequant_rejects_bad_shapes(packed_shape, scale_shape, scale2_shape, field) -> None:
    packed = torch.zeros(packed_shape, dtype=torch.uint8)
    scale = torch.ones(scale_shape).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        dequant_nvfp4(packed, scale, torch.ones(scale2_shape))


def test_pack_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_nvfp4(torch.randn(2, 24))
