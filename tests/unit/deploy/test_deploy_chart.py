"""The Helm chart, rendered offline for every values file in deploy/helm/meshserve/ci/.

Each render is validated against the Kubernetes API schemas (two versions), the CRD schemas in
crd_schemas/, and cross-object consistency; then its topology and flags are compared with
numbers written out here by hand.
"""

from __future__ import annotations

import copy
import json

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from tests.unit.deploy.manifests import (
    CHART,
    CI_VALUES,
    KUBE_VERSIONS,
    by_kind,
    consistency_problems,
    load_values,
    one,
    pod_templates,
    render,
    validate_manifest,
)

VALUES = {p.name.removesuffix("-values.yaml"): load_values(p) for p in CI_VALUES}


def test_every_issue_scenario_has_a_values_file():
    assert set(VALUES) == {"cpu-demo", "gpu-tp8-dcp2", "disaggregated", "kuberay"}


@pytest.fixture(scope="module")
def rendered():
    return {name: render(values) for name, values in VALUES.items()} | {"defaults": render({})}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", [*sorted(VALUES), "defaults"])
def test_every_manifest_fits_the_api_schemas(rendered, scenario, kube_version):
    docs = rendered[scenario]
    assert docs
    for doc in docs:
        try:
            validate_manifest(doc, kube_version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {kube_version}): {exc.message} "
                        f"at {list(exc.absolute_path)}")


@pytest.mark.parametrize("scenario", [*sorted(VALUES), "defaults"])
def test_objects_hang_together(rendered, scenario):
    assert consistency_problems(rendered[scenario]) == []


# scenario -> ({pool: (worker pods, GPUs per pod, Ray resource units per pod)}, kinds rendered)
TOPOLOGY = {
    "cpu-demo": ({"unified": (1, 0, 1)}, {"Deployment", "ConfigMap", "Service", "ServiceAccount",
                                          "PodDisruptionBudget", "NetworkPolicy"}),
    "gpu-tp8-dcp2": ({"unified": (2, 8, 8)}, {"Deployment", "ConfigMap", "Service", "ServiceAccount",
                                              "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"}),
    # prefill tp=4 (its own layout): 2 replicas share one 8-GPU pod; decode tp=8 (engine.tp), dcp=2.
    "disaggregated": ({"prefill": (1, 8, 8), "decode": (4, 8, 8)},
                      {"Deployment", "ConfigMap", "Service", "ServiceAccount", "PodDisruptionBudget",
                       "NetworkPolicy"}),
    # tp=2 on 4-GPU pods: 1 prefill replica and 2 decode replicas need 2 and 4 GPUs.
    "kuberay": ({"prefill": (1, 4, 4), "decode": (1, 4, 4)},
                {"RayCluster", "ConfigMap", "Service", "ServiceAccount", "PodDisruptionBudget",
                 "NetworkPolicy", "ServiceMonitor"}),
}


def _env(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("scenario", sorted(TOPOLOGY))
def test_worker_pools_have_the_planned_size(rendered, scenario):
    pools, kinds = TOPOLOGY[scenario]
    docs = rendered[scenario]
    assert {d["kind"] for d in docs} == kinds
    found = {}
    if "RayCluster" in kinds:
        for group in one(docs, "RayCluster", "ms-meshserve")["spec"]["workerGroupSpecs"]:
            container = group["template"]["spec"]["containers"][0]
            gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
            # KubeRay's own form: JSON in single quotes (its getResourcesMap strips them too).
            quoted = group["rayStartParams"]["resources"]
            assert quoted[0] == quoted[-1] == "'"
            resources = json.loads(quoted[1:-1])
            assert group["rayStartParams"]["num-gpus"] == str(gpus)
            units = resources[f"meshserve_{group['groupName']}"]
            found[group["groupName"]] = (group["replicas"], gpus, units)
    else:
        for dep in by_kind(docs, "Deployment"):
            labels = dep["spec"]["template"]["metadata"]["labels"]
            if labels["app.kubernetes.io/component"] != "worker":
                continue
            container = dep["spec"]["template"]["spec"]["containers"][0]
            env = _env(container)
            gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
            assert env["RAY_NUM_GPUS"] == str(gpus)
            assert env["MESHSERVE_POOL"] == labels["meshserve.io/pool"]
            units = int(env["MESHSERVE_POOL_SLOTS"])
            found[labels["meshserve.io/pool"]] = (dep["spec"]["replicas"], gpus, units)
    assert found == pools


def test_the_head_runs_the_server_with_grpc_health_probes(rendered):
    head = one(rendered["disaggregated"], "Deployment", "ms-meshserve-head")
    assert head["spec"]["replicas"] == 1 and head["spec"]["strategy"]["type"] == "Recreate"
    c = head["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["/usr/bin/tini", "--", "/bin/bash", "/etc/meshserve/scripts/head.sh"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": "meshserve.v1.Inference"}
    assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert c["startupProbe"]["grpc"] == {"port": 50051, "service": ""}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    pod = head["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["automountServiceAccountToken"] is False
    # The writable places Ray and the kernel caches need on a read-only root filesystem.
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/shm"}
    assert _env(c)["HOME"].startswith("/tmp/")


def test_tls_switches_probes_to_the_tls_health_script(rendered):
    head = one(rendered["gpu-tp8-dcp2"], "Deployment", "ms-meshserve-head")
    c = head["spec"]["template"]["spec"]["containers"][0]
    for kind, service in (("readinessProbe", "meshserve.v1.Inference"), ("livenessProbe", "")):
        cmd = c[kind]["exec"]["command"]
        assert cmd[:2] == ["python3", "/etc/meshserve/scripts/healthcheck.py"]
        assert f"--service={service}" in cmd
        assert {"--tls-dir=/etc/meshserve/tls", "--server-name=ms-meshserve.llm.svc",
                "--token-file=/etc/meshserve/auth/token", "--port=50051"} <= set(cmd)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["tls"] == "/etc/meshserve/tls" and mounts["auth"] == "/etc/meshserve/auth"
    assert mounts["metrics-auth"] == "/etc/meshserve/metrics-auth"
    volumes = {v["name"]: v for v in head["spec"]["template"]["spec"]["volumes"]}
    assert volumes["metrics-auth"]["secret"]["secretName"] == "meshserve-metrics-token"
    assert _env(c)["RAY_AUTH_MODE"] == "token"


def test_configmap_carries_the_values_as_server_flags(rendered):
    data = one(rendered["gpu-tp8-dcp2"], "ConfigMap", "ms-meshserve-config")["data"]
    # Plain strings only: Kubernetes refuses numbers in ConfigMap data, and Helm prints large
    # numbers as 1.31072e+05 unless the template converts them.
    assert all(isinstance(v, str) for v in data.values())
    expected = {
        "MESHSERVE_MODEL": "/models", "MESHSERVE_DTYPE": "bfloat16",
        "MESHSERVE_TP": "8", "MESHSERVE_DCP": "2", "MESHSERVE_EP": "1",
        "MESHSERVE_ATTENTION_BACKEND": "FLASHINFER", "MESHSERVE_BLOCK_SIZE": "16",
        "MESHSERVE_MAX_MODEL_LEN": "131072", "MESHSERVE_MAX_QUEUE": "4096", "MESHSERVE_POOLS": "unified",
        "MESHSERVE_API_SERVER_COUNT": "2",
        "MESHSERVE_REPLICAS": "2", "MESHSERVE_TLS_CERT": "/etc/meshserve/tls/tls.crt",
        "MESHSERVE_TLS_KEY": "/etc/meshserve/tls/tls.key",
        "MESHSERVE_AUTH_TOKEN_FILE": "/etc/meshserve/auth/token",
        "MESHSERVE_METRICS_TOKEN_FILE": "/etc/meshserve/metrics-auth/token",
        "RAY_HEAD_HOST": "ms-meshserve-ray.llm.svc", "RAY_PORT": "6379",
    }
    assert {k: data[k] for k in expected} == expected
    demo = one(rendered["cpu-demo"], "ConfigMap", "ms-meshserve-config")["data"]
    # Unset optional flags stay empty so the server's defaults apply (demo model, auto backend).
    assert demo["MESHSERVE_MODEL"] == demo["MESHSERVE_BLOCK_SIZE"] == demo["MESHSERVE_TLS_CERT"] == ""
    assert demo["MESHSERVE_API_SERVER_COUNT"] == ""  # one front-end process, the server's default
    assert demo["MESHSERVE_ATTENTION_BACKEND"] == ""  # automatic: CPU_SDPA on a CPU (next test)
    kuberay = one(rendered["kuberay"], "ConfigMap", "ms-meshserve-config")["data"]
    assert kuberay["RAY_HEAD_HOST"] == "ms-meshserve-head-svc.llm.svc"
    # A pool's own layout (pools.<pool>.tp/dcp), empty where the pool follows engine.tp/dcp.
    assert all(demo[f"MESHSERVE_{p}_{k}"] == "" for p in ("PREFILL", "DECODE") for k in ("TP", "DCP"))
    split = one(rendered["disaggregated"], "ConfigMap", "ms-meshserve-config")["data"]
    assert {k: split[f"MESHSERVE_{k}"] for k in ("PREFILL_TP", "PREFILL_DCP", "DECODE_TP", "DECODE_DCP")} == {
        "PREFILL_TP": "4", "PREFILL_DCP": "", "DECODE_TP": "", "DECODE_DCP": "2"}
    assert split["MESHSERVE_KV_TRANSPORT"] == demo["MESHSERVE_KV_TRANSPORT"] == "auto"  # pools.kvTransport


def test_cpu_demo_gets_the_cpu_default_backend():
    """The automatic choice the CPU demo values leave to the server is CPU_SDPA for the demo model."""
    import torch

    from meshserve.attention.layer_backends import make_backends
    from meshserve.attention.spec import AttentionSpec

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64)  # the bundled demo model's layers
    (backend,) = make_backends([spec], name=None, dtype=torch.float32, block_size=16, max_model_len=2048,
                               device=torch.device("cpu"))
    assert backend.name == "CPU_SDPA"


def test_model_pvc_is_mounted_read_only_everywhere(rendered):
    for owner, template in pod_templates(rendered["gpu-tp8-dcp2"]):
        vols = {v["name"]: v for v in template["spec"]["volumes"]}
        claim = vols["model"]["persistentVolumeClaim"]
        assert claim == {"claimName": "model-weights", "readOnly": True}, owner
        mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True,
                         "subPath": "DeepSeek-V2-Lite-Chat"}, owner


def test_kuberay_mode_uses_the_generated_ray_start(rendered):
    rc = one(rendered["kuberay"], "RayCluster", "ms-meshserve")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    ready = head["template"]["spec"]["containers"][0]["readinessProbe"]
    assert ready["grpc"]["service"] == "meshserve.v1.Inference"
    # The API Service selects the KubeRay head pod through the chart's own labels.
    svc = one(rendered["kuberay"], "Service", "ms-meshserve")
    labels = head["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())


def test_lint_is_clean_for_defaults_and_every_values_file():
    for values in [{}, *VALUES.values()]:
        report = helm.lint(CHART, values, strict=True)
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert serious == [] and report["errors"] == []


def test_a_long_release_name_still_gives_valid_names():
    name = "a-release-name-that-is-fifty-three-characters-long-xy"
    assert len(name) == 53  # Helm's own limit on release names
    docs = render(VALUES["disaggregated"], name=name)
    assert consistency_problems(docs) == []
    for doc in docs:
        validate_manifest(doc, KUBE_VERSIONS[-1])


def test_upgrades_roll_pods_only_when_the_config_changes():
    def checksums(values):
        return {o: t["metadata"]["annotations"]["checksum/config"] for o, t in pod_templates(render(values))}

    base = checksums(VALUES["disaggregated"])
    assert base == checksums(VALUES["disaggregated"])
    changed = copy.deepcopy(VALUES["disaggregated"])
    changed["engine"]["maxQueue"] = 100
    after = checksums(changed)
    assert after.keys() == base.keys() and all(after[k] != base[k] for k in base)


def test_the_validators_refuse_broken_manifests(rendered):
    """The checks above can fail: each validator rejects a manifest broken on purpose."""
    docs = rendered["kuberay"]
    broken_pod = copy.deepcopy(one(rendered["cpu-demo"], "Deployment", "ms-meshserve-head"))
    broken_pod["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(broken_pod, "1.33.0")
    rc = copy.deepcopy(one(docs, "RayCluster", "ms-meshserve"))
    del rc["spec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(rc, "1.33.0")
    rc = copy.deepcopy(one(docs, "RayCluster", "ms-meshserve"))
    rc["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(AssertionError, match="pod template"):
        validate_manifest(rc, "1.33.0")
    sm = copy.deepcopy(one(docs, "ServiceMonitor", "ms-meshserve"))
    sm["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(sm, "1.33.0")
    svc = copy.deepcopy(one(docs, "Service", "ms-meshserve"))
    svc["spec"]["ports"][0]["targetPort"] = "grpcc"
    swapped = [svc if (d["kind"], d["metadata"]["name"]) == ("Service", "ms-meshserve") else d for d in docs]
    assert consistency_problems(swapped) == ["Service/ms-meshserve: targetPort grpcc not on its pods"]


def test_chart_creates_the_ray_token_and_every_pod_joins_with_it():
    import base64

    from tests.unit.deploy.manifests import validate_manifest

    docs = render({"ray": {"authToken": {"create": True}}})
    secret = one(docs, "Secret", "ms-meshserve-ray-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    validate_manifest(secret, KUBE_VERSIONS[-1])
    templates = list(pod_templates(docs))
    assert templates
    for owner, template in templates:
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", owner
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ms-meshserve-ray-token",
                                                                      "key": "token"}, owner
    # An existing Secret wins over create, and no Secret is rendered then.
    docs = render({"ray": {"authToken": {"create": True, "existingSecret": "mine"}}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    for owner, template in pod_templates(docs):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "mine", owner
    # Neither: auth off.
    for owner, template in pod_templates(render({})):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env, owner


def test_service_monitor_sends_the_metrics_token_when_metrics_want_one(rendered):
    sm = one(rendered["gpu-tp8-dcp2"], "ServiceMonitor", "ms-meshserve")
    assert sm["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "meshserve-metrics-token", "key": "token"}}
    open_metrics = one(rendered["kuberay"], "ServiceMonitor", "ms-meshserve")  # no metricsAuth: no token
    assert "authorization" not in open_metrics["spec"]["endpoints"][0]
    assert one(rendered["kuberay"], "ConfigMap", "ms-meshserve-config")["data"]["MESHSERVE_METRICS_TOKEN_FILE"] == ""
