"""Bad values are refused before anything reaches a cluster, with a message naming the value.

Each file in bad_values/ starts with `# expect: TEXT` lines: the refusal must contain every TEXT.
Field rules come from values.schema.json; rules between fields from templates/_validate.tpl.
"""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import pytest

from tests.unit.deploy.manifests import CHART, CI_VALUES, REPO, load_values, render

BAD_VALUES = sorted((Path(__file__).parent / "bad_values").glob("*.yaml"))


def expected_messages(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [line.removeprefix("# expect:").strip() for line in lines if line.startswith("# expect:")]


def test_there_are_bad_values_files_and_each_says_what_it_expects():
    assert len(BAD_VALUES) >= 12 and len(SCHEMA_REFUSALS) >= 6
    assert all(expected_messages(p) for p in BAD_VALUES)


@pytest.mark.parametrize("path", BAD_VALUES, ids=lambda p: p.stem)
def test_bad_values_are_refused_with_a_readable_message(path):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as info:
        render(load_values(path))
    message = str(info.value)
    for expected in expected_messages(path):
        assert expected in message


# `helm lint` runs templates in lint mode, where `fail` only logs (by Helm's design), so it
# reports the schema's refusals (messages "at '/path': ...") but not _validate.tpl's.
SCHEMA_REFUSALS = [p for p in BAD_VALUES if expected_messages(p)[0].startswith("at '/")]


@pytest.mark.parametrize("path", SCHEMA_REFUSALS, ids=lambda p: p.stem)
def test_lint_reports_schema_refusals_as_errors(path):
    report = helm.lint(CHART, load_values(path))
    assert any(expected_messages(path)[0] in e for e in report["errors"]), report


def test_schema_alone_refuses_field_errors_and_accepts_the_defaults():
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)
        with pytest.raises(helm.HelmValuesError, match="/worker/gpus"):
            chart.validate_schema({"worker": {"gpus": -1}})


def test_every_value_in_values_yaml_is_described_by_the_schema():
    """additionalProperties is false throughout, so a value the schema lacks would be refused."""
    with helm.Chart.load(CHART) as chart:
        schema, values = chart.schema, chart.values

    def walk(node: dict, sch: dict, path: str) -> list[str]:
        missing = []
        for key, value in node.items():
            props = sch.get("properties", {})
            if key not in props:
                missing.append(f"{path}.{key}")
                continue
            sub = props[key]
            if "$ref" in sub:
                sub = schema["definitions"][sub["$ref"].rsplit("/", 1)[1]]
            if isinstance(value, dict) and "properties" in sub:
                missing += walk(value, sub, f"{path}.{key}")
        return missing

    assert schema is not None and schema.get("additionalProperties") is False
    assert walk(values, schema, "") == []


def leaf_paths(node: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        paths |= leaf_paths(value, path) if isinstance(value, dict) and value else {path}
    return paths


def test_docs_describe_every_value_and_no_other():
    text = (REPO / "docs" / "deploy.md").read_text()
    section = text.split("\n## Values\n", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
    with helm.Chart.load(CHART) as chart:
        values = chart.values
    assert sorted(documented) == sorted(leaf_paths(values))
    for path in CI_VALUES:
        assert f"`{path.name}`" in text


def test_a_phase_split_backend_reaches_the_server_flags():
    """engine.attentionBackend takes a phase split (attention/backends/phase_split.py) as the server
    flag spells it; the config reads the same string back."""
    from meshserve.config import AttentionConfig
    from tests.unit.deploy.manifests import one

    values = load_values(CHART / "ci" / "gpu-tp8-dcp2-values.yaml")
    values["engine"]["attentionBackend"] = "prefill=FLASHINFER,decode=TRITON"
    data = one(render(values), "ConfigMap", "ms-meshserve-config")["data"]
    assert data["MESHSERVE_ATTENTION_BACKEND"] == "prefill=FLASHINFER,decode=TRITON"
    assert AttentionConfig(backend=data["MESHSERVE_ATTENTION_BACKEND"]).backend == "prefill=FLASHINFER,decode=TRITON"
