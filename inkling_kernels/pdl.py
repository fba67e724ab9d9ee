"""Launch options for programmatic dependent launch (PDL): on Hopper and later GPUs every kernel of this package is
launched so that its programs may be scheduled while the previous kernel on the stream finishes; each waits inside
(``_triton_pdl.pdl_wait``) before it touches what another kernel writes, and the skinny GEMM issues its first
weight loads before that wait. Inside a CUDA graph this overlaps each kernel's launch and ramp with the tail of
the one before. Elsewhere (older GPUs, the CPU interpreter) the kernels launch as before."""

from functools import cache

import torch


@cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl(t: torch.Tensor) -> dict:
    """Keyword arguments of a launch whose tensors live with ``t``: the kernel's ``PDL`` flag and, when it is on,
    Triton's ``launch_pdl`` option."""
    on = t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
