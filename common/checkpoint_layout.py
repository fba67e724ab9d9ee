"""Checkpoint naming: raw vs HF-saved layouts seen through one raw-named view, gate/up interleaving, the
tensors a config expects, and the NVFP4 quantization config (spec/inkling-text.md 6.2-6.5)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.checkpoint_files import CheckpointFiles
from common.config import ModelConfig, TextConfig
from common.errors import CheckpointError
from common.nvfp4 import BLOCK_SIZE

QUANT_FILE = "hf_quant_config.json"
LLM, VISUAL, AUDIO, MTP = "model.llm.", "model.visual.", "model.audio.", "model.mtp."

# Kept in fp32 whatever the model dtype (router bias/scale feed fp32 routing; convs run in fp32 in HF).
FP32_SUFFIXES = (
    "mlp.gate.bias",
    "mlp.gate.global_scale",
    "attn.k_sconv.weight",
    "attn.v_sconv.weight",
    "attn_sconv.weight",
    "mlp_sconv.weight",
)
ROUTED_STACKS = ("mlp.experts.w13_weight", "mlp.experts.w2_weight")


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
    if name.startswith(text_prefix) and not name.startswith(("model.vision_tower.", "model.audio_tower.", MTP)):
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

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`get(name)` narrowed to `[start, stop)` along `dim`, reading only those rows of each stored part."""
        src = self._sources[name]
        if dim != src.cat_dim or len(src.parts) == 1:
            tensors = [self.files.read_slice(p, dim, start, stop) for p in src.parts]
            return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=src.cat_dim)
        pieces, offset = [], 0
        for p in src.parts:
            n = self.files.shape(p)[dim]
            a, b = max(start, offset), min(stop, offset + n)
            if a < b:
                pieces.append(self.files.read_slice(p, dim, a - offset, b - offset))
            offset += n
        return torch.cat(pieces, dim=dim)


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


def interleave_dim(name: str) -> int | None:
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
