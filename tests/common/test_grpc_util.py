"""Server plumbing: exclusive binds, reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from common.auth import bind_server
from common.errors import ConfigError
from common.grpc_util import REFLECTION_V1, bind, create_server, enable_reflection
from common.settings import SecuritySettings
from proto.inkling_epd.v1 import generator_pb2_grpc


def test_second_server_on_a_used_port_fails_naming_the_port() -> None:
    async def run() -> None:
        first = create_server()
        port = bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            for bind_second in (
                lambda s: bind(s, "127.0.0.1", port),
                lambda s: bind_server(s, "127.0.0.1", port, SecuritySettings()),
            ):
                with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: port in use"):
                    bind_second(create_server())
        finally:
            await first.stop(0)

    asyncio.run(run())


@pytest.mark.parametrize("service", [REFLECTION_V1, "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_is_served_as_v1_and_v1alpha(service: str) -> None:
    async def run() -> tuple[list[str], bytes]:
        server = create_server()
        generator_pb2_grpc.add_GeneratorServicer_to_server(generator_pb2_grpc.GeneratorServicer(), server)
        enable_reflection(server, ["inkling_epd.v1.Generator"])
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream(
                    f"/{service}/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                requests = [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="inkling_epd.v1.Generator"),
                ]
                listed, described = [r async for r in call(iter(requests), timeout=10)]
        finally:
            await server.stop(0)
        return [s.name for s in listed.list_services_response.service], described

    names, described = asyncio.run(run())
    assert {"inkling_epd.v1.Generator", REFLECTION_V1, "grpc.reflection.v1alpha.ServerReflection"} <= set(names)
    files = described.file_descriptor_response.file_descriptor_proto
    assert any(b"inkling_epd.v1" in f for f in files)
