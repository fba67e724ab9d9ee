"""Towers against HF transformers' Inkling towers (random weights, fp32 and bf16) and plans against HF's planner."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.models.inkling.configuration_inkling import InklingConfig
from transformers.models.inkling.modeling_inkling import InklingModel, plan_out_scales

from common.config import AudioConfig, VisionConfig, parse_model_config
from common.errors import CheckpointError, ConfigError
from encoder_service.towers import AudioTower, Scale, VisionTower, build_towers, fold, plan_scales

HIDDEN = 64
TINY_TEXT = dict(
    vocab_size=512,
    hidden_size=HIDDEN,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    swa_num_attention_heads=2,
    swa_num_key_value_heads=1,
    swa_head_dim=32,
    sliding_window_size=8,
    d_rel=4,
    rel_extent=8,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=2,
    num_experts_per_tok=1,
    n_shared_experts=1,
)


def _hf_model(P: int, T: int, L: int, seed: int = 0) -> InklingModel:
    config = InklingConfig(
        text_config=TINY_TEXT,
        vision_config=dict(patch_size=P, temporal_patch_size=T, num_channels=3, num_hidden_layers=L),
        audio_config=dict(n_mel_bins=80, mel_vocab_size=16),
    )
    model = InklingModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision_tower" in name or "audio_tower" in name:
                noise = torch.randn(param.shape, generator=gen)
                # norms away from 1; projections large enough that GELU is far from linear
                param.copy_(1.0 + 0.5 * noise if param.dim() == 1 else noise / param.shape[-1] ** 0.5)
    return model


def _vision_state(model: InklingModel) -> dict[str, torch.Tensor]:
    """HF names -> raw names without `model.visual.` (spec 2.4)."""
    state = {}
    for name, tensor in model.vision_tower.state_dict().items():
        name = name.replace("encoder_layers.", "layers.")
        for hf, raw in ((".projection.", "linear_"), (".layer_norm.", "norm_")):
            if hf in name:
                _, index, _ = name.split(".", 2)
                name = f"layers.{raw}{index}.weight"
        state[name] = tensor.clone()
    return state


def _audio_state(model: InklingModel) -> dict[str, torch.Tensor]:
    tower = model.audio_tower
    return {
        "encoder.weight": tower.embed_audio_tokens.embed_audio_tokens.weight.detach().clone(),
        "final_norm.weight": tower.norm.weight.detach().clone(),
    }


def _vision_config(P: int, T: int, L: int, hf_compat: bool = False) -> VisionConfig:
    return VisionConfig(
        patch_size=P,
        temporal_patch_size=T,
        num_channels=3,
        num_layers=L,
        output_dim=HIDDEN,
        use_norm=True,
        hf_compat_plan=hf_compat,
    )


AUDIO_CONFIG = AudioConfig(
    n_mel_bins=80, mel_vocab_size=16, dmel_min_value=-7.0, dmel_max_value=2.0, output_dim=HIDDEN, use_norm=True
)


# ---------------------------------------------------------------------------------------------------------------
# Plans


def test_small_profile_plan_matches_spec_table():
    assert plan_scales(2, 40, 4, 3) == [
        Scale(1, 1, 1, 3),
        Scale(1, 5, 5, 128),
        Scale(1, 10, 10, 320),
        Scale(1, 40, 40, 4800),
        Scale(2, 40, 40, 9600),
    ]


@pytest.mark.parametrize(
    "P,T,L",
    [
        (4, 2, 2),
        (4, 2, 3),
        (8, 2, 2),
        (8, 2, 3),
        (8, 2, 4),
        (10, 2, 3),
        (10, 2, 4),
        (20, 2, 4),
        (40, 2, 3),
        (40, 2, 4),
        (40, 2, 5),
        (40, 2, 6),
        (4, 1, 2),
        (6, 2, 2),
    ],
)
def test_plan_equals_hf_where_the_stacks_agree(P, T, L):
    # "agree" = same layer widths: the last scale's channel count is never used (the last layer outputs D)
    hf = [Scale(*(int(v) for v in row)) for row in plan_out_scales(T, P, L, 3)]
    ours = plan_scales(T, P, L, 3)
    assert ours[:-1] == hf[:-1] and ours[-1][:3] == hf[-1][:3]


def test_hf_compat_plan_equals_hf_everywhere():
    for P, T, L in itertools.product([2, 3, 4, 6, 8, 9, 10, 12, 14, 16, 20, 28, 30, 40], [1, 2, 3, 4, 8], range(1, 9)):
        hf = [Scale(*(int(v) for v in row)) for row in plan_out_scales(T, P, L, 3)]
        assert plan_scales(T, P, L, 3, hf_compat=True) == hf, (P, T, L)


def test_released_plan_differs_from_hf_only_in_temporal_channels():
    # spec 2.6: (P, T, L) = (2, 2, 3) -> HF widths 12->64, 128->1536, 1536->D; released 12->64, 128->64, 64->D
    released, hf = plan_scales(2, 2, 3, 3), plan_scales(2, 2, 3, 3, hf_compat=True)
    assert [s.c for s in released] == [3, 64, 64, 64] and [s.c for s in hf] == [3, 64, 1536, 1536]
    assert [s[:3] for s in released] == [s[:3] for s in hf]


def test_invalid_fold_plan_is_a_config_error():
    # scipy's tie-break in HF's order gives (1,10,10) -> (1,5,5) for (P,T,L) = (10,8,5): not a whole fold
    with pytest.raises(ConfigError, match="patch_size=10"):
        VisionTower(_vision_config(10, 8, 5, hf_compat=True))
    VisionTower(_vision_config(10, 8, 5))  # the released (sorted) assignment is valid


def test_fold_channel_order():
    x = torch.arange(2 * 4 * 4 * 3).reshape(1, 2, 4, 4, 3)  # [B, T, H, W, C]
    y = fold(x, 2, 2)  # [1, 1, 2, 2, 24]
    dt, dy, dx, c, i, j = 1, 1, 0, 2, 1, 0
    assert y[0, 0, i, j, ((dt * 2 + dy) * 2 + dx) * 3 + c] == x[0, dt, i * 2 + dy, j * 2 + dx, c]


# ---------------------------------------------------------------------------------------------------------------
# Vision tower vs HF get_image_features


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("P,T,L", [(8, 2, 3), (10, 2, 4), (4, 2, 2), (8, 2, 4)])
def test_vision_tower_equals_hf_fp32(P, T, L):
    hf = _hf_model(P, T, L, seed=P * 100 + L)
    tower = VisionTower(_vision_config(P, T, L))
    tower.load_state_dict(_vision_state(hf), strict=True)
    pixels = torch.randn(5, P, P, 3, generator=torch.Generator().manual_seed(1))  # [N, P, P, 3], one frame
    with torch.no_grad():
        expected = hf.get_image_features(pixels[:, None].expand(-1, T, -1, -1, -1)).pooler_output.reshape(5, -1)
        ours = tower(pixels)
        two_frames = torch.randn(5, T, P, P, 3, generator=torch.Generator().manual_seed(2))
        expected_2 = hf.get_image_features(two_frames).pooler_output.reshape(5, -1)
        ours_2 = tower(two_frames)
    assert ours.shape == (5, HIDDEN)
    assert _rel_err(ours, expected) <= 1e-5
    assert _rel_err(ours_2, expected_2) <= 1e-5


def test_vision_tower_hf_compat_loads_a_diverging_hf_config():
    P, T, L = 2, 2, 3
    hf = _hf_model(P, T, L)
    with pytest.raises(RuntimeError, match="size mismatch"):
        VisionTower(_vision_config(P, T, L)).load_state_dict(_vision_state(hf))
    tower = VisionTower(_vision_config(P, T, L, hf_compat=True))
    tower.load_state_dict(_vision_state(hf), strict=True)
    pixels = torch.randn(3, P, P, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf.get_image_features(pixels[:, None].expand(-1, T, -1, -1, -1)).pooler_output.reshape(3, -1)
        assert _rel_err(tower(pixels), expected) <= 1e-5


def test_vision_tower_equals_hf_bf16():
    P, T, L = 8, 2, 3
    hf = _hf_model(P, T, L).to(torch.bfloat16)
    tower = VisionTower(_vision_config(P, T, L)).to(torch.bfloat16)
    tower.load_state_dict(_vision_state(hf), strict=True)
    pixels = torch.randn(4, P, P, 3, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        expected = hf.get_image_features(pixels[:, None].expand(-1, T, -1, -1, -1)).pooler_output.reshape(4, -1)
        ours = tower(pixels)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, expected, rtol=1.6e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# Audio tower vs HF get_audio_features


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_audio_tower_equals_hf(dtype, rtol):
    hf = _hf_model(8, 2, 3, seed=7).to(dtype)
    tower = AudioTower(AUDIO_CONFIG).to(dtype)
    tower.load_state_dict(_audio_state(hf), strict=True)
    codes = torch.randint(0, 16, (1, 9, 80), generator=torch.Generator().manual_seed(5))  # [B, F, M]
    mask = torch.ones(1, 9, dtype=torch.bool)
    with torch.no_grad():
        expected = hf.get_audio_features(codes, mask).pooler_output  # [F, D]
        ours = tower(codes[0].to(torch.uint8))
    assert ours.shape == (9, HIDDEN) and ours.dtype == dtype
    if dtype == torch.float32:
        assert _rel_err(ours, expected) <= rtol
    else:
        torch.testing.assert_close(ours, expected, rtol=rtol, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# build_towers


def _raw_config() -> dict:
    text = dict(TINY_TEXT, route_scale=8.0, logits_mup_width_multiplier=24.0)
    return {
        "model_type": "inkling_mm_model",
        "eos_token_id": 200006,
        "text_config": text,
        "vision_config": {
            "vision_encoder_type": "hmlp",
            "patch_size": 8,
            "temporal_patch_size": 2,
            "n_channels": 3,
            "n_layers": 3,
            "decoder_dmodel": HIDDEN,
        },
        "audio_config": {"n_mel_bins": 80, "mel_vocab_size": 16, "decoder_dmodel": HIDDEN},
    }


def test_build_towers_loads_and_casts():
    hf = _hf_model(8, 2, 3)
    config = parse_model_config(_raw_config())
    vision, audio = build_towers(config, _vision_state(hf), _audio_state(hf), "cpu", torch.bfloat16)
    assert vision.layers.linear_0.weight.dtype == torch.bfloat16 and not vision.training
    assert audio.encoder.weight.shape == (1280, HIDDEN)
    assert vision(torch.zeros(2, 8, 8, 3)).shape == (2, HIDDEN)
    state = _vision_state(hf)
    state.pop("final_norm.weight")
    with pytest.raises(CheckpointError, match="final_norm.weight"):
        build_towers(config, state, _audio_state(hf), "cpu", torch.float32)
    with pytest.raises(CheckpointError, match="audio tower"):
        build_towers(config, _vision_state(hf), None, "cpu", torch.float32)
