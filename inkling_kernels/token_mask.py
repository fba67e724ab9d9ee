"""Grammar token masks: logits of tokens whose bit is 0 in a packed bitmask become -inf, in place.

The bitmask is xgrammar's layout: int32 ``[N, W]`` with ``W >= cdiv(V, 32)``; token ``t`` of row ``r`` is allowed
when bit ``t % 32`` of word ``bitmask[r, t // 32]`` is set. Logits are ``[N, V]`` (strided rows, unit last stride),
fp32/fp16/bf16. With ``rows`` (int32 ``[N]``), logits row ``r`` takes bitmask row ``rows[r]`` instead, and ``-1``
leaves it unmasked: the sampler's persistent bitmask buffer holds only the constrained rows, in any order. Grid:
``(N, cdiv(V, BLOCK_V))``; no host reads, so the call is CUDA-graph safe when the bitmask lives in a static buffer.
"""

from __future__ import annotations

import torch

from inkling_kernels.pdl import pdl

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_V = 4096


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> tuple[int, int]:
    if logits.dim() != 2 or bitmask.dim() != 2 or (rows is None and bitmask.shape[0] != logits.shape[0]):
        raise ValueError(
            f"logits [N, V] and bitmask [N, W] expected, got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if rows is not None and (rows.shape != logits.shape[:1] or rows.dtype != torch.int32 or rows.stride(0) != 1):
        raise ValueError(f"rows must be a contiguous int32 [{logits.shape[0]}], got {rows.dtype} {tuple(rows.shape)}")
    if rows is not None and rows.device != logits.device:
        raise ValueError(f"rows are on {rows.device}, logits on {logits.device}")
    n, v = logits.shape
    if bitmask.shape[1] * 32 < v:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row, {v} tokens need {-(-v // 32)}")
    if logits.dtype not in _FLOATS or bitmask.dtype != torch.int32:
        raise ValueError(f"logits must be fp32/fp16/bf16 and bitmask int32, got {logits.dtype} and {bitmask.dtype}")
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError(f"logits and bitmask need a unit last stride, got {logits.stride()} and {bitmask.stride()}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")
    return n, v


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set ``logits[r, t] = -inf`` wherever bit t of bitmask row r (or ``rows[r]``, -1: none) is 0 (Triton)."""
    import triton

    from inkling_kernels import _triton_token_mask as tk

    n, v = _check(logits, bitmask, rows)
    if not n or not v:
        return
    block_v = min(_BLOCK_V, triton.next_power_of_2(v))
    tk.token_mask_kernel[(n, triton.cdiv(v, block_v))](
        logits,
        bitmask,
        bitmask if rows is None else rows,
        v,
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK_V=block_v,
        num_warps=4,
        **pdl(logits),
    )


def token_mask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Torch version of ``apply_token_mask`` (same arguments, also in place)."""
    _, v = _check(logits, bitmask, rows)
    if rows is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, v), float("-inf"))
        return
    masked = (rows >= 0).nonzero().flatten()  # the logits rows that have a bitmask row
    allowed = unpack_bitmask(bitmask[rows[masked].long()], v)  # [K, V]
    logits[masked] = logits[masked].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 ``[N, W]`` -> bool ``[N, vocab_size]`` (True = allowed).

    Read as little-endian bytes (every platform torch serves on), byte ``4w + k`` of a row holds the bits of
    tokens ``32w + 8k ..``, so unpacking bytes keeps token order with an intermediate a quarter of int32 bits'."""
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [N, 4W, 8]
    return bits.flatten(1)[:, :vocab_size].bool()
