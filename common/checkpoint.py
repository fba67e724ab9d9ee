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

import json
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from common.config import ModelConfig, TextConfig, load_model_config
from common.errors import CheckpointError, ConfigError
from common.nvfp4 import BLOCK_SIZE

INDEX_FILE = "model.safetensors.index.json"
QUANT_FILE = "hf_quant_config.json"
LLM, VISUAL, AUDIO, MTP = "model.llm.", "model.visual.", "model.audio.", "model.mtp."

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Kept in fp32 whatever the model dtype (router bias/scale feed fp32 routing; convs run in fp32 in HF).
_FP32_SUFFIXES = (
    "mlp.gate.bias",
    "mlp.gate.global_scale",
    "attn.k_sconv.weight",
    "attn.v_sconv.weight",
    "attn_sconv.weight",
    "mlp_sconv.weight",
)
_ROUTED = ("mlp.experts.w13_weight", "mlp.experts.w2_weight")
_LIST_LIMIT = 20


def _name_list(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_LIST_LIMIT])
    return f"{shown} (+{len(names) - _LIST_LIMIT} more)" if len(names) > _LIST_LIMIT else shown


# ----------------------------------------------------------------------------------------------------
# Files


def _read_header(path: Path) -> dict[str, dict]:
    """Tensor entries of a safetensors header, without touching the data."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        (length,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    return header


class CheckpointFiles:
    """Lazy name -> tensor directory over the index and every top-level `*.safetensors` file."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        self._file: dict[str, Path] = {}
        self._entry: dict[str, dict] = {}
        self._handles: dict[Path, object] = {}
        indexed = self._read_index()
        files = sorted(self.directory.glob("*.safetensors"))
        missing_files = sorted({p.name for p in indexed.values()} - {p.name for p in files})
        if missing_files:
            raise CheckpointError(f"{INDEX_FILE} names shard files that do not exist: {missing_files}")
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        for path in files:
            for name, entry in _read_header(path).items():
                if name in self._file:
                    raise CheckpointError(
                        f"tensor {name} is stored twice: {self._file[name].name} and {path.name}"
                    )
                if name in indexed and indexed[name] != path:
                    raise CheckpointError(
                        f"tensor {name} is in {path.name} but the index says {indexed[name].name}"
                    )
                self._file[name] = path
                self._entry[name] = entry
        absent = [n for n in indexed if n not in self._file]
        if absent:
            raise CheckpointError(
                f"{INDEX_FILE} lists tensors missing from their shard: {_name_list(absent)}"
            )
        self.unindexed = sorted(n for n in self._file if indexed and n not in indexed)

    def _read_index(self) -> dict[str, Path]:
        path = self.directory / INDEX_FILE
        if not path.exists():
            return {}
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: invalid index ({exc!r})") from exc
        return {name: self.directory / file for name, file in weight_map.items()}

    def names(self) -> list[str]:
        return sorted(self._file)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def _lookup(self, name: str) -> dict:
        if name not in self._entry:
            raise CheckpointError(f"tensor {name} is not in the checkpoint {self.directory}")
        return self._entry[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._lookup(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._lookup(name)["dtype"]
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name}: unsupported safetensors dtype {code}")
        return _ST_DTYPES[code]

    def nbytes(self, name: str) -> int:
        start, end = self._lookup(name)["data_offsets"]
        return end - start

    def file_of(self, name: str) -> Path:
        self._lookup(name)
        return self._file[name]

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of(name)
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


# ----------------------------------------------------------------------------------------------------
# Layouts: a raw-named view over either layout


@dataclass(frozen=True)
class _Source:
    parts: tuple[str, ...]  # stored names; several parts are concatenated along cat_dim ([gate; up])
    cat_dim: int = 0
    interleaved: bool = True  # fused gate/up rows still alternate (raw layout)


# HF name patterns (after the text prefix is replaced by `model.llm.`) -> raw name; order matters.
_HF_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^model\.llm\.embed_tokens\.embed_norm\.", "model.llm.embed_norm."),
    (r"^model\.llm\.embed_tokens\.", "model.llm.embed."),
    (r"\.self_attn\.q_proj\.", ".attn.wq_du."),
    (r"\.self_attn\.k_proj\.", ".attn.wk_dv."),
    (r"\.self_attn\.v_proj\.", ".attn.wv_dv."),
    (r"\.self_attn\.r_proj\.", ".attn.wr_du."),
    (r"\.self_attn\.o_proj\.", ".attn.wo_ud."),
    (r"\.self_attn\.(k|v)_sconv\.conv1d\.", r".attn.\1_sconv."),
    (r"\.self_attn\.", ".attn."),
    (r"\.(attn|mlp)_sconv\.conv1d\.", r".\1_sconv."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".mlp_norm."),
    (r"\.mlp\.down_proj\.weight$", ".mlp.w2_md.weight"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.bias"),
    (r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w13_weight"),
    (r"\.mlp\.experts\.down_proj$", ".mlp.experts.w2_weight"),
    (r"\.mlp\.shared_experts\.down_proj$", ".mlp.shared_experts.shared_w2_weight"),
    (r"^model\.vision_tower\.encoder_layers\.(\d+)\.projection\.", r"model.visual.layers.linear_\1."),
    (r"^model\.vision_tower\.encoder_layers\.(\d+)\.layer_norm\.", r"model.visual.layers.norm_\1."),
    (r"^model\.vision_tower\.", "model.visual."),
    (r"^model\.audio_tower\.embed_audio_tokens\.embed_audio_tokens\.", "model.audio.encoder."),
    (r"^model\.audio_tower\.norm\.", "model.audio.final_norm."),
    (r"^model\.audio_tower\.", "model.audio."),
)
# HF split pairs -> (fused raw suffix, gate/up part index, concatenation dim)
_HF_PAIRS: tuple[tuple[str, str, int, int], ...] = (
    (r"\.mlp\.gate_proj\.weight$", ".mlp.w13_dn.weight", 0, 0),
    (r"\.mlp\.up_proj\.weight$", ".mlp.w13_dn.weight", 1, 0),
    (r"\.mlp\.shared_experts\.gate_proj$", ".mlp.shared_experts.shared_w13_weight", 0, 1),
    (r"\.mlp\.shared_experts\.up_proj$", ".mlp.shared_experts.shared_w13_weight", 1, 1),
)


def detect_layout(names: Iterable[str]) -> str:
    """'raw', 'hf' (multimodal HF-saved) or 'hf-text' (text-only HF-saved)."""
    names = list(names)
    if any(n.startswith(LLM) for n in names):
        return "raw"
    if any(n.startswith("model.language_model.") for n in names):
        return "hf"
    if any(n.startswith(("model.layers.", "model.embed_tokens.")) for n in names):
        return "hf-text"
    raise CheckpointError(
        "unrecognised checkpoint layout: no model.llm.*, model.language_model.* or model.layers.* tensors"
    )


def _hf_to_raw(name: str, text_prefix: str) -> tuple[str, int | None, int]:
    """(raw name, gate/up part index or None, concat dim) of one HF-saved tensor name."""
    if name == "lm_head.weight":
        return LLM + "unembed.weight", None, 0
    if name.startswith(text_prefix) and not name.startswith(
        ("model.vision_tower.", "model.audio_tower.", MTP)
    ):
        name = LLM + name[len(text_prefix) :]
    for pattern, fused, part, dim in _HF_PAIRS:
        if re.search(pattern, name):
            return re.sub(pattern, fused, name), part, dim
    for pattern, repl in _HF_RENAMES:
        name = re.sub(pattern, repl, name)
    return name, None, 0


class RawView:
    """The tensors of a checkpoint under their raw (released) names, whatever the layout on disk."""

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.layout = detect_layout(files.names())
        self._sources: dict[str, _Source] = {}
        if self.layout == "raw":
            self._sources = {n: _Source((n,)) for n in files.names()}
            return
        text_prefix = "model.language_model." if self.layout == "hf" else "model."
        pairs: dict[str, dict[int, str]] = {}
        dims: dict[str, int] = {}
        for stored in files.names():
            raw, part, dim = _hf_to_raw(stored, text_prefix)
            if part is None:
                self._add(raw, _Source((stored,), interleaved=False))
            else:
                if part in pairs.setdefault(raw, {}):
                    raise CheckpointError(f"tensors {pairs[raw][part]} and {stored} both map to {raw}")
                pairs[raw][part] = stored
                dims[raw] = dim
        for raw, parts in pairs.items():
            if set(parts) != {0, 1}:
                raise CheckpointError(
                    f"{raw}: found only {sorted(parts.values())}, expected a gate_proj and an up_proj tensor"
                )
            self._add(raw, _Source((parts[0], parts[1]), cat_dim=dims[raw], interleaved=False))

    def _add(self, raw: str, source: _Source) -> None:
        if raw in self._sources:
            raise CheckpointError(f"tensors {self._sources[raw].parts} and {source.parts} both map to {raw}")
        self._sources[raw] = source

    def names(self) -> list[str]:
        return sorted(self._sources)

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def stored_names(self, name: str) -> tuple[str, ...]:
        return self._sources[name].parts

    def interleaved(self, name: str) -> bool:
        return self._sources[name].interleaved

    def shape(self, name: str) -> tuple[int, ...]:
        src = self._sources[name]
        shapes = [self.files.shape(p) for p in src.parts]
        if len(shapes) == 1:
            return shapes[0]
        first = list(shapes[0])
        first[src.cat_dim] = sum(s[src.cat_dim] for s in shapes)
        return tuple(first)

    def dtype(self, name: str) -> torch.dtype:
        dtypes = {self.files.dtype(p) for p in self._sources[name].parts}
        if len(dtypes) != 1:
            raise CheckpointError(f"{name}: parts {self._sources[name].parts} have different dtypes {dtypes}")
        return dtypes.pop()

    def nbytes(self, name: str) -> int:
        return sum(self.files.nbytes(p) for p in self._sources[name].parts)

    def get(self, name: str) -> torch.Tensor:
        src = self._sources[name]
        tensors = [self.files.get(p) for p in src.parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=src.cat_dim)


# ----------------------------------------------------------------------------------------------------
# Gate/up interleaving


def deinterleave_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows [g0, u0, g1, u1, ...] along `dim` -> [g0, g1, ...; u0, u1, ...]."""
    n = x.shape[dim]
    if n % 2:
        raise CheckpointError(f"cannot de-interleave an odd number of rows ({n}) along dim {dim}")
    return x.unflatten(dim, (n // 2, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


def interleave_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `deinterleave_rows`: [gate; up] along `dim` -> alternating rows."""
    n = x.shape[dim]
    if n % 2:
        raise CheckpointError(f"cannot interleave an odd number of rows ({n}) along dim {dim}")
    return x.unflatten(dim, (2, n // 2)).transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


def _interleave_dim(name: str) -> int | None:
    if name.endswith("mlp.w13_dn.weight"):
        return 0
    if name.endswith(
        ("mlp.experts.w13_weight", "mlp.experts.w13_weight.scale", "mlp.shared_experts.shared_w13_weight")
    ):
        return 1
    return None


# ----------------------------------------------------------------------------------------------------
# Expected tensors


def layer_tensor_shapes(
    text: TextConfig, sliding: bool, dense: bool, rel_extent: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Logical shapes of one decoder layer (trunk layer or MTP transformer block), raw names, no prefix."""
    g = text.geometry(sliding)
    h, k = text.hidden_size, text.conv_kernel_size
    shapes = {
        "attn_norm.weight": (h,),
        "mlp_norm.weight": (h,),
        "attn.wq_du.weight": (g.q_width, h),
        "attn.wk_dv.weight": (g.kv_width, h),
        "attn.wv_dv.weight": (g.kv_width, h),
        "attn.wr_du.weight": (g.num_heads * text.d_rel, h),
        "attn.wo_ud.weight": (h, g.q_width),
        "attn.q_norm.weight": (g.head_dim,),
        "attn.k_norm.weight": (g.head_dim,),
        "attn.k_sconv.weight": (g.kv_width, 1, k),
        "attn.v_sconv.weight": (g.kv_width, 1, k),
        "attn.rel_logits_proj.proj": (text.d_rel, rel_extent or g.rel_extent),
        "attn_sconv.weight": (h, 1, k),
        "mlp_sconv.weight": (h, 1, k),
    }
    if dense:
        d = text.dense_intermediate_size
        shapes |= {"mlp.w13_dn.weight": (2 * d, h), "mlp.w2_md.weight": (h, d), "mlp.global_scale": (1,)}
    else:
        e, s, i = text.n_routed_experts, text.n_shared_experts, text.moe_intermediate_size
        shapes |= {
            "mlp.gate.weight": (e + s, h),
            "mlp.gate.bias": (e,),
            "mlp.gate.global_scale": (1,),
            "mlp.experts.w13_weight": (e, 2 * i, h),
            "mlp.experts.w2_weight": (e, h, i),
            "mlp.shared_experts.shared_w13_weight": (s, 2 * i, h),
            "mlp.shared_experts.shared_w2_weight": (s, h, i),
        }
    return shapes


def decoder_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shapes of every decoder tensor, in-memory names (prefix `model.llm.` stripped)."""
    t = config.text
    shapes = {
        "embed.weight": (t.vocab_size, t.hidden_size),
        "embed_norm.weight": (t.hidden_size,),
        "norm.weight": (t.hidden_size,),
        "unembed.weight": (t.vocab_size, t.hidden_size),
    }
    for i in range(t.num_layers):
        for key, shape in layer_tensor_shapes(t, t.sliding_layers[i], t.dense_layers[i]).items():
            shapes[f"layers.{i}.{key}"] = shape
    return shapes


def mtp_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shapes of every MTP tensor (prefix `model.mtp.` stripped); empty without an mtp config."""
    t, m = config.text, config.mtp
    if m is None:
        return {}
    h = t.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for d in range(m.num_layers):
        sliding = m.sliding_layers[d]
        shapes |= {
            f"layers.{d}.hidden_norm.weight": (h,),
            f"layers.{d}.embed_norm.weight": (h,),
            f"layers.{d}.input_proj.weight": (h, 2 * h),
        }
        block = layer_tensor_shapes(t, sliding, dense=True, rel_extent=m.window if sliding else None)
        shapes |= {f"layers.{d}.transformer_block.{k}": v for k, v in block.items()}
    if m.chain_hidden_post_norm:
        shapes["chain_norm.weight"] = (h,)
    return shapes


# ----------------------------------------------------------------------------------------------------
# Quantization config


@dataclass(frozen=True)
class QuantConfig:
    algo: str
    exclude_modules: tuple[str, ...]

    def excludes(self, name: str) -> bool:
        """Dot-boundary prefix match of a raw tensor name against the exclude list."""
        return any(name == p or name.startswith(p + ".") for p in self.exclude_modules)


def read_quant_config(directory: str | Path, config: ModelConfig | None = None) -> QuantConfig | None:
    """`hf_quant_config.json` (else config.json `quantization_config`, flat or nested); None if absent."""
    directory = Path(directory)
    path = directory / QUANT_FILE
    if path.exists():
        where = QUANT_FILE
        try:
            block = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
    else:
        raw = config.raw if config is not None else {}
        block = raw.get("quantization_config")
        where = "config.json quantization_config"
        if block is None:
            return None
    if not isinstance(block, dict):
        raise CheckpointError(f"{where}: expected an object")
    block = block.get("quantization", block)
    algo = block.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "NVFP4":
        raise CheckpointError(f"{where}: quant_algo={algo!r} is not supported (only NVFP4)")
    kv = block.get("kv_cache_quant_algo")
    if kv is not None and not (isinstance(kv, str) and kv.strip().lower() in ("", "none")):
        raise CheckpointError(f"{where}: kv_cache_quant_algo={kv!r} is not supported (KV cache quantization)")
    group = block.get("group_size", BLOCK_SIZE)
    if group != BLOCK_SIZE:
        raise CheckpointError(f"{where}: group_size={group!r} is not supported (only {BLOCK_SIZE})")
    exclude = block.get("exclude_modules") or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise CheckpointError(f"{where}: exclude_modules must be a list of strings")
    return QuantConfig(algo="NVFP4", exclude_modules=tuple(exclude))


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
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=f"loading {self.what}", disable=not show
        ) as bar:
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
            problems.append(f"{len(missing)} missing: {_name_list(missing)}")
        if self.report.unexpected:
            problems.append(f"{len(self.report.unexpected)} unexpected: {_name_list(self.report.unexpected)}")
        if problems:
            raise CheckpointError(f"{self.what} ({self.report.layout} layout): " + "; ".join(problems))
        return self.report


def _float_transform(
    raw: str, dtype: torch.dtype, interleaved: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    target = torch.float32 if raw.endswith(_FP32_SUFFIXES) else dtype
    dim = _interleave_dim(raw) if interleaved else None

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
    return raw in view and (
        view.dtype(raw) == torch.uint8 or raw + ".scale" in view or raw + ".scale2" in view
    )


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
        if key.endswith(_ROUTED) and _is_nvfp4(view, raw):
            if quant is not None and quant.excludes(raw):
                raise CheckpointError(f"tensor {raw} is NVFP4 but its quantization config excludes it")
            _nvfp4_stack(loader, raw, shape, plan, key)
            nvfp4_layers.append(int(key.split(".")[1]))
            continue
        if raw not in view:
            missing.append(raw)
            continue
        if key.endswith(_ROUTED) and quant is not None and not quant.excludes(raw):
            raise CheckpointError(
                f"tensor {raw} is {view.dtype(raw)} but the quantization config does not exclude "
                f"it (expected NVFP4)"
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
    if (
        name.startswith(LLM)
        and name.endswith(".input_amax")
        and name[: -len(".input_amax")].endswith(_ROUTED)
    ):
        return "NVFP4 activation calibration (weight-only inference)"
    return None


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
    view = RawView(files)
    quant = read_quant_config(files.directory, config)
    loader = _Loader(view, device, progress, "decoder weights")
    plan: dict = {}
    missing: list[str] = []
    nvfp4 = _plan_stack(loader, LLM, decoder_tensor_shapes(config), dtype, quant, plan, missing)
    loader.commit(plan)
    loader.report.nvfp4_layers = tuple(nvfp4)
    report = loader.finish(missing, _decoder_ignore)
    return loader.read_all(plan), report


def load_mtp_weights(
    files: CheckpointFiles,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The MTP drafter's weights (prefix `model.mtp.` stripped, w13 de-interleaved); all bf16 in releases."""
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
    report = loader.finish(missing, ignore)
    return loader.read_all(plan), report


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
        shapes: dict[str, tuple[int, ...] | None] = {
            f"layers.linear_{i}.weight": None for i in range(v.num_layers)
        }
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
    expected = (
        _tower_shapes(config, prefix)
        if config is not None
        else {k: None for k in present if pattern.match(k)}
    )
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
    groups = Counter(
        next((p for p in (LLM, VISUAL, AUDIO, MTP) if n.startswith(p)), "other") for n in view.names()
    )
    lines.append("groups: " + ", ".join(f"{g.rstrip('.')} {c}" for g, c in sorted(groups.items())))
    nvfp4 = sorted(
        {
            int(n.split(".")[3])
            for n in view.names()
            if n.startswith(LLM + "layers.") and n.endswith(_ROUTED) and _is_nvfp4(view, n)
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
