"""Fixtures: the tiny checkpoint (random weights, the real 200k vocabulary), an engine on it, one compiler."""

from __future__ import annotations

import pytest

from common.settings import DecodeEngineSettings
from decode_service.engine.build import build_engine
from decode_service.structured.compiler import ConstraintCompiler
from tools.make_tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("structured-ckpt"), seed=0)


@pytest.fixture(scope="session")
def engine(checkpoint):
    settings = DecodeEngineSettings(
        dtype="float32", kv_cache_bytes=16 << 20, max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_cache=False
    )
    return build_engine(checkpoint, settings)


@pytest.fixture(scope="session")
def compiler(engine):
    c = ConstraintCompiler(engine.config.text.unpadded_vocab_size, engine.config.eos_token_ids)
    yield c
    c.close()
