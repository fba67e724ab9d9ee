"""The tower-free planner: a decode replica's mm_keys equal the encoder's, without loading the towers."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from common.fingerprint import encoder_fingerprint_of
from common.hashing import mm_key
from common.media import ImageOptions, MediaInput, VideoOptions
from common.settings import EncoderSettings
from encoder_service.planner import MediaPlanner
from encoder_service.service import load_engine
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import make_tiny_checkpoint

MEDIA = sample_media()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def test_planner_keys_equal_the_encoder_keys(checkpoint):
    items = [
        MediaInput("image", MEDIA["shapes.png"]),
        MediaInput("image", MEDIA["shapes.png"], ImageOptions("none")),
        MediaInput("audio", MEDIA["tones_16k.wav"]),
        MediaInput("video", MEDIA["moving.mp4"], video=VideoOptions(fps=4.0, max_frames=3)),
    ]
    engine = load_engine(EncoderSettings(checkpoint=str(checkpoint), l1_cache_bytes=0))

    async def encode():
        try:
            return [r async for r in engine.encode(items, "keys")]
        finally:
            await engine.close()

    encoded = asyncio.run(encode())
    planner = MediaPlanner.for_checkpoint(checkpoint)
    fingerprint = encoder_fingerprint_of(checkpoint, "bfloat16")
    assert fingerprint == engine.fingerprint
    keys = [
        mm_key(m.modality, m.data, planner.preprocess_fingerprint(m, f"media[{i}]"), fingerprint)
        for i, m in enumerate(items)
    ]
    assert keys == [e.mm_key for e in encoded]
    assert len(set(keys)) == len(keys)


def test_the_planner_loads_no_towers():
    code = "import sys, encoder_service.planner; print('encoder_service.towers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
