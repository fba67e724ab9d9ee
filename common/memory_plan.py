"""Per-rank memory plan of a decode replica (issue 14): weights, KV pools, conv slots, graphs; does it fit?

Weights are counted from the sharding plan (common/tensor_parallel.py) over the in-memory tensors the loader
hands the model: model-dtype floats, fp32 router bias/scale and conv weights, NVFP4 routed stacks as packed
codes (1/2 byte), e4m3 block scales (1/16 byte) and one fp32 `scale2` per expert. The KV pools use the engine's
page geometry (decode_service/engine/kv_cache.py): per layer kind one pool of `[layers, pages * page_size, nKV,
hd]` for k and for v with the rank's local KV heads, one scratch page per pool beyond the allocatable ones; conv
slots hold `(2 * local kv width + 2 * H) * (K - 1)` values per layer, one slot per sequence plus a scratch slot.
The MTP depths (when counted) bring their weights and their own pools of the depths' geometry.

The minimum pool a request needs: in sliding pools every sequence's window (`ceil(W / page) + 1` pages) plus one
prefill chunk; in global pools `kv_tokens` tokens plus one partial page per sequence. Whatever is left of the
device after weights, that minimum, conv slots, graphs and the reserve is `headroom` (more pages at runtime).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from common.checkpoint_layout import FP32_SUFFIXES, decoder_tensor_shapes, mtp_tensor_shapes
from common.config import ModelConfig, TextConfig
from common.errors import ConfigError
from common.nvfp4 import BLOCK_SIZE
from common.tensor_parallel import RankPlan, Shard, plan_rank

GiB = 1 << 30
_NVFP4_STACKS = ("mlp.experts.w13_weight", "mlp.experts.w2_weight")


@dataclass(frozen=True)
class MemoryRequest:
    """What one decode replica must hold per GPU (plain data; built from the serving settings)."""

    device_bytes: int  # usable memory of one GPU
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int  # one prefill chunk
    kv_tokens: int  # global-layer tokens the pool must hold at least (summed over sequences)
    graph_bytes: int  # CUDA-graph allowance
    reserve_bytes: int = 0  # activations, CUDA context, collective buffers
    dtype: torch.dtype = torch.bfloat16
    include_mtp: bool = True

    def __post_init__(self) -> None:
        for name in ("device_bytes", "page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"memory request {name}={getattr(self, name)!r}: expected >= 1")
        for name in ("kv_tokens", "graph_bytes", "reserve_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"memory request {name}={getattr(self, name)!r}: expected >= 0")


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weight_bytes: int
    kv_bytes: int  # minimum sliding + global pools (trunk and MTP depths)
    conv_bytes: int
    graph_bytes: int
    reserve_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.conv_bytes + self.graph_bytes + self.reserve_bytes


@dataclass(frozen=True)
class MemoryPlan:
    size: int
    expert_parallel: bool
    device_bytes: int
    ranks: tuple[RankMemory, ...]

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda m: m.total)

    @property
    def fits(self) -> bool:
        return self.largest.total <= self.device_bytes

    @property
    def headroom(self) -> int:
        """Bytes left on the fullest rank (for more KV pages)."""
        return self.device_bytes - self.largest.total

    def summary(self) -> str:
        m = self.largest
        mode = "expert" if self.expert_parallel else "tensor"
        return (
            f"memory per rank ({mode} parallel {self.size}, rank {m.rank} the fullest): "
            f"weights {m.weight_bytes / GiB:.2f} GiB, KV pools {m.kv_bytes / GiB:.2f} GiB, "
            f"conv slots {m.conv_bytes / GiB:.3f} GiB, graphs {m.graph_bytes / GiB:.2f} GiB, "
            f"reserve {m.reserve_bytes / GiB:.2f} GiB; total {m.total / GiB:.2f} of {self.device_bytes / GiB:.2f} GiB "
            f"({self.headroom / GiB:+.2f} GiB headroom)"
        )


# ----------------------------------------------------------------------------------------------------
# Bytes


def weight_specs(
    config: ModelConfig, nvfp4_layers: Iterable[int] = (), dtype: torch.dtype = torch.bfloat16
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """(decoder, MTP) in-memory tensors as the loader returns them: key -> (shape, dtype)."""
    nvfp4 = set(nvfp4_layers)

    def specs(shapes: dict[str, tuple[int, ...]], quantized: set[int]) -> dict:
        out = {}
        for key, shape in shapes.items():
            layer = int(key.split(".")[1]) if key.startswith("layers.") else None
            if layer in quantized and key.endswith(_NVFP4_STACKS):
                e, r, c = shape
                out[key] = ((e, r, c // 2), torch.uint8)
                out[key + "_scale"] = ((e, r, c // BLOCK_SIZE), torch.float8_e4m3fn)
                out[key + "_scale2"] = ((e,), torch.float32)
            else:
                out[key] = (shape, torch.float32 if key.endswith(FP32_SUFFIXES) else dtype)
        return out

    return specs(decoder_tensor_shapes(config), nvfp4), specs(mtp_tensor_shapes(config), set())


def _local_bytes(specs: dict, shards: dict[str, Shard]) -> int:
    return sum(math.prod(shards[k].local_shape(shape)) * dt.itemsize for k, (shape, dt) in specs.items())


def _depths(text: TextConfig, config: ModelConfig) -> TextConfig:
    """The MTP depths as a text config of their own (one dense layer per depth; decode_service/model/mtp.py)."""
    m = config.mtp
    return dataclasses.replace(
        text,
        num_layers=m.num_layers,
        sliding_layers=m.sliding_layers,
        dense_layers=(True,) * m.num_layers,
        sliding_window=m.window,
    )


def cache_bytes(text: TextConfig, plan: RankPlan, request: MemoryRequest) -> tuple[int, int]:
    """(minimum KV pool bytes, conv slot bytes) of one rank for the layers of `text`."""
    elt = request.dtype.itemsize
    page, seqs = request.page_size, request.max_num_seqs
    pages = {
        True: seqs * (math.ceil(text.sliding_window / page) + 1) + math.ceil(request.max_num_batched_tokens / page),
        False: math.ceil(request.kv_tokens / page) + seqs,
    }
    kv = conv = 0
    for i in range(text.num_layers):
        sliding = text.sliding_layers[i]
        width = plan.heads(sliding).num_kv * text.geometry(sliding).head_dim
        kv += 2 * width * page * (pages[sliding] + 1) * elt  # k and v, plus the scratch page
        conv += (2 * width + 2 * text.hidden_size) * (text.conv_kernel_size - 1) * (seqs + 1) * elt
    return kv, conv


def plan_memory(
    config: ModelConfig,
    request: MemoryRequest,
    size: int,
    expert_parallel: bool = False,
    nvfp4_layers: Iterable[int] = (),
) -> MemoryPlan:
    """Bytes every rank of a `size`-way replica needs (raises ConfigError when `size` cannot shard the config)."""
    nvfp4 = tuple(nvfp4_layers)
    decoder, mtp = weight_specs(config, nvfp4, request.dtype)
    with_mtp = request.include_mtp and config.mtp is not None
    ranks = []
    for r in range(size):
        plan = plan_rank(config, size, r, expert_parallel, nvfp4)
        weights = _local_bytes(decoder, plan.shards) + (_local_bytes(mtp, plan.mtp_shards) if with_mtp else 0)
        kv, conv = cache_bytes(config.text, plan, request)
        if with_mtp:
            kv_mtp, conv_mtp = cache_bytes(_depths(config.text, config), plan, request)
            kv, conv = kv + kv_mtp, conv + conv_mtp
        ranks.append(RankMemory(r, weights, kv, conv, request.graph_bytes, request.reserve_bytes))
    return MemoryPlan(size, expert_parallel, request.device_bytes, tuple(ranks))


def plan_fitting(
    config: ModelConfig,
    request: MemoryRequest,
    size: int,
    expert_parallel: bool = False,
    nvfp4_layers: Iterable[int] = (),
    max_size: int = 64,
) -> MemoryPlan:
    """`plan_memory`, or a ConfigError naming the bytes the fullest rank needs and the smallest size (of those
    that can shard this config) that would fit."""
    nvfp4 = tuple(nvfp4_layers)
    plan = plan_memory(config, request, size, expert_parallel, nvfp4)
    if plan.fits:
        return plan
    m = plan.largest
    smallest = None
    for n in range(size + 1, max_size + 1):
        try:
            candidate = plan_memory(config, request, n, expert_parallel, nvfp4)
        except ConfigError:  # this size cannot shard the config's heads or intermediate sizes
            continue
        if candidate.fits:
            smallest = n
            break
    hint = (
        f"tensor_parallel_size={smallest} would fit"
        if smallest is not None
        else f"no tensor_parallel_size up to {max_size} fits"
    )
    raise ConfigError(
        f"the model does not fit tensor_parallel_size={size}: rank {m.rank} needs {m.total} bytes "
        f"({m.total / GiB:.1f} GiB: weights {m.weight_bytes / GiB:.1f}, KV {m.kv_bytes / GiB:.1f}, conv "
        f"{m.conv_bytes / GiB:.2f}, graphs {m.graph_bytes / GiB:.1f}, reserve {m.reserve_bytes / GiB:.1f}) of "
        f"{request.device_bytes} ({request.device_bytes / GiB:.1f} GiB) per GPU; {hint}"
    )
