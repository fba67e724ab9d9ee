"""The model compute dtypes by name: the one map from `--dtype` values (`common.settings.DTYPE_NAMES`) to torch."""

from __future__ import annotations

import torch

from common.errors import ConfigError
from common.settings import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
assert tuple(TORCH_DTYPES) == DTYPE_NAMES


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ConfigError(f"--dtype must be one of {DTYPE_NAMES}, got {name!r}")
    return TORCH_DTYPES[name]
