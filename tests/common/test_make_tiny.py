"""`make-tiny` writes a released-layout checkpoint that our loader and `transformers` both read completely."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from common.checkpoint import (
    CheckpointFiles,
    inspect_checkpoint,
    load_decoder_weights,
    load_mtp_weights,
    load_tower_weights,
)
from common.config import load_model_config
from tools.make_tiny_checkpoint import hmlp_linear_shapes, main, make_tiny_checkpoint

SMALL = {"vocab_size": 512, "unpadded_vocab_size": 500}


@pytest.fixture(scope="module")
def tiny_nvfp4(tmp_path_factory):
    """The default demo checkpoint: real vocabulary, NVFP4 experts."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", nvfp4=True, seed=0)


def test_nvfp4_tiny_loads_with_everything_accounted(tiny_nvfp4) -> None:
    files, config = CheckpointFiles(tiny_nvfp4), load_model_config(tiny_nvfp4)
    assert config.text.vocab_size == 201024 and config.text.unpadded_vocab_size == 200058
    assert config.eos_token_ids == (200006,)
    weights, report = load_decoder_weights(files, config, dtype=torch.bfloat16, progress=False)
    assert report.nvfp4_layers == (3, 4, 5) and not report.unexpected
    assert weights["layers.2.mlp.experts.w13_weight"].dtype == torch.bfloat16  # first MoE layer stays bf16
    assert weights["layers.3.mlp.experts.w2_weight_scale"].shape == (8, 64, 2)
    assert weights["embed.weight"].shape == (201024, 64)
    vision, _ = load_tower_weights(files, "model.visual.", config)
    audio, _ = load_tower_weights(files, "model.audio.", config)
    mtp, _ = load_mtp_weights(files, config, progress=False)
    assert len(vision) == 6 and set(audio) == {"encoder.weight", "final_norm.weight"}
    assert len(mtp) == 2 * 20 and mtp["layers.1.transformer_block.attn.rel_logits_proj.proj"].shape == (4, 32)
    taken = len(report.consumed) + len(vision) + len(audio) + len(mtp)
    amax = [n for n in report.ignored if n.endswith(".input_amax")]
    assert taken + len(amax) == len(files.names())
    # mtp.safetensors exists but is not in the index (found by the header scan)
    assert set(files.unindexed) == {"model.mtp." + k for k in mtp}
    assert "tensors missing from the index (found by scanning): 40" in inspect_checkpoint(tiny_nvfp4)


def test_side_files(tiny_nvfp4) -> None:
    raw = json.loads((tiny_nvfp4 / "config.json").read_text())
    assert raw["model_type"] == "inkling_mm_model" and raw["text_config"]["dense_mlp_idx"] == 2
    assert raw["mtp_config"] == {
        "num_nextn_predict_layers": 2,
        "chain_hidden_post_norm": False,
        "local_layer_ids": [0],
    }
    processor = json.loads((tiny_nvfp4 / "processor_config.json").read_text())
    assert processor["image_processor"]["size"] == {"height": 8, "width": 8}
    assert processor["feature_extractor"]["sampling_rate"] == 16000
    assert processor["num_dmel_bins"] == raw["audio_config"]["mel_vocab_size"] == 16
    quant = json.loads((tiny_nvfp4 / "hf_quant_config.json").read_text())["quantization"]
    assert (quant["quant_algo"], quant["kv_cache_quant_algo"], quant["group_size"]) == ("NVFP4", "none", 16)
    exclude = set(quant["exclude_modules"])
    assert "model.llm.layers.2.mlp.experts" in exclude and "model.llm.layers.3.mlp.experts" not in exclude
    assert {"model.llm.embed", "model.llm.layers.3.mlp.gate", "model.llm.layers.0.mlp.w13_dn"} <= exclude
    index = json.loads((tiny_nvfp4 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }


def test_bf16_tiny_is_what_transformers_loads(tmp_path) -> None:
    """Independent oracle: HF's own conversion reads the file; its tensors equal ours after de-interleave."""
    transformers = pytest.importorskip("transformers")
    directory = make_tiny_checkpoint(tmp_path, nvfp4=False, seed=1, **SMALL)
    config = load_model_config(directory)
    ours, _ = load_decoder_weights(CheckpointFiles(directory), config, dtype=torch.bfloat16, progress=False)
    hf, info = transformers.InklingForConditionalGeneration.from_pretrained(
        directory, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    state = {k: v for k, v in hf.state_dict().items()}
    lm = "model.language_model.layers."
    pairs = {
        "unembed.weight": "lm_head.weight",
        "embed_norm.weight": "model.language_model.embed_tokens.embed_norm.weight",
        "layers.5.attn.rel_logits_proj.proj": lm + "5.self_attn.rel_logits_proj.proj",
        "layers.4.attn.wk_dv.weight": lm + "4.self_attn.k_proj.weight",
        "layers.3.mlp.experts.w13_weight": lm + "3.mlp.experts.gate_up_proj",
        "layers.3.mlp.gate.bias": lm + "3.mlp.gate.e_score_correction_bias",
    }
    for key, hf_key in pairs.items():
        assert torch.equal(ours[key], state[hf_key].to(ours[key].dtype)), key
    assert torch.equal(
        ours["layers.1.mlp.w13_dn.weight"],
        torch.cat([state[lm + "1.mlp.gate_proj.weight"], state[lm + "1.mlp.up_proj.weight"]]),
    )
    shared = [state[lm + f"2.mlp.shared_experts.{p}_proj"] for p in ("gate", "up")]
    assert torch.equal(ours["layers.2.mlp.shared_experts.shared_w13_weight"], torch.cat(shared, dim=1))
    assert torch.equal(ours["layers.0.attn_sconv.weight"], state[lm + "0.attn_sconv.conv1d.weight"].float())
    vision, _ = load_tower_weights(CheckpointFiles(directory), "model.visual.", config)
    assert torch.equal(vision["layers.linear_1.weight"], state["model.vision_tower.encoder_layers.1.projection.weight"])
    # norms are not left at one, router scales are spread, bias is non-zero
    assert (ours["layers.0.attn.q_norm.weight"] != 1).all()
    assert ours["layers.3.mlp.gate.bias"].abs().min() > 0


def test_deterministic_for_a_seed(tmp_path) -> None:
    def digest(directory) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    a = digest(make_tiny_checkpoint(tmp_path / "a", nvfp4=True, seed=7, **SMALL))
    b = digest(make_tiny_checkpoint(tmp_path / "b", nvfp4=True, seed=7, **SMALL))
    c = digest(make_tiny_checkpoint(tmp_path / "c", nvfp4=True, seed=8, **SMALL))
    assert a == b
    assert a["model-00001-of-00002.safetensors"] != c["model-00001-of-00002.safetensors"]


def test_overrides_and_cli(tmp_path) -> None:
    with pytest.raises(ValueError, match="not_a_key"):
        make_tiny_checkpoint(tmp_path / "bad", not_a_key=1)
    assert main([str(tmp_path / "cli"), "--seed", "2"]) == 0
    assert not (tmp_path / "cli" / "hf_quant_config.json").exists()
    wide = make_tiny_checkpoint(tmp_path / "wide", hidden_size=32, vision_config={"patch_size": 10}, **SMALL)
    config = load_model_config(wide)
    assert config.vision.patch_size == 10 and config.vision.output_dim == 32
    _, report = load_decoder_weights(CheckpointFiles(wide), config, progress=False)
    assert not report.unexpected


def test_hmlp_plan_matches_spec() -> None:
    # Inkling-Small (multimodal spec 2.3) and the tiny plan HF builds for (8, 2, 3)
    assert hmlp_linear_shapes(40, 2, 4, 3, 4096) == [(128, 75), (320, 512), (4800, 5120), (4096, 9600)]
    assert hmlp_linear_shapes(8, 2, 3, 3, 64) == [(64, 12), (192, 1024), (64, 384)]


def test_files_are_readable_by_other_users(tiny_nvfp4) -> None:
    """The compose mount is read by the container user (uid 10001), not the file's owner."""
    assert tiny_nvfp4.stat().st_mode & 0o005 == 0o005
    modes = {path.name: path.stat().st_mode & 0o777 for path in tiny_nvfp4.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert all(mode & 0o004 for mode in modes.values()), modes
