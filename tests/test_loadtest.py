"""``nmt loadtest``: real Locust runs (headless, a few users, bounded time) against a translator it starts
itself on loopback over the session's tiny model, or against a test server whose metrics show the model
loaded; the SLO gates and the saturation search; the help. Locust runs in its own process (it monkey-patches
with gevent): this module never imports the locustfile."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.cli import DEFAULT_MODEL, free_port
from loadtests.scenarios import WEIGHTS
from loadtests.slo import ScenarioStats, Slo, Step, saturation, violations
from nmt.cli import main as nmt_main
from server.metrics import STATUS_CODES
from tests.conftest import SERVED_MODEL, number_pairs
from tests.harness import ServerHarness
from tests.test_server import default_loader, test_config

ROOT = Path(__file__).resolve().parent.parent


def loadtest(repository: Path, texts: Path, results: Path, *extra: str) -> int:
    return nmt_main(["loadtest", "--model-repository", str(repository), "--model", SERVED_MODEL, "--texts",
                     str(texts), "--results", str(results), "--users", "4", "--spawn-rate", "4", *extra])


def test_loadtest_runs_every_scenario_and_writes_reports(repository: Path, tmp_path: Path) -> None:
    texts = tmp_path / "test.tsv"  # a held-out split: pairs the tiny model never trained on
    texts.write_text("".join(f"{s}\t{t}\n" for s, t in number_pairs(50, seed=7)), encoding="utf-8")
    results = tmp_path / "run"
    assert loadtest(repository, texts, results, "--run-time", "6s", "--slo-p95-ms", "5000",
                    "--slo-p99-ms", "10000") == 0
    with open(results / "locust_stats.csv", encoding="utf-8", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for scenario in WEIGHTS:
        assert int(rows[scenario]["Request Count"]) > 0, scenario
        assert int(rows[scenario]["Failure Count"]) == 0, scenario
    assert (results / "report.html").stat().st_size > 1000
    assert (results / "locust_stats_history.csv").is_file()
    assert "SLO: met" in (results / "summary.md").read_text(encoding="utf-8")
    # the gate can fail: an impossible SLO makes the run exit non-zero
    impossible = tmp_path / "impossible"
    assert loadtest(repository, texts, impossible, "--run-time", "2s", "--slo-p95-ms", "0.01") == 1
    assert "SLO: MISSED" in (impossible / "summary.md").read_text(encoding="utf-8")


def test_saturation_is_the_busiest_step_within_the_slo() -> None:
    slo = Slo(p95_ms=100)
    steps = [Step(4, 50.0, 20.0, 0.0), Step(8, 90.0, 60.0, 0.0), Step(12, 95.0, 140.0, 0.0), Step(16, 96.0, 300, 1)]
    best, past = saturation(steps, slo)
    assert (best.users, best.rps) == (8, 90.0) and past.users == 12
    failing = [Step(4, 50.0, 20.0, 0.0), Step(8, 80.0, 30.0, 2.0)]
    assert saturation(failing, slo)[0].users == 4  # failures start: saturated even within the latency SLO
    assert saturation(steps[:2], slo) == (steps[1], None)


def test_violations_name_the_scenario_and_the_objective() -> None:
    stats = [ScenarioStats("short greedy", 100, 2, 10.0, 5.0, 50.0, 300.0),
             ScenarioStats("list models", 0, 0, 0, 0, 0, 0)]
    assert violations(stats, Slo(max_failure_ratio=0.01, p95_ms=40, p99_ms=1000)) == [
        "short greedy: failure ratio 0.020 > 0.01", "short greedy: p95 50 ms > 40 ms", "list models: no requests"]


def test_distributed_master_and_worker_through_the_same_command(repository: Path, tmp_path: Path) -> None:
    texts = tmp_path / "test.tsv"
    texts.write_text("".join(f"{s}\t{t}\n" for s, t in number_pairs(30, seed=8)), encoding="utf-8")
    results = tmp_path / "distributed"
    port = str(free_port())  # not Locust's default: test runs may overlap on one machine
    master = subprocess.Popen([sys.executable, "-m", "nmt", "loadtest", "--model-repository", str(repository),
                               "--model", SERVED_MODEL, "--texts", str(texts), "--results", str(results),
                               "--master", "--expect-workers", "1",
                               "--master-port", port,
                               "--users", "2", "--spawn-rate", "2", "--run-time", "6s", "--slo-p95-ms", "5000",
                               "--slo-p99-ms", "10000"], cwd=ROOT)
    worker = subprocess.Popen([sys.executable, "-m", "nmt", "loadtest", "--worker", "--master-host", "127.0.0.1",
                               "--master-port", port, "--texts", str(texts)], cwd=ROOT)
    try:
        assert master.wait(120) == 0
        assert worker.wait(30) == 0
    finally:
        for process in (master, worker):
            if process.poll() is None:
                process.kill()
    with open(results / "locust_stats.csv", encoding="utf-8", newline="") as f:
        aggregated = next(row for row in csv.DictReader(f) if row["Name"] == "Aggregated")
    assert int(aggregated["Request Count"]) > 0 and int(aggregated["Failure Count"]) == 0


def test_a_scenario_can_have_its_own_objectives() -> None:
    default = Slo(p95_ms=40)
    name, many = default.with_override("many texts:p95=2000,failures=0.1")
    assert name == "many texts" and many == Slo(max_failure_ratio=0.1, p95_ms=2000, p99_ms=default.p99_ms)
    stats = [ScenarioStats("many texts", 100, 5, 10.0, 5.0, 500.0, 900.0),
             ScenarioStats("short greedy", 100, 0, 10.0, 5.0, 50.0, 90.0)]
    assert violations(stats, default, {name: many}) == ["short greedy: p95 50 ms > 40 ms"]
    with pytest.raises(ValueError, match="bad SLO override"):
        default.with_override("many texts:p96=3")


def test_loadtest_loads_the_demo_transformer_with_its_split_by_default(
    tiny_models: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With no ``--model`` and no ``--texts``: the demo Transformer, on its demo run's held-out split, although the
    server's own default is demo-bahdanau (first by name); and Locust does not call the options it honours
    (``--users``, ``--spawn-rate``, ``--run-time``) ignored."""
    repository, runs = tmp_path / "models", tmp_path / "runs"
    for name, arch in (("demo-bahdanau", "bahdanau"), (DEFAULT_MODEL, "transformer")):
        shutil.copytree(tiny_models[arch], repository / name / "1")
    (runs / DEFAULT_MODEL).mkdir(parents=True)
    (runs / DEFAULT_MODEL / "test.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in number_pairs(30, seed=9)),
                                                   encoding="utf-8")
    harness = ServerHarness(test_config(repository), default_loader())
    try:
        assert harness.model_version().name == "demo-bahdanau"
        status = nmt_main(["loadtest", "--address", harness.address, "--demo-runs", str(runs), "--results",
                           str(tmp_path / "run"), "--users", "2", "--spawn-rate", "2", "--run-time", "6s",
                           "--slo-p95-ms", "5000", "--slo-p99-ms", "10000"])
        requests = {model: sum(harness.metric("nmt_requests_total", {"model": model, "method": "Translate",
                                                                     "code": code}) for code in STATUS_CODES)
                    for model in ("demo-bahdanau", DEFAULT_MODEL)}
    finally:
        harness.close()
    output = "".join(capfd.readouterr())
    assert status == 0, output
    assert requests[DEFAULT_MODEL] > 0 and requests["demo-bahdanau"] == 0, requests
    assert f"model {DEFAULT_MODEL}" in output
    assert "will be ignored" not in output and "no impact on LoadShapes" not in output, output


def test_loadtest_help_states_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        nmt_main(["loadtest", "--help"])
    options = [" ".join(option.split()) for option in
               re.split(r"\n  (?=-)", capsys.readouterr().out.split("\noptions:\n", 1)[1])]
    assert len(options) > 20
    for option in options:
        assert option.count("(default:") <= 1 and "(default: )" not in option, option
    assert any(option.startswith("--model MODEL") and f"(default: {DEFAULT_MODEL};" in option for option in options)
