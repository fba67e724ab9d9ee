"""16 concurrent mixed requests (text, image, audio, image + audio; greedy) against one in-process decode replica
with a real encoder: each request's tokens equal the ones it got alone.

Continuous batching mixes prefill chunks and decode steps of different requests in one forward pass, and the
encoder batches items of different requests into one tower call; neither may change any request's output.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.inkling_epd.v1 import generator_pb2_grpc
from tests.e2e.conftest import MIX, chat_request, generate_once, start_decode, start_encoder, wait_idle

COUNT = 16
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def replica(tiny_checkpoint, fingerprints, loop_thread):
    async def start():
        encoder = await start_encoder(tiny_checkpoint)
        decode = await start_decode(tiny_checkpoint, fingerprints, [encoder.address])
        return encoder, decode

    encoder, decode = loop_thread.run(start())
    try:
        yield decode
    finally:
        loop_thread.run(decode.stop(1.0))
        loop_thread.run(encoder.stop(1.0))


def test_concurrent_mixed_requests_equal_their_sequential_results(replica, loop_thread):
    # 8 distinct prompts (each kind twice, different images/text), each sent once alone and twice at once.
    requests = [
        chat_request(f"seq-{i}", MIX[i % len(MIX)], variant=100 + i, max_tokens=MAX_TOKENS) for i in range(COUNT // 2)
    ]

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
            stub = generator_pb2_grpc.GeneratorStub(channel)
            alone = [await generate_once(stub, request, 60.0) for request in requests]
            concurrent = []
            for copy in range(2):
                for request in requests:
                    twin = type(request)()
                    twin.CopyFrom(request)
                    twin.request_id = f"con-{copy}-{request.request_id}"
                    concurrent.append(twin)
            together = await asyncio.gather(*(generate_once(stub, r, 60.0) for r in concurrent))
            return alone, together, await wait_idle(replica)

    alone, together, idle = loop_thread.run(run(), timeout_s=100.0)
    assert [o.status for o in alone] == ["OK"] * len(requests), alone
    assert all(len(o.tokens) == MAX_TOKENS for o in alone)
    assert len({tuple(o.tokens) for o in alone}) > 1  # the prompts really differ
    for i, outcome in enumerate(together):
        reference = alone[i % len(requests)]
        assert outcome.status == "OK", outcome
        assert outcome.tokens == reference.tokens, f"{outcome.request_id} differs from {reference.request_id}"
    assert not any(idle.values()), idle
