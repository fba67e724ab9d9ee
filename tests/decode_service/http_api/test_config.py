"""`inkling-epd api` flags -> ApiSettings, and the errors that name a bad flag."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from decode_service.http_api.config import ApiSettings, MediaFetchSettings, api_settings
from tools.cli import build_parser


def test_flags_build_the_settings(tmp_path):
    token = tmp_path / "token"
    token.write_text("upstream-secret\n")
    args = build_parser().parse_args(
        ["api", "--upstream", "router:50050", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "ink",
         "--auth-token-file", str(token), "--allow-media-host", "Media.Example.com"]
    )  # fmt: skip
    settings = api_settings(args)
    assert (settings.upstream, settings.host, settings.port, settings.served_model_name) == (
        "router:50050",
        "0.0.0.0",
        8000,
        "ink",
    )
    assert settings.upstream_security.token == "upstream-secret" and settings.api_key is None
    assert settings.media.allowed_hosts == ("media.example.com",)


@pytest.mark.parametrize(
    "build, flag",
    [
        (lambda: ApiSettings(upstream="router"), "--upstream"),
        (lambda: ApiSettings(upstream="r:1", port=70000), "--port"),
        (lambda: ApiSettings(upstream="r:1", served_model_name=" "), "--served-model-name"),
        (lambda: ApiSettings(upstream="r:1", api_key="two words"), "--api-key-file"),
        (lambda: MediaFetchSettings(max_bytes=0), "--media-max-bytes"),
        (lambda: MediaFetchSettings(allowed_hosts=("host:8080",)), "--allow-media-host"),
    ],
)
def test_bad_settings_name_the_flag(build, flag):
    with pytest.raises(ConfigError, match=flag):
        build()
