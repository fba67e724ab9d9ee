"""Media URLs of OpenAI content parts -> the bytes a `MediaItem` carries.

`data:` URLs (base64) are always accepted. http(s) URLs only when their host is on the allow-list, and then
the name must resolve to public addresses only (no loopback, private, link-local or reserved ranges), the
connection goes to the checked address, redirects are not followed, and the body is capped in bytes and
time. Every other scheme (file://, ftp://, ...) is refused. Errors are 400s naming the content part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from urllib.parse import urlsplit

import httpx

from decode_service.http_api.config import MediaFetchSettings
from decode_service.http_api.errors import bad_request


def decode_base64(text: str, where: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(where, f"not valid base64 ({exc})") from None
    if not data:
        raise bad_request(where, "empty media data")
    return data


def decode_data_url(url: str, where: str, mime_prefix: str) -> bytes:
    """`data:<mime>;base64,<payload>`; the MIME type must start with `mime_prefix` ("image/", ...)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise bad_request(where, "data URL without a ',' before its payload")
    meta = header[len("data:") :].split(";")
    mime = meta[0].strip().lower()
    if "base64" not in (m.strip().lower() for m in meta[1:]):
        raise bad_request(where, "only base64 data URLs are supported (data:<mime>;base64,...)")
    if mime and not (mime.startswith(mime_prefix) or mime == "application/octet-stream"):
        raise bad_request(where, f"data URL of type {mime!r} where {mime_prefix}* was expected")
    return decode_base64(payload, where)


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_global and not ip.is_multicast


class MediaLoader:
    """Resolves the URL of an image_url / audio_url / video_url part. `transport` is for tests (an
    `httpx.MockTransport`); `resolve` maps a host name to its addresses (default: the system resolver)."""

    def __init__(
        self,
        settings: MediaFetchSettings,
        transport: httpx.AsyncBaseTransport | None = None,
        resolve=None,
    ) -> None:
        self.settings = settings
        self._transport = transport
        self._resolve = resolve or _system_resolve

    async def load(self, url: str, where: str, mime_prefix: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise bad_request(where, "expected a non-empty URL string")
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return decode_data_url(url, where, mime_prefix)
        if scheme not in ("http", "https"):
            raise bad_request(where, f"URL scheme {scheme!r} is not allowed (data:, or http(s) on allowed hosts)")
        return await self._fetch(url, where)

    async def _fetch(self, url: str, where: str) -> bytes:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if not self.settings.allowed_hosts:
            raise bad_request(where, "http(s) media URLs are disabled on this server; send a data: URL")
        if host not in self.settings.allowed_hosts:
            raise bad_request(where, f"host {host!r} is not on the media allow-list")
        try:
            addresses = await self._resolve(host)
        except OSError as exc:
            raise bad_request(where, f"cannot resolve {host!r}: {exc}") from None
        if not addresses or not all(_public(a) for a in addresses):
            raise bad_request(where, f"host {host!r} resolves to a non-public address")
        # Connect to the address just checked (no second lookup an attacker could rebind); keep the name
        # for the Host header and TLS server name.
        ip = ipaddress.ip_address(addresses[0])
        netloc = f"[{ip}]" if ip.version == 6 else str(ip)
        if parts.port:
            netloc += f":{parts.port}"
        target = parts._replace(netloc=netloc).geturl()
        headers = {"Host": parts.netloc.rsplit("@", 1)[-1]}
        extensions = {"sni_hostname": host}
        limit = self.settings.max_bytes
        try:
            async with httpx.AsyncClient(
                transport=self._transport, timeout=self.settings.timeout_s, follow_redirects=False
            ) as client:
                async with client.stream("GET", target, headers=headers, extensions=extensions) as response:
                    if response.status_code != 200:
                        raise bad_request(where, f"fetching {url} gave HTTP {response.status_code}")
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise bad_request(where, f"{url} is larger than the {limit}-byte limit")
                        chunks.append(chunk)
        except httpx.TimeoutException:
            raise bad_request(where, f"fetching {url} timed out after {self.settings.timeout_s}s") from None
        except httpx.HTTPError as exc:
            raise bad_request(where, f"fetching {url} failed: {exc}") from None
        data = b"".join(chunks)
        if not data:
            raise bad_request(where, f"{url} returned an empty body")
        return data


async def _system_resolve(host: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]
