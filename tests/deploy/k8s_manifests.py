"""The Kubernetes manifests of deploy/k8s, read offline (no cluster) by the tests/deploy/test_k8s_*.py files.

`render` runs `kubectl kustomize` on an overlay (`render_with`: an overlay plus a component) and `validate` checks
an object strictly (unknown fields are errors) against the Kubernetes 1.32 schemas shipped in the
`kubernetes-validate` wheel (a test extra). The rest reads the rendered objects: Deployments, pod specs and
containers by name, label selection, container args with `$(VAR)` expanded as the kubelet does, and those args
through the real `inkling-epd` parser (`parse`: a rejection fails the test).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"
OVERLAYS = ("cpu-tiny", "inkling-small-tp2", "inkling-tp8")
GPU_OVERLAYS = {"inkling-small-tp2": 2, "inkling-tp8": 8}
POOLS = ("encoder", "decode", "router", "api")  # the Deployments that run `inkling-epd`
GRPC_PORTS = {"encoder": 50061, "decode": 50051, "router": 50050}
API_PORT = 8000
METRICS_PORT = 9100
POD_UID = 10001  # the images' non-root user (deploy/Dockerfile)
FAKE_ENV = {"status.podIP": "10.0.0.7"}  # values of fieldRef env vars when args are expanded

requires_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed"
)


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def validate(doc: dict) -> None:
    """Strict validation against the 1.32 schemas; raises `kubernetes_validate.ValidationError`."""
    _validate_json(json.dumps(doc, sort_keys=True))


@functools.cache
def _validate_json(text: str) -> None:  # the renders share most objects: each distinct one is checked once
    assert kubernetes_validate.validate(json.loads(text), KUBERNETES_VERSION, strict=True) == "1.32"


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in render(overlay) if doc["kind"] == kind}


def deployment(overlay: str, name: str) -> dict:
    return objects(overlay, "Deployment")[name]


def pod_spec(overlay: str, name: str) -> dict:
    return deployment(overlay, name)["spec"]["template"]["spec"]


def container(overlay: str, name: str) -> dict:
    (main,) = [c for c in pod_spec(overlay, name)["containers"] if c["name"] == name]
    return main


def pod_labels(overlay: str, name: str) -> dict:
    return deployment(overlay, name)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions are not used here
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def expanded_args(spec: dict, c: dict) -> list[str]:
    """A container's args with `$(VAR)` expanded the way the kubelet does, from the container's env."""
    env = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = FAKE_ENV[var["valueFrom"]["fieldRef"]["fieldPath"]]

    def expand(match: re.Match) -> str:
        assert match.group(1) in env, f"{c['name']}: $({match.group(1)}) is not in the container's env"
        return env[match.group(1)]

    assert "command" not in c, f"{c['name']}: the image's ENTRYPOINT is inkling-epd; set args only"
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, str(arg)) for arg in c["args"]]


def parse(argv: list[str]) -> argparse.Namespace:
    """`inkling-epd` args through the real parser; a rejection (argparse's sys.exit) fails the test."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"inkling-epd rejects `{shlex.join(argv)}`: {err.getvalue().strip()}")


def cli_args(overlay: str, name: str) -> argparse.Namespace:
    return parse(expanded_args(pod_spec(overlay, name), container(overlay, name)))


def dns_target(value: str) -> tuple[str, int]:
    match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", value)
    assert match, f"{value!r} is not dns:///name:port"
    return match.group(1), int(match.group(2))


def container_of(deployment_doc: dict) -> dict:
    return deployment_doc["spec"]["template"]["spec"]["containers"][0]


def cli_value(overlay: str, name: str, option: str) -> str:
    """An option's value in a container's args, read without the parser (for checks independent of it)."""
    args = expanded_args(pod_spec(overlay, name), container(overlay, name))
    assert option in args, (name, option, args)
    return args[args.index(option) + 1]


def served_port(overlay: str, name: str) -> int:
    """A gRPC server's --port, checked to be its named `grpc` container port (and --metrics-port `metrics`)."""
    c = container(overlay, name)
    port = int(cli_value(overlay, name, "--port"))
    assert {"name": "grpc", "containerPort": port} in c["ports"], (name, c["ports"])
    assert int(cli_value(overlay, name, "--metrics-port")) == METRICS_PORT
    assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"], name
    return port


def decoded(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


POOL_CASES = [pytest.param(o, n, id=f"{o}-{n}") for o in OVERLAYS for n in POOLS]  # (overlay, pool)


@functools.cache
def render_with(overlay: str, component: str, extra: str = "") -> tuple[dict, ...]:
    """An overlay plus a component, rendered from a temporary kustomization and validated strictly."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = Path(os.path.relpath(K8S, tmp))
        (Path(tmp) / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [{rel / 'overlays' / overlay}]\ncomponents: [{rel / 'components' / component}]\n{extra}"
        )
        result = subprocess.run(["kubectl", "kustomize", tmp], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    docs = tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)
    for doc in docs:
        validate(doc)
    return docs


def by_kind(docs: tuple[dict, ...], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}
