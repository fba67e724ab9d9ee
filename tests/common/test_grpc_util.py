"""Server plumbing: exclusive binds."""

from __future__ import annotations

import asyncio

import pytest

from common.auth import bind_server
from common.errors import ConfigError
from common.grpc_util import bind, create_server
from common.settings import SecuritySettings


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
