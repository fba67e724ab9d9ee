"""`inkling-epd api`: run the OpenAI-compatible front with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from decode_service.http_api.app import build_app
from decode_service.http_api.config import api_settings


def serve(args: argparse.Namespace) -> int:
    settings = api_settings(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        build_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=10,
    )
    return 0
