"""Triton code for the grammar token mask. Public entry: inkling_kernels/token_mask.py.

Program ``(r, b)`` covers tokens ``b * BLOCK_V ..`` of logits row r: it finds the row's bitmask row (r itself, or
``Rows[r]`` with HAS_ROWS, where -1 leaves the row alone), loads each token's 32-bit word (neighbouring tokens
share a word, so the loads hit the same cache lines), extracts the token's bit, and stores -inf where the bit is
0. Allowed logits are never written.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def token_mask_kernel(
    Logits,
    Bitmask,
    Rows,
    n_vocab,
    stride_lm,
    stride_bm,
    HAS_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_row = row
    if HAS_ROWS:
        mask_row = tl.load(Rows + row).to(tl.int64)
    live = (cols < n_vocab) & (cols * 0 + mask_row >= 0)  # [BLOCK_V]: in the vocabulary, on a masked row
    words = tl.load(Bitmask + mask_row * stride_bm + cols // 32, mask=live, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    neg_inf = tl.full((BLOCK_V,), float("-inf"), Logits.dtype.element_ty)
    tl.store(Logits + row * stride_lm + cols, neg_inf, mask=live & ~allowed)
