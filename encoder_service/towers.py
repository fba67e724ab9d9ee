"""The two encoder towers (spec multimodal sections 2 and 3.5).

- `VisionTower`: the hMLP. Patches [N, T, P, P, C] are folded space/time -> depth through a planned sequence of
  scales; each layer is fold, bias-free linear, then RMSNorm + exact GELU (all but the last); a final RMSNorm.
- `AudioTower`: the dMel codebook. Each frame's 80 codes pick one row per mel bin; the rows are summed in fp32
  and RMS-normalised.

Parameter names are the raw checkpoint names without their `model.visual.` / `model.audio.` prefix
(ARCHITECTURE.md), so `load_state_dict` takes what `common.checkpoint.load_tower_weights` returns.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn

from common.config import AudioConfig, ModelConfig, VisionConfig
from common.errors import CheckpointError, ConfigError, InvalidInputError

TOWER_NORM_EPS = 1e-6  # both towers, independent of the text config's rms_norm_eps


class Scale(NamedTuple):
    t: int  # frames folded into one position
    h: int  # patch rows folded into one position
    w: int  # patch columns folded into one position
    c: int  # channels per position


def prime_factors(n: int) -> list[int]:
    """Ascending prime factors with multiplicity (prime_factors(40) == [2, 2, 2, 5])."""
    factors: list[int] = []
    divisor = 2
    while divisor * divisor <= n:
        while n % divisor == 0:
            factors.append(divisor)
            n //= divisor
        divisor += 1 if divisor == 2 else 2
    if n > 1:
        factors.append(n)
    return factors


def _roundup64(x: int) -> int:
    return -(-x // 64) * 64


def candidate_scales(T: int, P: int, C: int, hf_compat: bool = False) -> list[Scale]:
    """Base scale, then spatial growth (largest prime first), then temporal growth (spec 2.1 step 3).

    `hf_compat` reproduces HF's temporal channel count ceil(P*P*C*t) * 64 instead of roundup64(P*P*C*t).
    """
    scales = [Scale(1, 1, 1, C)]
    h = 1
    for factor in reversed(prime_factors(P)):
        h *= factor
        scales.append(Scale(1, h, h, _roundup64(h * h * C)))
    t = 1
    for factor in reversed(prime_factors(T)):
        t *= factor
        channels = P * P * C * t * 64 if hf_compat else _roundup64(P * P * C * t)
        scales.append(Scale(t, P, P, channels))
    return scales


def _select(cost: np.ndarray, L: int, monotone: bool) -> list[int]:
    """Row -> candidate: per-row argmin when L >= candidates, else an optimal distinct assignment.

    Candidate sizes grow with their index, so sorting an optimal assignment keeps it optimal (1-D L1 cost) and
    breaks cost ties toward a plan whose folds are valid; `monotone=False` keeps scipy's order (HF).
    """
    if L >= cost.shape[1]:
        chosen = [int(k) for k in cost.argmin(axis=1)]
    else:
        _, columns = linear_sum_assignment(cost)
        chosen = sorted(int(k) for k in columns) if monotone else [int(k) for k in columns]
    chosen[0], chosen[-1] = 0, cost.shape[1] - 1
    return chosen


def plan_scales(T: int, P: int, L: int, C: int, hf_compat: bool = False) -> list[Scale]:
    """The L+1 scales the hMLP moves through (spec 2.1): log-sizes as close as possible to a linspace.

    The default follows the released serving stacks (float64 cost, roundup64 temporal channels); `hf_compat`
    follows HF transformers (float32 cost, its temporal channel formula) so that any HF tiny config loads.
    """
    for name, value in (("temporal_patch_size", T), ("patch_size", P), ("num_layers", L), ("num_channels", C)):
        if value < 1:
            raise ConfigError(f"vision_config.{name} must be >= 1, got {value}")
    scales = candidate_scales(T, P, C, hf_compat)
    sizes = [s.t * s.h * s.w for s in scales]
    dtype = torch.float32 if hf_compat else torch.float64
    cpu = torch.device("cpu")  # also when called under a meta-device context
    log_sizes = torch.log(torch.tensor(sizes, dtype=dtype, device=cpu))  # [K]
    end = math.log(P * P * T * C)
    if hf_compat:  # HF forms the end point in float32 too
        end = torch.log(torch.tensor(float(P * P * T * C), device=cpu)).item()
    ideal = torch.linspace(0.0, end, L + 1, dtype=dtype, device=cpu)  # [L+1]
    cost = (ideal[:, None] - log_sizes[None, :]).abs().numpy()  # [L+1, K]
    return [scales[k] for k in _select(cost, L, monotone=not hf_compat)]


class RMSNorm(nn.Module):
    """y = w * round_to_dtype(x * rsqrt(mean(x^2) + eps)), the statistics in fp32."""

    def __init__(self, width: int, eps: float = TOWER_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalised.to(x.dtype)


def fold(x: torch.Tensor, t: int, hw: int) -> torch.Tensor:
    """Space/time -> depth: [B, T, H, W, C] -> [B, T/t, H/hw, W/hw, t*hw*hw*C], channel ((dt*hw+dy)*hw+dx)*C+c."""
    B, T, H, W, C = x.shape
    x = x.reshape(B, T // t, t, H // hw, hw, W // hw, hw, C)
    x = x.permute(0, 1, 3, 5, 2, 4, 6, 7)  # [B, T/t, H/hw, W/hw, t, hw, hw, C]
    return x.reshape(B, T // t, H // hw, W // hw, t * hw * hw * C)


def _check_plan(plan: list[Scale], config: VisionConfig) -> None:
    for i, (a, b) in enumerate(zip(plan[:-1], plan[1:], strict=True)):
        if b.t % a.t or b.h % a.h or b.w % a.w:
            raise ConfigError(
                f"vision_config (patch_size={config.patch_size}, temporal_patch_size="
                f"{config.temporal_patch_size}, n_layers={config.num_layers}): layer {i} would "
                f"fold {tuple(a)} into {tuple(b)}, which is not a whole fold"
            )


class VisionTower(nn.Module):
    """hMLP: normalised patches -> one embedding row per patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.plan = plan_scales(
            config.temporal_patch_size,
            config.patch_size,
            config.num_layers,
            config.num_channels,
            hf_compat=config.hf_compat_plan,
        )
        _check_plan(self.plan, config)
        self.folds: list[tuple[int, int]] = []  # (t_fold, hw_fold) per layer
        self.layers = nn.Module()
        last = config.num_layers - 1
        for i, (a, b) in enumerate(zip(self.plan[:-1], self.plan[1:], strict=True)):
            t_fold, hw_fold = b.t // a.t, b.h // a.h
            width_out = config.output_dim if i == last else b.c
            self.layers.add_module(f"linear_{i}", nn.Linear(a.c * t_fold * hw_fold * hw_fold, width_out, bias=False))
            if i != last:
                self.layers.add_module(f"norm_{i}", RMSNorm(width_out))
            self.folds.append((t_fold, hw_fold))
        self.final_norm = RMSNorm(config.output_dim) if config.use_norm else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, P, P, C] (one still frame, repeated T times) or [N, T, P, P, C] -> [N, D]."""
        cfg = self.config
        P, C, T = cfg.patch_size, cfg.num_channels, cfg.temporal_patch_size
        if pixels.dim() == 4:
            pixels = pixels.unsqueeze(1)  # [N, 1, P, P, C] stands for T identical frames
        if pixels.dim() != 5 or pixels.shape[2:] != (P, P, C) or pixels.shape[1] not in (1, T):
            raise InvalidInputError(
                f"vision tower: expected [N, P, P, {C}] or [N, {T}, P, P, {C}] with P={P}, got {tuple(pixels.shape)}"
            )
        x = pixels.to(self.layers.linear_0.weight.dtype)
        last = cfg.num_layers - 1
        for i, (t_fold, hw_fold) in enumerate(self.folds):
            if t_fold > 1 and x.shape[1] == 1:
                # Layers so far never mix frames, so one frame stood for all T; the first temporal fold needs them.
                x = x.expand(-1, T, -1, -1, -1)
            if t_fold > 1 or hw_fold > 1:
                x = fold(x, t_fold, hw_fold)
            x = getattr(self.layers, f"linear_{i}")(x)
            if i != last:
                x = F.gelu(getattr(self.layers, f"norm_{i}")(x))
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x.reshape(pixels.shape[0], cfg.output_dim)  # [N, 1, 1, 1, D] -> [N, D]


class AudioTower(nn.Module):
    """dMel codebook: codes [F, n_mels] -> embeddings [F, D]."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        self.encoder = nn.Embedding(config.n_mel_bins * config.mel_vocab_size, config.output_dim)
        self.final_norm = RMSNorm(config.output_dim) if config.use_norm else None

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if codes.dim() != 2 or codes.shape[1] != cfg.n_mel_bins:
            raise InvalidInputError(f"audio tower: expected codes [F, {cfg.n_mel_bins}], got {tuple(codes.shape)}")
        offsets = torch.arange(cfg.n_mel_bins, device=codes.device) * cfg.mel_vocab_size  # [M]
        rows = codes.long() + offsets  # [F, M]: bin m's code q selects row m*vocab + q
        table = self.encoder.weight
        summed = F.embedding_bag(rows, table.float(), mode="sum")  # [F, D], fp32 accumulation
        x = summed.to(table.dtype)
        return self.final_norm(x) if self.final_norm is not None else x


def _load(module: nn.Module, state: dict[str, torch.Tensor], name: str) -> None:
    try:
        result = module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatch
        raise CheckpointError(f"{name} tower: {exc}") from exc
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{name} tower: missing {sorted(result.missing_keys)}, unexpected {sorted(result.unexpected_keys)}"
        )


def build_audio_tower(
    config: AudioConfig, state: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
) -> AudioTower:
    """An `AudioTower` with `state` loaded (cast to `dtype`, as `build_towers` does), on `device`, eval mode."""
    with torch.device("meta"):
        module = AudioTower(config)
    _load(module, {k: v.to(dtype) for k, v in state.items()}, "audio")
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_towers(
    config: ModelConfig,
    vision_state: dict[str, torch.Tensor] | None,
    audio_state: dict[str, torch.Tensor] | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[VisionTower | None, AudioTower | None]:
    """Instantiate the towers the config enables, load their weights, move them to (device, dtype), eval mode."""
    towers: list[nn.Module | None] = []
    for name, cfg, state, cls in (
        ("vision", config.vision, vision_state, VisionTower),
        ("audio", config.audio, audio_state, AudioTower),
    ):
        if cfg is None:
            towers.append(None)
            continue
        if state is None:
            raise CheckpointError(f"{name} tower: enabled in the config but no weights were given")
        with torch.device("meta"):
            module = cls(cfg)
        _load(module, state, name)
        module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        towers.append(module)
    vision, audio = towers
    return vision, audio


__all__ = [
    "AudioTower",
    "RMSNorm",
    "Scale",
    "VisionTower",
    "build_audio_tower",
    "build_towers",
    "candidate_scales",
    "fold",
    "plan_scales",
    "prime_factors",
]
