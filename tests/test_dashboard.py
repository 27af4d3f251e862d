"""The Grafana dashboard: generated from code without drift, well-formed, and querying only metrics and
labels the server really exports (``tests/test_prometheus.py`` also runs every expression on a real
Prometheus)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.grafana.dashboard import OUTPUT, UID, dashboard_expressions, render
from tests.harness import ServerHarness
from tests.test_server import default_loader, test_config

ROOT = Path(__file__).resolve().parent.parent
METRIC = re.compile(r"\b((?:nmt|process)_[a-z_]+)")
SELECTOR = re.compile(r"\b((?:nmt|process)_[a-z_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"\b(\w+)\s*(?:=~|!~|!=|=)\s*\"")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")
TARGET_LABELS = {"job", "instance"}  # added by Prometheus at scrape time


@pytest.fixture(scope="module")
def exported(repository: Path) -> Iterator[dict[str, set[str]]]:
    """Metric family -> label names, from a live server's /metrics."""
    h = ServerHarness(test_config(repository), default_loader())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{h.server.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        h.close()
    yield {f.name: {k for s in f.samples for k in s.labels} for f in text_string_to_metric_families(text)}


def test_the_json_is_what_the_code_generates() -> None:
    assert OUTPUT.read_text(encoding="utf-8") == render(), \
        "deploy/grafana/dashboards/translator.json is stale: run `python deploy/grafana/dashboard.py`"


def test_dashboard_structure() -> None:
    model = json.loads(OUTPUT.read_text(encoding="utf-8"))
    assert model["uid"] == UID and model["title"] == "NMT translator"
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert set(variables) == {"datasource", "model", "version"}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in model["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def family_of(name: str, exported: dict[str, set[str]]) -> str | None:
    """The exported family a series name belongs to (``x_bucket`` -> ``x``), or None."""
    return next((name.removesuffix(s) for s in ("", *SUFFIXES) if name.removesuffix(s) in exported), None)


def test_every_expression_queries_exported_metrics_and_labels(exported: dict[str, set[str]]) -> None:
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    for expr in expressions:
        families = [family_of(name, exported) for name in METRIC.findall(expr)]
        assert families and None not in families, f"{expr}: a metric that is not exported"
        for name, matchers in SELECTOR.findall(expr):  # a matcher's label must be on its own metric
            family = family_of(name, exported)
            labels = exported[family] | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
            used = set(MATCHER.findall(matchers))
            assert used <= labels, f"{expr}: labels {used - labels} are not on {family}"
        labels = set().union(*(exported[f] for f in families)) | {"le"} | TARGET_LABELS
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        assert grouped <= labels, f"{expr}: labels {grouped - labels} are not on {families}"


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/translator.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in compose["services"]["grafana"]["volumes"]
