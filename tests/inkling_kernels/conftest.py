"""Kernel tests: the `cpu_interpreter` and `cuda_device` fixtures come from the root conftest, which also sets
TRITON_INTERPRET when there is no CUDA device."""
