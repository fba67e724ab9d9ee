"""Checkpoint loading against `transformers`: released layout, HF-saved layouts, NVFP4, tensor accounting."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from common.checkpoint import CheckpointFiles, inspect_checkpoint, load_decoder_weights, load_tower_weights
from common.checkpoint_layout import QuantConfig, read_quant_config
from common.config import load_model_config
from common.errors import CheckpointError
from tests.reference.hf_tiny import build_hf_model, randomize_, raw_config
from tests.reference.released_layout import hf_state_to_released, write_released_checkpoint

transformers = pytest.importorskip("transformers")

SMALL_VOCAB = {"vocab_size": 512, "unpadded_vocab_size": 500}
_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def expected_from_hf(lm, lm_head) -> dict[str, torch.Tensor]:
    """Our in-memory decoder dict, read off the HF modules (gate/up fused as [gate; up])."""
    out = {
        "embed.weight": lm.embed_tokens.weight,
        "embed_norm.weight": lm.embed_tokens.embed_norm.weight,
        "norm.weight": lm.norm.weight,
        "unembed.weight": lm_head.weight,
    }
    for i, layer in enumerate(lm.layers):
        a, m, p = layer.self_attn, layer.mlp, f"layers.{i}."
        out |= {
            p + "attn_norm.weight": layer.input_layernorm.weight,
            p + "mlp_norm.weight": layer.post_attention_layernorm.weight,
            p + "attn.wq_du.weight": a.q_proj.weight,
            p + "attn.wk_dv.weight": a.k_proj.weight,
            p + "attn.wv_dv.weight": a.v_proj.weight,
            p + "attn.wr_du.weight": a.r_proj.weight,
            p + "attn.wo_ud.weight": a.o_proj.weight,
            p + "attn.q_norm.weight": a.q_norm.weight,
            p + "attn.k_norm.weight": a.k_norm.weight,
            p + "attn.k_sconv.weight": a.k_sconv.conv1d.weight,
            p + "attn.v_sconv.weight": a.v_sconv.conv1d.weight,
            p + "attn.rel_logits_proj.proj": a.rel_logits_proj.proj,
            p + "attn_sconv.weight": layer.attn_sconv.conv1d.weight,
            p + "mlp_sconv.weight": layer.mlp_sconv.conv1d.weight,
        }
        if hasattr(m, "gate_proj"):
            out |= {
                p + "mlp.w13_dn.weight": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                p + "mlp.w2_md.weight": m.down_proj.weight,
                p + "mlp.global_scale": m.global_scale,
            }
        else:
            s = m.shared_experts
            out |= {
                p + "mlp.gate.weight": m.gate.weight,
                p + "mlp.gate.bias": m.gate.e_score_correction_bias,
                p + "mlp.gate.global_scale": m.gate.global_scale,
                p + "mlp.experts.w13_weight": m.experts.gate_up_proj,
                p + "mlp.experts.w2_weight": m.experts.down_proj,
                p + "mlp.shared_experts.shared_w13_weight": torch.cat([s.gate_proj, s.up_proj], dim=1),
                p + "mlp.shared_experts.shared_w2_weight": s.down_proj,
            }
    return {k: v.detach() for k, v in out.items()}


def assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    bad = [k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not bad, f"differ: {bad[:10]}"


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model(raw_config(SMALL_VOCAB), seed=3)


@pytest.fixture(scope="module")
def raw() -> dict:
    return raw_config(SMALL_VOCAB)


@pytest.fixture(scope="module")
def released_dir(tmp_path_factory, hf_model, raw):
    directory = tmp_path_factory.mktemp("released")
    write_released_checkpoint(directory, raw, hf_state_to_released(hf_model.state_dict()))
    return directory


def load(directory, config=None, dtype=torch.float32):
    config = config or load_model_config(directory)
    return load_decoder_weights(CheckpointFiles(directory), config, dtype=dtype, device="cpu", progress=False)


def test_released_layout_loads_hf_weights(released_dir, hf_model) -> None:
    weights, report = load(released_dir)
    assert_same(weights, expected_from_hf(hf_model.model.language_model, hf_model.lm_head))
    assert report.layout == "raw" and not report.unexpected and report.nvfp4_layers == ()
    assert set(report.ignored.values()) == {"vision tower (encoder service)", "audio tower (encoder service)"}
    assert len(report.consumed) + len(report.ignored) == len(CheckpointFiles(released_dir).names())


def test_reference_writer_matches_transformers_loader(released_dir, hf_model) -> None:
    """The released-layout writer is checked against HF's own conversion (re-interleave, renames)."""
    reloaded = transformers.InklingForConditionalGeneration.from_pretrained(released_dir, dtype=torch.float32)
    ours, theirs = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("original_format", [False, True])
def test_hf_saved_layout_loads_the_same(tmp_path, hf_model, released_dir, original_format) -> None:
    hf_model.save_pretrained(tmp_path, save_original_format=original_format)
    weights, report = load(tmp_path)
    assert report.layout == ("raw" if original_format else "hf")
    assert_same(weights, load(released_dir)[0])
    towers = [
        load_tower_weights(CheckpointFiles(d), p, load_model_config(d))[0]
        for d in (tmp_path, released_dir)
        for p in ("model.visual.", "model.audio.")
    ]
    assert_same(towers[0], towers[2])
    assert_same(towers[1], towers[3])


def test_text_only_layouts(tmp_path, raw) -> None:
    config = transformers.InklingTextConfig(**raw["text_config"])
    model = transformers.InklingForCausalLM(config).float()
    randomize_(model, seed=5)
    expected = expected_from_hf(model.model, model.lm_head)
    model.save_pretrained(tmp_path / "hf", save_original_format=False)
    weights, report = load(tmp_path / "hf")
    assert report.layout == "hf-text"
    assert_same(weights, expected)
    write_released_checkpoint(
        tmp_path / "raw",
        {"model_type": "inkling_mm_model", "text_config": raw["text_config"]},
        hf_state_to_released(model.state_dict(), text_only=True),
    )
    assert_same(load(tmp_path / "raw")[0], expected)


def test_tower_weights(released_dir, hf_model) -> None:
    files, config = CheckpointFiles(released_dir), load_model_config(released_dir)
    vision, report = load_tower_weights(files, "model.visual.", config)
    tower = hf_model.model.vision_tower
    expected = {"final_norm.weight": tower.final_norm.weight.detach()}
    for i, layer in enumerate(tower.encoder_layers):
        expected[f"layers.linear_{i}.weight"] = layer.projection.weight.detach()
        if hasattr(layer, "layer_norm"):
            expected[f"layers.norm_{i}.weight"] = layer.layer_norm.weight.detach()
    assert_same(vision, expected)
    assert not report.unexpected
    audio, _ = load_tower_weights(files, "model.audio.", config, dtype=torch.bfloat16)
    hf_audio = hf_model.model.audio_tower
    assert_same(
        audio,
        {
            "encoder.weight": hf_audio.embed_audio_tokens.embed_audio_tokens.weight.detach().bfloat16(),
            "final_norm.weight": hf_audio.norm.weight.detach().bfloat16(),
        },
    )


def test_dtype_policy(released_dir) -> None:
    weights, _ = load(released_dir, dtype=torch.bfloat16)
    fp32 = {k for k, v in weights.items() if v.dtype == torch.float32}
    assert fp32 and all(k.endswith(("gate.bias", "gate.global_scale", "sconv.weight")) for k in fp32)
    assert {k for k in weights if k.endswith("sconv.weight")} <= fp32
    assert weights["layers.0.mlp.global_scale"].dtype == torch.bfloat16


def decode_by_hand(packed: torch.Tensor, scale: torch.Tensor, scale2: torch.Tensor) -> torch.Tensor:
    """[E, R, C/2] bytes -> [E, R, C] with integer ops (low nibble first, bit 3 sign)."""
    low, high = (packed % 16).long(), (packed // 16).long()
    codes = torch.stack([low, high], dim=-1).flatten(-2)
    magnitude = torch.tensor(_MAGNITUDES)[codes % 8]
    value = torch.where(codes >= 8, -magnitude, magnitude)
    return value * scale.float().repeat_interleave(16, dim=-1) * scale2[:, None, None]


def test_nvfp4_routed_experts(tmp_path, hf_model, raw) -> None:
    write_released_checkpoint(tmp_path, raw, hf_state_to_released(hf_model.state_dict()), nvfp4_layers=(3, 5))
    weights, report = load(tmp_path)
    assert report.nvfp4_layers == (3, 5)
    assert sum(reason.startswith("NVFP4 activation") for reason in report.ignored.values()) == 4
    assert weights["layers.4.mlp.experts.w13_weight"].dtype == torch.float32  # not quantized
    files = CheckpointFiles(tmp_path)
    for layer in (3, 5):
        experts = hf_model.model.language_model.layers[layer].mlp.experts
        for stack, hf_value in (("w13", experts.gate_up_proj), ("w2", experts.down_proj)):
            key = f"layers.{layer}.mlp.experts.{stack}_weight"
            packed, scale, scale2 = weights[key], weights[key + "_scale"], weights[key + "_scale2"]
            assert (packed.dtype, scale.dtype, scale2.dtype) == (
                torch.uint8,
                torch.float8_e4m3fn,
                torch.float32,
            )
            ours = decode_by_hand(packed, scale, scale2)
            stored = decode_by_hand(*(files.get(f"model.llm.{key}{s}") for s in ("", ".scale", ".scale2")))
            if stack == "w13":  # stored rows alternate gate/up; ours are [gate; up]
                stored = torch.cat([stored[:, 0::2], stored[:, 1::2]], dim=1)
            assert torch.equal(ours, stored)
            block_amax = hf_value.detach().abs().unflatten(-1, (-1, 16)).amax(-1).repeat_interleave(16, -1)
            assert ((ours - hf_value.detach()).abs() <= 0.2 * block_amax + 1e-6).all()
    quant = read_quant_config(tmp_path)
    assert quant.excludes("model.llm.layers.2.mlp.experts.w13_weight")
    assert not quant.excludes("model.llm.layers.3.mlp.experts.w13_weight")
    assert quant.excludes("model.llm.layers.3.mlp.shared_experts.shared_w13_weight")


def _edit_quant(directory, **changes) -> None:
    path = directory / "hf_quant_config.json"
    data = json.loads(path.read_text())
    data["quantization"].update(changes)
    path.write_text(json.dumps(data))


def test_quant_config_cross_checks(tmp_path, hf_model, raw) -> None:
    write_released_checkpoint(tmp_path, raw, hf_state_to_released(hf_model.state_dict()), nvfp4_layers=(4,))
    for ok in ("none", "NONE", "", None):
        _edit_quant(tmp_path, kv_cache_quant_algo=ok)
        assert load(tmp_path)[1].nvfp4_layers == (4,)
    for field, bad in (("kv_cache_quant_algo", "FP8"), ("group_size", 32), ("quant_algo", "FP8")):
        _edit_quant(tmp_path, **{"kv_cache_quant_algo": "none", "group_size": 16, "quant_algo": "NVFP4", field: bad})
        with pytest.raises(CheckpointError, match=field):
            load(tmp_path)
    _edit_quant(tmp_path, kv_cache_quant_algo="none", group_size=16, quant_algo="NVFP4")
    exclude = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    _edit_quant(tmp_path, exclude_modules=exclude + ["model.llm.layers.4.mlp.experts"])
    with pytest.raises(CheckpointError, match=r"layers\.4\.mlp\.experts\.w13_weight is NVFP4"):
        load(tmp_path)
    _edit_quant(tmp_path, exclude_modules=[e for e in exclude if e != "model.llm.layers.2.mlp.experts"])
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.w13_weight .*expected NVFP4"):
        load(tmp_path)


@pytest.mark.parametrize("nested", [True, False])
def test_quant_config_inside_config_json(tmp_path, hf_model, raw, nested) -> None:
    write_released_checkpoint(tmp_path, raw, hf_state_to_released(hf_model.state_dict()), nvfp4_layers=(3,))
    block = json.loads((tmp_path / "hf_quant_config.json").read_text())
    (tmp_path / "hf_quant_config.json").unlink()
    config = dict(raw, quantization_config=block if nested else block["quantization"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load(tmp_path)[1].nvfp4_layers == (3,)
    assert read_quant_config(tmp_path, load_model_config(tmp_path)).excludes("model.llm.layers.2.mlp.experts")
    block["quantization"]["kv_cache_quant_algo"] = "FP8"
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, quantization_config=block)))
    with pytest.raises(CheckpointError, match="config.json quantization_config: kv_cache_quant_algo='FP8'"):
        load(tmp_path)


def test_dot_boundary_prefix_match() -> None:
    quant = QuantConfig("NVFP4", ("model.llm.layers.2", "model.llm.embed"))
    assert quant.excludes("model.llm.layers.2.mlp.experts.w13_weight")
    assert quant.excludes("model.llm.embed")
    assert not quant.excludes("model.llm.layers.20.mlp.experts.w13_weight")
    assert not quant.excludes("model.llm.embed_norm.weight")


def test_missing_unexpected_and_bad_shapes_are_named(tmp_path, hf_model, raw) -> None:
    tensors = hf_state_to_released(hf_model.state_dict())
    del tensors["model.llm.layers.1.attn.q_norm.weight"]
    tensors["model.llm.layers.1.attn.bogus.weight"] = torch.zeros(2)
    tensors["model.llm.layers.3.mlp.shared_experts.shared_w13_weight.scale"] = torch.zeros(2)  # never NVFP4
    write_released_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(CheckpointError) as err:
        load(tmp_path)
    message = str(err.value)
    assert "1 missing: model.llm.layers.1.attn.q_norm.weight" in message
    assert "model.llm.layers.1.attn.bogus.weight" in message
    assert "model.llm.layers.3.mlp.shared_experts.shared_w13_weight.scale" in message

    tensors = hf_state_to_released(hf_model.state_dict())
    tensors["model.llm.layers.5.attn.rel_logits_proj.proj"] = torch.zeros(4, 16)
    write_released_checkpoint(tmp_path / "shape", raw, tensors)
    with pytest.raises(CheckpointError, match=r"rel_logits_proj.proj: expected shape \(4, 32\), got \(4, 16\)"):
        load(tmp_path / "shape")


def test_files_scan_index_and_duplicates(tmp_path, released_dir) -> None:
    for f in released_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    extra = {"model.mtp.layers.0.hidden_norm.weight": torch.ones(64)}
    save_file(extra, str(tmp_path / "mtp.safetensors"))
    files = CheckpointFiles(tmp_path)
    assert files.unindexed == ["model.mtp.layers.0.hidden_norm.weight"]
    assert files.shape("model.mtp.layers.0.hidden_norm.weight") == (64,)
    assert files.dtype("model.llm.layers.3.mlp.gate.bias") == torch.float32
    _, report = load(tmp_path)
    assert report.ignored["model.mtp.layers.0.hidden_norm.weight"] == "MTP drafter not built"
    save_file({"model.llm.norm.weight": torch.ones(64)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="model.llm.norm.weight"):
        CheckpointFiles(tmp_path)
    (tmp_path / "extra.safetensors").unlink()
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        CheckpointFiles(tmp_path)


def test_inspect(tmp_path, hf_model, raw) -> None:
    write_released_checkpoint(tmp_path, raw, hf_state_to_released(hf_model.state_dict()), nvfp4_layers=(3,))
    text = inspect_checkpoint(tmp_path)
    assert "layout: raw" in text and "NVFP4 routed experts in layers [3]" in text
    assert "uint8 2" in text and "float8_e4m3fn 2" in text and "text: 6 layers (global [5])" in text
