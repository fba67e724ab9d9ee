"""Image bytes -> normalised hMLP patches (spec multimodal section 1).

Pipeline per image: header probe + limits, decode, EXIF orientation, RGB with alpha over white, optional
long-edge rescale (PIL LANCZOS, half-up rounding), patch grid of ceil(H/P) rows by floor(W/P)+1 columns padded
with the raw value -1, CLIP normalisation. One frame per patch is returned; the tower makes the T=2 copy.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from common.errors import InvalidInputError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PAD_VALUE = -1.0  # raw value (0..255 scale) of pixels outside the image, applied before normalisation
DECODABLE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


@dataclass(frozen=True)
class ImagePolicy:
    """Every knob of the image path; `fingerprint()` lists those that change the tower input."""

    patch_size: int = 40
    rescale_frac: float | None = 2.0  # None: no resize
    max_upscaled_long_edge: int | None = 2048  # cap on growth only; None: uncapped
    exif_transpose: bool = True
    max_patches: int = 32768
    max_pixels: int = 178_956_970  # decoded (source) pixels
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.patch_size < 1:
            raise InvalidInputError(f"ImagePolicy.patch_size must be >= 1, got {self.patch_size}")
        frac = self.rescale_frac
        if frac is not None and not (math.isfinite(frac) and frac > 0):
            raise InvalidInputError(f"ImagePolicy.rescale_frac must be finite and > 0 or None, got {frac}")
        cap = self.max_upscaled_long_edge
        if cap is not None and cap < 1:
            raise InvalidInputError(f"ImagePolicy.max_upscaled_long_edge must be >= 1 or None, got {cap}")
        for name in ("max_patches", "max_pixels", "max_bytes"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"ImagePolicy.{name} must be >= 1, got {getattr(self, name)}")

    def fingerprint(self) -> dict:
        """Parameters that change the patches (limits do not: they only accept or reject)."""
        fields = asdict(self)
        for name in ("max_patches", "max_pixels", "max_bytes"):
            fields.pop(name)
        fields.update(
            mean=list(CLIP_MEAN),
            std=list(CLIP_STD),
            pad_value=PAD_VALUE,
            resample="PIL.LANCZOS",
            alpha="composite_on_white",
        )
        return fields


@dataclass(frozen=True)
class ImagePatches:
    """One image ready for the vision tower."""

    pixels: np.ndarray  # [N, P, P, 3] float32, one frame, normalised; N = rows * cols
    rows: int
    cols: int
    width: int  # size after rescale (the grid is computed from it)
    height: int

    @property
    def num_tokens(self) -> int:
        return self.rows * self.cols


# ---------------------------------------------------------------------------------------------------------------
# Sizes and token counts (header only)


def rescaled_size(width: int, height: int, policy: ImagePolicy) -> tuple[int, int]:
    """Size after the optional long-edge rescale (spec 1.1 step 3); the cap only limits growth."""
    if policy.rescale_frac is None:
        return width, height
    long_edge = max(width, height)
    target = long_edge * policy.rescale_frac
    if policy.max_upscaled_long_edge is not None:
        target = min(target, max(policy.max_upscaled_long_edge, long_edge))
    ratio = target / long_edge
    if ratio == 1.0:
        return width, height
    return max(1, math.floor(width * ratio + 0.5)), max(1, math.floor(height * ratio + 0.5))


def patch_grid(width: int, height: int, patch_size: int) -> tuple[int, int]:
    """(rows, cols) of the patch grid; the extra column is the always-padded end-of-row patch."""
    return -(-height // patch_size), width // patch_size + 1


def image_token_count(width: int, height: int, policy: ImagePolicy) -> int:
    """Tokens the image will occupy, from its (oriented) header size alone."""
    rows, cols = patch_grid(*rescaled_size(width, height, policy), policy.patch_size)
    return rows * cols


def _open(data: bytes, item: str) -> Image.Image:
    """Lazy open: reads only the header."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=DECODABLE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise InvalidInputError(f"{item}: image too large ({exc})") from exc
    except UnidentifiedImageError:  # its message names the Python buffer object
        formats = ", ".join(DECODABLE_FORMATS).lower()
        raise InvalidInputError(f"{item}: not a decodable image (format not recognised; accepted: {formats})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidInputError(f"{item}: not a decodable image ({exc})") from exc


def _oriented_size(image: Image.Image, exif_transpose: bool) -> tuple[int, int]:
    width, height = image.size
    if exif_transpose:
        try:
            orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
        except Exception:  # a broken EXIF block is ignored, as exif_transpose does
            orientation = 1
        if orientation in _TRANSPOSING_ORIENTATIONS:
            return height, width
    return width, height


def probe_image(data: bytes, exif_transpose: bool = True, item: str = "image") -> tuple[int, int]:
    """(width, height) as displayed (after EXIF orientation), without decoding pixels."""
    return _oriented_size(_open(data, item), exif_transpose)


def _check_limits(width: int, height: int, policy: ImagePolicy, item: str) -> None:
    if width < 1 or height < 1:
        raise InvalidInputError(f"{item}: empty image ({width}x{height})")
    if width * height > policy.max_pixels:
        raise InvalidInputError(f"{item}: {width}x{height} exceeds the limit of {policy.max_pixels} pixels")
    tokens = image_token_count(width, height, policy)
    if tokens > policy.max_patches:
        raise InvalidInputError(
            f"{item}: {width}x{height} gives {tokens} patches, above the limit of {policy.max_patches}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Decode and patchify


def decode_image(data: bytes, policy: ImagePolicy, item: str = "image") -> Image.Image:
    """Bytes -> oriented PIL image (any mode); limits are checked on the header before the pixels are decoded."""
    if len(data) > policy.max_bytes:
        raise InvalidInputError(f"{item}: {len(data)} bytes exceeds the limit of {policy.max_bytes}")
    image = _open(data, item)
    _check_limits(*_oriented_size(image, policy.exif_transpose), policy, item)
    try:
        image.load()  # the first frame only, for animated GIF/WebP/TIFF
        if policy.exif_transpose:
            image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidInputError(f"{item}: corrupt image data ({exc})") from exc
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, 8 bit; any alpha (band or palette transparency) is composited over opaque white."""
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _normalise(values: np.ndarray) -> np.ndarray:
    """(x - 255*mean) / (255*std) in float32 with the factors formed in float32 (bit-equal to HF)."""
    scale = np.float32(255.0)
    mean = np.asarray(CLIP_MEAN, dtype=np.float32) * scale
    std = np.asarray(CLIP_STD, dtype=np.float32) * scale
    return (values - mean) / std


def patchify(rgb: np.ndarray, patch_size: int) -> tuple[np.ndarray, int, int]:
    """uint8 [H, W, 3] -> normalised [rows*cols, P, P, 3] float32 with the padded grid of spec 1.1 step 4."""
    height, width, _ = rgb.shape
    rows, cols = patch_grid(width, height, patch_size)
    canvas = np.full((rows * patch_size, cols * patch_size, 3), PAD_VALUE, dtype=np.float32)
    canvas[:height, :width] = rgb
    canvas = _normalise(canvas)
    patches = canvas.reshape(rows, patch_size, cols, patch_size, 3).transpose(0, 2, 1, 3, 4)  # [R, K, P, P, 3]
    return np.ascontiguousarray(patches.reshape(rows * cols, patch_size, patch_size, 3)), rows, cols


def preprocess_pil(image: Image.Image | np.ndarray, policy: ImagePolicy, item: str = "image") -> ImagePatches:
    """Decoded image (PIL, or uint8 [H, W, 3] array such as a video frame) -> patches."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InvalidInputError(f"{item}: expected a uint8 [H, W, 3] array, got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    _check_limits(*image.size, policy, item)
    rgb = to_rgb(image)
    size = rescaled_size(*rgb.size, policy)
    if size != rgb.size:
        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
    pixels, rows, cols = patchify(np.asarray(rgb, dtype=np.uint8), policy.patch_size)
    return ImagePatches(pixels=pixels, rows=rows, cols=cols, width=size[0], height=size[1])


def preprocess_image(data: bytes, policy: ImagePolicy, item: str = "image") -> ImagePatches:
    """Encoded image bytes -> patches."""
    image = decode_image(data, policy, item)
    try:
        return preprocess_pil(image, policy, item)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{item}: corrupt image data ({exc})") from exc
