"""Checkpoint fingerprints from the files: equal for the same checkpoint, different for different weights."""

from __future__ import annotations

import shutil

import pytest

from common.fingerprint import encoder_fingerprint_of, model_fingerprint
from tools.make_tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    a = make_tiny_checkpoint(tmp_path_factory.mktemp("a"), seed=0)
    b = make_tiny_checkpoint(tmp_path_factory.mktemp("b"), seed=1)  # same config, other weights
    return a, b


def test_model_fingerprint_follows_the_weights(checkpoints, tmp_path):
    a, b = checkpoints
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert model_fingerprint(a, "bfloat16") == model_fingerprint(a, "bfloat16")
    assert model_fingerprint(a, "bfloat16") != model_fingerprint(b, "bfloat16")
    assert model_fingerprint(a, "bfloat16") != model_fingerprint(a, "float32")
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert model_fingerprint(copy, "bfloat16") == model_fingerprint(a, "bfloat16")


def test_encoder_fingerprint_follows_the_tower_weights(checkpoints):
    a, b = checkpoints
    assert encoder_fingerprint_of(a, "bfloat16") == encoder_fingerprint_of(a, "bfloat16")
    assert encoder_fingerprint_of(a, "bfloat16") != encoder_fingerprint_of(b, "bfloat16")
    assert encoder_fingerprint_of(a, "bfloat16") != encoder_fingerprint_of(a, "float32")
