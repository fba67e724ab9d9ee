"""Triton side of programmatic dependent launch (kernels/pdl.py)."""

import triton
import triton.language as tl


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """PDL 1: wait until the previous grid has completed and its writes are visible (``griddepcontrol.wait``);
    2: then let the next grid launch (``griddepcontrol.launch_dependents``). 0: nothing (no PDL launch)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
