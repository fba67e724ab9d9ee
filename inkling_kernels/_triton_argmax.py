"""Triton code for argmaxes over rows as torch.argmax takes them. Public entry: inkling_kernels/argmax.py (and the
skinny GEMM's fused greedy head, inkling_kernels/skinny_gemm.py).

A value and its column pack into one int64 key (``argmax_key``) whose integer order is the argmax order: larger
values first, among equal ones the smaller column. So every partial argmax is one ``max`` of keys: a program of
``argmax_chunks_kernel`` (or of the GEMV's epilogue) stores its chunk's largest key, ``argmax_reduce_kernel``
reduces a row's keys and unpacks the column.
"""

import triton
import triton.language as tl

from inkling_kernels._triton_pdl import pdl_wait


@triton.jit
def argmax_key(y, cols):
    """Packed int64 keys of fp32 values ``y`` at columns ``cols`` (int32): a larger key is a larger value, among
    equal values the smaller column, as torch.argmax takes them (-0 equals +0, NaN above everything)."""
    bits = y.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # the float order as a signed-integer order
    key = tl.where(y == 0.0, 0, key)
    key = tl.where(y != y, 0x7FFFFFFF, key)
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit(do_not_specialize=["N", "stride_vm", "stride_km"])
def argmax_chunks_kernel(Values, Keys, N, stride_vm, stride_km, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (chunk c, row m): the largest key of ``Values[m, c*BLOCK : (c+1)*BLOCK]`` into ``Keys[m, c]``."""
    pdl_wait(PDL)
    chunk, row = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(Values + row.to(tl.int64) * stride_vm + cols, mask=cols < N, other=float("-inf"))
    tl.store(Keys + row * stride_km + chunk, tl.max(argmax_key(v.to(tl.float32), cols), axis=0))


@triton.jit(do_not_specialize=["P", "stride_pm"])
def argmax_reduce_kernel(Keys, Tokens, P, stride_pm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(0)``: the largest of its ``P`` packed keys -> its column, as int64."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    floor = argmax_key(tl.full((BLOCK,), float("-inf"), tl.float32), tl.full((BLOCK,), 0x7FFFFFFF, tl.int32))
    best = floor
    for p0 in range(0, P, BLOCK):
        keys = tl.load(Keys + row * stride_pm + p0 + offs, mask=p0 + offs < P, other=floor)
        best = tl.maximum(best, keys)
    tl.store(Tokens + row, 0x7FFFFFFF - (tl.max(best, axis=0) & 0x7FFFFFFF))
