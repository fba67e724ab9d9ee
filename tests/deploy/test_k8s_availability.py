"""Pods that come, go and scale safely: probes on `grpc.health.v1`, a startup budget for loading the model, drain
times that match the servers' `--grace-seconds`, HPAs on the metrics the pools export (and the documented
adapter rule serving them), disruption budgets and spreading over nodes."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.k8s_manifests import (
    API_PORT,
    GRPC_PORTS,
    OVERLAYS,
    POOLS,
    ROOT,
    cli_args,
    cli_value,
    container,
    deployment,
    objects,
    pod_labels,
    pod_spec,
    requires_kubectl,
    selects,
    served_port,
)
from tools.cli import build_parser


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_readiness_and_liveness_probes(overlay):
    for name, doc in objects(overlay, "Deployment").items():
        for c in doc["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, (name, c["name"])
    for name, port in GRPC_PORTS.items():
        c = container(overlay, name)
        assert served_port(overlay, name) == port
        # Readiness = SERVING on grpc.health.v1, checked by the kubelet's native gRPC probe.
        assert c["readinessProbe"]["grpc"] == {"port": port}, name
        if name == "router":
            # NOT_SERVING while no decode replica is healthy: that is for readiness, not a reason to restart.
            assert c["livenessProbe"]["tcpSocket"] == {"port": port}
        else:
            assert c["livenessProbe"]["grpc"] == {"port": port}, name
            assert c["startupProbe"]["grpc"] == {"port": port}, name  # model loading happens before SERVING
    api = container(overlay, "api")
    assert api["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": API_PORT} in api["ports"]
    assert cli_value(overlay, "api", "--port") == str(API_PORT)


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decode_startup_allows_the_model_to_load(overlay):
    probe = container(overlay, "decode")["startupProbe"]
    budget = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget >= {"cpu-tiny": 600, "inkling-small-tp2": 900, "inkling-tp8": 1800}[overlay]


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prestop_and_grace_period_cover_the_servers_drain(overlay):
    """SIGTERM comes after preStop; the server then drains for --grace-seconds (graceful_stop in
    common/grpc_util.py). The pod's grace period must cover both, plus a bounded margin to release."""
    for name in POOLS:
        spec = pod_spec(overlay, name)
        sleep = container(overlay, name)["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep >= 5, name  # endpoints and the router's DNS re-resolution (5 s) drop the pod first
        grace = spec["terminationGracePeriodSeconds"]
        if name in GRPC_PORTS:
            drain = float(cli_value(overlay, name, "--grace-seconds"))
            assert sleep + drain < grace <= sleep + drain + 15, (name, sleep, drain, grace)
        else:
            assert grace > sleep, name


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpas_scale_both_pools_on_the_metrics_they_export(overlay):
    hpas = objects(overlay, "HorizontalPodAutoscaler")
    assert set(hpas) == {"encoder", "decode"}
    expected = {
        "encoder": {"inkling_encoder_inflight_items"},
        "decode": {"inkling_requests_running", "inkling_requests_waiting", "inkling_kv_cache_usage"},
    }
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert 1 <= spec["minReplicas"] < spec["maxReplicas"], name
        assert {m["type"] for m in spec["metrics"]} == {"Pods"}, name
        assert {m["pods"]["metric"]["name"] for m in spec["metrics"]} == expected[name]
        for metric in spec["metrics"]:
            assert metric["pods"]["target"]["type"] == "AverageValue", (name, metric)
        assert "replicas" not in deployment(overlay, name)["spec"], name  # the HPA owns the count
    (kv,) = [m for m in hpas["decode"]["spec"]["metrics"] if m["pods"]["metric"]["name"] == "inkling_kv_cache_usage"]
    assert kv["pods"]["target"]["averageValue"] == "800m"  # a fraction of the pool (0..1)


@requires_kubectl
def test_the_documented_adapter_rule_serves_every_hpa_metric():
    """docs/deploy.md's Prometheus-adapter rule must expose each metric an HPA asks for, under its own name."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    (block,) = re.findall(r"```yaml\n(rules:\n.*?)```", doc, re.S)
    (rule,) = yaml.safe_load(block)["rules"]
    selector = re.fullmatch(r'\{__name__=~"(.+?)",namespace!="",pod!=""\}', rule["seriesQuery"])
    assert selector, rule["seriesQuery"]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert (rule["name"]["matches"], rule["name"]["as"]) == ("^(.*)$", "${1}")
    for overlay in OVERLAYS:
        for hpa in objects(overlay, "HorizontalPodAutoscaler").values():
            for metric in hpa["spec"]["metrics"]:
                name = metric["pods"]["metric"]["name"]
                assert re.fullmatch(selector.group(1), name), (overlay, name)
                assert f"`{name}`" in doc, name  # in the metrics reference too


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pool_has_a_disruption_budget(overlay):
    pdbs = objects(overlay, "PodDisruptionBudget")
    for name in POOLS:
        matching = [n for n, pdb in pdbs.items() if selects(pdb["spec"]["selector"], pod_labels(overlay, name))]
        assert len(matching) == 1, (name, matching)
        assert pdbs[matching[0]]["spec"]["maxUnavailable"] == 1, name


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pools_spread_over_nodes_and_the_router_admits_what_an_api_pod_relays(overlay):
    for name in POOLS:
        (spread,) = pod_spec(overlay, name)["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname", name
        assert spread["labelSelector"] == deployment(overlay, name)["spec"]["selector"], name
    # One api pod is one client address to the router: its per-client cap must not throttle the HTTP front.
    router = cli_args(overlay, "router")
    live_per_replica = build_parser().parse_args(["decode", "--checkpoint", "x"]).max_live_requests
    assert router.max_streams_per_client == 0 or router.max_streams_per_client >= live_per_replica
