"""Install metadata: pyproject floors that the generated stubs really need, per-role extras (the router installs
and imports without torch or media libraries), and the one constraints file that `make venv` and the images
share."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "proto" / "inkling_epd" / "v1"
MODEL_LIBRARIES = ("torch", "numpy", "av", "PIL", "librosa", "soxr", "scipy", "safetensors", "tqdm", "tml_renderers")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(specs: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(spec)).name: r for spec in specs}


def floor(requirement: Requirement) -> Version:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    assert floors, f"{requirement} has no floor"
    return max(floors)


def protobuf_gencode_versions() -> dict[str, Version]:
    versions = {}
    for path in sorted(STUBS.glob("*_pb2.py")):
        match = re.search(
            r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
            path.read_text(),
        )
        assert match, f"{path.name}: no runtime version check found"
        versions[path.name] = Version(".".join(match.groups()))
    assert versions
    return versions


def grpc_generated_versions() -> dict[str, Version]:
    versions = {}
    for path in sorted(STUBS.glob("*_pb2_grpc.py")):
        match = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", path.read_text(), re.M)
        assert match, f"{path.name}: no GRPC_GENERATED_VERSION"
        versions[path.name] = Version(match.group(1))
    assert versions
    return versions


def test_floors_cover_what_the_generated_stubs_require():
    core = requirements(project()["dependencies"])
    test_extra = requirements(project()["optional-dependencies"]["test"])
    for stub, needed in protobuf_gencode_versions().items():
        assert floor(core["protobuf"]) >= needed, (
            f"{stub} needs protobuf>={needed}, pyproject allows {core['protobuf']}"
        )
    for stub, needed in grpc_generated_versions().items():
        for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
            assert floor(core[name]) >= needed, f"{stub} needs grpcio>={needed}, pyproject allows {core[name]}"
        assert floor(test_extra["grpcio-tools"]) >= needed, "make proto would generate older stubs"


def constraint_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pins[requirement.name] = Version(spec.version)
    return pins


def assert_pinned_within_floors(specs: list[str], unpinned: set[str]) -> None:
    """Each requirement of `specs` but `unpinned` has a pin in deploy/constraints.txt that its specifier allows."""
    pins = constraint_pins()
    for requirement in requirements(specs).values():
        if requirement.name in unpinned:
            continue
        assert requirement.name in pins, f"{requirement.name} is not pinned in deploy/constraints.txt"
        assert requirement.specifier.contains(pins[requirement.name]), (requirement, pins[requirement.name])


def test_constraint_pins_satisfy_pyproject_and_cover_every_runtime_dependency():
    extras = project()["optional-dependencies"]
    runtime = project()["dependencies"] + extras["router"] + extras["encoder"] + extras["decode"]
    assert_pinned_within_floors(runtime, {"inkling-epd", "torch"})  # torch: a platform index's, by TORCH_VERSION
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip\S* install .*-c deploy/constraints\.txt", makefile.replace("$(PIP)", "pip"))
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert dockerfile.count("COPY deploy/constraints.txt /tmp/constraints.txt") >= 2
    torch_make = re.search(r"^TORCH_VERSION := (\S+)$", makefile, re.M).group(1)
    torch_docker = set(re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M))
    assert torch_docker == {torch_make}
    assert requirements(extras["encoder"])["torch"].specifier.contains(torch_make)


def test_constraints_pin_the_test_tools():
    """`make venv` installs `.[test]` under the same constraints: every test tool is pinned at a version its floor
    allows, so CI on two commits runs the same transformers, ruff and pytest (a new transformers broke it once);
    the ones shared with the runtime libraries or torch's wheels are left to them."""
    test = project()["optional-dependencies"]["test"]
    assert_pinned_within_floors(test, {"inkling-epd", "pyyaml", "packaging", "tomli", "triton"})


def test_no_installed_distribution_ships_a_top_level_package_of_ours():
    """Our top-level import names are ours alone in this environment (the test extras included): transformers
    >= 5.25 installs the `kernels` hub package, which our former top-level `kernels` shadowed (and which shadowed
    it outside the checkout), so transformers failed to import."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    ours = {pattern.rstrip("*") for pattern in patterns}
    assert "inkling_kernels" in ours and "kernels" not in ours
    shipped = importlib.metadata.packages_distributions()
    for name in sorted(ours):
        others = {dist for dist in shipped.get(name, ()) if dist != "inkling-epd"}
        assert not others, f"top-level package {name!r} is also shipped by {sorted(others)}"


def test_router_role_needs_no_model_libraries():
    extras = project()["optional-dependencies"]
    names = set(requirements(project()["dependencies"] + extras["router"]))
    assert not names & {"torch", "numpy", "av", "pillow", "librosa", "tml-renderers"}, names
    assert "torch" in requirements(extras["encoder"]) and "inkling-epd[encoder]" in extras["decode"]


BLOCKED_IMPORT = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Block())
import tools.healthcheck
from decode_service.router import router_config
import decode_service.http_api.app
import decode_service.http_api.server
from tools.cli import build_parser

args = build_parser().parse_args(["router", "--decoders", "127.0.0.1:1", "--metrics-port", "0"])
print(router_config(args).decoders)
"""


@pytest.mark.parametrize("blocked", [",".join(MODEL_LIBRARIES)])
def test_router_and_transport_import_with_model_libraries_blocked(blocked):
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT, blocked], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "('127.0.0.1:1',)"
    probe = subprocess.run(  # the hook does block: importing the engine fails
        [
            sys.executable,
            "-c",
            BLOCKED_IMPORT.replace("import tools.healthcheck", "import decode_service.service"),
            blocked,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "blocked import of" in probe.stderr
