"""``deploy/prometheus/`` against a real Prometheus (the Debian package ``prometheus``: ``prometheus`` and
``promtool``): the config and rules check, every alert's unit tests pass, the server's ``/metrics`` lints
clean, and a live Prometheus scraping a live translator evaluates every alert expression.

Without the binaries these tests skip and say why (``.ci/run`` installs the package when it runs as root).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.grafana.dashboard import dashboard_expressions
from loadtests.cli import free_port
from server.protos import SERVICE_NAME, pb2
from tests.harness import ServerHarness
from tests.test_server import MODEL, TEXTS, default_loader, rpc_error, test_config, translate

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
CONFIG = DEPLOY / "prometheus.yml"
ALERTS = DEPLOY / "alerts.yml"
ALERT_TESTS = DEPLOY / "alerts_test.yml"
COMPOSE_TARGETS = """    dns_sd_configs:  # every replica: the compose service name resolves to all of them
      - names: ["translator"]
        type: A
        port: 9400
        refresh_interval: 30s"""  # the docker-compose service's replicas; a live test scrapes one static target
INSTALL = "install the Debian package `prometheus` (apt-get install -y prometheus; .ci/run does it when run as root)"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool is not on PATH: {INSTALL}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus is not on PATH: {INSTALL}")
METRIC_NAME = re.compile(r"\b(?:nmt_[a-z_]+|grpc_server_[a-z_]+|up)\b")


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False)


def alert_rules() -> list[dict[str, Any]]:
    """The alerting rules of ``alerts.yml``."""
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.fixture(scope="module")
def harness(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(test_config(repository), default_loader())
    yield h
    h.close()


def send_traffic(harness: ServerHarness) -> None:
    """Translations, client errors and an undecodable message (every family gets samples)."""
    for text in TEXTS:
        translate(harness, [text], beam_size=2)
    assert rpc_error(lambda: translate(harness, [""])).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_error(lambda: translate(harness, ["one"], model="klingon")).code() == grpc.StatusCode.NOT_FOUND
    raw = harness.channel.unary_unary(f"/{SERVICE_NAME}/Translate", request_serializer=None,
                                      response_deserializer=None)
    assert rpc_error(lambda: raw(b"\xff\xff\xff\xff", timeout=10)).code() == grpc.StatusCode.INVALID_ARGUMENT
    harness.stub.ListModels(pb2.ListModelsRequest(), timeout=10)


def metrics_text(harness: ServerHarness) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{harness.server.metrics_port}/metrics", timeout=10) as response:
        return response.read().decode()


# ---- static checks ------------------------------------------------------------------------------------


@needs_promtool
def test_promtool_checks_config_and_rules() -> None:
    config = promtool("check", "config", str(CONFIG))  # loads the rule files it names too
    assert config.returncode == 0, config.stdout + config.stderr
    assert "1 rule files found" in config.stdout
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"{len(alert_rules())} rules found" in rules.stdout


def test_every_alert_has_labels_annotations_docs_and_unit_tests_that_fire_and_stay_quiet() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names) >= 8
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    tests = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    assert tests["rule_files"] == [ALERTS.name]
    checks = [check for test in tests["tests"] for check in test.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in checks if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in checks if not c.get("exp_alerts")}
    assert set(names) <= fires, f"alerts without a test where they fire: {set(names) - fires}"
    assert set(names) <= quiet, f"alerts without a test where they stay quiet: {set(names) - quiet}"
    readme = (DEPLOY.parent.parent / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert [name for name in names if f"| `{name}` |" not in readme] == [], "alerts missing in docs/metrics.md's table"


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_check_metrics_on_the_live_metrics_is_clean(harness: ServerHarness) -> None:
    send_traffic(harness)
    text = metrics_text(harness)
    assert "nmt_request_duration_seconds_bucket" in text and "nmt_queue_capacity" in text
    result = promtool("check", "metrics", stdin=text)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


# ---- a live Prometheus ----------------------------------------------------------------------------------


class Prometheus:
    """A ``prometheus`` process on loopback with the repo's config, pointed at ``target`` and scraping each second."""

    def __init__(self, target: str, workdir: Path) -> None:
        config = CONFIG.read_text(encoding="utf-8")
        assert COMPOSE_TARGETS in config and "scrape_interval: 15s" in config
        config = config.replace(COMPOSE_TARGETS, f'    static_configs:\n      - targets: ["{target}"]')
        config = config.replace("scrape_interval: 15s", "scrape_interval: 1s")
        config = config.replace("evaluation_interval: 15s", "evaluation_interval: 1s")
        (workdir / "prometheus.yml").write_text(config, encoding="utf-8")
        shutil.copy(ALERTS, workdir / ALERTS.name)  # rule_files are relative to the config file
        self.log = workdir / "prometheus.log"
        self.url = f"http://127.0.0.1:{free_port()}"
        assert PROMETHEUS is not None
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: str) -> dict[str, Any]:
        """A JSON answer of the HTTP API (error answers too: a query that does not parse is a 400)."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            if error.code == 503:  # "Service Unavailable" while it starts: its API answers once storage is ready
                raise ConnectionError("prometheus is not ready yet") from error
            return json.load(error)

    def query(self, expr: str) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
            try:
                if condition():
                    return
            except (urllib.error.URLError, ConnectionError):
                pass  # not listening, or not ready yet
            assert time.monotonic() < deadline, f"{what} not reached in {timeout} s: {self.log.read_text()[-2000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def values(answer: dict[str, Any]) -> list[float]:
    assert answer["status"] == "success", answer
    return [float(sample["value"][1]) for sample in answer["data"]["result"]]


@needs_prometheus
def test_live_prometheus_scrapes_the_server_and_evaluates_every_alert_and_dashboard_expression(
    harness: ServerHarness, tmp_path: Path
) -> None:
    prometheus = Prometheus(f"127.0.0.1:{harness.server.metrics_port}", tmp_path)
    try:
        prometheus.wait_for(lambda: values(prometheus.query('up{job="translator"}')) == [1.0], 20, "a scrape")
        send_traffic(harness)
        errors = 'sum(nmt_requests_total{job="translator", code="INVALID_ARGUMENT"})'
        served = metrics_text(harness)
        expected = sum(float(line.rsplit(" ", 1)[1]) for line in served.splitlines()
                       if line.startswith("nmt_requests_total{") and 'code="INVALID_ARGUMENT"' in line)
        assert expected >= 2
        # the traffic is scraped, and rate() has at least two samples after it
        prometheus.wait_for(lambda: values(prometheus.query(errors)) == [expected], 20, "a scrape after the traffic")
        time.sleep(2.5)

        rules = alert_rules()
        for rule in rules:
            answer = prometheus.query(rule["expr"])
            assert answer["status"] == "success", (rule["alert"], answer)
            for name in set(METRIC_NAME.findall(rule["expr"])):  # a misspelt metric parses, but finds nothing
                assert values(prometheus.query(f'count({{__name__="{name}", job="translator"}})')), \
                    (rule["alert"], name)
        # Prometheus itself loaded the repo's rules and evaluates each of them without error
        def evaluated() -> bool:
            loaded = [r for g in prometheus.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
            return len(loaded) == len(rules) and all(r["health"] == "ok" for r in loaded)

        prometheus.wait_for(evaluated, 10, "every rule evaluated")
        loaded = [r for g in prometheus.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        assert {r["name"] for r in loaded} == {r["alert"] for r in rules}
        assert all(not r.get("lastError") for r in loaded), loaded
        assert not [a for a in prometheus.get("/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]
        # the queue-near-full alert's ratio: each version's queue against its capacity (--queue-size)
        capacity = values(prometheus.query(f'nmt_queue_capacity{{model="{MODEL}"}}'))
        versions = [mv for mv in harness.server.repository if mv.name == MODEL]
        assert capacity == [float(harness.server.config.queue_size)] * len(versions) and len(versions) == 3
        assert values(prometheus.query("nmt_queue_depth / nmt_queue_capacity")) == [0.0] * len(capacity)
        # every expression of the Grafana dashboard parses and returns data (variables at "All")
        for expr in dashboard_expressions():
            concrete = expr.replace("$model", ".*").replace("$version", ".*").replace("$__rate_interval", "1m")
            answer = prometheus.query(concrete)
            assert answer["status"] == "success", (expr, answer)
            assert answer["data"]["result"], f"no data for the dashboard expression {expr}"
    finally:
        prometheus.stop()


@needs_prometheus
def test_the_request_panels_show_list_models_whatever_models_are_selected(
    harness: ServerHarness, tmp_path: Path
) -> None:
    """ListModels names no model (``model=""``): each dashboard expression over ``nmt_requests_total``, with
    ``$model`` written as Grafana writes a selection of all models, one model or two, returns its series."""
    prometheus = Prometheus(f"127.0.0.1:{harness.server.metrics_port}", tmp_path)
    try:
        prometheus.wait_for(lambda: values(prometheus.query('up{job="translator"}')) == [1.0], 20, "a scrape")
        translate(harness, [TEXTS[0]])
        for _ in range(3):
            harness.stub.ListModels(pb2.ListModelsRequest(), timeout=10)
        listed = 'nmt_requests_total{model="", method="ListModels", code="OK"}'
        [served] = [sample.value for family in text_string_to_metric_families(metrics_text(harness))
                    for sample in family.samples if sample.name == "nmt_requests_total"
                    and sample.labels == {"model": "", "method": "ListModels", "code": "OK"}]
        prometheus.wait_for(lambda: values(prometheus.query(listed)) == [served], 20, "a scrape after the calls")
        time.sleep(2.5)  # rate() has two samples after the calls

        expressions = [expr for expr in dashboard_expressions() if "nmt_requests_total" in expr]
        assert len(expressions) >= 3
        for selection in (".*", MODEL, f"({MODEL}|another)"):
            for expr in expressions:
                concrete = expr.replace("$model", selection).replace("$__rate_interval", "1m")
                answer = prometheus.query(concrete)
                assert answer["status"] == "success", (concrete, answer)
                methods = {series["metric"].get("method") for series in answer["data"]["result"]}
                assert {"ListModels", "Translate"} <= methods, f"{concrete}: series of the methods {methods}"
    finally:
        prometheus.stop()
