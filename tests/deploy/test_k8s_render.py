"""Each overlay renders with `kubectl kustomize` and every object validates strictly (unknown fields are errors)
against the Kubernetes 1.32 schemas; the schemas do catch the mistakes that matter."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.k8s_manifests import (
    KUBERNETES_VERSION,
    OVERLAYS,
    container_of,
    deployment,
    objects,
    render,
    requires_kubectl,
    validate,
)


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly_against_the_1_32_schemas(overlay):
    docs = render(overlay)
    errors = []
    for doc in docs:
        try:
            validate(doc)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            where = "/".join(map(str, getattr(exc, "absolute_path", [])))
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} {where}: {exc.message}")
    assert not errors, "\n".join(errors)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    namespaces = {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, namespaces
    (ns,) = objects(overlay, "Namespace")
    assert namespaces == {ns}


@requires_kubectl
def test_strict_validation_catches_the_mistakes_that_matter():
    """The schemas are strict (a green validation means something): typos and wrong types are errors."""
    decode = deployment("cpu-tiny", "decode")
    mistakes = {
        "misspelled probe field": lambda d: container_of(d)["readinessProbe"]["grpc"].update(sevice=""),
        "port as a string": lambda d: container_of(d)["readinessProbe"]["grpc"].update(port="50051"),
        "preStop sleep as a string": lambda d: container_of(d)["lifecycle"]["preStop"]["sleep"].update(seconds="5"),
        "unknown container field": lambda d: container_of(d).update(gpus=1),
    }
    for what, mutate in mistakes.items():
        broken = copy.deepcopy(decode)
        mutate(broken)
        try:
            kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError:
            continue
        pytest.fail(f"the 1.32 schema accepted a {what}")
