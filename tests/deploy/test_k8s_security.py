"""Who may reach whom (the NetworkPolicies), the non-root pods, and the security component's token and mTLS on
every tier."""

from __future__ import annotations

import pytest

from tests.deploy.k8s_manifests import (
    API_PORT,
    GRPC_PORTS,
    METRICS_PORT,
    OVERLAYS,
    POD_UID,
    POOL_CASES,
    POOLS,
    by_kind,
    expanded_args,
    objects,
    parse,
    pod_labels,
    render_with,
    requires_kubectl,
    selects,
)


def allowed(policies: list[dict], source: dict | None, target: dict, port: int) -> bool:
    """Whether ingress from a pod of this namespace with labels `source` (None: outside the namespace, not the
    monitoring namespace) to a pod with labels `target` on `port` is allowed by `policies`."""
    applying = [p for p in policies if selects(p["spec"]["podSelector"], target)]
    assert applying, f"no policy selects {target}"  # the default-deny one selects every pod
    for policy in applying:
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            if port not in {p["port"] for p in rule.get("ports", [])}:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                if set(peer) == {"podSelector"} and source is not None and selects(peer["podSelector"], source):
                    return True
    return False


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_exposes_only_api_and_router(overlay):
    policies = list(objects(overlay, "NetworkPolicy").values())
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies)  # default deny
    labels = {name: pod_labels(overlay, name) for name in (*POOLS, "redis")}
    ports = {**GRPC_PORTS, "api": API_PORT, "redis": 6379}
    callers = {"router": {None, "api"}, "api": {None}, "decode": {"router"}, "encoder": {"decode"}}
    callers["redis"] = {"encoder", "decode", "router"}
    for target, port in ports.items():
        for source in (None, *POOLS, "redis"):
            source_labels = None if source is None else labels[source]
            expected = source in callers[target] or (None in callers[target])
            assert allowed(policies, source_labels, labels[target], port) == expected, (source, target, port)
    for name in GRPC_PORTS:  # metrics only from the monitoring namespace, not from the world
        assert not allowed(policies, None, labels[name], METRICS_PORT), name


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_the_images_non_root_user(overlay):
    for name, doc in objects(overlay, "Deployment").items():
        spec = doc["spec"]["template"]["spec"]
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        if name in POOLS:
            assert security["runAsUser"] == security["runAsGroup"] == POD_UID, name
        for c in spec["containers"] + spec.get("initContainers", []):
            cs = c["securityContext"]
            assert cs["allowPrivilegeEscalation"] is False and cs["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert cs["readOnlyRootFilesystem"] is True, c["name"]
            assert "privileged" not in cs and "runAsUser" not in cs, c["name"]
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]) or name == "redis", c["name"]


SECURITY_FLAGS = {
    "auth_token_file": "/etc/inkling/auth/token",
    "tls_cert": "/etc/inkling/tls/tls.crt",
    "tls_key": "/etc/inkling/tls/tls.key",
    "tls_ca": "/etc/inkling/tls/ca.crt",
    "tls_server_name": "inkling-epd",
}


def security_options(overlay: str, name: str) -> tuple[dict, dict, list[str]]:
    """A pool's pod spec and container under the security component, and the container's expanded args."""
    spec = by_kind(render_with(overlay, "security"), "Deployment")[name]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c, expanded_args(spec, c)


def option(flag: str) -> str:
    return f"--{flag.replace('_', '-')}"


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", POOLS)
def test_security_component_gives_every_tier_the_token_and_mtls(overlay, name):
    """Every tier serves and dials with the token and mTLS from the Secrets (the api also checks an API key),
    and (the kubelet's gRPC probes being plaintext) the gRPC servers are probed by tools.healthcheck over TLS."""
    spec, c, argv = security_options(overlay, name)
    options = dict(zip(argv[1::2], argv[2::2], strict=True))  # every arg after the subcommand is a pair
    assert {flag: options[option(flag)] for flag in SECURITY_FLAGS} == SECURITY_FLAGS
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    files = {"auth": ["auth_token_file"], "tls": ["tls_cert", "tls_key", "tls_ca"]}
    secrets = {"auth": "inkling-auth", "tls": "inkling-tls"}
    if name == "api":  # /health and /metrics need no key
        files["api-key"], secrets["api-key"] = ["api_key_file"], "inkling-api-key"
    else:
        assert "api-key" not in volumes and "--api-key-file" not in options
    for volume, flags in files.items():
        assert volumes[volume]["secret"]["secretName"] == secrets[volume], volume
        assert mounts[volume]["readOnly"] is True, volume
        for flag in flags:
            assert options[option(flag)].startswith(mounts[volume]["mountPath"] + "/"), flag
    if name not in GRPC_PORTS:
        return
    tls = {k: v for k, v in SECURITY_FLAGS.items() if k.startswith("tls_")}  # health needs no token
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe not in c or (name == "router" and probe == "livenessProbe"):
            continue
        assert "grpc" not in c[probe], (name, probe)
        command = c[probe]["exec"]["command"]
        assert command[:4] == ["python", "-m", "tools.healthcheck", f"127.0.0.1:{options['--port']}"], command
        given = dict(zip(command[4::2], command[5::2], strict=True))
        assert {k: given[option(k)] for k in tls} == tls, (name, probe)
        assert float(given["--timeout"]) < c[probe]["timeoutSeconds"], (name, probe)


@requires_kubectl
@pytest.mark.parametrize(("overlay", "name"), POOL_CASES)
def test_security_component_args_parse_with_the_real_cli(overlay, name):
    _, _, argv = security_options(overlay, name)
    args = parse(argv)
    assert {flag: getattr(args, flag) for flag in SECURITY_FLAGS} == SECURITY_FLAGS
    if name == "api":
        assert args.api_key_file == "/etc/inkling/api/key"
