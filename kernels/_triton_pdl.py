"""Triton side of programmatic dependent launch (kernels/pdl.py)."""

import triton
import triton.language as tl


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the previous grid has completed and its writes are visible (``griddepcontrol.wait``),
    then let the next grid launch (``griddepcontrol.launch_dependents``); without, nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
