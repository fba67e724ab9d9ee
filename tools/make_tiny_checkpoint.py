"""`inkling-epd make-tiny DIR [--nvfp4] [--seed N]`: a small random checkpoint in the exact RELEASED layout.

What is written (spec/inkling-text.md 6.1-6.6, spec/inkling-multimodal.md 1.5 and 2.4):
- `config.json`: multimodal (`inkling_mm_model`) with the raw `text_config` keys, release flags, top-level
  `eos_token_id`, `vision_config`, `audio_config`, `mtp_config`;
- `processor_config.json`: image processor (patch size), 16 kHz feature extractor, dMel grid;
- `model.safetensors.index.json` + `model-00001-of-00002.safetensors`, `model-00002-of-00002.safetensors`:
  `model.llm.*` (interleaved w13 everywhere), `model.visual.*`, `model.audio.*`;
- `mtp.safetensors`: `model.mtp.*`, deliberately NOT listed in the index (as in Inkling-Small bf16);
- with `--nvfp4`: routed experts of every MoE layer after the first in NVFP4 (+ sidecars) and
  `hf_quant_config.json` whose exclude list uses raw names (including the first MoE layer's experts).

The layers are tiny; the vocabulary is the real one (201024 rows) so the real tokenizer works.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.checkpoint_files import INDEX_FILE
from common.checkpoint_layout import QUANT_FILE, decoder_tensor_shapes, interleave_rows, mtp_tensor_shapes
from common.config import parse_model_config
from common.nvfp4 import BLOCK_SIZE, pack_nvfp4

TEXT_CONFIG = {
    "vocab_size": 201024,
    "unpadded_vocab_size": 200058,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 16,
    "d_rel": 4,
    "rel_extent": 32,
    "log_scaling_n_floor": 24,
    "log_scaling_alpha": 0.1,
    "local_layer_ids": [0, 1, 2, 3, 4],
    "dense_mlp_idx": 2,
    "dense_intermediate_size": 96,
    "intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "route_scale": 8.0,
    "logits_mup_width_multiplier": 24.0,
    "rms_norm_eps": 1e-6,
    "rms_norm_eps_moe_gate": 1e-6,
    "sconv_kernel_size": 4,
    "model_max_length": 1048576,
    "hidden_act": "silu",
    "use_embed_norm": True,
    "use_sconv": True,
    "use_gate_bias": True,
    "use_global_scale": True,
    "shared_expert_sink": True,
    "norm_after_topk": True,
    "inference_moe_w13_interleaved": True,
    "gate_activation": "sigmoid",
    "q_bias": False,
    "o_bias": False,
    "final_logit_softcapping": None,
    "torch_dtype": "bfloat16",
}
# (P, T, L) = (8, 2, 3): HF and SGLang/vLLM build the same hMLP plan for it (multimodal spec 2.6).
VISION_CONFIG = {
    "vision_encoder_type": "hmlp",
    "patch_size": 8,
    "temporal_patch_size": 2,
    "n_channels": 3,
    "n_layers": 3,
    "use_vision_norm": True,
}
AUDIO_CONFIG = {
    "n_mel_bins": 80,
    "mel_vocab_size": 16,
    "dmel_min_value": -7.0,
    "dmel_max_value": 2.0,
    "use_audio_norm": True,
    "audio_mode": "dmel",
}
MTP_CONFIG = {"num_nextn_predict_layers": 2, "chain_hidden_post_norm": False, "local_layer_ids": [0]}
EOS_TOKEN_ID = 200006
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_BLOCKS = ("vision_config", "audio_config", "mtp_config")


def raw_config(**overrides) -> dict:
    """The released-style config.json; `overrides` replace text_config keys, or merge into a named block."""
    text = copy.deepcopy(TEXT_CONFIG)
    blocks = {
        "vision_config": dict(VISION_CONFIG),
        "audio_config": dict(AUDIO_CONFIG),
        "mtp_config": copy.deepcopy(MTP_CONFIG),
    }
    for key, value in overrides.items():
        if key in _BLOCKS:
            if not isinstance(value, dict):
                raise ValueError(f"override {key}: expected a dict, got {type(value).__name__}")
            blocks[key].update(value)
        elif key in text:
            text[key] = value
        else:
            raise ValueError(f"override {key!r} is not a text_config key nor one of {_BLOCKS}")
    for block in ("vision_config", "audio_config"):
        blocks[block]["decoder_dmodel"] = text["hidden_size"]
    return {
        "model_type": "inkling_mm_model",
        "architectures": ["InklingForConditionalGeneration"],
        "eos_token_id": EOS_TOKEN_ID,
        "image_token_id": 200054,
        "audio_token_id": 200053,
        "image_bos_token_id": 200005,
        "audio_bos_token_id": 200020,
        "text_config": text,
        **blocks,
        "torch_dtype": "bfloat16",
    }


def processor_config(raw: dict) -> dict:
    vision, audio = raw["vision_config"], raw["audio_config"]
    patch = vision["patch_size"]
    return {
        "processor_class": "InklingProcessor",
        "image_processor": {
            "image_processor_type": "InklingImageProcessor",
            "size": {"height": patch, "width": patch},
            "rescale_image_frac": 2.0,
            "rescale_image_max_upscaled_long_edge": 2048,
            "do_convert_rgb": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": _CLIP_MEAN,
            "image_std": _CLIP_STD,
            "resample": 1,
        },
        "feature_extractor": {
            "feature_extractor_type": "InklingFeatureExtractor",
            "feature_size": audio["n_mel_bins"],
            "sampling_rate": 16000,
            "padding_value": 0.0,
            "audio_token_duration_s": 0.05,
            "window_size_multiplier": 2.0,
        },
        "image_token": "<|unused_200054|>",
        "audio_token": "<|unused_200053|>",
        "image_bos_token": "<|content_image|>",
        "audio_bos_token": "<|content_audio_input|>",
        "num_dmel_bins": audio["mel_vocab_size"],
        "dmel_min_value": audio["dmel_min_value"],
        "dmel_max_value": audio["dmel_max_value"],
    }


# ----------------------------------------------------------------------------------------------------
# Shapes of the towers


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def hmlp_linear_shapes(patch: int, temporal: int, n_layers: int, channels: int, out_dim: int) -> list[tuple]:
    """[out, in] of each hMLP linear, from the SGLang/vLLM scale plan (multimodal spec 2.1-2.2)."""

    def up64(x: int) -> int:
        return -(-x // 64) * 64

    scales = [(1, 1, 1, channels)]
    h = 1
    for f in reversed(_prime_factors(patch)):
        h *= f
        scales.append((1, h, h, up64(h * h * channels)))
    t = 1
    for f in reversed(_prime_factors(temporal)):
        t *= f
        scales.append((t, patch, patch, up64(patch * patch * channels * t)))
    total = math.log(patch * patch * temporal * channels)
    ideal = [i * total / n_layers for i in range(n_layers + 1)]
    log_size = [math.log(s[0] * s[1] * s[2]) for s in scales]

    def cost(row: int, col: int) -> float:
        return abs(ideal[row] - log_size[col])

    if n_layers >= len(scales):
        pick = [min(range(len(scales)), key=lambda c, r=r: cost(r, c)) for r in range(n_layers + 1)]
    else:  # distinct columns; for this 1-D cost the optimal assignment is monotone
        pick = list(
            min(
                combinations(range(len(scales)), n_layers + 1),
                key=lambda cols: sum(cost(r, c) for r, c in enumerate(cols)),
            )
        )
    pick[0], pick[-1] = 0, len(scales) - 1
    plan = [scales[i] for i in pick]
    shapes = []
    for i, (a, b) in enumerate(zip(plan[:-1], plan[1:], strict=True)):
        fold = (b[0] // a[0]) * (b[1] // a[1]) ** 2
        shapes.append((out_dim if i == n_layers - 1 else b[3], a[3] * fold))
    return shapes


def tower_tensor_shapes(raw: dict) -> dict[str, tuple[int, ...]]:
    """Raw names and shapes of the vision and audio tower tensors."""
    v, a = raw["vision_config"], raw["audio_config"]
    d = raw["text_config"]["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    linears = hmlp_linear_shapes(v["patch_size"], v["temporal_patch_size"], v["n_layers"], v["n_channels"], d)
    for i, (out, inp) in enumerate(linears):
        shapes[f"model.visual.layers.linear_{i}.weight"] = (out, inp)
        if i < len(linears) - 1:
            shapes[f"model.visual.layers.norm_{i}.weight"] = (out,)
    shapes["model.visual.final_norm.weight"] = (d,)
    shapes["model.audio.encoder.weight"] = (a["n_mel_bins"] * a["mel_vocab_size"], d)
    shapes["model.audio.final_norm.weight"] = (d,)
    return shapes


# ----------------------------------------------------------------------------------------------------
# Random values


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A value for one raw tensor, fp32, chosen so every code path is exercised (norms away from 1, etc.)."""
    randn = torch.randn(shape, generator=gen)
    if name.endswith("gate.bias"):
        return 0.1 * randn
    if name.endswith("global_scale"):
        return 0.5 + torch.rand(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.3 * randn
    if "sconv" in name:
        return 0.3 * randn
    if name.endswith("rel_logits_proj.proj"):
        return 0.5 * randn
    if name.endswith(("embed.weight", "unembed.weight", "audio.encoder.weight")):
        return 0.02 * randn
    return randn / math.sqrt(shape[-1])  # linear weights: unit-variance outputs


def random_tensors(raw: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the released layout (bf16, gate/bias/global_scale of routers fp32), w13 interleaved."""
    config = parse_model_config(raw)
    shapes = {"model.llm." + k: v for k, v in decoder_tensor_shapes(config).items()}
    shapes |= tower_tensor_shapes(raw)
    shapes |= {"model.mtp." + k: v for k, v in mtp_tensor_shapes(config).items()}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        value = _random(name, shapes[name], gen)
        fp32 = name.endswith(("mlp.gate.bias", "mlp.gate.global_scale"))
        out[name] = value.to(torch.float32 if fp32 else torch.bfloat16)
    return out


# ----------------------------------------------------------------------------------------------------
# Writing (shared with tests/reference/released_layout.py)


def quantize_routed(
    tensors: dict[str, torch.Tensor], layers: Sequence[int], gen: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Replace the routed stacks of `layers` by NVFP4: packed + .scale/.scale2/.input_amax/.original_shape."""
    out = dict(tensors)
    for layer in layers:
        for stack in ("w13_weight", "w2_weight"):
            name = f"model.llm.layers.{layer}.mlp.experts.{stack}"
            if name not in out:
                raise KeyError(f"cannot quantize {name}: no such tensor")
            w = out.pop(name)
            packed, scale, scale2 = pack_nvfp4(w.float())
            amax = 1.0 + torch.rand((1,), generator=gen) if gen is not None else torch.ones(1)
            out |= {
                name: packed,
                f"{name}.scale": scale,
                f"{name}.scale2": scale2.float(),
                f"{name}.input_amax": amax.to(torch.bfloat16),
                f"{name}.original_shape": torch.tensor(list(w.shape), dtype=torch.int64),
            }
    return out


def quant_exclude_modules(names: Sequence[str], quantized_layers: Sequence[int]) -> list[str]:
    """The raw-name module prefixes of every unquantized module, structured like the released exclude list."""
    quantized = {f"model.llm.layers.{i}.mlp.experts" for i in quantized_layers}
    modules = set()
    for name in names:
        if name.startswith("model.mtp."):
            continue  # released files do not list the MTP block although it is bf16
        parts = name.split(".")
        if name.startswith("model.llm.layers."):
            depth = 6 if parts[4] == "mlp" else 5  # model.llm.layers.N.attn / model.llm.layers.N.mlp.gate
            module = ".".join(parts[:depth])
        else:
            module = ".".join(parts[:-1])
        if module not in quantized:
            modules.add(module)
    if any(n.startswith("model.audio.") for n in names):
        modules.add("model.audio.decoder")  # present in the released list, matches no tensor
    return sorted(modules)


def hf_quant_config(exclude: Sequence[str]) -> dict:
    quantizer = {
        "num_bits": [2, 1],
        "block_sizes": {"-1": BLOCK_SIZE, "type": "dynamic", "scale_bits": [4, 3]},
        "axis": None,
        "enable": True,
    }
    return {
        "producer": {"name": "modelopt", "version": "tiny"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": "none",
            "group_size": BLOCK_SIZE,
            "exclude_modules": list(exclude),
            "modelopt_quant_config": {
                "algorithm": "max",
                "quant_cfg": {
                    "*weight_quantizer": quantizer,
                    "*input_quantizer": dict(quantizer),
                    "default": {"enable": False},
                },
            },
        },
    }


def write_checkpoint_files(
    out_dir: str | Path,
    raw: dict,
    tensors: dict[str, torch.Tensor],
    nvfp4_layers: Sequence[int] = (),
    n_shards: int = 2,
) -> Path:
    """Write configs, index + shards, mtp.safetensors (unindexed) and, if quantized, hf_quant_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if nvfp4_layers:
        exclude = quant_exclude_modules(list(tensors), nvfp4_layers)
        (out / QUANT_FILE).write_text(json.dumps(hf_quant_config(exclude), indent=2) + "\n")
    model = sorted(n for n in tensors if not n.startswith("model.mtp."))
    mtp = sorted(n for n in tensors if n.startswith("model.mtp."))
    per_shard = -(-len(model) // n_shards)
    weight_map, total = {}, 0
    for i in range(n_shards):
        file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in model[i * per_shard : (i + 1) * per_shard]}
        save_file(chunk, str(out / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in chunk}
        total += sum(t.numel() * t.element_size() for t in chunk.values())
    if mtp:
        save_file({n: tensors[n].contiguous() for n in mtp}, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if raw.get("vision_config") and raw.get("audio_config"):
        (out / "processor_config.json").write_text(json.dumps(processor_config(raw), indent=2) + "\n")
    # safetensors writes 0600: make everything world-readable so a container user (uid 10001) can mount it.
    out.chmod(0o755)
    for path in out.iterdir():
        path.chmod(0o644)
    return out


def make_tiny_checkpoint(out_dir: str | Path, nvfp4: bool = False, seed: int = 0, **overrides) -> Path:
    """Write a random tiny checkpoint in the released layout; identical output for identical arguments."""
    raw = raw_config(**overrides)
    config = parse_model_config(raw)
    tensors = random_tensors(raw, seed)
    # Interleave like a real export: draw [gate; up] then store rows alternating.
    for name in list(tensors):
        if name.endswith("mlp.w13_dn.weight"):
            tensors[name] = interleave_rows(tensors[name], 0)
        elif name.endswith(("experts.w13_weight", "shared_w13_weight")):
            tensors[name] = interleave_rows(tensors[name], 1)
    moe_layers = [i for i, dense in enumerate(config.text.dense_layers) if not dense]
    quantized = moe_layers[1:] if nvfp4 else []
    if quantized:
        tensors = quantize_routed(tensors, quantized, torch.Generator().manual_seed(seed + 1))
    return write_checkpoint_files(out_dir, raw, tensors, quantized)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inkling-epd make-tiny", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--nvfp4", action="store_true", help="NVFP4 routed experts after the first MoE layer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(args.out_dir, nvfp4=args.nvfp4, seed=args.seed)
    print(f"wrote tiny checkpoint to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
