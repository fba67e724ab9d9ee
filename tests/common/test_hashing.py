"""mm_key framing: every collision class of serving spec section 2 must give different keys."""

import hashlib

import pytest

from common.hashing import canonical_encoding, encoder_fingerprint, mm_key, tensor_digest

FP = hashlib.sha256(b"encoder").digest()
IMAGE = {"patch_size": 40, "rescale_frac": 2.0, "max_upscaled_long_edge": 2048}


def test_key_is_full_sha256_and_deterministic():
    key = mm_key("image", b"png-bytes", IMAGE, FP)
    assert len(key) == 32
    assert key == mm_key("image", b"png-bytes", dict(reversed(list(IMAGE.items()))), FP)


def test_same_bytes_different_params_or_modality_or_encoder():
    base = mm_key("image", b"same", IMAGE, FP)
    assert base != mm_key("image", b"same", {**IMAGE, "rescale_frac": None}, FP)
    assert base != mm_key("image", b"same", {**IMAGE, "rescale_frac": 1.0}, FP)
    assert base != mm_key("video", b"same", IMAGE, FP)
    assert base != mm_key("image", b"same", IMAGE, hashlib.sha256(b"other weights").digest())
    assert base != mm_key("image", b"same", {**IMAGE, "exif_transpose": False}, FP)


def test_video_sampling_params_change_the_key():
    video = {"fps": 2.0, "max_frames": 8, "include_audio": False}
    base = mm_key("video", b"mp4", video, FP)
    assert base != mm_key("video", b"mp4", {**video, "fps": 1.0}, FP)
    assert base != mm_key("video", b"mp4", {**video, "max_frames": 9}, FP)
    assert base != mm_key("video", b"mp4", {**video, "include_audio": True}, FP)


def test_shape_confusable_inputs():
    # 30x100 vs 100x30 with identical raw bytes: shape is framed, not concatenated.
    a = tensor_digest("uint8", (30, 100), bytes(3000))
    b = tensor_digest("uint8", (100, 30), bytes(3000))
    c = tensor_digest("int8", (30, 100), bytes(3000))
    assert len({a, b, c}) == 3
    # Boundary shifts between adjacent fields cannot collide.
    assert canonical_encoding(["ab", "c"]) != canonical_encoding(["a", "bc"])
    assert mm_key("image", b"ab", {"k": "c"}, FP) != mm_key("image", b"a", {"k": "bc"}, FP)
    assert canonical_encoding({"a": [1, 2]}) != canonical_encoding({"a": [12]})


def test_types_are_tagged():
    encodings = {canonical_encoding(v) for v in (1, 1.0, "1", b"1", True, [1], {"1": None}, None)}
    assert len(encodings) == 8


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        mm_key("pointcloud", b"x", {}, FP)
    with pytest.raises(ValueError):
        mm_key("image", b"x", {}, FP[:8])
    with pytest.raises(ValueError):
        canonical_encoding(float("nan"))
    with pytest.raises(TypeError):
        canonical_encoding(object())


def test_encoder_fingerprint_tracks_weights_and_config():
    cfg = {"patch_size": 40, "n_layers": 4}
    digests = {"visual.w": tensor_digest("bfloat16", (4, 4), bytes(32))}
    fp = encoder_fingerprint(cfg, digests)
    assert len(fp) == 32
    assert fp != encoder_fingerprint({**cfg, "n_layers": 3}, digests)
    changed = tensor_digest("bfloat16", (4, 4), b"\x01" + bytes(31))
    assert fp != encoder_fingerprint(cfg, {"visual.w": changed})
    assert fp != encoder_fingerprint(cfg, {"visual.v": digests["visual.w"]})
