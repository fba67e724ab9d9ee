"""The golden test (DESIGN.md correctness ladder, rung 3): the whole cluster returns transformers' greedy tokens.

Router + one decode replica + two encoders + Redis run as real processes (`deploy.launch.Cluster`) on a tiny
checkpoint in float32. One chat request with an image (no rescale, as HF's processor does by default) and an
audio clip goes through the router; its greedy tokens must equal `InklingForConditionalGeneration.generate` on
the same checkpoint, with input ids rendered by our chat code and pixel values / dMel codes computed by HF's own
image processor and feature extractor. The same request again must be served from the shared Redis embedding
cache (no encoder call) with the same tokens.
"""

from __future__ import annotations

import importlib.util
import io
import time
import types
import uuid
import wave

import grpc
import numpy as np
import pytest
import redis
import torch
from PIL import Image

from decode_service.chat import ChatMessage, MediaPart, TextPart, render_chat
from decode_service.router import prefix_directory_key, request_prefix_hashes
from deploy.launch import Cluster, ClusterSpec
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import sample_media
from tools.make_tiny_checkpoint import VISION_CONFIG, make_tiny_checkpoint

REDIS_URL = "redis://127.0.0.1:6379/15"
MAX_TOKENS = 12
QUESTION = "What do you see and hear?"


def _redis_or_skip() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    return client


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # bf16 weights everywhere (no NVFP4): transformers reads this released layout with `from_pretrained`.
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("golden"), nvfp4=False, seed=0))


def _chat_request(rid: str, image: bytes, audio: bytes) -> pb.GenerateRequest:
    parts = [
        pb.ContentPart(media=media_pb2.MediaItem(
            modality=media_pb2.MODALITY_IMAGE, data=image,
            image=media_pb2.ImageParams(rescale_policy=media_pb2.RESCALE_POLICY_NONE))),
        pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=audio)),
        pb.ContentPart(text=QUESTION),
    ]
    return pb.GenerateRequest(
        request_id=rid, chat=pb.ChatPrompt(messages=[pb.Message(role=pb.ROLE_USER, content=parts)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))


def _generate(address: str, request: pb.GenerateRequest) -> tuple[list[int], pb.Final]:
    with grpc.insecure_channel(address) as channel:
        stub = generator_pb2_grpc.GeneratorStub(channel)
        responses = list(stub.Generate(request, timeout=60))
    assert responses and responses[-1].WhichOneof("response") == "final"
    return [t for r in responses[:-1] for t in r.delta.token_ids], responses[-1].final


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as wav:
        assert wav.getframerate() == 16000 and wav.getnchannels() == 1 and wav.getsampwidth() == 2
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


def _hf_pixel_values(image: bytes) -> tuple[torch.Tensor, int]:
    """HF's `pixel_values` [N, T=2, P, P, 3] for one image without rescale (HF's default).

    HF's image processor needs torchvision, which cannot be installed beside the CPU torch wheel here; without
    it the patches come from our preprocessor (checked against HF's processor in tests/encoder_service when
    torchvision is present), laid out and frame-duplicated the way HF's processor returns them.
    """
    patch = VISION_CONFIG["patch_size"]
    if importlib.util.find_spec("torchvision") is not None:
        from transformers.models.inkling.image_processing_inkling import InklingImageProcessor

        out = InklingImageProcessor(size={"height": patch, "width": patch}, rescale_image_frac=None)(
            Image.open(io.BytesIO(image)), return_tensors="pt")
        return out["pixel_values"].float(), int(out["num_patches"][0])
    from encoder_service.preprocess.image import ImagePolicy, preprocess_image

    pixels = torch.from_numpy(preprocess_image(image, ImagePolicy(patch_size=patch, rescale_frac=None)).pixels)
    return pixels[:, None].repeat(1, 2, 1, 1, 1), int(pixels.shape[0])  # [N, P, P, 3] -> [N, 2, P, P, 3]


@torch.no_grad()
def _transformers_tokens(checkpoint: str, image: bytes, audio: bytes) -> tuple[list[int], int]:
    from transformers import InklingForConditionalGeneration
    from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor
    from transformers.models.inkling.processing_inkling import InklingProcessor

    pixel_values, num_patches = _hf_pixel_values(image)
    features = InklingFeatureExtractor()(_wav_samples(audio), sampling_rate=16000, return_attention_mask=True,
                                         return_tensors="pt")
    # HF's own dMel quantisation (the processor method, without building a tokenizer for the processor).
    dmel = types.SimpleNamespace(bin_centers=torch.linspace(-7.0, 2.0, 16, dtype=torch.float64).float(),
                                 dmel_min_value=-7.0, dmel_max_value=2.0)
    audio_ids = InklingProcessor._extract_dmel_bins(dmel, features["input_features"])
    audio_mask = features["input_features_mask"]
    counts = [num_patches, int(audio_mask.sum())]
    messages = [ChatMessage("user", [MediaPart("image", 0), MediaPart("audio", 1), TextPart(QUESTION)])]
    prompt = render_chat(messages, (), 0.9, counts).token_ids  # the server's default reasoning effort

    model = InklingForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.config.text_config._attn_implementation = "eager"
    out = model.generate(torch.tensor([prompt]), pixel_values=pixel_values,
                         audio_input_ids=audio_ids, audio_input_ids_mask=audio_mask, max_new_tokens=MAX_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist(), len(prompt)


def test_cluster_greedy_tokens_equal_transformers(checkpoint, tmp_path, monkeypatch):
    client = _redis_or_skip()
    prefix = f"ink:test-golden-{uuid.uuid4().hex[:12]}:"
    monkeypatch.setenv("INKLING_REDIS_KEY_PREFIX", prefix)  # the cluster's processes inherit it
    media = sample_media()
    image, audio = media["shapes.png"], media["tones_16k.wav"]
    expected, prompt_tokens = _transformers_tokens(checkpoint, image, audio)
    spec = ClusterSpec(checkpoint=checkpoint, encoders=2, decoders=1, redis=REDIS_URL, dtype="float32",
                       log_dir=str(tmp_path / "logs"), startup_timeout_s=90.0, stop_timeout_s=15.0,
                       grace_seconds=1.0)
    request = _chat_request("golden-1", image, audio)
    directory_keys = [prefix_directory_key(h) for h in request_prefix_hashes(request)]
    try:
        with Cluster(spec) as cluster:
            tokens, final = _generate(cluster.router_address, request)
            assert tokens == expected
            assert final.finish_reason == pb.FINISH_REASON_LENGTH
            assert final.usage.prompt_tokens == prompt_tokens
            assert final.usage.image_tokens == 8 * 13 and final.usage.audio_tokens == 30
            assert final.usage.mm_items_encoded == 2 and final.usage.mm_items_cached == 0
            # The encoders' asynchronous Redis writes land; the next request never reaches an encoder.
            deadline = time.monotonic() + 10
            while len(client.keys(prefix + "*")) < 2:
                assert time.monotonic() < deadline, "encoder outputs never reached Redis"
                time.sleep(0.05)
            tokens2, final2 = _generate(cluster.router_address, _chat_request("golden-2", image, audio))
            assert tokens2 == expected
            assert final2.usage.mm_items_cached == 2 and final2.usage.mm_items_encoded == 0
            # The decode replica published the prompt to the router's prefix directory.
            assert cluster.decoder_addresses[0].encode() in client.hgetall(directory_keys[0])
    finally:
        for key in [*client.scan_iter(prefix + "*"), *directory_keys]:
            client.delete(key)
        client.close()
