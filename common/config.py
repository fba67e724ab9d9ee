"""Checkpoint config dialects -> one frozen, validated `ModelConfig`.

Two dialects are read (spec/inkling-text.md section 1):
- the RELEASED multimodal `config.json` (`model_type: "inkling_mm_model"`, raw keys such as `dense_mlp_idx`,
  `dense_intermediate_size`, `sconv_kernel_size`, `local_layer_ids`, a top-level `mtp_config` and `eos_token_id`);
- an HF-saved config (transformers naming: `layer_types`, `mlp_layer_types`, `moe_intermediate_size`,
  `conv_kernel_size`, `num_mtp_layers`, ...), multimodal or text-only.

Everything downstream reads only `ModelConfig`; no other module looks at config.json keys.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError

IMAGE_TOKEN_ID = 200054
AUDIO_TOKEN_ID = 200053
IMAGE_BOS_TOKEN_ID = 200005
AUDIO_BOS_TOKEN_ID = 200020
DEFAULT_EOS_TOKEN_ID = 200006


@dataclass(frozen=True)
class AttentionGeometry:
    """Head layout of one layer kind (sliding and global layers differ)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rel_extent: int  # R: number of backward distances with a relative bias
    window: int | None  # sliding window W (self + W-1 previous tokens); None for global layers
    log_scaling: bool  # tau log-scaling applies (global layers with n_floor set)

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    unpadded_vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    swa_num_heads: int
    swa_num_kv_heads: int
    swa_head_dim: int
    sliding_window: int
    d_rel: int
    rel_extent: int
    log_scaling_n_floor: int | None
    log_scaling_alpha: float
    sliding_layers: tuple[bool, ...]  # per layer: True = sliding, False = global
    dense_layers: tuple[bool, ...]  # per layer: True = dense MLP, False = MoE
    dense_intermediate_size: int  # Id
    moe_intermediate_size: int  # I (routed and shared experts)
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    route_scale: float
    mup_multiplier: float
    rms_norm_eps: float
    conv_kernel_size: int
    max_position_embeddings: int

    def geometry(self, sliding: bool) -> AttentionGeometry:
        if sliding:
            return AttentionGeometry(
                self.swa_num_heads,
                self.swa_num_kv_heads,
                self.swa_head_dim,
                self.sliding_window,
                self.sliding_window,
                False,
            )
        return AttentionGeometry(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.rel_extent,
            None,
            self.log_scaling_n_floor is not None,
        )

    def layer_geometry(self, layer: int) -> AttentionGeometry:
        return self.geometry(self.sliding_layers[layer])


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int
    temporal_patch_size: int
    num_channels: int
    num_layers: int
    output_dim: int  # decoder_dmodel (= text hidden size)
    use_norm: bool
    hf_compat_plan: bool = False  # reproduce HF's temporal-channel formula (spec multimodal 2.1 step 3)


@dataclass(frozen=True)
class AudioConfig:
    n_mel_bins: int
    mel_vocab_size: int
    dmel_min_value: float
    dmel_max_value: float
    output_dim: int
    use_norm: bool


@dataclass(frozen=True)
class MtpConfig:
    num_layers: int
    chain_hidden_post_norm: bool
    sliding_layers: tuple[bool, ...]
    window: int


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None
    audio: AudioConfig | None
    mtp: MtpConfig | None
    eos_token_ids: tuple[int, ...]
    image_token_id: int = IMAGE_TOKEN_ID
    audio_token_id: int = AUDIO_TOKEN_ID
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def fingerprint_fields(self) -> dict:
        """The config as plain data, for fingerprints (hashing) and `inspect`."""
        return _plain(self.raw)


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True))


# ---------------------------------------------------------------------------------------------------------------
# Parsing


# Release flags that we assert instead of implementing other branches (spec 1.2).
_REQUIRED_TRUE = (
    "use_embed_norm",
    "use_sconv",
    "use_gate_bias",
    "use_global_scale",
    "shared_expert_sink",
    "norm_after_topk",
    "inference_moe_w13_interleaved",
)
_REQUIRED_FALSE = ("q_bias", "o_bias")


class _Reader:
    """Reads one config block, remembering the block name so errors name the field exactly."""

    def __init__(self, block: dict, where: str):
        if not isinstance(block, dict):
            raise ConfigError(f"{where}: expected an object, got {type(block).__name__}")
        self.block = block
        self.where = where

    def has(self, *keys: str) -> bool:
        return any(k in self.block and self.block[k] is not None for k in keys)

    def get(self, *keys: str, default: Any = ...) -> Any:
        for k in keys:
            if k in self.block and self.block[k] is not None:
                return self.block[k]
        if default is ...:
            raise ConfigError(f"{self.where}: missing required field {' / '.join(keys)!r}")
        return default

    def int(self, *keys: str, default: Any = ..., minimum: int = 1) -> int:
        value = self.get(*keys, default=default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.where}.{keys[0]}: expected an integer >= {minimum}, got {value!r}")
        return value

    def float(self, *keys: str, default: Any = ..., positive: bool = True) -> float:
        value = self.get(*keys, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.where}.{keys[0]}: expected a finite number, got {value!r}")
        if positive and value <= 0:
            raise ConfigError(f"{self.where}.{keys[0]}: expected a positive number, got {value!r}")
        return float(value)

    def int_list(self, key: str) -> list[int]:
        value = self.block[key]
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{self.where}.{key}: expected a list of integers, got {value!r}")
        return value


def _check_release_flags(r: _Reader) -> None:
    for flag in _REQUIRED_TRUE:
        if flag in r.block and r.block[flag] is not True:
            raise ConfigError(f"{r.where}.{flag}={r.block[flag]!r} is not supported (only true)")
    for flag in _REQUIRED_FALSE:
        if flag in r.block and r.block[flag] not in (False, None):
            raise ConfigError(f"{r.where}.{flag}={r.block[flag]!r} is not supported (only false)")
    if r.block.get("gate_activation", "sigmoid") != "sigmoid":
        raise ConfigError(f"{r.where}.gate_activation={r.block['gate_activation']!r} is not supported (only sigmoid)")
    if r.block.get("final_logit_softcapping") is not None:
        raise ConfigError(f"{r.where}.final_logit_softcapping={r.block['final_logit_softcapping']!r} is not supported")
    if r.block.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{r.where}.hidden_act={r.block['hidden_act']!r} is not supported (only silu)")


def _layer_kinds(r: _Reader, n_layers: int) -> tuple[bool, ...]:
    """Sliding (True) or global (False) per layer (spec 1.4)."""
    if r.has("layer_types"):
        kinds = r.get("layer_types")
        if not isinstance(kinds, list) or len(kinds) != n_layers:
            raise ConfigError(f"{r.where}.layer_types: expected {n_layers} entries, got {kinds!r}")
        allowed = {"hybrid_sliding": True, "hybrid": False, "sliding_attention": True, "full_attention": False}
        for k in kinds:
            if k not in allowed:
                raise ConfigError(f"{r.where}.layer_types: unknown layer type {k!r}")
        return tuple(allowed[k] for k in kinds)
    if r.has("local_layer_ids"):
        ids = r.int_list("local_layer_ids")
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(f"{r.where}.local_layer_ids: out of range for {n_layers} layers: {bad}")
        return tuple(i in set(ids) for i in range(n_layers))
    return tuple((i + 1) % 6 != 0 for i in range(n_layers))


def _mlp_kinds(r: _Reader, n_layers: int) -> tuple[bool, ...]:
    """Dense (True) or MoE (False) per layer."""
    if r.has("mlp_layer_types"):
        kinds = r.get("mlp_layer_types")
        if not isinstance(kinds, list) or len(kinds) != n_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ConfigError(f"{r.where}.mlp_layer_types: expected {n_layers} of 'dense'/'sparse', got {kinds!r}")
        return tuple(k == "dense" for k in kinds)
    dense_idx = r.int("dense_mlp_idx", default=0, minimum=0)
    return tuple(i < dense_idx for i in range(n_layers))


def _intermediate_sizes(r: _Reader) -> tuple[int, int]:
    """(Id, I) with the raw/HF naming swap resolved (spec 1.3)."""
    if r.has("dense_intermediate_size"):
        return r.int("dense_intermediate_size"), r.int("intermediate_size")
    if r.has("moe_intermediate_size"):
        return r.int("intermediate_size"), r.int("moe_intermediate_size")
    size = r.int("intermediate_size")
    return size, size


def parse_text_config(block: dict, where: str = "text_config") -> TextConfig:
    r = _Reader(block, where)
    _check_release_flags(r)
    n_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    num_heads = r.int("num_attention_heads")
    num_kv = r.int("num_key_value_heads")
    head_dim = r.int("head_dim", default=hidden // num_heads)
    dense_id, moe_i = _intermediate_sizes(r)
    vocab = r.int("vocab_size")
    unpadded = r.int("unpadded_vocab_size", default=vocab)
    if unpadded > vocab:
        raise ConfigError(f"{where}.unpadded_vocab_size={unpadded} exceeds vocab_size={vocab}")
    n_floor = r.get("log_scaling_n_floor", default=None)
    if n_floor is not None:
        n_floor = r.int("log_scaling_n_floor")
    cfg = TextConfig(
        vocab_size=vocab,
        unpadded_vocab_size=unpadded,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        swa_num_heads=r.int("swa_num_attention_heads", default=num_heads),
        swa_num_kv_heads=r.int("swa_num_key_value_heads", default=num_kv),
        swa_head_dim=r.int("swa_head_dim", default=head_dim),
        sliding_window=r.int("sliding_window_size", "sliding_window"),
        d_rel=r.int("d_rel"),
        rel_extent=r.int("rel_extent"),
        log_scaling_n_floor=n_floor,
        log_scaling_alpha=r.float("log_scaling_alpha", default=0.1, positive=False),
        sliding_layers=_layer_kinds(r, n_layers),
        dense_layers=_mlp_kinds(r, n_layers),
        dense_intermediate_size=dense_id,
        moe_intermediate_size=moe_i,
        n_routed_experts=r.int("n_routed_experts", "num_local_experts"),
        num_experts_per_tok=r.int("num_experts_per_tok"),
        n_shared_experts=r.int("n_shared_experts", minimum=0),
        route_scale=r.float("route_scale"),
        mup_multiplier=r.float("logits_mup_width_multiplier", "embedding_multiplier"),
        rms_norm_eps=r.float("rms_norm_eps", default=1e-6),
        conv_kernel_size=r.int("sconv_kernel_size", "conv_kernel_size", default=4),
        max_position_embeddings=r.int("model_max_length", "max_position_embeddings", default=1048576),
    )
    for name, heads, kv in (
        ("num_attention_heads", cfg.num_heads, cfg.num_kv_heads),
        ("swa_num_attention_heads", cfg.swa_num_heads, cfg.swa_num_kv_heads),
    ):
        if heads % kv:
            raise ConfigError(f"{where}.{name}={heads} is not a multiple of its key/value head count {kv}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(f"{where}.num_experts_per_tok={cfg.num_experts_per_tok} exceeds n_routed_experts")
    return cfg


def _parse_vision(block: dict | None, hidden: int) -> VisionConfig | None:
    if not block:
        return None
    r = _Reader(block, "vision_config")
    if "decoder_dmodel" in block and block["decoder_dmodel"] is None:  # the tower is switched off
        return None
    encoder_type = r.get("vision_encoder_type", default="hmlp")
    if encoder_type != "hmlp":
        raise ConfigError(f"vision_config.vision_encoder_type={encoder_type!r} is not supported (only hmlp)")
    dmodel = r.int("decoder_dmodel", "text_hidden_size", default=hidden)
    if dmodel != hidden:
        raise ConfigError(f"vision_config.decoder_dmodel={dmodel} differs from text hidden_size={hidden}")
    return VisionConfig(
        patch_size=r.int("patch_size"),
        temporal_patch_size=r.int("temporal_patch_size"),
        num_channels=r.int("n_channels", "num_channels"),
        num_layers=r.int("n_layers", "num_hidden_layers"),
        output_dim=dmodel,
        use_norm=bool(r.get("use_vision_norm", default=True)),
    )


def _parse_audio(block: dict | None, hidden: int) -> AudioConfig | None:
    if not block:
        return None
    r = _Reader(block, "audio_config")
    if "decoder_dmodel" in block and block["decoder_dmodel"] is None:  # the tower is switched off
        return None
    mode = r.get("audio_mode", default="dmel")
    if mode != "dmel":
        raise ConfigError(f"audio_config.audio_mode={mode!r} is not supported (only dmel)")
    dmodel = r.int("decoder_dmodel", "text_hidden_size", default=hidden)
    if dmodel != hidden:
        raise ConfigError(f"audio_config.decoder_dmodel={dmodel} differs from text hidden_size={hidden}")
    lo = r.float("dmel_min_value", default=-7.0, positive=False)
    hi = r.float("dmel_max_value", default=2.0, positive=False)
    if not lo < hi:
        raise ConfigError(f"audio_config: dmel_min_value={lo} must be below dmel_max_value={hi}")
    return AudioConfig(
        n_mel_bins=r.int("n_mel_bins", "num_codebooks"),
        mel_vocab_size=r.int("mel_vocab_size", "codebook_size"),
        dmel_min_value=lo,
        dmel_max_value=hi,
        output_dim=dmodel,
        use_norm=bool(r.get("use_audio_norm", default=True)),
    )


def _parse_mtp(mtp_block: dict | None, text_block: dict, text: TextConfig) -> MtpConfig | None:
    if mtp_block:  # released layout: top-level mtp_config
        r = _Reader(mtp_block, "mtp_config")
        n = r.int("num_nextn_predict_layers", "n_layers", minimum=0)
        local = r.int_list("local_layer_ids") if r.has("local_layer_ids") else []
        chain = bool(r.get("chain_hidden_post_norm", default=False))
        window = r.int("local_extent", default=text.sliding_window)
    elif text_block.get("num_mtp_layers"):  # HF-saved: copied into the text config
        r = _Reader(text_block, "text_config")
        n = r.int("num_mtp_layers", minimum=0)
        local = r.int_list("mtp_local_layer_ids") if r.has("mtp_local_layer_ids") else []
        chain = bool(r.get("chain_hidden_post_norm", default=False))
        window = text.sliding_window
    else:
        return None
    if n == 0:
        return None
    bad = [i for i in local if not 0 <= i < n]
    if bad:
        raise ConfigError(f"mtp_config.local_layer_ids: out of range for {n} depths: {bad}")
    return MtpConfig(
        num_layers=n,
        chain_hidden_post_norm=chain,
        sliding_layers=tuple(i in set(local) for i in range(n)),
        window=window,
    )


def _eos_ids(value: Any, where: str) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{where}: expected a token id or a list of ids, got {value!r}")
    return tuple(ids)


def parse_model_config(raw: dict) -> ModelConfig:
    """Parse a config.json object in either dialect (released multimodal, HF multimodal, HF text-only)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json: expected a JSON object")
    model_type = raw.get("model_type")
    if "text_config" in raw:
        text_block = raw["text_config"]
        text = parse_text_config(text_block)
        # Only the top level carries the real EOS; the text config's eos (HF placeholder 2) is ignored.
        eos = _eos_ids(raw.get("eos_token_id", DEFAULT_EOS_TOKEN_ID), "eos_token_id")
        vision = _parse_vision(raw.get("vision_config"), text.hidden_size)
        audio = _parse_audio(raw.get("audio_config"), text.hidden_size)
        mtp = _parse_mtp(raw.get("mtp_config"), text_block, text)
        image_id = raw.get("image_token_id", IMAGE_TOKEN_ID)
        audio_id = raw.get("audio_token_id", AUDIO_TOKEN_ID)
    elif model_type in ("inkling_text", "inkling", None):
        text = parse_text_config(raw, "config")
        eos_value = raw.get("eos_token_id")
        # HF's text-only default (2) is a placeholder; a real Inkling vocabulary ends turns with 200006.
        if eos_value in (None, 2) and text.vocab_size > DEFAULT_EOS_TOKEN_ID:
            eos_value = DEFAULT_EOS_TOKEN_ID
        eos = _eos_ids(eos_value if eos_value is not None else DEFAULT_EOS_TOKEN_ID, "eos_token_id")
        vision = audio = None
        mtp = _parse_mtp(raw.get("mtp_config"), raw, text)
        image_id, audio_id = IMAGE_TOKEN_ID, AUDIO_TOKEN_ID
    else:
        raise ConfigError(f"config.json: model_type={model_type!r} is not an Inkling model")
    if model_type == "inkling2":
        raise ConfigError("config.json: model_type='inkling2' is a different architecture (not supported)")
    return ModelConfig(
        text=text,
        vision=vision,
        audio=audio,
        mtp=mtp,
        eos_token_ids=eos,
        image_token_id=image_id,
        audio_token_id=audio_id,
        raw=raw,
    )


def load_model_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"no config.json at {path}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from exc
    return parse_model_config(raw)
