"""Image preprocessing against HF (normalisation, patches when torchvision is present), tml-renderers (token
counts) and the spec's tables."""

from __future__ import annotations

import importlib.util
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from tml_renderers import chat, tokenizers, v0
from transformers.image_processing_backends import TorchvisionBackend
from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from common.errors import InvalidInputError
from encoder_service.preprocess.image import (
    ImagePolicy,
    image_token_count,
    patchify,
    preprocess_image,
    preprocess_pil,
    probe_image,
    rescaled_size,
)

NO_RESCALE = ImagePolicy(rescale_frac=None)
SERVING = ImagePolicy(rescale_frac=2.0, max_upscaled_long_edge=2048)


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _random_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------------------------
# Token counts: spec 1.3 table and the canonical TML renderer


SPEC_TABLE = [  # (w, h, tokens without rescale, size with f=2 C=2048, tokens with rescale)
    (224, 224, 36, (448, 448), 144),
    (336, 336, 81, (672, 672), 289),
    (512, 512, 169, (1024, 1024), 676),
    (640, 480, 204, (1280, 960), 792),
    (800, 600, 315, (1600, 1200), 1230),
    (1024, 768, 520, (2048, 1536), 2028),
    (1280, 720, 594, (2048, 1152), 1508),
    (1500, 1000, 950, (2048, 1365), 1820),
    (1920, 1080, 1323, (2048, 1152), 1508),
    (4032, 3024, 7676, (4032, 3024), 7676),
]


@pytest.mark.parametrize("w,h,plain,size,scaled", SPEC_TABLE)
def test_token_counts_match_spec_table(w, h, plain, size, scaled):
    assert image_token_count(w, h, NO_RESCALE) == plain
    assert rescaled_size(w, h, SERVING) == size
    assert image_token_count(w, h, SERVING) == scaled


def test_token_counts_match_tml_renderers():
    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    user = chat.Author(chat.AuthorKind.User)
    sizes = [(640, 480), (224, 224), (1024, 768), (40, 40), (80, 39), (1, 1), (39, 41), (4032, 3024), (333, 777)]
    for w, h in sizes:
        for policy in (NO_RESCALE, SERVING):
            rw, rh = rescaled_size(w, h, policy)
            message = chat.Message(chat.ImagePointer("/nonexistent.png", chat.ImageFormat.Png, rw, rh), user)
            spans, _ = renderer.render_for_completion([message])
            counts = [s.span.num_tokens for s in spans if isinstance(s.span, chat.ImageAssetPointerTokenSpan)]
            assert counts == [image_token_count(w, h, policy)], (w, h, policy.rescale_frac)


def test_rescale_rules():
    assert rescaled_size(1023, 10, SERVING) == (2046, 20)
    assert rescaled_size(3000, 5, SERVING) == (3000, 5)  # above the cap: never shrunk
    assert rescaled_size(3, 5, ImagePolicy(rescale_frac=0.5)) == (2, 3)  # half-up, not banker's rounding
    assert rescaled_size(7, 7, ImagePolicy(rescale_frac=1.0)) == (7, 7)
    with pytest.raises(InvalidInputError, match="rescale_frac"):
        ImagePolicy(rescale_frac=float("nan"))


# ---------------------------------------------------------------------------------------------------------------
# Pixels


def test_normalisation_equals_hf_fused_formula_for_every_value():
    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor(
        None, True, tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD), True, 1 / 255
    )
    values = torch.arange(-1, 256, dtype=torch.float32)[:, None].expand(-1, 3)  # [257, 3] incl. the pad value
    expected = ((values - mean) / std).numpy()
    rgb = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2)  # every value once
    patches, rows, cols = patchify(rgb, 16)  # [2, 16, 16, 3]: image patch + all-pad patch
    assert (rows, cols) == (1, 2)
    assert np.array_equal(patches[0].reshape(256, 3), expected[1:])
    assert np.array_equal(patches[1].reshape(256, 3), np.broadcast_to(expected[0], (256, 3)))
    np.testing.assert_allclose(expected[0], [-1.80686, -1.76710, -1.49444], atol=1e-5)  # spec 1.2


def test_patch_layout_row_major_with_extra_padded_column():
    image = _random_rgb(23, 17)
    out = preprocess_pil(image, ImagePolicy(patch_size=8, rescale_frac=None))
    assert (out.rows, out.cols, out.pixels.shape) == (3, 3, (9, 8, 8, 3))
    raw = np.asarray(image)
    reference = preprocess_pil(Image.new("RGB", (1, 1)), ImagePolicy(patch_size=8, rescale_frac=None)).pixels
    pad = reference[0, 0, 1]  # right of a 1x1 image
    for y, x in [(0, 0), (16, 22), (9, 15), (5, 7)]:
        single = patchify(raw[y : y + 1, x : x + 1], 8)[0][0, 0, 0]
        assert np.array_equal(out.pixels[(y // 8) * 3 + x // 8, y % 8, x % 8], single)
    assert np.array_equal(out.pixels[2 * 3 + 0, 1, 0], pad)  # below the image (rows 17..23)
    assert np.array_equal(out.pixels[0 * 3 + 2, 0, 7], pad)  # right of the image (column 23)


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None,
    reason="HF InklingImageProcessor needs torchvision (not installable here with CPU torch)",
)
def test_patches_equal_hf_image_processor():
    from transformers.models.inkling.image_processing_inkling import InklingImageProcessor

    processor = InklingImageProcessor(size={"height": 8, "width": 8})
    for w, h in [(23, 17), (16, 16), (5, 9)]:
        image = _random_rgb(w, h, seed=w)
        expected = processor(images=[image], return_tensors="pt")["pixel_values"]  # [N, 2, P, P, 3]
        ours = preprocess_pil(image, ImagePolicy(patch_size=8, rescale_frac=None)).pixels
        assert torch.equal(expected[:, 0], torch.from_numpy(ours))
        assert torch.equal(expected[:, 1], torch.from_numpy(ours))


def test_rescale_uses_pil_lanczos():
    image = _random_rgb(30, 20)
    out = preprocess_pil(image, ImagePolicy(patch_size=8))
    assert (out.width, out.height) == (60, 40)
    direct = preprocess_pil(
        image.resize((60, 40), Image.Resampling.LANCZOS), ImagePolicy(patch_size=8, rescale_frac=None)
    )
    assert np.array_equal(out.pixels, direct.pixels)


def test_alpha_is_composited_on_white():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 0  # transparent -> white
    rgba[0, 1, 3] = 255  # opaque -> (200, 0, 0)
    rgba[0, 2, 3] = 128
    data = _encode(Image.fromarray(rgba, "RGBA"), "PNG")
    out = preprocess_image(data, ImagePolicy(patch_size=4, rescale_frac=None)).pixels
    white = patchify(np.full((1, 1, 3), 255, np.uint8), 4)[0][0, 0, 0]
    red = patchify(np.array([[[200, 0, 0]]], np.uint8), 4)[0][0, 0, 0]
    assert np.array_equal(out[0, 0, 0], white) and np.array_equal(out[0, 0, 1], red)
    blend = Image.alpha_composite(
        Image.new("RGBA", (1, 1), (255, 255, 255, 255)), Image.new("RGBA", (1, 1), (200, 0, 0, 128))
    ).convert("RGB")
    assert np.array_equal(out[0, 0, 2], patchify(np.asarray(blend), 4)[0][0, 0, 0])
    # palette image with a transparent index
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0
    out = preprocess_image(_encode(palette, "PNG", transparency=0), ImagePolicy(patch_size=4, rescale_frac=None))
    assert np.array_equal(out.pixels[0, 0, 0], white)


def test_exif_orientation_is_applied():
    image = _random_rgb(30, 10)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = _encode(image, "PNG", exif=exif)
    assert probe_image(data) == (10, 30)
    assert probe_image(data, exif_transpose=False) == (30, 10)
    out = preprocess_image(data, ImagePolicy(patch_size=8, rescale_frac=None))
    expected = preprocess_pil(image.transpose(Image.Transpose.ROTATE_270), ImagePolicy(patch_size=8, rescale_frac=None))
    assert (out.width, out.height) == (10, 30) and np.array_equal(out.pixels, expected.pixels)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_formats_decode(fmt):
    image = _random_rgb(12, 9)
    data = _encode(image, fmt)
    assert probe_image(data) == (12, 9)
    out = preprocess_image(data, ImagePolicy(patch_size=4, rescale_frac=None))
    assert out.pixels.shape == (3 * 4, 4, 4, 3) and out.pixels.dtype == np.float32


def _png_header_only(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = b"IDAT" + zlib.compress(b"\x00" * 16)
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
        + struct.pack(">I", len(idat) - 4)
        + idat
        + struct.pack(">I", zlib.crc32(idat))
    )


def test_bad_input_names_the_item():
    with pytest.raises(InvalidInputError, match="image 3: not a decodable image"):
        preprocess_image(b"definitely not an image", SERVING, item="image 3")
    truncated = _encode(_random_rgb(64, 64), "PNG")[:200]
    with pytest.raises(InvalidInputError, match="photo"):
        preprocess_image(truncated, SERVING, item="photo")
    with pytest.raises(InvalidInputError, match="bytes exceeds"):
        preprocess_image(b"x" * 100, ImagePolicy(max_bytes=10))


def test_limits_checked_from_the_header_before_decoding():
    bomb = _png_header_only(20_000, 8_000)  # 160 Mpixel (480 MB decoded) in 60 bytes
    assert probe_image(bomb) == (20_000, 8_000)
    with pytest.raises(InvalidInputError, match="bomb: 20000x8000 exceeds the limit of 100000000 pixels"):
        preprocess_image(bomb, ImagePolicy(max_pixels=100_000_000), item="bomb")
    with pytest.raises(InvalidInputError, match="huge: .*too large"):
        probe_image(_png_header_only(100_000, 100_000), item="huge")  # beyond PIL's own bomb limit
    with pytest.raises(InvalidInputError, match="patches"):
        preprocess_image(_png_header_only(4000, 4000), ImagePolicy(max_patches=1000), item="big")


def test_fingerprint_tracks_tower_input_parameters():
    assert SERVING.fingerprint() != NO_RESCALE.fingerprint()
    assert ImagePolicy(max_patches=5).fingerprint() == ImagePolicy().fingerprint()
