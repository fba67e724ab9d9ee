"""Triton side of programmatic dependent launch (PDL, Hopper on): the Python side is inkling_kernels/pdl.py.

A kernel launched with ``launch_pdl`` may start while the kernel before it on the stream is still running, so
every such kernel calls ``pdl_wait`` in every program before it loads anything another kernel writes and before
it stores anything: past the wait, the previous kernel has finished and its stores are visible. Loads of tensors
no kernel writes (weights) may go before the wait; that is what the early start buys. The wait then lets the
kernel after this one launch (its programs start as this kernel's last ones run), which is safe because that
kernel waits in turn: every kernel waits for the one before it, so each one also follows all earlier ones.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel (its stores visible), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
