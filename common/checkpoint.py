"""Checkpoint directories -> the in-memory weight dicts of ARCHITECTURE.md, with every tensor accounted for.

Two on-disk layouts are read (spec/inkling-text.md 6.1-6.6, spec/inkling-multimodal.md 2.4):
- RELEASED ("raw"): `model.llm.*`, `model.visual.*`, `model.audio.*`, `model.mtp.*`, fused gate/up tensors
  with interleaved rows, NVFP4 routed experts with `.scale` / `.scale2` / `.input_amax` / `.original_shape`
  sidecars,
  optional `hf_quant_config.json`, `mtp.safetensors` possibly missing from the index;
- HF-SAVED (`save_pretrained(save_original_format=False)`): `model.language_model.*` (or `model.*` text-only),
  `lm_head.weight`, `model.vision_tower.*`, `model.audio_tower.*`, split gate/up tensors.

Both are first seen through a `RawView` that speaks raw names; the loaders then check shapes against the
`ModelConfig`, de-interleave, cast and move tensors. Forward code never sees any of this.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from common.checkpoint_files import CheckpointFiles, name_list
from common.checkpoint_layout import (
    AUDIO,
    FP32_SUFFIXES,
    LLM,
    MTP,
    ROUTED_STACKS,
    VISUAL,
    QuantConfig,
    RawView,
    decoder_tensor_shapes,
    deinterleave_rows,
    interleave_dim,
    mtp_tensor_shapes,
    read_quant_config,
)
from common.config import ModelConfig, load_model_config
from common.errors import CheckpointError, ConfigError
from common.nvfp4 import BLOCK_SIZE

# ----------------------------------------------------------------------------------------------------
# Loading


@dataclass
class LoadReport:
    """Where every tensor of the checkpoint went (raw names)."""

    layout: str
    consumed: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)  # name -> reason
    unexpected: list[str] = field(default_factory=list)
    nvfp4_layers: tuple[int, ...] = ()

    def summary(self) -> str:
        reasons = Counter(self.ignored.values())
        parts = [
            f"layout {self.layout}: {len(self.consumed)} consumed, {len(self.ignored)} ignored, "
            f"{len(self.unexpected)} unexpected"
        ]
        parts += [f"  ignored {n}: {reason}" for reason, n in sorted(reasons.items())]
        if self.nvfp4_layers:
            parts.append(f"  NVFP4 routed experts in layers {list(self.nvfp4_layers)}")
        return "\n".join(parts)


class _Loader:
    """One pass over a raw view: takes expected tensors, records the rest, fails on anything unaccounted."""

    def __init__(self, view: RawView, device: torch.device | str, progress: bool | None, what: str):
        self.view = view
        self.device = torch.device(device)
        self.progress = progress
        self.what = what
        self.report = LoadReport(layout=view.layout)
        self.taken: set[str] = set()

    def check(self, name: str, expected: tuple[int, ...]) -> None:
        got = self.view.shape(name)
        if tuple(got) != tuple(expected):
            raise CheckpointError(f"tensor {name}: expected shape {tuple(expected)}, got {tuple(got)}")

    def check_dtype(self, name: str, allowed: tuple[torch.dtype, ...] | None = None) -> None:
        got = self.view.dtype(name)
        ok = got in allowed if allowed else got.is_floating_point and got.itemsize > 1
        if not ok:
            raise CheckpointError(
                f"tensor {name}: unexpected dtype {got}"
                + (f" (expected {allowed})" if allowed else " (expected a float type)")
            )

    def commit(self, plan: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]) -> None:
        """Mark the names of a plan (key -> (raw name, transform on the target device)) consumed."""
        for raw, _ in plan.values():
            self.take(raw)

    def read_all(self, plan: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]) -> dict:
        total = sum(self.view.nbytes(raw) for raw, _ in plan.values())
        show = total > (1 << 30) if self.progress is None else self.progress
        out: dict[str, torch.Tensor] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {self.what}", disable=not show) as bar:
            for key, (raw, transform) in plan.items():
                out[key] = transform(self.view.get(raw).to(self.device))
                bar.update(self.view.nbytes(raw))
        return out

    def take(self, raw: str) -> None:
        self.taken.add(raw)
        self.report.consumed.append(raw)

    def finish(self, missing: list[str], ignore: Callable[[str], str | None]) -> LoadReport:
        for name in self.view.names():
            if name in self.taken:
                continue
            reason = ignore(name)
            if reason is None:
                self.report.unexpected.append(name)
            else:
                self.report.ignored[name] = reason
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {name_list(missing)}")
        if self.report.unexpected:
            problems.append(f"{len(self.report.unexpected)} unexpected: {name_list(self.report.unexpected)}")
        if problems:
            raise CheckpointError(f"{self.what} ({self.report.layout} layout): " + "; ".join(problems))
        return self.report


def _float_transform(raw: str, dtype: torch.dtype, interleaved: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    target = torch.float32 if raw.endswith(FP32_SUFFIXES) else dtype
    dim = interleave_dim(raw) if interleaved else None

    def transform(x: torch.Tensor) -> torch.Tensor:
        x = x.to(target)
        return deinterleave_rows(x, dim) if dim is not None else x.contiguous()

    return transform


def _nvfp4_stack(loader: _Loader, raw: str, logical: tuple[int, ...], plan: dict, key: str) -> None:
    """Plan packed weight, block scale and scale2 of one NVFP4 routed stack; check and consume sidecars."""
    view = loader.view
    e, r, c = logical
    for suffix in (".scale", ".scale2"):
        if raw + suffix not in view:
            raise CheckpointError(f"NVFP4 stack {raw}: missing sidecar {raw + suffix}")
    loader.check_dtype(raw, (torch.uint8,))
    loader.check(raw, (e, r, c // 2))
    loader.check_dtype(raw + ".scale", (torch.float8_e4m3fn,))
    loader.check(raw + ".scale", (e, r, c // BLOCK_SIZE))
    loader.check_dtype(raw + ".scale2", (torch.float32,))
    loader.check(raw + ".scale2", (e,))
    if raw + ".original_shape" in view:
        shape = view.get(raw + ".original_shape").tolist()
        if shape != [e, r, c]:
            raise CheckpointError(f"tensor {raw}.original_shape: expected {[e, r, c]}, got {shape}")
        loader.take(raw + ".original_shape")
    dim = 1 if raw.endswith("w13_weight") and view.interleaved(raw) else None

    def rows(x: torch.Tensor) -> torch.Tensor:
        return deinterleave_rows(x, dim) if dim is not None else x.contiguous()

    plan[key] = (raw, rows)
    plan[key + "_scale"] = (raw + ".scale", rows)
    plan[key + "_scale2"] = (raw + ".scale2", lambda x: x.contiguous())


def _is_nvfp4(view: RawView, raw: str) -> bool:
    return raw in view and (view.dtype(raw) == torch.uint8 or raw + ".scale" in view or raw + ".scale2" in view)


def _plan_stack(
    loader: _Loader,
    prefix: str,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    quant: QuantConfig | None,
    plan: dict,
    missing: list[str],
) -> list[int]:
    """Plan every tensor of `shapes` (keys relative to `prefix`); returns the layers found in NVFP4."""
    view = loader.view
    nvfp4_layers = []
    for key, shape in shapes.items():
        raw = prefix + key
        if key.endswith(ROUTED_STACKS) and _is_nvfp4(view, raw):
            if quant is not None and quant.excludes(raw):
                raise CheckpointError(f"tensor {raw} is NVFP4 but its quantization config excludes it")
            _nvfp4_stack(loader, raw, shape, plan, key)
            nvfp4_layers.append(int(key.split(".")[1]))
            continue
        if raw not in view:
            missing.append(raw)
            continue
        if key.endswith(ROUTED_STACKS) and quant is not None and not quant.excludes(raw):
            raise CheckpointError(
                f"tensor {raw} is {view.dtype(raw)} but the quantization config does not exclude it (expected NVFP4)"
            )
        loader.check_dtype(raw)
        loader.check(raw, shape)
        plan[key] = (raw, _float_transform(raw, dtype, view.interleaved(raw)))
    return sorted(set(nvfp4_layers))


def _decoder_ignore(name: str) -> str | None:
    if name.startswith(MTP):
        return "MTP drafter not built"
    if name.startswith(VISUAL):
        return "vision tower (encoder service)"
    if name.startswith(AUDIO):
        return "audio tower (encoder service)"
    if name.startswith(LLM) and name.endswith(".input_amax") and name[: -len(".input_amax")].endswith(ROUTED_STACKS):
        return "NVFP4 activation calibration (weight-only inference)"
    return None


def _decoder_plan(
    files: CheckpointFiles, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, progress: bool | None
) -> tuple[_Loader, dict]:
    view = RawView(files)
    quant = read_quant_config(files.directory, config)
    loader = _Loader(view, device, progress, "decoder weights")
    plan: dict = {}
    missing: list[str] = []
    nvfp4 = _plan_stack(loader, LLM, decoder_tensor_shapes(config), dtype, quant, plan, missing)
    loader.commit(plan)
    loader.report.nvfp4_layers = tuple(nvfp4)
    loader.finish(missing, _decoder_ignore)
    return loader, plan


def plan_decoder_weights(
    files: CheckpointFiles, config: ModelConfig, dtype: torch.dtype = torch.bfloat16
) -> tuple[RawView, dict, LoadReport]:
    """What `load_decoder_weights` checks and reads, reading only headers (and NVFP4 `original_shape` sidecars):
    (raw view, plan: in-memory key -> (raw name, transform of the tensor as stored), report)."""
    loader, plan = _decoder_plan(files, config, dtype, "cpu", False)
    return loader.view, plan, loader.report


def load_decoder_weights(
    files: CheckpointFiles,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The decoder's in-memory weights (ARCHITECTURE.md keys) and the accounting of every checkpoint tensor.

    `progress=None` shows a progress bar only for checkpoints above 1 GiB.
    """
    loader, plan = _decoder_plan(files, config, dtype, device, progress)
    return loader.read_all(plan), loader.report


def _mtp_plan(
    files: CheckpointFiles, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, progress: bool | None
) -> tuple[_Loader, dict]:
    if config.mtp is None:
        raise CheckpointError("config has no mtp_config: no MTP weights to load")
    view = RawView(files)
    loader = _Loader(view, device, progress, "MTP weights")
    plan: dict = {}
    missing: list[str] = []
    _plan_stack(loader, MTP, mtp_tensor_shapes(config), dtype, None, plan, missing)

    def ignore(name: str) -> str | None:
        return None if name.startswith(MTP) else "not part of the MTP drafter"

    loader.commit(plan)
    loader.finish(missing, ignore)
    return loader, plan


def plan_mtp_weights(
    files: CheckpointFiles, config: ModelConfig, dtype: torch.dtype = torch.bfloat16
) -> tuple[RawView, dict, LoadReport]:
    """`plan_decoder_weights` for `load_mtp_weights`."""
    loader, plan = _mtp_plan(files, config, dtype, "cpu", False)
    return loader.view, plan, loader.report


def load_mtp_weights(
    files: CheckpointFiles,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The MTP drafter's weights (prefix `model.mtp.` stripped, w13 de-interleaved); all bf16 in releases."""
    loader, plan = _mtp_plan(files, config, dtype, device, progress)
    return loader.read_all(plan), loader.report


_TOWER_IGNORED = {
    AUDIO + "decoder.": "audio output head (not used for understanding)",
    AUDIO + "logits_processor.": "audio output head (not used for understanding)",
}


def _tower_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...] | None]:
    """Expected tower keys; None where the shape depends on the hMLP plan (checked by the tower itself)."""
    if prefix == VISUAL:
        v = config.vision
        if v is None:
            return {}
        shapes: dict[str, tuple[int, ...] | None] = {f"layers.linear_{i}.weight": None for i in range(v.num_layers)}
        shapes |= {f"layers.norm_{i}.weight": None for i in range(v.num_layers - 1)}
        if v.use_norm:
            shapes["final_norm.weight"] = (v.output_dim,)
        return shapes
    a = config.audio
    if a is None:
        return {}
    shapes = {"encoder.weight": (a.n_mel_bins * a.mel_vocab_size, a.output_dim)}
    if a.use_norm:
        shapes["final_norm.weight"] = (a.output_dim,)
    return shapes


def load_tower_weights(
    files: CheckpointFiles,
    prefix: str,
    config: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Tower weights under `prefix` ("model.visual." or "model.audio."), keys without the prefix.

    With `config`, the exact key set and the shapes that do not depend on the hMLP plan are checked; without
    it, every tensor under the prefix matching the tower's naming is taken. `dtype=None` keeps stored dtypes.
    """
    if prefix not in (VISUAL, AUDIO):
        raise CheckpointError(f"tower prefix must be {VISUAL!r} or {AUDIO!r}, got {prefix!r}")
    view = RawView(files)
    loader = _Loader(view, device, False, f"{prefix.rstrip('.')} tower weights")
    pattern = (
        re.compile(r"^(layers\.(linear|norm)_\d+\.weight|final_norm\.weight)$")
        if prefix == VISUAL
        else re.compile(r"^(encoder|final_norm)\.weight$")
    )
    present = {n[len(prefix) :] for n in view.names() if n.startswith(prefix)}
    expected = _tower_shapes(config, prefix) if config is not None else {k: None for k in present if pattern.match(k)}
    if config is not None and not expected:
        raise CheckpointError(f"config has no {prefix.rstrip('.')} tower")
    plan: dict = {}
    missing = [prefix + k for k in expected if k not in present]
    for key, shape in expected.items():
        raw = prefix + key
        if raw not in view:
            continue
        loader.check_dtype(raw)
        if shape is not None:
            loader.check(raw, shape)
        plan[key] = (
            raw,
            (lambda x: x.contiguous()) if dtype is None else (lambda x: x.to(dtype).contiguous()),
        )

    def ignore(name: str) -> str | None:
        if not name.startswith(prefix):
            return "not part of this tower"
        return next((why for p, why in _TOWER_IGNORED.items() if name.startswith(p)), None)

    loader.commit(plan)
    report = loader.finish(missing, ignore)
    return loader.read_all(plan), report


# ----------------------------------------------------------------------------------------------------
# Inspection


def inspect_checkpoint(directory: str | Path) -> str:
    """Human-readable summary of a checkpoint directory (for `inkling-epd inspect`)."""
    files = CheckpointFiles(directory)
    view = RawView(files)
    names = files.names()
    lines = [
        f"checkpoint {files.directory}",
        f"layout: {view.layout}",
        f"files: {len({files.file_of(n).name for n in names})} safetensors, {len(names)} tensors, "
        f"{sum(files.nbytes(n) for n in names) / 1e6:.1f} MB",
    ]
    if files.unindexed:
        lines.append(f"tensors missing from the index (found by scanning): {len(files.unindexed)}")
    by_dtype = Counter(str(files.dtype(n)).replace("torch.", "") for n in names)
    lines.append("dtypes: " + ", ".join(f"{d} {c}" for d, c in sorted(by_dtype.items())))
    groups = Counter(next((p for p in (LLM, VISUAL, AUDIO, MTP) if n.startswith(p)), "other") for n in view.names())
    lines.append("groups: " + ", ".join(f"{g.rstrip('.')} {c}" for g, c in sorted(groups.items())))
    nvfp4 = sorted(
        {
            int(n.split(".")[3])
            for n in view.names()
            if n.startswith(LLM + "layers.") and n.endswith(ROUTED_STACKS) and _is_nvfp4(view, n)
        }
    )
    try:
        config: ModelConfig | None = load_model_config(files.directory)
    except ConfigError as exc:  # the summary still helps when config.json is broken
        config = None
        lines.append(f"config.json: unreadable ({exc})")
    quant = read_quant_config(files.directory, config)
    lines.append(
        "quantization: "
        + (f"NVFP4 routed experts in layers {nvfp4}" if nvfp4 else "none")
        + (f"; {quant.algo} config with {len(quant.exclude_modules)} exclude entries" if quant else "")
    )
    if config is not None:
        t = config.text
        lines.append(
            f"text: {t.num_layers} layers (global {[i for i, s in enumerate(t.sliding_layers) if not s]}), "
            f"hidden {t.hidden_size}, {t.n_routed_experts} experts top-{t.num_experts_per_tok}, "
            f"vocab {t.vocab_size}"
        )
        lines.append(
            f"towers: vision {'yes' if config.vision else 'no'}, audio {'yes' if config.audio else 'no'}; "
            f"MTP depths: {config.mtp.num_layers if config.mtp else 0}"
        )
    return "\n".join(lines)
