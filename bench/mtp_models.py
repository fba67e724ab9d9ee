"""The models `bench.bench_mtp` times and counts: Inkling-Small's first layers as the trunk (`build_trunk`, Small-L6
by default), random MTP depths of the released block (`random_drafter`), and the whole 42-layer model on the meta
device for the byte floors (`full_model`)."""

from __future__ import annotations

import math

import torch

from bench.proxy import proxy_nvfp4_layers, proxy_shapes, random_proxy
from common.config import ModelConfig, MtpConfig, parse_model_config
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter
from tools.make_tiny_checkpoint import raw_config
from tools.model_shapes import INKLING_MTP

FULL_LAYERS = 42  # Inkling-Small (spec 1.5), for the full-depth estimate
PROXY_LAYERS = 6  # the trunk's layers (Small-L6 on CUDA)


def model_config(num_depths: int, layers: int = PROXY_LAYERS, small: bool = True) -> ModelConfig:
    """The first `layers` layers of Inkling-Small (`small`) or make-tiny shapes with as many layers (every 6th
    global, as `proxy_shapes`), with the first `num_depths` depths of the released MTP block."""
    mtp = dict(INKLING_MTP, num_nextn_predict_layers=num_depths)
    mtp["local_layer_ids"] = [i for i in INKLING_MTP["local_layer_ids"] if i < num_depths]
    if small:
        return parse_model_config(raw_config(**proxy_shapes(layers), mtp_config=mtp))
    local = [i for i in range(layers) if (i + 1) % 6]
    return parse_model_config(raw_config(num_hidden_layers=layers, local_layer_ids=local, mtp_config=mtp))


def build_trunk(device: str, layers: int = PROXY_LAYERS, num_depths: int = 1) -> tuple[InklingDecoder, ModelConfig]:
    """The random trunk of `model_config` (Inkling-Small's first `layers` layers with its NVFP4 experts and the fast
    ops on CUDA, make-tiny shapes on CPU) and the config it was built from."""
    parsed = model_config(num_depths, layers, small=device == "cuda")
    if device == "cuda":
        return random_proxy(parsed.text, proxy_nvfp4_layers(layers), device).with_ops("fast"), parsed
    return random_proxy(parsed.text, frozenset(), device), parsed


def build(
    device: str, num_depths: int, head: str = "bf16", layers: int = PROXY_LAYERS
) -> tuple[InklingDecoder, MTPDrafter]:
    """The trunk (`build_trunk`: Small-L6 by default) and `num_depths` random MTP depths of the real block,
    drafting through `head` (`MTP_DRAFT_HEADS`: the shared bf16 lm_head or its FP8 copy)."""
    trunk, parsed = build_trunk(device, layers, num_depths)
    assert parsed.mtp is not None
    drafter = random_drafter(parsed.mtp, trunk)
    if head == "fp8":
        drafter.use_fp8_head()
    return trunk, drafter


@torch.no_grad()
def random_drafter(mtp: MtpConfig, trunk: InklingDecoder) -> MTPDrafter:
    """The drafter's own tensors drawn like `random_proxy`'s (unit-variance linear outputs), in the dtypes
    `MTPDrafter.from_weights` gives them (convs fp32, the rest the trunk's dtype); embed and lm_head shared."""
    with torch.device("meta"):
        drafter = MTPDrafter(mtp, trunk)
    device, dtype = trunk.embed.weight.device, trunk.dtype
    state = {}
    for name, meta in drafter.state_dict().items():
        if name.startswith(("embed.", "embed_norm.", "unembed.")):
            continue
        shape = tuple(meta.shape)
        if name.endswith("sconv.weight"):
            t = 0.1 * torch.randn(shape, device=device)
        elif name.endswith("norm.weight"):
            t = (1.0 + 0.1 * torch.randn(shape, device=device)).to(dtype)
        elif name.endswith("rel_logits_proj.proj"):
            t = (0.5 * torch.randn(shape, device=device)).to(dtype)
        else:
            t = torch.randn(shape, device=device, dtype=dtype).mul_(1.0 / math.sqrt(shape[-1]))
        state[name] = t
    missing = drafter.load_state_dict(state, strict=False, assign=True).missing_keys
    assert all(name.startswith(("embed.", "embed_norm.", "unembed.")) for name in missing), missing
    return drafter.eval()


def full_model(num_depths: int, head: str) -> tuple[InklingDecoder, MTPDrafter]:
    """Inkling-Small's 42 layers and `num_depths` MTP depths drafting through `head`, on the meta device in the
    dtypes the served model has (bf16; convs and the gate's bias and scale fp32): shapes and bytes, no memory."""
    parsed = model_config(num_depths, FULL_LAYERS)
    assert parsed.mtp is not None
    trunk = random_proxy(parsed.text, proxy_nvfp4_layers(FULL_LAYERS), "meta")
    drafter = random_drafter(parsed.mtp, trunk)
    if head == "fp8":
        drafter.use_fp8_head()
    return trunk, drafter
