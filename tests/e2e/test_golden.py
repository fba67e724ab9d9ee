"""The golden test (DESIGN.md correctness ladder, rung 3): the whole cluster returns transformers' greedy tokens.

Router + one decode replica + one encoder + Redis run as real processes (`deploy.launch.Cluster`, started once
for the module) on a tiny checkpoint in float32. Each case sends one chat request through the router; its
greedy tokens must equal `InklingForConditionalGeneration.generate` on the same checkpoint, with input ids
rendered by our chat code and pixel values / dMel codes computed by HF's own image processor and feature
extractor:

- (a) text only;
- (b) two images (no rescale, as HF's processor does by default) and an audio clip; sent twice: the second run
  is served from the shared Redis embedding cache (no encoder call) and the decoder's prefix cache;
- (c) a short video: its sampled frames are image spans; HF gets the same frames, decoded here, as images;
- (b) again on a replica with `--local-encode` (no encoder tier, no Redis).
- (b) and (a) on a replica of two tensor-parallel ranks (`--tensor-parallel-size 2`, gloo on CPU).
"""

from __future__ import annotations

import importlib.util
import io
import time
import types
import uuid
import wave
from collections.abc import Iterator
from dataclasses import dataclass

import av
import grpc
import numpy as np
import pytest
import redis
import torch
from PIL import Image

from decode_service.chat import ChatMessage, MediaPart, TextPart, render_chat
from decode_service.router import prefix_directory_key, request_prefix_hashes
from deploy.launch import Cluster, ClusterSpec
from encoder_service.preprocess.video import sample_frame_indices
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import draw_shapes, png_bytes, sample_media
from tools.make_tiny_checkpoint import VISION_CONFIG, make_tiny_checkpoint

REDIS_URL = "redis://127.0.0.1:6379/15"
MAX_TOKENS = 12
QUESTION = "What do you see and hear?"
EFFORT = 0.9  # the server's default reasoning effort (requests leave it unset)
VIDEO_FPS, VIDEO_FRAMES = 4.0, 4  # the 1 s, 8-frame sample clip -> frames 0, 2, 4, 7

MEDIA = sample_media()
IMAGE_A = MEDIA["shapes.png"]
IMAGE_B = png_bytes(draw_shapes(40, 24, shift=5))
AUDIO = MEDIA["tones_16k.wav"]
VIDEO = MEDIA["moving.mp4"]
NO_RESCALE = media_pb2.ImageParams(rescale_policy=media_pb2.RESCALE_POLICY_NONE)


@dataclass
class Golden:
    cluster: Cluster
    redis: redis.Redis
    prefix: str

    @property
    def address(self) -> str:
        return self.cluster.router_address


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # bf16 weights everywhere (no NVFP4): transformers reads this released layout with `from_pretrained`.
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("golden"), nvfp4=False, seed=0))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import InklingForConditionalGeneration

    model = InklingForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.config.text_config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def golden(checkpoint, tmp_path_factory) -> Iterator[Golden]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"ink:test-golden-{uuid.uuid4().hex[:12]}:"
    spec = ClusterSpec(
        checkpoint=checkpoint,
        encoders=1,
        decoders=1,
        redis=REDIS_URL,
        dtype="float32",
        log_dir=str(tmp_path_factory.mktemp("golden-logs")),
        startup_timeout_s=90.0,
        stop_timeout_s=15.0,
        grace_seconds=1.0,
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("INKLING_REDIS_KEY_PREFIX", prefix)  # the cluster's processes inherit it
            cluster = Cluster(spec).start()
        try:
            yield Golden(cluster, client, prefix)
        finally:
            cluster.stop()
    finally:
        for key in client.scan_iter(prefix + "*"):
            client.delete(key)
        client.close()


# ---------------------------------------------------------------------------------------------------------
# Requests


def _image(data: bytes) -> pb.ContentPart:
    return pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=data, image=NO_RESCALE))


def _audio(data: bytes) -> pb.ContentPart:
    return pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=data))


def _video(data: bytes) -> pb.ContentPart:
    params = media_pb2.VideoParams(fps=VIDEO_FPS, max_frames=VIDEO_FRAMES, include_audio=False, frame=NO_RESCALE)
    return pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_VIDEO, data=data, video=params))


def _request(rid: str, parts: list[pb.ContentPart]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        chat=pb.ChatPrompt(messages=[pb.Message(role=pb.ROLE_USER, content=parts)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


def _generate(address: str, request: pb.GenerateRequest) -> tuple[list[int], pb.Final]:
    with grpc.insecure_channel(address) as channel:
        responses = list(generator_pb2_grpc.GeneratorStub(channel).Generate(request, timeout=60))
    assert responses and responses[-1].WhichOneof("response") == "final"
    assert all(r.WhichOneof("response") == "delta" for r in responses[:-1])
    return [t for r in responses[:-1] for t in r.delta.token_ids], responses[-1].final


# ---------------------------------------------------------------------------------------------------------
# The transformers side


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as wav:
        assert wav.getframerate() == 16000 and wav.getnchannels() == 1 and wav.getsampwidth() == 2
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


def _hf_pixel_values(image: Image.Image) -> torch.Tensor:
    """HF's `pixel_values` [N, T=2, P, P, 3] for one image without rescale (HF's default).

    HF's image processor needs torchvision, which cannot be installed beside the CPU torch wheel here; without
    it the patches come from our preprocessor (checked against HF's processor in tests/encoder_service when
    torchvision is present), laid out and frame-duplicated the way HF's processor returns them.
    """
    patch = VISION_CONFIG["patch_size"]
    if importlib.util.find_spec("torchvision") is not None:
        from transformers.models.inkling.image_processing_inkling import InklingImageProcessor

        out = InklingImageProcessor(size={"height": patch, "width": patch}, rescale_image_frac=None)(
            image, return_tensors="pt"
        )
        return out["pixel_values"].float()
    from encoder_service.preprocess.image import ImagePolicy, preprocess_pil

    pixels = torch.from_numpy(preprocess_pil(image, ImagePolicy(patch_size=patch, rescale_frac=None)).pixels)
    return pixels[:, None].repeat(1, 2, 1, 1, 1)  # [N, P, P, 3] -> [N, 2, P, P, 3]


def _hf_audio(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's dMel codes and mask for one clip (the processor's own quantisation, without its tokenizer)."""
    from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor
    from transformers.models.inkling.processing_inkling import InklingProcessor

    features = InklingFeatureExtractor()(
        _wav_samples(data), sampling_rate=16000, return_attention_mask=True, return_tensors="pt"
    )
    dmel = types.SimpleNamespace(
        bin_centers=torch.linspace(-7.0, 2.0, 16, dtype=torch.float64).float(), dmel_min_value=-7.0, dmel_max_value=2.0
    )
    return InklingProcessor._extract_dmel_bins(dmel, features["input_features"]), features["input_features_mask"]


def _video_frames(data: bytes) -> list[Image.Image]:
    """The frames the encoder samples (SGLang's rule at VIDEO_FPS / VIDEO_FRAMES), decoded independently."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_image() for frame in container.decode(stream)]
        rate = float(stream.average_rate)
    return [frames[i] for i in sample_frame_indices(len(frames), rate, VIDEO_FPS, VIDEO_FRAMES)]


@torch.no_grad()
def _hf_tokens(model, parts: list, counts: list, **features) -> tuple[list[int], int]:
    prompt = render_chat([ChatMessage("user", parts)], (), EFFORT, counts).token_ids
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **features,
    )
    return out[0, len(prompt) :].tolist(), len(prompt)


# ---------------------------------------------------------------------------------------------------------
# Cases


def test_text_only_equals_transformers(golden, hf_model):
    expected, prompt_tokens = _hf_tokens(hf_model, [TextPart(QUESTION)], [])
    tokens, final = _generate(golden.address, _request("golden-text", [pb.ContentPart(text=QUESTION)]))
    assert tokens == expected
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == prompt_tokens and final.usage.completion_tokens == MAX_TOKENS
    assert final.usage.image_tokens == final.usage.audio_tokens == 0


def _images_and_audio(hf_model) -> tuple[list[int], int, list[int], list[pb.ContentPart]]:
    """Case (b): transformers' tokens, its prompt length, the per-item row counts, and the request's parts."""
    pixels = [_hf_pixel_values(Image.open(io.BytesIO(data))) for data in (IMAGE_A, IMAGE_B)]
    audio_ids, audio_mask = _hf_audio(AUDIO)
    counts = [pixels[0].shape[0], pixels[1].shape[0], int(audio_mask.sum())]
    parts = [MediaPart("image", 0), MediaPart("image", 1), MediaPart("audio", 2), TextPart(QUESTION)]
    expected, prompt_tokens = _hf_tokens(
        hf_model,
        parts,
        counts,
        pixel_values=torch.cat(pixels),
        audio_input_ids=audio_ids,
        audio_input_ids_mask=audio_mask,
    )
    wire = [_image(IMAGE_A), _image(IMAGE_B), _audio(AUDIO), pb.ContentPart(text=QUESTION)]
    return expected, prompt_tokens, counts, wire


def test_two_images_and_audio_equal_transformers_then_come_from_the_caches(golden, hf_model):
    expected, prompt_tokens, counts, wire = _images_and_audio(hf_model)

    tokens, final = _generate(golden.address, _request("golden-mm-1", wire))
    assert tokens == expected
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == prompt_tokens
    assert final.usage.image_tokens == counts[0] + counts[1] and final.usage.audio_tokens == counts[2]
    assert final.usage.mm_items_encoded == 3 and final.usage.mm_items_cached == 0
    # The encoder's asynchronous Redis writes land; the next request never reaches an encoder.
    deadline = time.monotonic() + 10
    while len(golden.redis.keys(golden.prefix + "*")) < 3:
        assert time.monotonic() < deadline, "encoder outputs never reached Redis"
        time.sleep(0.05)

    again = _request("golden-mm-2", wire)
    tokens2, final2 = _generate(golden.address, again)
    assert tokens2 == expected
    assert final2.usage.mm_items_cached == 3 and final2.usage.mm_items_encoded == 0
    assert 0 < final2.usage.cached_tokens < prompt_tokens
    assert final2.usage.cached_tokens == final2.usage.cached_tokens_gpu + final2.usage.cached_tokens_redis
    # The decode replica published the prompt to the router's prefix directory.
    directory_keys = [prefix_directory_key(h) for h in request_prefix_hashes(again)]
    try:
        assert golden.cluster.decoder_addresses[0].encode() in golden.redis.hgetall(directory_keys[0])
    finally:
        golden.redis.delete(*directory_keys)


def test_video_frames_equal_transformers_images(golden, hf_model):
    frames = [_hf_pixel_values(frame) for frame in _video_frames(VIDEO)]
    assert len(frames) == VIDEO_FRAMES
    counts = [[f.shape[0] for f in frames]]
    expected, prompt_tokens = _hf_tokens(
        hf_model, [MediaPart("video", 0), TextPart(QUESTION)], counts, pixel_values=torch.cat(frames)
    )
    tokens, final = _generate(golden.address, _request("golden-video", [_video(VIDEO), pb.ContentPart(text=QUESTION)]))
    assert tokens == expected
    assert final.usage.prompt_tokens == prompt_tokens
    assert final.usage.image_tokens == sum(counts[0]) and final.usage.audio_tokens == 0


def test_local_encode_replica_equals_transformers_with_images_and_audio(checkpoint, hf_model, tmp_path):
    """`decode --local-encode` (no encoder tier, no Redis): the replica encodes in-process, its audio as dMel
    codes summed at the fuse point, and still returns transformers' tokens."""
    expected, prompt_tokens, counts, wire = _images_and_audio(hf_model)
    spec = ClusterSpec(
        checkpoint=checkpoint,
        encoders=0,
        decoders=1,
        redis="none",
        dtype="float32",
        log_dir=str(tmp_path),
        startup_timeout_s=90.0,
        stop_timeout_s=15.0,
        grace_seconds=1.0,
    )
    cluster = Cluster(spec).start()
    try:
        tokens, final = _generate(cluster.router_address, _request("golden-local", wire))
    finally:
        cluster.stop()
    assert tokens == expected
    assert final.usage.prompt_tokens == prompt_tokens and final.usage.audio_tokens == counts[2]


def test_tensor_parallel_replica_equals_transformers_with_images_and_audio(checkpoint, hf_model, tmp_path):
    """A decode replica of two ranks (`--tensor-parallel-size 2`: gloo on CPU, rank 1 a child process) behind the
    router, with an encoder and Redis: transformers' tokens for images + audio, and for text."""
    expected, prompt_tokens, counts, wire = _images_and_audio(hf_model)
    text_expected, _ = _hf_tokens(hf_model, [TextPart(QUESTION)], [])
    spec = ClusterSpec(
        checkpoint=checkpoint,
        encoders=1,
        decoders=1,
        redis=REDIS_URL,
        dtype="float32",
        log_dir=str(tmp_path),
        startup_timeout_s=120.0,
        stop_timeout_s=15.0,
        grace_seconds=1.0,
        extra_args={"decode": ["--tensor-parallel-size", "2"]},
    )
    prefix = f"ink:test-golden-tp-{uuid.uuid4().hex[:12]}:"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INKLING_REDIS_KEY_PREFIX", prefix)
        cluster = Cluster(spec).start()
    try:
        tokens, final = _generate(cluster.router_address, _request("golden-tp-mm", wire))
        text_tokens, _ = _generate(cluster.router_address, _request("golden-tp-text", [pb.ContentPart(text=QUESTION)]))
    finally:
        cluster.stop()
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0)
        for key in client.scan_iter(prefix + "*"):
            client.delete(key)
        client.close()
    assert tokens == expected and text_tokens == text_expected
    assert final.usage.prompt_tokens == prompt_tokens and final.usage.audio_tokens == counts[2]
