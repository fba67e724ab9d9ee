"""Tenant isolation end to end over gRPC: the KV prefix cache is shared only between requests with equal
`cache_salt`; media embeddings are content-addressed and shared regardless (usage reports both)."""

from __future__ import annotations

import grpc

from proto.inkling_epd.v1 import generator_pb2, generator_pb2_grpc

LONG_TEXT = " ".join(f"fact {i} is that the sky over city {i} was clear." for i in range(24))


def _request(e2e, request_id: str, salt: str) -> generator_pb2.GenerateRequest:
    request = e2e.chat_request(request_id, "image", variant=7, max_tokens=2)
    request.chat.messages[0].content.append(generator_pb2.ContentPart(text=LONG_TEXT))
    request.cache_salt = salt
    return request


async def _usage(stub, request) -> generator_pb2.Usage:
    finals = [m.final async for m in stub.Generate(request, timeout=30) if m.HasField("final")]
    assert len(finals) == 1
    return finals[0].usage


def test_prefix_cache_is_scoped_by_cache_salt(e2e, tiny_checkpoint, fingerprints, loop_thread):
    async def scenario():
        encoder = await e2e.start_encoder(tiny_checkpoint, l1_cache_bytes=8 << 20)
        decode = None
        try:
            decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [encoder.address], prefix_cache=True)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
                stub = generator_pb2_grpc.GeneratorStub(channel)
                return [
                    await _usage(stub, _request(e2e, rid, salt))
                    for rid, salt in (
                        ("a-1", "tenant-a"),
                        ("a-2", "tenant-a"),
                        ("b-1", "tenant-b"),
                        ("none-1", ""),
                        ("b-2", "tenant-b"),
                    )
                ]
        finally:
            if decode is not None:
                await decode.stop(0.5)
            await encoder.stop(0.5)

    a1, a2, b1, unsalted, b2 = loop_thread.run(scenario())
    assert a1.cached_tokens == 0
    assert a2.cached_tokens > 0  # same tenant: the prefix is reused
    assert b1.cached_tokens == 0 and unsalted.cached_tokens == 0  # other tenants never see it
    assert b2.cached_tokens > 0
    # The image embedding is shared across tenants (content-addressed: same as recomputing it).
    assert a1.mm_items_encoded == 1 and a1.mm_items_cached == 0
    assert b1.mm_items_cached == 1 and b1.mm_items_encoded == 0
    assert {a2.prompt_tokens, b1.prompt_tokens, unsalted.prompt_tokens} == {a1.prompt_tokens}
