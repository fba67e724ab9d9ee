"""Tiny random `transformers` Inkling models (the oracle) built from a RELEASED-style raw config dict."""

from __future__ import annotations

import torch

from tools.make_tiny_checkpoint import raw_config as tiny_raw_config


def raw_config(text_overrides: dict | None = None, vision: dict | None = None) -> dict:
    """The make-tiny released-style config (hidden 64, 6 layers, layer 5 global, window 16, rel_extent 32, tau from
    position 24, real vocabulary), with text_config keys and the vision block overridden."""
    blocks = {"vision_config": vision} if vision else {}
    return tiny_raw_config(**(text_overrides or {}), **blocks)


def hf_config(raw: dict):
    from transformers import InklingConfig

    vision = raw["vision_config"]
    audio = raw["audio_config"]
    return InklingConfig(
        text_config=dict(raw["text_config"]),
        vision_config={
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "num_channels": vision["n_channels"],
            "num_hidden_layers": vision["n_layers"],
        },
        audio_config={"n_mel_bins": audio["n_mel_bins"], "mel_vocab_size": audio["mel_vocab_size"]},
        image_token_id=raw["image_token_id"],
        audio_token_id=raw["audio_token_id"],
        eos_token_id=raw["eos_token_id"],
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random and non-trivial: norms and scales away from 1, convs and rel banks non-zero."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("global_scale"):
            value = 1.0 + 0.3 * torch.randn(shape, generator=gen)
        elif "sconv" in name:
            value = 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith("rel_logits_proj.proj"):
            value = 0.5 * torch.randn(shape, generator=gen)
        elif "embed_tokens.weight" in name and "audio" not in name:
            value = torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            value = torch.randn(shape, generator=gen) / fan_in**0.5
        p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build_hf_model(raw: dict, seed: int = 0):
    """An fp32 eager `InklingForConditionalGeneration` with random weights."""
    from transformers import InklingForConditionalGeneration

    config = hf_config(raw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(config).float().eval()
    randomize_(model, seed)
    return model
