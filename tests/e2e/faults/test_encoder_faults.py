"""Encoder-side faults with in-process servers (real gRPC on 127.0.0.1) under a steady stream of mixed requests.

Each scenario: every request ends as success or an explicit gRPC status within its deadline (none hangs), the
decode replica's KV pages, conv slots, live requests and in-flight encode items return to idle, the encoders'
in-flight counters return to 0, and the next request succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

from decode_service.encoder_client import ClientSettings
from encoder_service.server import EncoderServicer
from proto.inkling_epd.v1 import generator_pb2_grpc

log = logging.getLogger(__name__)
DEADLINE_S = 8.0


class SlowServicer(EncoderServicer):
    """Sleeps `delay_s` before answering (far beyond any request deadline; cancellation ends the sleep)."""

    delay_s = 60.0

    async def Encode(self, request, context):
        await asyncio.sleep(self.delay_s)
        async for message in super().Encode(request, context):
            yield message


class CorruptingServicer(EncoderServicer):
    """While `corrupt` is set, flips one bit in the first data chunk of every item (its CRC-32 no longer
    matches the header)."""

    corrupt = True
    calls = 0

    async def Encode(self, request, context):
        self.calls += 1
        async for message in super().Encode(request, context):
            if self.corrupt and message.HasField("data") and message.data.seq == 0:
                payload = message.data.payload
                message.data.payload = bytes([payload[0] ^ 0x01]) + payload[1:]
            yield message


def record(record_property, scenario: str, outcomes, recovery_s: float) -> None:
    counts = dict(Counter(o.status for o in outcomes))
    record_property(scenario, {"sent": len(outcomes), **counts, "recovery_s": round(recovery_s, 2)})
    log.info("scenario %s: sent %d, outcomes %s, recovery %.2fs", scenario, len(outcomes), counts, recovery_s)


async def wait_encoders(decode, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(decode.encoder.healthy()) < count:
        assert time.monotonic() < deadline, "encoders never became healthy in the client"
        await asyncio.sleep(0.05)


def test_slow_encoder_beyond_the_deadline(e2e, tiny_checkpoint, fingerprints, loop_thread, record_property):
    deadline_s = 3.0

    async def scenario():
        slow = await e2e.start_encoder(tiny_checkpoint, SlowServicer)
        decode = None
        try:
            decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [slow.address])
            await wait_encoders(decode, 1)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                outcomes = await e2e.run_traffic(stub, count=8, concurrency=4, deadline_s=deadline_s, prefix="slow")
                idle = await e2e.wait_idle(decode)
                await asyncio.sleep(0.2)  # the encoder sees the cancellations
                encoder_inflight = slow.engine.inflight_items
                recovery = await e2e.recovery_time(stub, kind="text")
            return outcomes, idle, encoder_inflight, recovery
        finally:
            if decode is not None:
                await decode.stop(0.5)
            await slow.stop(0.5)

    outcomes, idle, encoder_inflight, recovery = loop_thread.run(scenario())
    record(record_property, "slow_encoder", outcomes, recovery)
    for i, outcome in enumerate(outcomes):
        assert outcome.seconds < deadline_s + 2.0, outcome  # ends with its deadline, never hangs
        if i % 4 == 0:  # text only: never touches the encoder
            assert outcome.status == "OK", outcome
        else:
            assert outcome.status == "DEADLINE_EXCEEDED", outcome
    assert not any(idle.values()), idle
    assert encoder_inflight == 0


def test_corrupt_chunk_is_retried_on_another_encoder(e2e, tiny_checkpoint, fingerprints, loop_thread, record_property):
    kinds = ("image", "image+audio", "audio")

    async def scenario():
        good = await e2e.start_encoder(tiny_checkpoint)
        bad = await e2e.start_encoder(tiny_checkpoint, CorruptingServicer)
        decode = None
        try:
            # Breaker effectively off: every garbled stream must be detected and retried, not just avoided.
            client = ClientSettings(breaker_failures=1000, ready_wait_s=2.0)
            decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [good.address, bad.address], client=client)
            await wait_encoders(decode, 2)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                outcomes = await e2e.run_traffic(
                    stub, count=12, concurrency=4, deadline_s=DEADLINE_S, prefix="crc", kinds=kinds
                )
                idle = await e2e.wait_idle(decode)
                bad.servicer.corrupt = False
                # The same requests with no corruption anywhere: the outputs must be identical.
                clean = await e2e.run_traffic(
                    stub, count=12, concurrency=4, deadline_s=DEADLINE_S, prefix="crc", kinds=kinds
                )
                recovery = await e2e.recovery_time(stub)
            return outcomes, clean, idle, bad.servicer.calls, good.engine.inflight_items, recovery
        finally:
            if decode is not None:
                await decode.stop(0.5)
            await good.stop(0.5)
            await bad.stop(0.5)

    outcomes, clean, idle, corrupt_calls, good_inflight, recovery = loop_thread.run(scenario())
    record(record_property, "corrupt_chunk", outcomes, recovery)
    assert corrupt_calls > 0  # the corrupting encoder was really chosen
    assert [o.status for o in outcomes] == ["OK"] * len(outcomes), e2e.summarize(outcomes)
    assert [o.tokens for o in outcomes] == [o.tokens for o in clean]
    assert not any(idle.values()), idle
    assert good_inflight == 0
