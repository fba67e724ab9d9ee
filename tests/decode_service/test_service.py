"""DecodeService on the tiny checkpoint (float32, CPU): streaming, usage, abort, cancellation, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time

import pytest
import torch

from common.errors import InvalidInputError, UnavailableError
from common.fingerprint import model_fingerprint
from common.media import ImageOptions, MediaInput
from common.settings import DecodeEngineSettings
from common.wire import DTYPE_BF16, KIND_DMEL_CODES, KIND_EMBEDDINGS, EncodedItem, bytes_to_codes
from decode_service.api import DeltaEvent, FinalEvent, GenerateInput, SamplingParams, ServiceLimits
from decode_service.chat import CONTENT_TEXT, END_MESSAGE, MESSAGE_USER, ChatMessage, MediaPart, TextPart, encode_text
from decode_service.engine.build import build_engine
from decode_service.local_encoder import LocalEncoder
from decode_service.service import DecodeService
from encoder_service.codebook import AudioCodebook
from tools.make_sample_media import sample_media

PROMPT = (MESSAGE_USER, CONTENT_TEXT, *encode_text("Hello there"), END_MESSAGE)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def local_encoder(checkpoint):
    encoder = LocalEncoder.load(checkpoint, dtype="float32")  # its batchers belong to this test's event loop
    yield encoder
    await encoder.close()


@pytest.fixture
async def service(checkpoint, engine, local_encoder):
    svc = DecodeService(engine, local_encoder, audio_codebook=AudioCodebook.load(checkpoint))
    await svc.start()
    yield svc
    await svc.close()


async def collect(service: DecodeService, inp: GenerateInput) -> tuple[list[DeltaEvent], FinalEvent]:
    events = [e async for e in service.generate(inp)]
    assert isinstance(events[-1], FinalEvent)
    assert all(isinstance(e, DeltaEvent) for e in events[:-1])
    return events[:-1], events[-1]


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def wait_idle(service: DecodeService, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = service.load()
        if load.running == 0 and load.waiting == 0 and not service.engine.requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {service.load()}")


async def test_text_request_streams_deltas_and_ends_with_usage(service):
    deltas, final = await collect(service, GenerateInput("text-1", prompt_token_ids=PROMPT, sampling=GREEDY))
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 6
    assert final.finish_reason == "length"
    assert final.usage.prompt_tokens == len(PROMPT)
    assert final.usage.completion_tokens == 6
    assert final.usage.image_tokens == final.usage.audio_tokens == 0
    assert 0 < final.timings.ttft_s and final.timings.decode_s >= 0
    # Greedy is deterministic: the same request again gives the same tokens.
    again, _ = await collect(service, GenerateInput("text-2", prompt_token_ids=PROMPT, sampling=GREEDY))
    assert [t for d in again for t in d.token_ids] == tokens


async def test_logprobs_and_stop_token_ids(service):
    first, _ = await collect(service, GenerateInput("lp-0", prompt_token_ids=PROMPT, sampling=GREEDY))
    tokens = [t for d in first for t in d.token_ids]
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, stop_token_ids=(tokens[2],))
    deltas, final = await collect(service, GenerateInput("lp-1", prompt_token_ids=PROMPT, sampling=sampling))
    got = [t for d in deltas for t in d.token_ids]
    assert got == tokens[: tokens.index(tokens[2]) + 1]
    assert final.finish_reason == "stop" and final.matched_stop_token_id == tokens[2]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in logprobs] == got
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)


async def test_min_tokens_holds_off_stop_token_ids_and_stop_strings(service):
    first, _ = await collect(service, GenerateInput("mt-0", prompt_token_ids=PROMPT, sampling=GREEDY))
    tokens = [t for d in first for t in d.token_ids]
    text = "".join(d.text for d in first)
    early = tokens.index(tokens[0]) + 1  # the stop token would end the output after its first occurrence
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=(tokens[0],))
    stopped, _ = await collect(service, GenerateInput("mt-1", prompt_token_ids=PROMPT, sampling=sampling))
    assert len([t for d in stopped for t in d.token_ids]) == early
    held = dataclasses.replace(sampling, min_tokens=early + 1)
    deltas, final = await collect(service, GenerateInput("mt-2", prompt_token_ids=PROMPT, sampling=held))
    later = [i + 1 for i in range(held.min_tokens - 1, len(tokens)) if tokens[i] == tokens[0]]
    assert [t for d in deltas for t in d.token_ids] == tokens[: later[0] if later else len(tokens)]
    # A stop string that matches from the first token on ends nothing before min_tokens.
    strings = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=(text[:1],), min_tokens=6)
    deltas, final = await collect(service, GenerateInput("mt-3", prompt_token_ids=PROMPT, sampling=strings))
    assert [t for d in deltas for t in d.token_ids] == tokens
    short, _ = await collect(
        service, GenerateInput("mt-4", prompt_token_ids=PROMPT, sampling=dataclasses.replace(strings, min_tokens=0))
    )
    assert len([t for d in short for t in d.token_ids]) < len(tokens)


async def test_unset_max_tokens_is_the_bounded_default(engine):
    svc = DecodeService(engine, limits=ServiceLimits(default_max_tokens=3))
    await svc.start(warm_up=False)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        _, final = await collect(svc, GenerateInput("dm-1", prompt_token_ids=PROMPT, sampling=sampling))
        assert final.finish_reason == "length" and final.usage.completion_tokens == 3
    finally:
        await svc.close()


async def test_stop_string_cuts_the_text(service):
    deltas, _ = await collect(service, GenerateInput("s-0", prompt_token_ids=PROMPT, sampling=GREEDY))
    text = "".join(d.text for d in deltas)
    assert len(text) > 4
    stop = text[2:4]
    deltas, final = await collect(
        service,
        GenerateInput(
            "s-1",
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=(stop,)),
        ),
    )
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]
    assert final.finish_reason == "stop" and final.matched_stop == stop
    await wait_idle(service)


async def test_abort_by_id_ends_with_abort(service):
    sampling = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    gen = service.generate(GenerateInput("ab-1", prompt_token_ids=PROMPT, sampling=sampling))
    first = await anext(gen)
    assert isinstance(first, DeltaEvent)
    assert service.abort(["ab-1", "nope"]) == ["ab-1"]
    rest = [e async for e in gen]
    assert isinstance(rest[-1], FinalEvent) and rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens < 500
    await wait_idle(service)


async def test_cancellation_frees_pages_and_conv_slots(service):
    cache = service.engine.cache
    free_pages = {k: pool.num_free for k, pool in cache.pools.items()}
    free_slots = cache.num_free_slots
    sampling = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    gen = service.generate(GenerateInput("cx-1", prompt_token_ids=PROMPT, sampling=sampling))
    await anext(gen)
    await wait_for(lambda: service.load().running == 1)
    assert cache.num_free_slots == free_slots - 1
    await gen.aclose()  # what a cancelled gRPC call does to the stream
    await wait_idle(service)
    assert {k: pool.num_free for k, pool in cache.pools.items()} == free_pages
    assert cache.num_free_slots == free_slots
    assert service.load().kv_usage == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingParams(top_p=0.0), "sampling.top_p"),
        (SamplingParams(temperature=float("nan")), "sampling.temperature"),
        (SamplingParams(temperature=float("inf")), "sampling.temperature=inf must be finite"),
        (SamplingParams(repetition_penalty=float("inf")), "sampling.repetition_penalty=inf must be finite"),
        (SamplingParams(min_tokens=-1), "sampling.min_tokens"),
        (SamplingParams(min_tokens=7, max_tokens=6), "sampling.min_tokens=7 exceeds max_tokens=6"),
        (SamplingParams(logprobs=1000), "sampling.logprobs"),
        (SamplingParams(max_tokens=0), "sampling.max_tokens"),
        (SamplingParams(stop=("",)), "sampling.stop[0]"),
    ],
)
async def test_bad_sampling_names_the_field(service, sampling, field):
    with pytest.raises(InvalidInputError, match=field.replace("[", r"\[").replace("]", r"\]")):
        await collect(service, GenerateInput("bad", prompt_token_ids=PROMPT, sampling=sampling))


async def test_bad_prompts_name_the_field(service):
    with pytest.raises(InvalidInputError, match="prompt"):
        await collect(service, GenerateInput("bad-1", sampling=GREEDY))
    media = (MediaInput("image", sample_media()["shapes.png"]),)
    with pytest.raises(InvalidInputError, match="prompt.token_ids"):
        await collect(service, GenerateInput("bad-2", prompt_token_ids=PROMPT, media=media, sampling=GREEDY))
    with pytest.raises(InvalidInputError, match="^media: a text prompt takes no media"):
        await collect(service, GenerateInput("bad-2t", prompt_text="Describe.", media=media, sampling=GREEDY))
    with pytest.raises(InvalidInputError, match=r"media\[0\]"):
        bad = (MediaInput("image", b"not an image"),)
        await collect(
            service,
            GenerateInput(
                "bad-3", messages=(ChatMessage("user", [MediaPart("image", 0)]),), media=bad, sampling=GREEDY
            ),
        )
    await wait_idle(service)


async def test_chat_and_token_prompt_with_image_and_audio_agree(service):
    files = sample_media()
    media = (
        MediaInput("image", files["shapes.png"], ImageOptions(rescale="none")),
        MediaInput("audio", files["tones_16k.wav"]),
    )
    chat = (ChatMessage("user", [MediaPart("image", 0), MediaPart("audio", 1), TextPart("What is this?")]),)
    deltas, final = await collect(service, GenerateInput("mm-chat", messages=chat, media=media, sampling=GREEDY))
    assert final.usage.image_tokens == 8 * 13  # 64 rows / 8 x (96 / 8 + 1) columns
    assert final.usage.audio_tokens == 30  # 1.5 s at 20 tokens/s
    assert final.usage.mm_items_encoded == 2
    # The same prompt as token ids with one placeholder per item gives the same tokens.
    from decode_service.chat import render_chat

    rendered = render_chat(list(chat), (), 0.9, [1, 1])
    deltas2, final2 = await collect(
        service, GenerateInput("mm-tok", prompt_token_ids=tuple(rendered.token_ids), media=media, sampling=GREEDY)
    )
    assert final2.usage.prompt_tokens == final.usage.prompt_tokens
    assert [t for d in deltas2 for t in d.token_ids] == [t for d in deltas for t in d.token_ids]


class _Rewriting:
    """A MediaEncoder that passes the local encoder's items through `rewrite` (what another wire would carry)."""

    def __init__(self, inner: LocalEncoder, rewrite) -> None:
        self.inner, self.rewrite = inner, rewrite
        self.inflight_items, self.pool_fingerprint = 0, inner.pool_fingerprint

    async def encode(self, items, request_id="", timeout_s=None):
        return [self.rewrite(item) for item in await self.inner.encode(items, request_id, timeout_s)]


def _as_tower_rows(tower):
    """A codes item -> the bf16 rows the encoder used to send for it: its audio tower's output."""

    def rewrite(item: EncodedItem) -> EncodedItem:
        if item.kind != KIND_DMEL_CODES:
            return item
        codes = torch.from_numpy(bytes_to_codes(item.payload, item.rows, item.codes_per_row).copy())
        with torch.inference_mode():
            payload = tower(codes).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        return dataclasses.replace(
            item, payload=payload, dtype=DTYPE_BF16, kind=KIND_EMBEDDINGS, codes_per_row=0, tower_dtype=""
        )

    return rewrite


MIXED = (
    MediaInput("audio", sample_media()["tones_16k.wav"]),
    MediaInput("image", sample_media()["shapes.png"], ImageOptions(rescale="none")),
    MediaInput("audio", sample_media()["tones_44k_stereo.wav"]),
)
MIXED_CHAT = (
    ChatMessage("user", [MediaPart("audio", 0), MediaPart("image", 1), TextPart("Compare."), MediaPart("audio", 2)]),
)


async def test_audio_as_codes_gives_the_rows_the_encoder_used_to_send(service, engine, local_encoder):
    """Mixed image + audio: the rows the model sees are those of rows on the wire, bit for bit (model in fp32)."""
    rows_wire = DecodeService(engine, _Rewriting(local_encoder, _as_tower_rows(local_encoder.engine.audio)))  # idle
    codes = await local_encoder.encode(MIXED)
    assert [i.kind for i in codes] == [KIND_DMEL_CODES, KIND_EMBEDDINGS, KIND_DMEL_CODES]
    inp = GenerateInput("mm-codes", messages=MIXED_CHAT, media=MIXED, sampling=GREEDY)
    _, from_codes = service._prepare(inp, codes)
    _, from_rows = rows_wire._prepare(inp, [_as_tower_rows(local_encoder.engine.audio)(i) for i in codes])
    assert [m.length for m in from_codes] == [30, 8 * 13, 30]
    for a, b in zip(from_codes, from_rows, strict=True):
        assert a.mm_key == b.mm_key and a.start == b.start and a.rows.dtype == b.rows.dtype == torch.float32
        assert torch.equal(a.rows.view(torch.int32), b.rows.view(torch.int32))
    _, final = await collect(service, inp)
    assert final.usage.audio_tokens == 60 and final.usage.image_tokens == 8 * 13


async def test_corrupt_audio_codes_fail_the_request_naming_the_item(engine, local_encoder, checkpoint):
    def corrupt(item: EncodedItem) -> EncodedItem:
        if item.kind != KIND_DMEL_CODES:
            return item
        return dataclasses.replace(item, payload=bytes([99]) + item.payload[1:])

    svc = DecodeService(engine, _Rewriting(local_encoder, corrupt), audio_codebook=AudioCodebook.load(checkpoint))
    await svc.start(warm_up=False)
    try:
        inp = GenerateInput("mm-bad", messages=MIXED_CHAT, media=MIXED, sampling=GREEDY)
        with pytest.raises(UnavailableError, match=r"media\[0\] \(audio\): corrupt dMel codes: frame 0, mel bin 0"):
            await collect(svc, inp)
        _, final = await collect(svc, GenerateInput("after", prompt_token_ids=PROMPT, sampling=GREEDY))
        assert final.usage.completion_tokens == GREEDY.max_tokens
    finally:
        await svc.close()


async def test_audio_codes_without_an_audio_tower_are_unavailable(engine, local_encoder):
    svc = DecodeService(engine, local_encoder)
    await svc.start(warm_up=False)
    try:
        inp = GenerateInput("mm-none", messages=MIXED_CHAT, media=MIXED, sampling=GREEDY)
        with pytest.raises(UnavailableError, match=r"media\[0\] \(audio\): the encoder sent dMel codes"):
            await collect(svc, inp)
    finally:
        await svc.close()


async def test_a_started_service_freezes_the_collector_until_it_closes(engine, local_encoder):
    """The startup heap leaves the garbage collector's walks while a service of the process runs."""
    assert gc.get_freeze_count() == 0
    svc = DecodeService(engine, local_encoder)
    await svc.start(warm_up=False)
    assert gc.get_freeze_count() > 0
    await svc.close()
    await svc.close()  # twice: counted once
    assert gc.get_freeze_count() == 0


async def test_not_ready_is_unavailable(engine):
    svc = DecodeService(engine)
    with pytest.raises(UnavailableError):
        async with contextlib.aclosing(svc.generate(GenerateInput("x", prompt_token_ids=PROMPT))) as gen:
            await anext(gen)


async def test_an_engine_step_that_raises_fails_the_request_and_the_service_carries_on(service, monkeypatch):
    from decode_service.api import EngineFailure

    real_step = service.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(service.engine, "step", flaky_step)
    with pytest.raises(EngineFailure, match="injected"):
        await collect(service, GenerateInput("boom", prompt_token_ids=PROMPT, sampling=GREEDY))
    await wait_idle(service)
    _, final = await collect(service, GenerateInput("after", prompt_token_ids=PROMPT, sampling=GREEDY))
    assert final.finish_reason == "length"


async def test_too_many_live_requests_is_resource_exhausted(engine):
    from common.errors import ResourceExhaustedError

    svc = DecodeService(engine, limits=ServiceLimits(max_live_requests=1))
    await svc.start(warm_up=False)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        async with contextlib.aclosing(
            svc.generate(GenerateInput("busy-1", prompt_token_ids=PROMPT, sampling=sampling))
        ) as first:
            await anext(first)
            with pytest.raises(ResourceExhaustedError, match="busy"):
                await collect(svc, GenerateInput("busy-2", prompt_token_ids=PROMPT, sampling=GREEDY))
        await wait_idle(svc)
    finally:
        await svc.close()


async def test_a_repeated_prompt_reports_prefix_cache_tokens(checkpoint):
    engine = build_engine(
        checkpoint,
        DecodeEngineSettings(
            dtype="float32",
            kv_cache_bytes=8 << 20,
            max_num_seqs=2,
            max_num_batched_tokens=256,
            enable_prefix_cache=True,
        ),
    )
    svc = DecodeService(engine)
    await svc.start(warm_up=False)
    try:
        prompt = (
            MESSAGE_USER,
            CONTENT_TEXT,
            *encode_text("the quick brown fox jumps over the lazy dog " * 6),
            END_MESSAGE,
        )
        first, final1 = await collect(svc, GenerateInput("p-1", prompt_token_ids=prompt, sampling=GREEDY))
        second, final2 = await collect(svc, GenerateInput("p-2", prompt_token_ids=prompt, sampling=GREEDY))
        assert final1.usage.cached_tokens_gpu == 0 and final2.usage.cached_tokens_gpu >= 32
        assert final2.usage.cached_tokens == final2.usage.cached_tokens_gpu
        assert [t for d in second for t in d.token_ids] == [t for d in first for t in d.token_ids]
        assert svc.load().prefix_cache_hit_rate > 0
        # The prefix keys carry the weights fingerprint of the checkpoint, and GetModelInfo reports it.
        assert engine.prefix_cache.fingerprint == model_fingerprint(checkpoint, "float32")
        assert svc.model_info().model_fingerprint == model_fingerprint(checkpoint, "float32")
    finally:
        await svc.close()
