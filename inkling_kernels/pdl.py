"""Launch options for programmatic dependent launch (PDL): on Hopper and later GPUs every kernel of this package is
launched so that it may start while the previous kernel on the stream finishes (its programs are scheduled, its
weight loads go out) and waits inside (``_triton_pdl.pdl_wait``) before it touches what that kernel writes. In a
CUDA graph this removes the launch gap and the ramp of each kernel, the latency a decode step of ~100 small
kernels is made of. Elsewhere (older GPUs, the CPU interpreter) the kernels launch as before."""

from functools import cache

import torch


@cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl(t: torch.Tensor) -> dict:
    """Keyword arguments of a launch whose tensors live with ``t``: the kernel's ``PDL`` flag and Triton's
    ``launch_pdl`` option."""
    on = t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}
