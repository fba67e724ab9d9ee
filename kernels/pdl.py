"""Programmatic dependent launch (PDL) of the decode step's kernels: each kernel's launch and prologue overlap the
tail of the kernel before it on the stream (Hopper and later; CUDA graphs keep the edges, CUDA >= 12.3).

A kernel launched with ``launch_pdl=True`` may start before the previous grid has finished. Every such kernel calls
``_triton_pdl.wait_for_inputs`` (``griddepcontrol.wait``: the previous grid has completed and its writes are
visible) before its first load of anything a kernel writes and before its first store (its output may reuse memory
the previous kernel still reads); before the wait it loads only weights, which no kernel of a step writes. Since
every kernel waits before it completes, a kernel that passed its wait sees the writes of every earlier kernel, so
a kernel may read an input written several launches back. A kernel signals its dependents
(``griddepcontrol.launch_dependents``) right after its wait rather than at its exit, so the next kernel's programs
are placed on free SMs while this one runs (they wait in turn); at most two grids are in flight.

Kernels take ``pdl: bool`` (the decode path's `TritonOps` passes it); ``launch_args`` turns it into the kernel's
``PDL`` constexpr and the launch option, off where the device lacks it (before sm_90), under the interpreter, and on
the CPU, so one call site serves every device.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(pdl: bool, device: torch.device) -> bool:
    """Whether a kernel asked to launch with PDL on ``device`` does."""
    return (
        pdl
        and device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and _supported(device.index if device.index is not None else torch.cuda.current_device())
    )


def launch_args(pdl: bool, device: torch.device) -> dict:
    """Keyword arguments of a launch: the kernel's ``PDL`` constexpr and Triton's ``launch_pdl`` option."""
    if not enabled(pdl, device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}
