"""The front's frozen settings, built from the `inkling-epd api` flags (no environment variables)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from common.errors import ConfigError
from common.settings import SecuritySettings, add_security_args, read_token_file, security_settings


@dataclass(frozen=True)
class MediaFetchSettings:
    """http(s) media URLs: off unless hosts are allowed; every fetch is bounded in bytes and time."""

    allowed_hosts: tuple[str, ...] = ()  # exact host names (lower case); empty: only data: URLs
    max_bytes: int = 32 << 20
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ConfigError(f"--media-max-bytes must be > 0, got {self.max_bytes}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--media-timeout-s must be > 0, got {self.timeout_s}")
        for host in self.allowed_hosts:
            if not host or host != host.strip().lower() or "/" in host or ":" in host:
                raise ConfigError(f"--allow-media-host {host!r}: expected a lower-case host name without port")


@dataclass(frozen=True)
class ApiSettings:
    upstream: str  # host:port of a router or decode replica (gRPC Generator)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the upstream's ModelInfo.model_id
    api_key: str | None = field(default=None, repr=False)  # None: no Authorization check
    upstream_security: SecuritySettings = field(default_factory=SecuritySettings)
    media: MediaFetchSettings = field(default_factory=MediaFetchSettings)
    request_timeout_s: float = 600.0  # deadline of each upstream Generate call
    health_timeout_s: float = 2.0
    max_body_bytes: int = 200 << 20  # inline base64 media inflate the JSON body by 4/3

    def __post_init__(self) -> None:
        if not self.upstream or ":" not in self.upstream:
            raise ConfigError(f"--upstream {self.upstream!r}: expected HOST:PORT")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ConfigError("--api-key-file: the key must be non-empty and contain no whitespace")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"--request-timeout-s must be > 0, got {self.request_timeout_s}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"--max-body-bytes must be > 0, got {self.max_body_bytes}")


def add_api_args(p: argparse.ArgumentParser) -> None:
    """Flags of `inkling-epd api`."""
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="router or decode replica (gRPC)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the upstream's)")
    p.add_argument("--api-key-file", default=None, help="file holding the key clients send as Authorization: Bearer")
    p.add_argument(
        "--allow-media-host",
        action="append",
        default=[],
        metavar="HOST",
        help="host whose http(s) image/audio/video URLs may be fetched (repeatable; default: data: URLs only)",
    )
    p.add_argument("--media-max-bytes", type=int, default=MediaFetchSettings.max_bytes, help="cap per fetched URL")
    p.add_argument("--media-timeout-s", type=float, default=MediaFetchSettings.timeout_s, help="timeout per fetch")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of each upstream Generate")
    p.add_argument("--log-level", default="INFO")
    add_security_args(p, max_streams_per_client=None)  # bearer token / TLS used to dial --upstream


def api_settings(args: argparse.Namespace) -> ApiSettings:
    return ApiSettings(
        upstream=args.upstream,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=read_token_file(args.api_key_file) if args.api_key_file else None,
        upstream_security=security_settings(args),
        media=MediaFetchSettings(
            allowed_hosts=tuple(h.lower() for h in args.allow_media_host),
            max_bytes=args.media_max_bytes,
            timeout_s=args.media_timeout_s,
        ),
        request_timeout_s=args.request_timeout_s,
    )
