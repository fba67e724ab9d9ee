"""Turn a `transformers` Inkling state dict into a RELEASED-layout checkpoint (spec/inkling-text.md 6.7).

Written independently of `common/checkpoint.py` (plain string renames, interleaving by stacking) so loader
tests compare two implementations of the name contract; `transformers.from_pretrained` verifies this one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from tools.make_tiny_checkpoint import quantize_routed, write_checkpoint_files

# HF layer-relative name -> raw layer-relative name (one tensor each).
_LAYER_RENAMES = {
    "self_attn.q_proj.weight": "attn.wq_du.weight",
    "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight",
    "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    "attn_sconv.conv1d.weight": "attn_sconv.weight",
    "mlp_sconv.conv1d.weight": "mlp_sconv.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.down_proj.weight": "mlp.w2_md.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
    "mlp.shared_experts.down_proj": "mlp.shared_experts.shared_w2_weight",
}
# (HF gate name, HF up name) -> (raw fused name, axis of the rows)
_LAYER_PAIRS = {
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"): ("mlp.w13_dn.weight", 0),
    ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"): (
        "mlp.shared_experts.shared_w13_weight",
        1,
    ),
}
_TOP_RENAMES = {
    "embed_tokens.weight": "model.llm.embed.weight",
    "embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
    "norm.weight": "model.llm.norm.weight",
}
_TOWER_RENAMES = {
    "model.vision_tower.final_norm.weight": "model.visual.final_norm.weight",
    "model.audio_tower.embed_audio_tokens.embed_audio_tokens.weight": "model.audio.encoder.weight",
    "model.audio_tower.norm.weight": "model.audio.final_norm.weight",
}
_VISION_LAYER = re.compile(r"^model\.vision_tower\.encoder_layers\.(\d+)\.(projection|layer_norm)\.weight$")
_TEXT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _alternate(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows g0, u0, g1, u1, ... along `dim`."""
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def hf_state_to_released(state: dict[str, torch.Tensor], text_only: bool = False) -> dict[str, torch.Tensor]:
    """HF `InklingForConditionalGeneration` (or `InklingForCausalLM` with text_only) state -> raw tensors.

    Every HF tensor must be mapped; an unknown name raises KeyError (so the mapping cannot silently drop one).
    """
    prefix = "model." if text_only else "model.language_model."
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}  # split gate/up halves waiting for their partner
    for name, value in state.items():
        value = value.detach().clone()
        if name == "lm_head.weight":
            out["model.llm.unembed.weight"] = value
        elif name in _TOWER_RENAMES:
            out[_TOWER_RENAMES[name]] = value
        elif match := _VISION_LAYER.match(name):
            kind = "linear" if match.group(2) == "projection" else "norm"
            out[f"model.visual.layers.{kind}_{match.group(1)}.weight"] = value
        elif name.startswith(prefix):
            rest = name[len(prefix) :]
            if rest in _TOP_RENAMES:
                out[_TOP_RENAMES[rest]] = value
                continue
            match = _TEXT_LAYER.match(rest)
            if match is None:
                raise KeyError(f"unmapped HF tensor {name}")
            layer, inner = f"model.llm.layers.{match.group(1)}.", match.group(2)
            if inner in _LAYER_RENAMES:
                out[layer + _LAYER_RENAMES[inner]] = value
            elif inner == "mlp.experts.gate_up_proj":  # [E, 2I, H] = [gate; up] along dim 1
                gate, up = value.chunk(2, dim=1)
                out[layer + "mlp.experts.w13_weight"] = _alternate(gate, up, 1)
            elif any(inner in pair for pair in _LAYER_PAIRS):
                pending[layer + inner] = value
            else:
                raise KeyError(f"unmapped HF tensor {name}")
        else:
            raise KeyError(f"unmapped HF tensor {name}")
    for key in list(pending):
        for (gate_name, up_name), (fused, dim) in _LAYER_PAIRS.items():
            if key.endswith("." + gate_name):
                layer = key[: -len(gate_name)]
                out[layer + fused] = _alternate(pending.pop(key), pending.pop(layer + up_name), dim)
    if pending:
        raise KeyError(f"gate/up halves without a partner: {sorted(pending)}")
    return out


def write_released_checkpoint(
    directory: str | Path,
    raw_config: dict,
    tensors: dict[str, torch.Tensor],
    nvfp4_layers: Sequence[int] = (),
    quantized_layers: Sequence[int] = (),
) -> Path:
    """Index + 2 shards (+ unindexed mtp.safetensors, + hf_quant_config.json when any layer is NVFP4).

    `nvfp4_layers`: routed stacks to quantize here with common.nvfp4; `quantized_layers`: stacks the caller
    already replaced by packed tensors and sidecars (only the quant config is written for them).
    """
    tensors = quantize_routed(tensors, nvfp4_layers) if nvfp4_layers else dict(tensors)
    layers = sorted(set(nvfp4_layers) | set(quantized_layers))
    return write_checkpoint_files(directory, raw_config, tensors, layers)
