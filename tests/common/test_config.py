"""Config dialects: released raw config.json vs the transformers-saved form parse to the same ModelConfig."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from common.config import DEFAULT_EOS_TOKEN_ID, load_model_config, parse_model_config, parse_text_config
from common.errors import ConfigError
from tools.make_tiny_checkpoint import raw_config

transformers = pytest.importorskip("transformers")


def hf_dict(raw: dict) -> dict:
    return transformers.InklingConfig(**copy.deepcopy(raw)).to_dict()


def test_released_and_hf_dialects_agree() -> None:
    raw = raw_config(model_max_length=65536)
    ours, theirs = parse_model_config(raw), parse_model_config(hf_dict(raw))
    assert ours.text == theirs.text
    assert ours.vision == theirs.vision and ours.vision is not None
    assert ours.audio == theirs.audio and ours.audio is not None
    assert ours.mtp == theirs.mtp and ours.mtp is not None
    assert ours.eos_token_ids == theirs.eos_token_ids == (200006,)
    t = ours.text
    assert (t.dense_intermediate_size, t.moe_intermediate_size) == (96, 32)
    assert t.sliding_layers == (True,) * 5 + (False,)
    assert t.dense_layers == (True, True, False, False, False, False)
    assert (t.num_kv_heads, t.swa_num_kv_heads, t.conv_kernel_size, t.log_scaling_n_floor) == (1, 2, 4, 24)
    mtp = ours.mtp
    assert (mtp.num_layers, mtp.sliding_layers, mtp.chain_hidden_post_norm) == (2, (True, False), False)


def test_hf_default_max_position_is_the_only_difference() -> None:
    raw = raw_config()
    del raw["text_config"]["model_max_length"]
    ours, theirs = parse_model_config(raw), parse_model_config(hf_dict(raw))
    assert ours.text.max_position_embeddings == 1048576
    assert theirs.text.max_position_embeddings == 131072  # HF's default is written into the saved dict
    assert dataclasses.replace(theirs.text, max_position_embeddings=1048576) == ours.text


def test_text_only_hf_dialect() -> None:
    raw = raw_config()
    text = transformers.InklingTextConfig(**copy.deepcopy(raw["text_config"])).to_dict()
    config = parse_model_config(text)
    assert config.text == parse_model_config(raw).text
    assert config.eos_token_ids == (DEFAULT_EOS_TOKEN_ID,)  # HF's placeholder eos 2 is replaced
    assert config.vision is None and config.audio is None


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"intermediate_size": 32, "dense_intermediate_size": 96}, (96, 32)),  # raw naming
        ({"intermediate_size": 96, "moe_intermediate_size": 32}, (96, 32)),  # HF naming
        ({"intermediate_size": 48}, (48, 48)),  # neither: one width for both
    ],
)
def test_intermediate_size_swap(keys: dict, expected: tuple[int, int]) -> None:
    block = raw_config()["text_config"]
    del block["intermediate_size"], block["dense_intermediate_size"]
    block.update(keys)
    text = parse_text_config(block)
    assert (text.dense_intermediate_size, text.moe_intermediate_size) == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gate_activation", "softmax"),
        ("use_embed_norm", False),
        ("q_bias", True),
        ("final_logit_softcapping", 30.0),
        ("hidden_act", "gelu"),
    ],
)
def test_unsupported_release_flags_name_the_field(field: str, value) -> None:
    block = raw_config()["text_config"]
    block[field] = value
    with pytest.raises(ConfigError, match=field):
        parse_text_config(block)


def test_layer_kinds_rules() -> None:
    block = raw_config()["text_config"]
    del block["local_layer_ids"]
    # rule 3 (fallback): layers 5, 11, ... are global
    fallback = parse_text_config(dict(block, num_hidden_layers=12)).sliding_layers
    assert [i for i, s in enumerate(fallback) if not s] == [5, 11]
    # rule 2: local_layer_ids
    assert parse_text_config(dict(block, local_layer_ids=[1, 3])).sliding_layers == (
        False,
        True,
        False,
        True,
        False,
        False,
    )
    # rule 1: layer_types wins over local_layer_ids
    types = ["hybrid", "hybrid_sliding"] * 3
    both = dict(block, local_layer_ids=[0, 1, 2, 3, 4], layer_types=types)
    assert parse_text_config(both).sliding_layers == (False, True) * 3
    with pytest.raises(ConfigError, match="local_layer_ids"):
        parse_text_config(dict(block, local_layer_ids=[6]))
    with pytest.raises(ConfigError, match="layer_types"):
        parse_text_config(dict(block, layer_types=["hybrid", "chunked"] * 3))


def test_mlp_kinds_from_mlp_layer_types() -> None:
    block = raw_config()["text_config"]
    block["mlp_layer_types"] = ["dense", "sparse", "dense", "sparse", "sparse", "sparse"]
    assert parse_text_config(block).dense_layers == (True, False, True, False, False, False)


def test_bad_values_name_the_field(tmp_path) -> None:
    raw = raw_config()
    raw["text_config"]["num_experts_per_tok"] = 9
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        parse_model_config(raw)
    raw = raw_config()
    raw["text_config"]["hidden_size"] = "64"
    with pytest.raises(ConfigError, match="hidden_size"):
        parse_model_config(raw)
    raw = raw_config()
    raw["audio_config"]["audio_mode"] = "whisper"
    with pytest.raises(ConfigError, match="audio_mode"):
        parse_model_config(raw)
    with pytest.raises(ConfigError, match="inkling2"):
        parse_model_config(dict(raw_config(), model_type="inkling2"))
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("block", ["vision_config", "audio_config"])
def test_null_decoder_dmodel_disables_the_tower(block: str) -> None:
    raw = raw_config()
    raw[block]["decoder_dmodel"] = None
    config = parse_model_config(raw)
    assert (config.vision if block == "vision_config" else config.audio) is None
