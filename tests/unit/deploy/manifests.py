"""Render the meshserve Helm chart offline and check what it renders, with no cluster.

Three layers of checking, each able to fail on its own:
1. schema: built-in kinds against the Kubernetes OpenAPI schemas bundled in kubernetes-validate
   (strict: unknown fields are errors); RayCluster and ServiceMonitor, which it does not know,
   against the JSON schemas in crd_schemas/, and the pod templates inside a RayCluster as
   core/v1 PodTemplate objects, so they get the full Kubernetes check too;
2. consistency across objects, which no schema sees: selectors that select the pods they mean,
   ports, volumes, ConfigMaps and scripts that exist where they are referenced;
3. policy: non-root pods, no privilege escalation, every container with requests and limits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "meshserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# The chart's kubeVersion floor and the version the issue names.
KUBE_VERSIONS = ("1.27.0", "1.33.0")

_CRD_DIR = Path(__file__).parent / "crd_schemas"
CRD_SCHEMAS = {
    "RayCluster": json.loads((_CRD_DIR / "raycluster.schema.json").read_text()),
    "ServiceMonitor": json.loads((_CRD_DIR / "servicemonitor.schema.json").read_text()),
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

Manifest = dict[str, Any]


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(
    values: dict[str, Any] | None = None, *, name: str = "ms", namespace: str = "llm"
) -> list[Manifest]:
    """Every object the chart renders for `values`, in template order (NOTES.txt left out)."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values or {}, name=name, namespace=namespace)
    docs: list[Manifest] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Manifest], kind: str, name: str) -> Manifest:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_templates(docs: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """(owner, pod template) for every pod the release would run, in both modes."""
    for doc in docs:
        owner = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield owner, doc["spec"]["template"]
        elif doc["kind"] == "RayCluster":
            yield f"{owner}/head", doc["spec"]["headGroupSpec"]["template"]
            for group in doc["spec"].get("workerGroupSpecs", []):
                yield f"{owner}/{group['groupName']}", group["template"]


def validate_manifest(doc: Manifest, kube_version: str) -> None:
    """Raise if `doc` does not fit its API schema (see the module docstring)."""
    schema = CRD_SCHEMAS.get(doc["kind"])
    if schema is None:
        kubernetes_validate.validate(doc, kube_version, strict=True)
        return
    jsonschema.Draft202012Validator(schema).validate(doc)
    for owner, template in pod_templates([doc]):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = list(exc.absolute_path)
            raise AssertionError(f"{owner}: pod template: {exc.message} at {where}") from exc


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _containers(template: Manifest) -> list[Manifest]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


def _check_pod(owner: str, template: Manifest, config_maps: dict[str, Manifest]) -> Iterator[str]:
    spec = template["spec"]
    psc = spec.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True or psc.get("runAsUser", 0) == 0:
        yield f"{owner}: pod must run as non-root (runAsNonRoot and a non-zero runAsUser)"
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for name, volume in volumes.items():
        cm = volume.get("configMap", {}).get("name")
        if cm is not None and cm not in config_maps:
            yield f"{owner}: volume {name} uses ConfigMap {cm}, which the chart does not render"
    for c in _containers(template):
        where = f"{owner}/{c['name']}"
        sc = c.get("securityContext", {})
        drops = sc.get("capabilities", {}).get("drop", [])
        if sc.get("allowPrivilegeEscalation") is not False or "ALL" not in drops:
            yield f"{where}: must drop ALL capabilities and forbid privilege escalation"
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(res.get(part, {}))
            if missing:
                yield f"{where}: resources.{part} lacks {sorted(missing)}"
        for key, qty in res.get("limits", {}).items():
            if "/" in key and res.get("requests", {}).get(key) != qty:
                yield f"{where}: extended resource {key} needs requests == limits"
        port_names = {p["name"] for p in c.get("ports", []) if "name" in p}
        port_numbers = {p["containerPort"] for p in c.get("ports", [])}
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        for m in mounts.values():
            if m["name"] not in volumes:
                yield f"{where}: volumeMount {m['name']} has no volume"
        for ref in c.get("envFrom", []):
            cm = ref.get("configMapRef", {}).get("name")
            if cm is not None and cm not in config_maps:
                yield f"{where}: envFrom ConfigMap {cm} is not rendered"
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            if "grpc" in probe and probe["grpc"]["port"] not in port_numbers:
                yield f"{where}: {kind} grpc port {probe['grpc']['port']} is not a container port"
            tcp = probe.get("tcpSocket", {}).get("port")
            if isinstance(tcp, str) and tcp not in port_names:
                yield f"{where}: {kind} tcpSocket port {tcp} is not a named container port"
        # Scripts the container runs must exist in the ConfigMap mounted where it looks for them.
        commands = [c.get("command", [])] + [
            c[k]["exec"]["command"] for k in ("startupProbe", "livenessProbe", "readinessProbe")
            if "exec" in c.get(k, {})
        ]
        for arg in (a for cmd in commands for a in cmd if a.startswith("/etc/")):
            folder, _, filename = arg.rpartition("/")
            mount = mounts.get(folder)
            volume = volumes.get(mount["name"]) if mount else None
            cm = config_maps.get((volume or {}).get("configMap", {}).get("name", ""))
            if cm is None or filename not in cm.get("data", {}):
                yield f"{where}: runs {arg}, but no mounted ConfigMap provides it"


def consistency_problems(docs: list[Manifest]) -> list[str]:
    """Every cross-object mistake found in `docs`; empty when the release hangs together."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        if key in seen:
            problems.append(f"{key[0]}/{key[1]} is rendered twice")
        seen.add(key)
        if not _DNS_LABEL.match(key[1]) or len(key[1]) > 63:
            problems.append(f"{key[0]}/{key[1]}: name is not a DNS label of at most 63 characters")

    config_maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    pods = list(pod_templates(docs))
    for owner, template in pods:
        problems.extend(_check_pod(owner, template, config_maps))
    for d in by_kind(docs, "Deployment"):
        if not _selects(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"Deployment/{d['metadata']['name']}: selector does not match its pod labels")

    def selected(selector: dict[str, str]) -> list[tuple[str, Manifest]]:
        return [(o, t) for o, t in pods if _selects(selector, t["metadata"].get("labels", {}))]

    def named_ports(templates: list[tuple[str, Manifest]]) -> set[str]:
        ports = (p for _, t in templates for c in _containers(t) for p in c.get("ports", []))
        return {p["name"] for p in ports if "name" in p}

    for svc in by_kind(docs, "Service"):
        where = f"Service/{svc['metadata']['name']}"
        targets = selected(svc["spec"]["selector"])
        if not targets:
            problems.append(f"{where}: selector matches no pod")
        for port in svc["spec"]["ports"]:
            if isinstance(port.get("targetPort"), str) and port["targetPort"] not in named_ports(targets):
                problems.append(f"{where}: targetPort {port['targetPort']} not on its pods")
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        if not selected(pdb["spec"]["selector"]["matchLabels"]):
            problems.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selector matches no pod")
    for pol in by_kind(docs, "NetworkPolicy"):
        where = f"NetworkPolicy/{pol['metadata']['name']}"
        covered = selected(pol["spec"]["podSelector"]["matchLabels"])
        if len(covered) != len(pods):
            problems.append(f"{where}: covers {len(covered)} of {len(pods)} pods")
        for rule in pol["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str) and port["port"] not in named_ports(covered):
                    problems.append(f"{where}: port {port['port']} not on its pods")
    services = by_kind(docs, "Service")
    for sm in by_kind(docs, "ServiceMonitor"):
        where = f"ServiceMonitor/{sm['metadata']['name']}"
        selector = sm["spec"]["selector"]["matchLabels"]
        matches = [s for s in services if _selects(selector, s["metadata"]["labels"])]
        for ep in sm["spec"]["endpoints"]:
            if not any(p["name"] == ep["port"] for s in matches for p in s["spec"]["ports"]):
                problems.append(f"{where}: no selected Service has port {ep['port']}")
            if "scrapeTimeout" in ep and _seconds(ep["scrapeTimeout"]) > _seconds(ep.get("interval", "30s")):
                problems.append(f"{where}: scrapeTimeout exceeds interval")
    for rc in by_kind(docs, "RayCluster"):
        groups = [g["groupName"] for g in rc["spec"].get("workerGroupSpecs", [])]
        if len(groups) != len(set(groups)):
            problems.append(f"RayCluster/{rc['metadata']['name']}: duplicate worker group names {groups}")
        for g in rc["spec"].get("workerGroupSpecs", []):
            lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 2**31 - 1)
            if not lo <= n <= hi:
                problems.append(f"RayCluster worker group {g['groupName']}: needs min <= replicas <= max")
    return problems


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))
