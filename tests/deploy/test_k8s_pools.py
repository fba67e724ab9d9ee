"""The four pools, Redis and their Services: pools found by DNS through headless Services, the images compose
builds, resources, GPUs for decode in the GPU overlays, where the checkpoint and the Redis URL come from (the
external-redis component too)."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.k8s_manifests import (
    GPU_OVERLAYS,
    GRPC_PORTS,
    OVERLAYS,
    POOLS,
    ROOT,
    by_kind,
    cli_value,
    container,
    decoded,
    dns_target,
    expanded_args,
    objects,
    parse,
    pod_labels,
    pod_spec,
    render,
    render_with,
    requires_kubectl,
    selects,
)


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_four_pools_redis_and_their_services(overlay):
    deployments = objects(overlay, "Deployment")
    assert set(deployments) == {*POOLS, "redis"}
    services = objects(overlay, "Service")
    assert set(services) == {*POOLS, "redis"}
    for name, service in services.items():
        assert service["spec"]["selector"] == deployments[name]["spec"]["selector"]["matchLabels"], name
        assert selects(deployments[name]["spec"]["selector"], pod_labels(overlay, name)), name
        target_ports = {p["targetPort"] for p in service["spec"]["ports"]}
        named = {p["name"] for c in pod_spec(overlay, name)["containers"] for p in c.get("ports", [])}
        assert target_ports <= named, (name, target_ports, named)


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replica_pools_are_headless_services_found_by_dns(overlay):
    """A ClusterIP would hide the replicas behind one VIP from rendezvous hashing and the router's pool."""
    services = objects(overlay, "Service")
    for name in ("encoder", "decode"):
        assert services[name]["spec"]["clusterIP"] == "None", name
        assert services[name]["spec"].get("publishNotReadyAddresses", False) is False, name  # DNS: ready only
    for name in ("router", "api", "redis"):
        assert services[name]["spec"].get("clusterIP") != "None", name

    def service_port(name: str, port: int) -> None:
        assert port in {p["port"] for p in services[name]["spec"]["ports"]}, (name, port)

    decode_targets = [dns_target(t) for t in cli_value(overlay, "decode", "--encoders").split(",")]
    router_targets = [dns_target(t) for t in cli_value(overlay, "router", "--decoders").split(",")]
    assert decode_targets == [("encoder", GRPC_PORTS["encoder"])]
    assert router_targets == [("decode", GRPC_PORTS["decode"])]
    for name, port in decode_targets + router_targets:
        service_port(name, port)
    host, _, port = cli_value(overlay, "api", "--upstream").rpartition(":")
    assert (host, int(port)) == ("router", GRPC_PORTS["router"])
    service_port(host, int(port))


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_the_ones_docker_compose_builds(overlay):
    """Same image names and tags as docker-compose.yml (one version to bump); the api front runs in the router
    image, as compose's `api` service does."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    built = {s["image"] for s in compose["services"].values() if "build" in s}
    for name, doc in objects(overlay, "Deployment").items():
        spec = doc["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            if name == "redis":
                assert c["image"] == compose["services"]["redis"]["image"]
            else:
                assert c["image"] in built, (name, c["image"])
    assert container(overlay, "api")["image"] == compose["services"]["api"]["image"]


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_resources(overlay):
    for name, doc in objects(overlay, "Deployment").items():
        spec = doc["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, c["name"])
            assert "memory" in c["resources"]["limits"], (name, c["name"])


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_for_decode_only_in_the_gpu_overlays(overlay):
    decode = container(overlay, "decode")
    resources = decode["resources"]
    gpus = GPU_OVERLAYS.get(overlay)
    for doc in render(overlay):
        text = yaml.safe_dump(doc)
        if doc["kind"] != "Deployment" or doc["metadata"]["name"] != "decode":
            assert "nvidia.com/gpu" not in text, doc["metadata"]["name"]
    if gpus is None:
        assert "nvidia.com/gpu" not in yaml.safe_dump(resources)
        assert cli_value(overlay, "decode", "--device") == "cpu"
        assert "--tensor-parallel-size" not in decode["args"]
        return
    assert float(cli_value(overlay, "decode", "--kv-budget-mb")) >= 16384  # not the CPU-demo default (512)
    assert resources["limits"]["nvidia.com/gpu"] == str(gpus)
    assert resources["requests"]["nvidia.com/gpu"] == str(gpus)
    assert cli_value(overlay, "decode", "--tensor-parallel-size") == str(gpus)
    assert cli_value(overlay, "decode", "--device") == "cuda"
    assert decode["image"] == "inkling-epd/decode:0.1.0"
    spec = pod_spec(overlay, "decode")
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in decode["volumeMounts"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkpoint_source(overlay):
    """cpu-tiny writes the tiny checkpoint per pod (one seed: identical weights); GPU overlays read the PVC."""
    pvcs = objects(overlay, "PersistentVolumeClaim")
    for name in ("encoder", "decode"):
        spec = pod_spec(overlay, name)
        (models,) = [v for v in spec["volumes"] if v["name"] == "models"]
        mount = [m for m in container(overlay, name)["volumeMounts"] if m["name"] == "models"]
        assert mount == [{"name": "models", "mountPath": "/models/inkling", "readOnly": True}], name
        assert cli_value(overlay, name, "--checkpoint") == "/models/inkling"
        if overlay == "cpu-tiny":
            assert set(models) == {"name", "emptyDir"}, models
            (init,) = spec["initContainers"]
            args = parse(expanded_args(spec, init))
            assert args.command == "make-tiny" and args.out_dir == "/models/inkling", name
            assert (args.nvfp4, args.seed) == (True, 0), name
        else:
            assert models["persistentVolumeClaim"] == {"claimName": "inkling-models", "readOnly": True}
            assert "ReadOnlyMany" in pvcs["inkling-models"]["spec"]["accessModes"]
    if overlay == "cpu-tiny":
        assert not pvcs


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pools_read_redis_from_the_secret(overlay):
    secrets = objects(overlay, "Secret")
    (redis_secret,) = [n for n in secrets if n.startswith("inkling-redis")]
    for name in ("encoder", "decode", "router"):
        env = {v["name"]: v for v in container(overlay, name)["env"]}
        ref = env["INKLING_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": redis_secret, "key": "url"}, name
        assert "--redis-url" not in container(overlay, name)["args"], name  # a password stays out of args
    redis_conf = (ROOT / "deploy" / "redis.conf").read_text()
    (config,) = [c for n, c in objects(overlay, "ConfigMap").items() if n.startswith("redis-config")]
    assert config["data"]["redis.conf"] == redis_conf  # base/redis.conf is a copy of deploy/redis.conf
    assert "redis://redis:6379/0" in [t for s in secrets.values() for t in decoded(s).values()]


@requires_kubectl
def test_external_redis_component_drops_the_in_cluster_redis():
    url = "rediss://:secret@redis.example.com:6380/0"
    extra = f"secretGenerator:\n  - name: inkling-redis\n    behavior: replace\n    literals: [url={url}]\n"
    docs = render_with("cpu-tiny", "external-redis", extra)
    assert set(by_kind(docs, "Deployment")) == set(POOLS)
    assert "redis" not in by_kind(docs, "Service") and "redis" not in by_kind(docs, "NetworkPolicy")
    assert not [n for n in by_kind(docs, "ConfigMap") if n.startswith("redis-config")]
    (name,) = [n for n in by_kind(docs, "Secret") if n.startswith("inkling-redis")]
    assert decoded(by_kind(docs, "Secret")[name]) == {"url": url}
    for pool in ("encoder", "decode", "router"):
        (c,) = by_kind(docs, "Deployment")[pool]["spec"]["template"]["spec"]["containers"]
        (env,) = [v for v in c["env"] if v["name"] == "INKLING_REDIS_URL"]
        assert env["valueFrom"]["secretKeyRef"]["name"] == name, pool
