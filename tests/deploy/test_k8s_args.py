"""Container args through the real `inkling-epd` parser, and the settings each server builds from them."""

from __future__ import annotations

import argparse

import pytest

from tests.deploy.k8s_manifests import (
    FAKE_ENV,
    GPU_OVERLAYS,
    GRPC_PORTS,
    METRICS_PORT,
    OVERLAYS,
    POOL_CASES,
    POOLS,
    cli_args,
    container,
    decoded,
    expanded_args,
    objects,
    parse,
    pod_spec,
    requires_kubectl,
)


def check_server_settings(name: str, args: argparse.Namespace) -> None:
    """Build the settings each server builds from its flags at start-up (value checks beyond argparse)."""
    from common.settings import decode_settings, encoder_settings
    from decode_service.router import router_config

    if name == "encoder":
        assert encoder_settings(args).redis is not None
    elif name == "router":
        assert router_config(args).redis is not None
    elif name == "decode":
        settings = decode_settings(args)
        assert settings.encoders == ("dns:///encoder:50061",) and settings.redis is not None


@requires_kubectl
@pytest.mark.parametrize(("overlay", "name"), POOL_CASES)
def test_container_args_parse_with_the_real_cli(overlay, name, monkeypatch):
    c = container(overlay, name)
    assert c["image"].startswith("inkling-epd/"), c["image"]
    args = cli_args(overlay, name)
    assert args.command == name and callable(args.func)
    assert args.host == "0.0.0.0"
    if name in GRPC_PORTS:
        assert args.port == GRPC_PORTS[name] and args.metrics_port == METRICS_PORT
        (secret,) = [s for n, s in objects(overlay, "Secret").items() if n.startswith("inkling-redis")]
        monkeypatch.setenv("INKLING_REDIS_URL", decoded(secret)["url"])  # what the pod's env carries
        check_server_settings(name, args)
    if name == "decode":
        assert args.replica_id == f"{FAKE_ENV['status.podIP']}:{GRPC_PORTS['decode']}"
    if overlay in GPU_OVERLAYS and name == "decode":
        assert args.tensor_parallel_size == GPU_OVERLAYS[overlay] and args.device == "cuda"


@requires_kubectl
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_decode_args_run_bf16_on_every_gpu_of_the_pod(overlay, monkeypatch):
    args = parse(expanded_args(pod_spec(overlay, "decode"), container(overlay, "decode")))
    assert (args.command, args.device, args.dtype, args.kv_budget_mb) == ("decode", "cuda", "bfloat16", 40960.0)
    assert args.tensor_parallel_size == GPU_OVERLAYS[overlay]
    monkeypatch.setenv("INKLING_REDIS_URL", "redis://redis:6379/0")
    check_server_settings("decode", args)


@requires_kubectl
def test_the_args_cases_cover_every_inkling_container():
    for overlay in OVERLAYS:
        ours = {
            name
            for name, doc in objects(overlay, "Deployment").items()
            if any(c["image"].startswith("inkling-epd/") for c in doc["spec"]["template"]["spec"]["containers"])
        }
        assert ours == set(POOLS), overlay


def test_a_rejected_flag_fails_the_test():
    """argparse exits on a bad flag; `parse` turns that into a test failure that quotes its message."""
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        parse(["router", "--decoders", "dns:///decode:50051", "--no-such-flag"])
