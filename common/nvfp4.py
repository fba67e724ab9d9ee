"""NVFP4 (ModelOpt) weights: E2M1 codes, e4m3 block scales, fp32 per-expert scale (spec/inkling-text.md 6.4).

A quantized stack with logical shape `[E, R, C]` is stored as
- `packed`  uint8          `[E, R, C/2]`: two 4-bit codes per byte, col `2m` in the LOW nibble, `2m+1` high;
- `scale`   float8_e4m3fn  `[E, R, C/16]`: one scale per 16 consecutive columns;
- `scale2`  float32        `[E]`: one global scale per expert.

`W[e, r, c] = E2M1[code[e, r, c]] * float(scale[e, r, c // 16]) * scale2[e]`.

Leading dimensions are free: `scale2` has the shape of everything before the last two axes (`[]` for a plain
matrix), so the same functions serve one expert, a stack, or a stack of stacks.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0

# Code -> value. Bit 3 is the sign, bits 0..2 index the magnitudes (code 8 is -0.0).
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_MAGNITUDES + tuple(-m for m in _MAGNITUDES), dtype=torch.float32)
# Decision points between neighbouring magnitudes; a tie goes to the smaller magnitude.
_MIDPOINTS = torch.tensor(
    [(a + b) / 2 for a, b in zip(_MAGNITUDES[:-1], _MAGNITUDES[1:], strict=True)], dtype=torch.float32
)


def _check_last_dim(name: str, tensor: torch.Tensor, multiple: int) -> None:
    if tensor.dim() < 1 or tensor.shape[-1] % multiple:
        raise ValueError(f"{name}: last dimension must be a multiple of {multiple}, got shape {tuple(tensor.shape)}")


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 0..15) of each element of `x` (already divided by its scale; saturates)."""
    mag = torch.bucketize(x.abs().float(), _MIDPOINTS.to(x.device))  # [...] int64 in 0..7
    sign = (x < 0).to(torch.int64) << 3
    return (mag | sign).to(torch.uint8)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] uint8 codes -> [..., C/2] bytes (even column in the low nibble)."""
    _check_last_dim("codes", codes, 2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] bytes -> [..., C] uint8 codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)  # [..., C/2, 2] -> [..., C]


def pack_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize `w` [..., R, C] to NVFP4 -> (packed [..., R, C/2], scale [..., R, C/16], scale2 [...]).

    ModelOpt's recipe: `scale2 = amax / (6 * 448)` over each leading slice (expert), block scales
    `block_amax / 6 / scale2` rounded to e4m3, codes the nearest E2M1 value of `w / (scale * scale2)`.
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating tensor with at least 2 dims, got {w.dtype} {tuple(w.shape)}")
    _check_last_dim("w", w, BLOCK_SIZE)
    w = w.float()
    amax = w.abs().amax(dim=(-2, -1))  # [...]
    scale2 = torch.where(amax > 0, amax / (FP4_MAX * E4M3_MAX), torch.ones_like(amax))
    blocks = w.unflatten(-1, (w.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))  # [..., R, C/16, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [..., R, C/16]
    scale = (block_amax / FP4_MAX / scale2[..., None, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = scale.float() * scale2[..., None, None]  # effective block scale, [..., R, C/16]
    # A block whose scale is zero only holds values that round to zero anyway.
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    codes = encode_e2m1(blocks * inv[..., None]).flatten(-2)  # [..., R, C]
    return pack_codes(codes), scale, scale2


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale2: torch.Tensor) -> torch.Tensor:
    """Reference dequant: packed [..., R, C/2], scale [..., R, C/16], scale2 [...] -> fp32 [..., R, C]."""
    if packed.dim() < 2:
        raise ValueError(f"packed: expected at least 2 dims, got shape {tuple(packed.shape)}")
    cols = packed.shape[-1] * 2
    if cols % BLOCK_SIZE or tuple(scale.shape) != (*packed.shape[:-1], cols // BLOCK_SIZE):
        raise ValueError(
            f"scale: expected shape {(*packed.shape[:-1], cols // BLOCK_SIZE)} for packed "
            f"{tuple(packed.shape)}, got {tuple(scale.shape)}"
        )
    if tuple(scale2.shape) != tuple(packed.shape[:-2]):
        raise ValueError(f"scale2: expected shape {tuple(packed.shape[:-2])}, got {tuple(scale2.shape)}")
    values = E2M1_VALUES.to(packed.device)[unpack_codes(packed).long()]  # [..., R, C]
    block = scale.float().repeat_interleave(BLOCK_SIZE, dim=-1)  # [..., R, C]
    return values * block * scale2.float()[..., None, None]
