"""Static checks of docker-compose.yml and deploy/Dockerfile (no Docker engine is needed)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCALABLE = ("encoder", "decode", "decode-cpu")
GRPC_SERVICES = {"encoder": 50061, "decode": 50051, "decode-cpu": 50051, "router": 50050}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "deploy" / "Dockerfile").read_text()


def cli_args(service: dict) -> list[str]:
    """The service's command as `inkling-epd` arguments (shell form: the replica-id made concrete)."""
    if service.get("entrypoint") == ["sh", "-c"]:
        script = re.sub(r"\$\$\([^)]*\)", "10.0.0.7", service["command"][0])
        words = shlex.split(script)
        assert words[:2] == ["exec", "inkling-epd"], words
        return words[2:]
    return [str(word) for word in service["command"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def dockerfile_stages(text: str) -> dict[str, str]:
    """Stage name -> its text (from its FROM line to the next one)."""
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    stages = {}
    for part in parts:
        match = re.match(r"FROM \S+ AS (\S+)", part)
        if match:
            stages[match.group(1)] = part
    return stages


def test_services_and_commands_parse_with_the_real_cli(compose):
    assert set(compose["services"]) == {"redis", "encoder", "decode", "decode-cpu", "router"}
    parser = build_parser()
    for name, port in GRPC_SERVICES.items():
        args = parser.parse_args(cli_args(compose["services"][name]))
        assert args.host == "0.0.0.0" and args.port == port, name
        assert args.redis_url == "redis://redis:6379/0", name
    decode = parser.parse_args(cli_args(compose["services"]["decode"]))
    assert decode.device == "cuda" and decode.replica_id == "10.0.0.7:50051"
    assert parser.parse_args(cli_args(compose["services"]["decode-cpu"])).device == "cpu"


def test_replicas_are_found_by_dns(compose):
    services = compose["services"]
    assert flag(cli_args(services["router"]), "--decoders") == "dns:///decode:50051"
    for name in ("decode", "decode-cpu"):
        assert flag(cli_args(services[name]), "--encoders") == "dns:///encoder:50061"
    assert services["decode-cpu"]["networks"]["inkling"]["aliases"] == ["decode"]


def test_scalable_services_have_no_fixed_names_or_host_ports(compose):
    for name in SCALABLE:
        service = compose["services"][name]
        assert "container_name" not in service and "ports" not in service, name
        assert "hostname" not in service, name
    assert compose["services"]["router"]["ports"] == ["${INKLING_ROUTER_PORT:-50050}:50050"]
    published = [n for n, s in compose["services"].items() if "ports" in s]
    assert published == ["router"]  # the single client entry point


def test_every_service_is_health_checked_and_started_in_order(compose):
    services = compose["services"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, port in GRPC_SERVICES.items():
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "tools.healthcheck",
                                                          f"127.0.0.1:{port}"], name
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, (name, dependency)
            assert condition["condition"] == "service_healthy", (name, dependency)
    assert set(services["encoder"]["depends_on"]) == {"redis"}
    assert set(services["decode"]["depends_on"]) == {"redis", "encoder"}
    router_deps = services["router"]["depends_on"]
    assert router_deps["decode"]["required"] is False and router_deps["decode-cpu"]["required"] is False


def test_gpu_reservation_and_cpu_variant(compose):
    decode = compose["services"]["decode"]
    devices = decode["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert decode["profiles"] == ["gpu"]
    cpu = compose["services"]["decode-cpu"]
    assert cpu["profiles"] == ["cpu"] and "resources" not in cpu.get("deploy", {})


def test_checkpoint_is_a_read_only_volume(compose):
    for name in SCALABLE:
        service = compose["services"][name]
        volumes = [v for v in service["volumes"] if v["target"] == "/models/inkling"]
        assert len(volumes) == 1 and volumes[0]["read_only"] is True, name
        assert flag(cli_args(service), "--checkpoint") == "/models/inkling", name
    assert "volumes" not in compose["services"]["router"]


def test_redis_is_bounded_with_lru_eviction(compose):
    command = compose["services"]["redis"]["command"]
    assert flag(command, "--maxmemory-policy") == "allkeys-lru" and "--maxmemory" in command
    assert compose["services"]["redis"]["image"].startswith("redis:7.")
    conf = (ROOT / "deploy" / "redis.conf").read_text()
    assert re.search(r"^maxmemory-policy allkeys-lru$", conf, re.M)
    assert re.search(r"^maxmemory \d+[kmg]b$", conf, re.M)


def test_build_targets_exist_and_run_as_non_root(compose, dockerfile):
    stages = dockerfile_stages(dockerfile)
    for name in ("encoder", "decode", "router"):
        assert name in stages, name
    for name, service in compose["services"].items():
        if "build" in service:
            target = service["build"]["target"]
            assert target in stages and service["build"]["dockerfile"] == "deploy/Dockerfile", name
            assert (ROOT / service["build"]["context"] / "deploy" / "Dockerfile").exists()
            text = stages[target]
            base = re.match(r"FROM (\S+)", text).group(1)
            inherited = stages.get(base, "")
            assert re.search(r"^USER inkling$", text + inherited, re.M), target
            assert "HEALTHCHECK" in text and "tools.healthcheck" in text, target
    for stage in ("slim", "decode"):
        assert "useradd --system --uid 10001" in stages[stage], stage


def test_dockerfile_pins_versions(dockerfile):
    images = re.findall(r"^ARG \w+_IMAGE=(\S+)$", dockerfile, re.M)
    assert len(images) == 2 and all(re.search(r":\d", image) for image in images)
    assert "nvidia/cuda:" in dockerfile and "latest" not in dockerfile
    for install in re.findall(r"pip install ([^&\n]+)", dockerfile):
        for word in install.split():
            if not word.startswith(("-", "$", "/", "http", "\\")):
                assert "==" in word, (install, word)
    for deps in re.findall(r'^ARG \w+_DEPS="([^"]+)"', dockerfile, re.M):
        assert all("==" in word for word in deps.replace("\\\n", " ").split()), deps
