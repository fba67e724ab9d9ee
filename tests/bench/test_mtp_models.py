"""`bench.mtp_models`: the whole model the floors count is the served one."""

from __future__ import annotations

import torch

from bench.mtp_models import full_model


def test_full_floors_model_has_the_served_dtypes() -> None:
    """The floors count the bytes of the model as served: bf16 matrices (the meta device's default, fp32, doubled
    every non-expert byte of an earlier version), NVFP4 codes and e4m3 scales in the experts of layers 3..41."""
    trunk, drafter = full_model(2, "bf16")
    assert trunk.config.num_layers == 42 and len(drafter.layers) == 2
    matrices = [(n, t) for n, t in (*trunk.state_dict().items(), *drafter.state_dict().items()) if t.dim() >= 2]
    floats = {t.dtype for n, t in matrices if "sconv" not in n and t.dtype != torch.uint8 and "_scale" not in n}
    assert floats == {torch.bfloat16}, floats
    assert trunk.layers[3].mlp.experts.w13_weight.dtype == torch.uint8
    assert trunk.layers[2].mlp.experts.w13_weight.dtype == torch.bfloat16
