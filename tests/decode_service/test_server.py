"""Decode + encoder gRPC servers in-process on port 0, tiny checkpoint in float32."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import UnavailableError
from common.fingerprint import encoder_fingerprint_of
from common.grpc_util import UNAVAILABLE_DEPENDENCY_KEY
from common.metrics import DecodeMetrics, new_registry
from common.settings import DecodeEngineSettings, EncoderSettings, GrpcSettings
from decode_service.api import DeltaEvent
from decode_service.chat import encode_text, token_bytes
from decode_service.encoder_client import EncoderClient, EncoderPoolUnavailableError
from decode_service.engine.build import build_engine
from decode_service.engine.engine import Engine
from decode_service.output_parser import ParsedToolCall
from decode_service.server import GeneratorServicer, build_server, delta_message
from decode_service.service import DecodeService
from encoder_service.codebook import AudioCodebook
from encoder_service.planner import MediaPlanner
from encoder_service.server import build_server as build_encoder_server
from encoder_service.service import load_engine
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import sample_media

pytestmark = pytest.mark.anyio

MODEL = "tiny"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def cluster(checkpoint, engine):
    """(decode server, decode stub, encoder server): everything bound to 127.0.0.1 port 0."""
    encoder = build_encoder_server(
        load_engine(EncoderSettings(checkpoint=str(checkpoint), dtype="float32")), GrpcSettings(port=0)
    )
    await encoder.start()
    planner = MediaPlanner.for_checkpoint(checkpoint)  # mm_keys without the towers, as `inkling-epd decode` does
    metrics = DecodeMetrics(new_registry(), MODEL)
    client = EncoderClient(
        [f"127.0.0.1:{encoder.port}"],
        planner.preprocess_fingerprint,
        local_fingerprint=encoder_fingerprint_of(checkpoint, "float32"),
        observer=metrics,
    )
    service = DecodeService(engine, client, audio_codebook=AudioCodebook.load(checkpoint))
    decode = build_server(service, GrpcSettings(port=0), client, metrics)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    statuses: list[int] = []

    async def follow() -> None:
        async for response in watch:
            statuses.append(response.status)

    follower = asyncio.create_task(follow())
    await decode.start()
    try:
        deadline = time.monotonic() + 10
        while health_pb2.HealthCheckResponse.SERVING not in statuses:
            assert time.monotonic() < deadline, f"health never went SERVING: {statuses}"
            await asyncio.sleep(0.01)
        yield decode, generator_pb2_grpc.GeneratorStub(channel), encoder, statuses
    finally:
        watch.cancel()
        follower.cancel()
        await channel.close()
        await decode.stop(0.5)
        await encoder.stop(0.5)


def chat_request(rid: str, media: list[media_pb2.MediaItem], max_tokens: int = 5) -> pb.GenerateRequest:
    parts = [pb.ContentPart(media=m) for m in media] + [pb.ContentPart(text="Describe this.")]
    return pb.GenerateRequest(
        request_id=rid,
        chat=pb.ChatPrompt(messages=[pb.Message(role=pb.ROLE_USER, content=parts)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def image_and_audio() -> list[media_pb2.MediaItem]:
    files = sample_media()
    return [
        media_pb2.MediaItem(
            modality=media_pb2.MODALITY_IMAGE,
            data=files["shapes.png"],
            image=media_pb2.ImageParams(rescale_policy=media_pb2.RESCALE_POLICY_NONE),
        ),
        media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=files["tones_16k.wav"]),
    ]


async def generate(stub, request) -> tuple[list[pb.Delta], pb.Final]:
    responses = [r async for r in stub.Generate(request, timeout=60)]
    assert responses[-1].WhichOneof("response") == "final"
    assert all(r.WhichOneof("response") == "delta" for r in responses[:-1])
    return [r.delta for r in responses[:-1]], responses[-1].final


async def wait_idle(decode, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while decode.service.load().running or decode.service.load().waiting or decode.service.engine.requests:
        assert time.monotonic() < deadline, f"engine not idle: {decode.service.load()}"
        await asyncio.sleep(0.01)


async def test_health_goes_serving_after_warm_up(cluster):
    _, _, _, statuses = cluster
    assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.SERVING in statuses


async def test_multimodal_generate_uses_the_encoder_then_its_cache(cluster):
    decode, stub, encoder, _ = cluster
    deltas, final = await generate(stub, chat_request("mm-1", image_and_audio()))
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 5
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.image_tokens == 104 and final.usage.audio_tokens == 30
    assert final.usage.mm_items_encoded == 2 and final.usage.mm_items_cached == 0
    assert final.usage.completion_tokens == 5 and final.timings.ttft_s > 0
    # Same media again: the encoder's cache answers (cache_hit in its headers) and the tokens are the same.
    deltas2, final2 = await generate(stub, chat_request("mm-2", image_and_audio()))
    assert [t for d in deltas2 for t in d.token_ids] == tokens
    assert final2.usage.mm_items_cached == 2
    registry = decode.metrics.registry

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": MODEL, **labels})

    assert sample("inkling_ttft_seconds_count") == 2
    assert sample("inkling_itl_seconds_count") == 2 * 4
    assert sample("inkling_queue_time_seconds_count") == 2 and sample("inkling_e2e_request_latency_seconds_count") == 2
    assert sample("inkling_prompt_tokens_total") == final.usage.prompt_tokens + final2.usage.prompt_tokens
    assert sample("inkling_completion_tokens_total") == 10
    gpu, redis = (
        sample("inkling_prefix_cache_hits_total", tier="gpu"),
        sample("inkling_prefix_cache_hits_total", tier="redis"),
    )
    assert gpu == final.usage.cached_tokens_gpu + final2.usage.cached_tokens_gpu and redis == 0
    assert 0.0 <= sample("inkling_kv_cache_usage") <= 1.0
    assert sample("inkling_embedding_cache_queries_total") == 0  # no Redis configured
    address = f"127.0.0.1:{encoder.port}"
    assert sample("inkling_encode_rpc_seconds_count", encoder=address, code="OK") == 2
    assert sample("inkling_decode_requests_total", status="OK") == 2
    info = await stub.GetModelInfo(pb.ModelInfoRequest())
    assert info.encoder_fingerprint == encoder.engine.fingerprint
    assert info.image_token_id == 200054 and info.max_context_tokens > 0


async def test_corrupt_image_is_invalid_argument_naming_the_item(cluster):
    _, stub, _, _ = cluster
    media = image_and_audio()
    media[1] = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"\x89PNG garbage")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, chat_request("bad-1", media))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "media[1]" in err.value.details()


async def test_bad_sampling_is_invalid_argument_naming_the_field(cluster):
    _, stub, _, _ = cluster
    request = chat_request("bad-2", [])
    request.sampling.top_p = 1.5
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_p" in err.value.details()


async def test_client_cancellation_frees_the_engine(cluster):
    decode, stub, _, _ = cluster
    cache = decode.service.engine.cache
    free = {k: p.num_free for k, p in cache.pools.items()}
    call = stub.Generate(chat_request("cx-1", [], max_tokens=500))
    first = await call.read()
    assert first.WhichOneof("response") == "delta"
    assert decode.service.engine.requests  # it is running
    call.cancel()
    await wait_idle(decode)
    assert {k: p.num_free for k, p in cache.pools.items()} == free
    load = await stub.GetLoad(pb.LoadRequest())
    assert load.running_requests == 0 and load.kv_usage == pytest.approx(0.0)


async def test_abort_rpc_ends_the_stream_with_abort(cluster):
    decode, stub, _, _ = cluster
    call = stub.Generate(chat_request("ab-1", [], max_tokens=500))
    await call.read()
    aborted = await stub.Abort(pb.AbortRequest(request_ids=["ab-1", "unknown"]))
    assert list(aborted.aborted_request_ids) == ["ab-1"]
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    assert responses[-1].final.finish_reason == pb.FINISH_REASON_ABORT
    assert await call.code() == grpc.StatusCode.OK
    await wait_idle(decode)


async def test_cli_generate_through_the_server(cluster, tmp_path, capsys):
    import json

    from tools.cli import main

    decode, _, _, _ = cluster
    image = tmp_path / "shapes.png"
    image.write_bytes(sample_media()["shapes.png"])
    argv = [
        "generate",
        "--server",
        f"127.0.0.1:{decode.port}",
        "--prompt",
        "Describe.",
        "--image",
        str(image),
        "--no-rescale",
        "--max-tokens",
        "3",
        "--json",
    ]
    assert await asyncio.to_thread(main, argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) <= 3 and result["finish_reason"] in ("length", "stop")
    assert result["usage"]["image_tokens"] == 104
    bad = await asyncio.to_thread(
        main,
        [
            "generate",
            "--server",
            f"127.0.0.1:{decode.port}",
            "--prompt-ids",
            "1,2",
            "--image",
            str(image),
            "--max-tokens",
            "2",
        ],
    )
    assert bad == 1 and "INVALID_ARGUMENT" in capsys.readouterr().err


async def test_graceful_stop_reports_not_serving_and_drains_running_calls(engine):
    decode = build_server(DecodeService(engine), GrpcSettings(port=0))
    await decode.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        call = generator_pb2_grpc.GeneratorStub(channel).Generate(chat_request("drain", [], max_tokens=30))
        responses = [await call.read()]
        stopping = asyncio.create_task(decode.stop(20.0))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        assert await call.code() == grpc.StatusCode.OK
        assert responses[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.delta.token_ids) for r in responses) == 30
        await stopping
    finally:
        await channel.close()


def test_a_raw_text_tool_call_keeps_its_body_on_the_wire():
    call = ParsedToolCall(0, "functions.unknown:0", "", "", "search x")
    delta = delta_message(DeltaEvent(channel="tool_call", tool_call=call)).delta
    assert delta.channel == pb.CHANNEL_TOOL_CALL
    assert (delta.tool_call.id, delta.tool_call.name, delta.tool_call.text) == ("functions.unknown:0", "", "search x")


class _AbortRecorder:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details, tuple(trailing_metadata))
        raise grpc.aio.AbortError()


@pytest.mark.parametrize(
    ("exc", "trailing"),
    [
        (EncoderPoolUnavailableError("cannot encode media"), ((UNAVAILABLE_DEPENDENCY_KEY, "encoder"),)),
        (UnavailableError("engine stopped"), ()),
    ],
)
def test_an_encoder_pool_outage_is_flagged_for_the_router(exc, trailing):
    context = _AbortRecorder()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(GeneratorServicer(None)._abort(context, "r1", exc))
    assert context.aborted == (grpc.StatusCode.UNAVAILABLE, str(exc), trailing)


def test_decode_server_imports_neither_the_encoder_server_nor_the_router():
    code = (
        "import sys, decode_service.server; "
        "print(sorted(m for m in ('encoder_service.server', 'decode_service.router') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


async def test_text_prompt_is_the_ordinary_token_prompt_and_logprobs_carry_token_text(cluster):
    _, stub, _, _ = cluster
    text = "Once upon a time <|content_text|>"  # a special token's spelling stays ordinary text
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    by_text, text_final = await generate(
        stub, pb.GenerateRequest(request_id="tx-1", text=pb.TextPrompt(text=text), sampling=sampling)
    )
    tokens = pb.TokenPrompt(token_ids=encode_text(text))
    by_ids, ids_final = await generate(stub, pb.GenerateRequest(request_id="tx-2", tokens=tokens, sampling=sampling))
    assert [t for d in by_text for t in d.token_ids] == [t for d in by_ids for t in d.token_ids]
    assert text_final.usage.prompt_tokens == ids_final.usage.prompt_tokens == len(encode_text(text))
    entries = [e for d in by_text for e in d.logprobs]
    assert len(entries) == 4
    for entry in entries:
        for e in (entry, *entry.top):
            assert e.token_bytes == token_bytes(e.token_id)
            assert e.token == token_bytes(e.token_id).decode("utf-8", errors="replace")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, pb.GenerateRequest(request_id="tx-3", text=pb.TextPrompt(), sampling=sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text.text" in err.value.details()


def _engine(checkpoint, mtp_depth: int):
    return build_engine(
        checkpoint,
        DecodeEngineSettings(
            dtype="float32", kv_cache_bytes=8 << 20, max_num_seqs=4, enable_prefix_cache=False, mtp_depth=mtp_depth
        ),
    )


async def _serve(engine, prompts: list[pb.GenerateRequest], max_tokens: int, opt_out: frozenset[int] = frozenset()):
    """Greedy generations through a decode server on `engine`, the prompts at `opt_out` with `disable_speculation`;
    (tokens, usages, metric deltas over the calls)."""
    metrics = DecodeMetrics(new_registry(), MODEL)
    decode = build_server(DecodeService(engine, None), GrpcSettings(port=0), None, metrics)
    await decode.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
    try:
        stub = generator_pb2_grpc.GeneratorStub(channel)
        before = scrape(metrics.registry)
        results = await asyncio.gather(
            *(
                generate(
                    stub,
                    pb.GenerateRequest(
                        request_id=f"mtp-{i}",
                        sampling=pb.SamplingParams(
                            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, disable_speculation=i in opt_out
                        ),
                        **prompt,
                    ),
                )
                for i, prompt in enumerate(prompts)
            )
        )
        after = scrape(metrics.registry)
    finally:
        await channel.close()
        await decode.stop(0.5)
    tokens = [[t for d in deltas for t in d.token_ids] for deltas, _ in results]
    return tokens, [final.usage for _, final in results], {k: v - before.get(k, 0.0) for k, v in after.items()}


def value(metrics, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def scrape(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The registry's /metrics text, parsed back: (sample name, labels) -> value."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


async def test_mtp_depth_2_streams_the_same_greedy_tokens_and_reports_acceptance(checkpoint):
    texts = ["Once upon a time", "The quick brown fox jumps", "1 2 3 4 5 6 7"]
    prompts = [{"text": pb.TextPrompt(text=t)} for t in texts]
    plain, plain_usage, plain_metrics = await _serve(_engine(checkpoint, 0), prompts, max_tokens=12)
    spec, spec_usage, spec_metrics = await _serve(_engine(checkpoint, 2), prompts, max_tokens=12)
    assert spec == plain
    for u0, u2 in zip(plain_usage, spec_usage, strict=True):
        assert (u0.draft_tokens, u0.accepted_draft_tokens) == (0, 0)
        assert u2.completion_tokens == u0.completion_tokens == 12
        assert 0 <= u2.accepted_draft_tokens <= u2.draft_tokens
        # every token after the first comes from a later step (its sampled token plus the drafts it accepted);
        # a step verifies at most D = 2 drafts (fewer, or none, where max_tokens leaves less room)
        steps = u2.completion_tokens - 1 - u2.accepted_draft_tokens
        assert 0 < u2.draft_tokens <= 2 * steps

    assert value(plain_metrics, "inkling_spec_decode_num_draft_tokens_total") == 0
    drafts = value(spec_metrics, "inkling_spec_decode_num_draft_tokens_total")
    accepted = value(spec_metrics, "inkling_spec_decode_num_accepted_tokens_total")
    rounds = value(spec_metrics, "inkling_spec_decode_num_drafts_total")
    assert drafts == sum(u.draft_tokens for u in spec_usage)
    assert drafts / 2 <= rounds <= sum(u.completion_tokens - 1 - u.accepted_draft_tokens for u in spec_usage)
    assert accepted == sum(u.accepted_draft_tokens for u in spec_usage)
    per_pos = [
        value(spec_metrics, "inkling_spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in (0, 1)
    ]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
    hist = "inkling_spec_decode_accepted_length"
    buckets = [value(spec_metrics, f"{hist}_bucket", le=le) for le in ("0.0", "1.0", "2.0", "+Inf")]
    assert buckets[2] == buckets[3] == value(spec_metrics, f"{hist}_count") == rounds
    assert buckets[1] - buckets[0] == per_pos[0] - per_pos[1]  # rounds that accepted exactly one draft
    assert value(spec_metrics, f"{hist}_sum") == accepted


async def test_disable_speculation_opts_one_request_out_through_generate(checkpoint):
    prompts = [{"text": pb.TextPrompt(text="Once upon a time")}] * 2
    tokens, usage, _ = await _serve(_engine(checkpoint, 2), prompts, max_tokens=8, opt_out=frozenset({1}))
    assert tokens[0] == tokens[1] and len(tokens[1]) == 8
    assert usage[0].draft_tokens > 0 and (usage[1].draft_tokens, usage[1].accepted_draft_tokens) == (0, 0)


class KnowsTheAnswer:
    """A test drafter that proposes the target's own greedy continuation, corrupted at a cycling index (0..D; D:
    nothing corrupted), so every accepted length occurs; requests it has no answer for get wrong drafts."""

    def __init__(self, answers: dict[str, list[int]], depth: int):
        self.answers, self.num_depths, self.rounds = answers, depth, Counter()

    def reset(self, request_id, start, token_ids, pages) -> None:
        pass

    def remember(self, hidden, rows) -> None:
        pass

    def forget(self, pages) -> None:
        pass

    def remove(self, request_id) -> None:
        pass

    def draft_probs(self, request_id) -> None:
        return None

    def extend(self, inputs) -> dict[str, tuple[int, ...]]:
        out = {}
        for item in inputs:
            if not item.draft:
                continue
            k, answer = len(item.token_ids), self.answers.get(item.request_id, [])
            drafts = (answer[k : k + self.num_depths] + [5] * self.num_depths)[: self.num_depths]
            cut = self.rounds[item.request_id] % (self.num_depths + 1) if answer else 0
            self.rounds[item.request_id] += 1
            out[item.request_id] = tuple((t + 1) % 1000 if i == cut else t for i, t in enumerate(drafts))
        return out


async def test_accepted_drafts_reach_usage_and_the_per_position_metrics(checkpoint):
    """Forced acceptance through gRPC: completion tokens unchanged, accepted drafts > 0 in usage, and the
    scrape's per-position counters and accepted-length histogram match the engine's rounds."""
    base = _engine(checkpoint, 0)
    prompts = [encode_text(t) for t in ("Once upon a time", "The quick brown fox", "1 2 3")]
    requests = [{"tokens": pb.TokenPrompt(token_ids=p)} for p in prompts]
    plain, _, _ = await _serve(base, requests, max_tokens=16)  # the warm-up (2 tokens) verifies no drafts
    answers = {f"mtp-{i}": p + out for i, (p, out) in enumerate(zip(prompts, plain, strict=True))}
    drafter = KnowsTheAnswer(answers, 3)
    engine = Engine(base.runner.model, base.config, dataclasses.replace(base.settings, mtp_depth=3), drafter=drafter)
    spec, usage, metrics = await _serve(engine, requests, max_tokens=16)
    assert spec == plain
    for u in usage:
        assert u.completion_tokens == 16 and 0 < u.accepted_draft_tokens <= u.draft_tokens
    accepted = value(metrics, "inkling_spec_decode_num_accepted_tokens_total")
    assert accepted == sum(u.accepted_draft_tokens for u in usage) == engine.speculation.num_accepted_tokens
    assert value(metrics, "inkling_spec_decode_num_draft_tokens_total") == sum(u.draft_tokens for u in usage)
    assert value(metrics, "inkling_spec_decode_num_drafts_total") == engine.speculation.num_rounds
    per_pos = [
        value(metrics, "inkling_spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(3)
    ]
    assert per_pos == engine.speculation.accepted_at and per_pos[2] > 0  # some rounds accepted all 3 drafts
    hist = "inkling_spec_decode_accepted_length"
    buckets = [value(metrics, f"{hist}_bucket", le=le) for le in ("0.0", "1.0", "2.0", "3.0")]
    lengths = engine.speculation.accepted_lengths
    assert buckets == [sum(lengths[: a + 1]) for a in range(4)] and all(n > 0 for n in lengths)
    assert value(metrics, f"{hist}_sum") == accepted
