"""Fixtures the service-level tests share: one tiny NVFP4 checkpoint per module, and the small engine on it that the
server and service tests drive."""

import pytest

from common.settings import DecodeEngineSettings
from decode_service.engine.build import build_engine
from tools.make_tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # module scope: the module-scoped async servers run on it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), nvfp4=True, seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint):
    """Four sequences, 256 batched tokens, 8 MiB of KV, no prefix cache (fp32)."""
    settings = DecodeEngineSettings(
        dtype="float32", kv_cache_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_cache=False
    )
    return build_engine(checkpoint, settings)
