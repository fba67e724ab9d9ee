"""Per-rank memory plan: released model sizes, local KV heads, and the error that names the size that would fit."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from common.config import parse_model_config
from common.errors import ConfigError
from common.memory_plan import GiB, MemoryRequest, plan_fitting, plan_memory, weight_specs
from tools.make_tiny_checkpoint import raw_config
from tools.model_shapes import INKLING, INKLING_MTP, INKLING_SMALL

# 64 sequences of 8k context, 8k prefill chunks, 2 GiB of graphs, 4 GiB for activations and the CUDA context
SERVING = MemoryRequest(
    device_bytes=141 * GiB,
    page_size=16,
    max_num_seqs=64,
    max_num_batched_tokens=8192,
    kv_tokens=64 * 8192,
    graph_bytes=2 * GiB,
    reserve_bytes=4 * GiB,
)


def released(text: dict):
    """A released config and its NVFP4 layers (every MoE layer after the first, bf16 layer 2)."""
    config = parse_model_config(raw_config(**text, mtp_config=INKLING_MTP))
    return config, [i for i in range(config.text.num_layers) if i > 2]


@pytest.mark.parametrize(("text", "gb"), [(INKLING_SMALL, 170.6), (INKLING, 591.8)])
def test_released_weight_bytes(text: dict, gb: float) -> None:
    """The issue's sizes of the released NVFP4 checkpoints (trunk + NVFP4 experts + bf16 layer 2 + MTP)."""
    config, nvfp4 = released(text)
    assert round(plan_memory(config, SERVING, 1, nvfp4_layers=nvfp4).ranks[0].weight_bytes / 1e9, 1) == gb


def test_inkling_small_needs_two_gpus() -> None:
    config, nvfp4 = released(INKLING_SMALL)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 would fit") as err:
        plan_fitting(config, SERVING, 1, nvfp4_layers=nvfp4)
    needed = plan_memory(config, SERVING, 1, nvfp4_layers=nvfp4).largest.total
    assert f"needs {needed} bytes" in str(err.value) and f"of {141 * GiB} " in str(err.value)
    plan = plan_fitting(config, SERVING, 2, nvfp4_layers=nvfp4)
    assert plan.fits and 79 * GiB < plan.largest.weight_bytes < 81 * GiB
    assert "tensor parallel 2" in plan.summary() and "headroom" in plan.summary()


def test_inkling_needs_eight_gpus() -> None:
    config, nvfp4 = released(INKLING)
    for size in (1, 2, 4):
        with pytest.raises(ConfigError, match="tensor_parallel_size=8 would fit"):  # 5, 6, 7 cannot shard 64 heads
            plan_fitting(config, SERVING, size, nvfp4_layers=nvfp4)
    plan = plan_fitting(config, SERVING, 8, nvfp4_layers=nvfp4)
    assert plan.fits and 69 * GiB < plan.largest.weight_bytes < 71 * GiB
    tight = dataclasses.replace(SERVING, device_bytes=48 * GiB)
    with pytest.raises(ConfigError, match="tensor_parallel_size=16 would fit"):
        plan_fitting(config, tight, 8, nvfp4_layers=nvfp4)
    with pytest.raises(ConfigError, match="no tensor_parallel_size up to 8 fits"):
        plan_fitting(config, tight, 4, nvfp4_layers=nvfp4, max_size=8)


def test_kv_pools_and_conv_slots_use_local_heads() -> None:
    # make-tiny: 5 sliding layers (2 KV heads), 1 global layer (1 KV head), hd 16, H 64, K 4, window 16.
    config = parse_model_config(raw_config())
    request = MemoryRequest(
        GiB, page_size=16, max_num_seqs=2, max_num_batched_tokens=32, kv_tokens=100, graph_bytes=0, include_mtp=False
    )
    # sliding pages 2 * (1 + 1) + 2 = 6, global pages 7 + 2 = 9, each pool +1 scratch page; bf16; k and v
    one, two = (plan_memory(config, request, n).ranks[0] for n in (1, 2))
    assert one.kv_bytes == 5 * 2 * (2 * 16) * 16 * 7 * 2 + 1 * 2 * (1 * 16) * 16 * 10 * 2
    assert two.kv_bytes == 5 * 2 * (1 * 16) * 16 * 7 * 2 + 1 * 2 * (1 * 16) * 16 * 10 * 2  # global head replicated
    # conv slots: (2 * kv width + 2 * H) * (K - 1) * (2 sequences + scratch) * 2 bytes per layer
    assert one.conv_bytes == (5 * (2 * 32 + 128) + (2 * 16 + 128)) * 3 * 3 * 2
    assert two.conv_bytes == (5 * (2 * 16 + 128) + (2 * 16 + 128)) * 3 * 3 * 2
    with_mtp = plan_memory(config, dataclasses.replace(request, include_mtp=True), 1).ranks[0]
    assert with_mtp.kv_bytes > one.kv_bytes and with_mtp.weight_bytes > one.weight_bytes


def test_weights_follow_the_shards() -> None:
    config = parse_model_config(raw_config(n_routed_experts=6))
    decoder, _ = weight_specs(config, nvfp4_layers=(3,))
    assert decoder["layers.3.mlp.experts.w2_weight"] == ((6, 64, 16), torch.uint8)
    assert decoder["layers.3.mlp.experts.w2_weight_scale"] == ((6, 64, 2), torch.float8_e4m3fn)
    assert decoder["layers.2.mlp.experts.w2_weight"] == ((6, 64, 32), torch.bfloat16)
    assert decoder["layers.2.attn.k_sconv.weight"][1] == torch.float32
    request = MemoryRequest(
        device_bytes=GiB, page_size=16, max_num_seqs=1, max_num_batched_tokens=16, kv_tokens=0, graph_bytes=0
    )
    ep = plan_memory(config, request, 4, expert_parallel=True)  # 6 experts over 4 ranks: 2, 2, 1, 1
    bytes_ = [m.weight_bytes for m in ep.ranks]
    assert bytes_[0] == bytes_[1] > bytes_[2] == bytes_[3] and ep.largest.rank == 0
    expert = 3 * 32 * 64 * 2  # one bf16 routed expert: w13 [2I, H] + w2 [H, I]
    assert bytes_[1] - bytes_[2] == 4 * expert  # one more expert in each of the MoE layers 2..5


def test_bad_request_names_the_field() -> None:
    with pytest.raises(ConfigError, match=re.escape("page_size=0")):
        MemoryRequest(
            device_bytes=GiB, page_size=0, max_num_seqs=1, max_num_batched_tokens=1, kv_tokens=0, graph_bytes=0
        )
    with pytest.raises(ConfigError, match=re.escape("kv_tokens=-1")):
        MemoryRequest(
            device_bytes=GiB, page_size=1, max_num_seqs=1, max_num_batched_tokens=1, kv_tokens=-1, graph_bytes=0
        )
