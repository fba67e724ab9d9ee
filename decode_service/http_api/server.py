"""`inkling-epd api`: run the OpenAI-compatible front with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from decode_service.http_api.app import build_app
from decode_service.http_api.config import api_settings


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful drain, so the process would end as killed by the signal;
    like our gRPC servers, this one exits 0 once the drain is done."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(args: argparse.Namespace) -> int:
    settings = api_settings(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(
        build_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=10,
    )
    _Server(config).run()
    return 0
