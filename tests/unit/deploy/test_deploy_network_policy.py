"""The NetworkPolicy: off by default; when on, every meshserve pod is covered, the release's pods
reach each other on any port (Ray, NCCL, KV hand-over), and from elsewhere gRPC, HTTP and metrics
are open to their peers and Ray's GCS port (and dashboard) only to networkPolicy.rayFrom.
Renders are validated against the Kubernetes schemas; the oracle is the values written here."""

from __future__ import annotations

import pytest

from tests.unit.deploy.manifests import (
    CI_VALUES,
    KUBE_VERSIONS,
    by_kind,
    consistency_problems,
    load_values,
    pod_templates,
    render,
    validate_manifest,
)

VALUES = {p.name.removesuffix("-values.yaml"): load_values(p) for p in CI_VALUES}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ADMIN = {"ipBlock": {"cidr": "10.20.0.0/16"}}


def policy(values) -> dict:
    (pol,) = by_kind(render(values), "NetworkPolicy")
    return pol


def rules_by_port(pol) -> dict[object, list]:
    """port -> the peers allowed to reach it ([] = any source); the release-internal rule left out."""
    out = {}
    for rule in pol["spec"]["ingress"]:
        for port in rule.get("ports", []):
            assert port["protocol"] == "TCP"
            out[port["port"]] = rule.get("from", [])
    return out


def test_off_by_default():
    assert by_kind(render({}), "NetworkPolicy") == []


@pytest.mark.parametrize("scenario", sorted(VALUES))
def test_every_values_file_renders_a_valid_policy_covering_every_pod(scenario):
    docs = render(VALUES[scenario])
    (pol,) = by_kind(docs, "NetworkPolicy")
    for version in KUBE_VERSIONS:
        validate_manifest(pol, version)  # raises when it does not fit
    assert consistency_problems(docs) == []  # covers every pod; named ports exist on them
    internal = [r for r in pol["spec"]["ingress"] if "ports" not in r]
    assert len(internal) == 1 and internal[0]["from"][0]["podSelector"] == pol["spec"]["podSelector"]
    assert len(list(pod_templates(docs))) >= 2  # head and workers both behind it


def test_each_port_is_open_to_its_own_peers():
    rules = rules_by_port(policy(VALUES["gpu-tp8-dcp2"]))
    assert rules == {"grpc": [GATEWAY], "metrics": [MONITORING], "http": [GATEWAY], 6379: [ADMIN]}


def test_empty_peer_lists_open_grpc_http_metrics_to_anyone_but_keep_ray_internal():
    rules = rules_by_port(policy({"networkPolicy": {"enabled": True}}))
    assert rules == {"grpc": [], "metrics": [], "http": []}


def test_dashboard_and_http_follow_their_switches():
    values = {"networkPolicy": {"enabled": True, "rayFrom": [ADMIN]}, "ray": {"dashboard": True, "port": 7000},
              "service": {"httpPort": 0}}
    docs = render(values)
    rules = rules_by_port(by_kind(docs, "NetworkPolicy")[0])
    assert rules == {"grpc": [], "metrics": [], 7000: [ADMIN], 8265: [ADMIN]}
    assert consistency_problems(docs) == []
    (svc,) = [s for s in by_kind(docs, "Service") if any(p["name"] == "grpc" for p in s["spec"]["ports"])]
    assert "http" not in [p["name"] for p in svc["spec"]["ports"]]


def test_bad_peers_are_refused_by_the_schema():
    with pytest.raises(Exception, match="rayFrom"):
        render({"networkPolicy": {"enabled": True, "rayFrom": "10.0.0.0/8"}})
