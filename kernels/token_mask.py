"""Grammar token masks: logits of tokens whose bit is 0 in a packed bitmask become -inf, in place.

The bitmask is xgrammar's layout: int32 ``[N, W]`` with ``W >= cdiv(V, 32)``; token ``t`` of row ``r`` is allowed
when bit ``t % 32`` of word ``bitmask[r, t // 32]`` is set. Logits are ``[N, V]`` (strided rows, unit last stride),
fp32/fp16/bf16. Grid: ``(N, cdiv(V, BLOCK_V))``; no host reads, so the call is CUDA-graph safe when the bitmask
lives in a static buffer.
"""

from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_V = 4096


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> tuple[int, int]:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits [N, V] and bitmask [N, W] expected, got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
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


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[r, t] = -inf`` wherever bit t of row r of ``bitmask`` is 0 (Triton)."""
    import triton

    from kernels import _triton_token_mask as tk

    n, v = _check(logits, bitmask)
    if not n or not v:
        return
    block_v = min(_BLOCK_V, triton.next_power_of_2(v))
    tk.token_mask_kernel[(n, triton.cdiv(v, block_v))](
        logits, bitmask, v, logits.stride(0), bitmask.stride(0), BLOCK_V=block_v, num_warps=4
    )


def token_mask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Torch version of ``apply_token_mask`` (same arguments, also in place)."""
    _, v = _check(logits, bitmask)
    allowed = unpack_bitmask(bitmask, v)
    logits.masked_fill_(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 ``[N, W]`` -> bool ``[N, vocab_size]`` (True = allowed).

    Read as little-endian bytes (every platform torch serves on), byte ``4w + k`` of a row holds the bits of
    tokens ``32w + 8k ..``, so unpacking bytes keeps token order with an intermediate a quarter of int32 bits'."""
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [N, 4W, 8]
    return bits.flatten(1)[:, :vocab_size].bool()
