"""Media URL resolution: data: URLs, refused schemes, the host allow-list, public-address checks, size cap."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from decode_service.http_api.config import MediaFetchSettings
from decode_service.http_api.errors import ApiError
from decode_service.http_api.media import MediaLoader

PNG = b"\x89PNG\r\n\x1a\npayload"


def load(loader: MediaLoader, url: str, mime: str = "image/") -> bytes:
    return asyncio.run(loader.load(url, "messages[0].content[0].image_url.url", mime))


def resolver(table: dict[str, list[str]]):
    async def resolve(host: str) -> list[str]:
        return table[host]

    return resolve


def test_data_urls_decode():
    loader = MediaLoader(MediaFetchSettings())
    assert load(loader, "data:image/png;base64," + base64.b64encode(PNG).decode()) == PNG


@pytest.mark.parametrize(
    "url, problem",
    [
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png,rawtext", "only base64"),
        ("data:audio/wav;base64,AAAA", "where image/* was expected"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("ftp://example.com/a.png", "scheme 'ftp' is not allowed"),
        ("https://example.com/a.png", "disabled on this server"),
    ],
)
def test_refused_urls_name_the_part(url, problem):
    with pytest.raises(ApiError) as info:
        load(MediaLoader(MediaFetchSettings()), url)
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"
    assert problem in info.value.message


def _loader(handler, table=None, **settings) -> MediaLoader:
    return MediaLoader(
        MediaFetchSettings(allowed_hosts=("media.example.com",), **settings),
        transport=httpx.MockTransport(handler),
        resolve=resolver(table or {"media.example.com": ["93.184.216.34"]}),
    )


def test_allowed_host_is_fetched_from_the_checked_address():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers["host"]))
        return httpx.Response(200, content=PNG)

    assert load(_loader(handler), "https://media.example.com/cat.png") == PNG
    assert seen == [("93.184.216.34", "media.example.com")]


@pytest.mark.parametrize("address", ["127.0.0.1", "10.0.0.8", "169.254.169.254", "::1", "fd00::1"])
def test_allowed_host_resolving_to_a_private_address_is_refused(address):
    loader = _loader(lambda r: httpx.Response(200, content=PNG), {"media.example.com": [address]})
    with pytest.raises(ApiError, match="non-public address"):
        load(loader, "http://media.example.com/cat.png")


def test_other_hosts_redirects_and_oversized_bodies_are_refused():
    ok = _loader(lambda r: httpx.Response(200, content=PNG))
    with pytest.raises(ApiError, match="not on the media allow-list"):
        load(ok, "https://evil.example.org/cat.png")
    redirect = _loader(lambda r: httpx.Response(302, headers={"location": "http://127.0.0.1/"}))
    with pytest.raises(ApiError, match="HTTP 302"):
        load(redirect, "https://media.example.com/cat.png")
    big = _loader(lambda r: httpx.Response(200, content=b"x" * 2048), max_bytes=1024)
    with pytest.raises(ApiError, match="larger than the 1024-byte limit"):
        load(big, "https://media.example.com/cat.png")
