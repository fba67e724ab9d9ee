"""Replica addresses: `--encoders` / `--decoders` target lists, their DNS resolution, rendezvous order.

A target list is `host:port,host:port` and/or `dns:///name:port` entries; a `dns:///` entry stands for every
address the name resolves to (re-resolved by the client that owns the pool). IPv6 hosts are written
`[addr]:port`. The router and the encoder client both use these functions, so both flags accept and reject
the same spellings with the same error.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import Iterable, Sequence

from common.errors import ConfigError

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"


def _split_host_port(text: str) -> tuple[str, str]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_targets(text: str, flag: str, required: bool = True) -> tuple[str, ...]:
    """Validated entries of a comma-separated target list; errors name `flag` (e.g. "--decoders")."""
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if required and not targets:
        raise ConfigError(f"{flag}: at least one host:port or dns:///name:port is required")
    for target in targets:
        host, port = _split_host_port(target.removeprefix(DNS_SCHEME))
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{flag}: {target!r} is not host:port or dns:///name:port")
    return targets


async def resolve_targets(targets: Iterable[str]) -> list[str]:
    """Static entries as given; `dns:///name:port` expanded to every address the name resolves to (sorted,
    deduplicated). A name that does not resolve is logged and contributes nothing."""
    loop = asyncio.get_running_loop()
    addresses: list[str] = []
    for target in targets:
        if not target.startswith(DNS_SCHEME):
            addresses.append(target)
            continue
        host, port = _split_host_port(target.removeprefix(DNS_SCHEME))
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("cannot resolve %s: %s", target, exc)
            continue
        addresses.extend(sorted({format_address(info[4][0], int(port)) for info in infos}))
    return list(dict.fromkeys(addresses))


def rendezvous_order(key: bytes, addresses: Sequence[str]) -> list[str]:
    """Highest-random-weight order of `addresses` for `key` (stable; ~1/N keys move when N changes)."""

    def weight(address: str) -> bytes:
        return hashlib.sha256(key + b"\x00" + address.encode()).digest()

    return sorted(addresses, key=weight, reverse=True)
