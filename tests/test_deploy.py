"""The deployment files, checked without a Docker engine: ``docker-compose config`` (Debian's Compose
implementation) on the compose file, every service command parsed by the real ``nmt`` parser, every
mounted path and Dockerfile target present, the images' health check run natively against a live server."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from nmt.cli import build_parser
from nmt.cli import main as nmt_main
from server.config import ENV_PREFIX, ServerConfig
from tests.harness import ServerHarness
from tests.test_server import default_loader, test_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)
IMAGE_CONF_D = "/etc/nginx/conf.d/"  # the nginx image's nginx.conf includes its *.conf inside http {}


def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]


def parses(command: list[str]) -> None:
    """The real ``nmt`` parser accepts ``command`` (``nmt SUBCOMMAND ...``)."""
    assert command[0] == "nmt", command
    try:
        build_parser().parse_args(command[1:])
    except SystemExit as error:
        raise AssertionError(f"`{' '.join(command)}` does not parse") from error


@pytest.fixture(scope="module")
def harness(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(test_config(repository), default_loader())
    yield h
    h.close()


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose (Debian package) not installed; .ci/run installs it when it can")
def test_compose_file_is_valid_for_a_compose_implementation() -> None:
    for profiles in ([], ["--profile", "gpu", "--profile", "loadtest"]):
        result = subprocess.run(["docker-compose", "-f", str(COMPOSE), *profiles, "config", "-q"],
                                capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert result.returncode == 0, result.stderr


def test_every_service_command_is_an_nmt_command_that_parses() -> None:
    commands = {name: s["command"] for name, s in services().items() if "build" in s}
    assert set(commands) == {"trainer", "translator", "translator-gpu", "locust-master", "locust-worker"}
    for command in commands.values():
        parses(command)


def test_translator_environment_is_server_configuration() -> None:
    for name in ("translator", "translator-gpu"):
        environment = services()[name]["environment"]
        assert all(key.startswith(ENV_PREFIX) for key in environment)
        config = ServerConfig.from_env({k: str(v) for k, v in environment.items()})  # validates every value
        assert config.listen == "0.0.0.0:50051" and config.model_repository == "/models"
    assert services()["translator-gpu"]["environment"]["NMT_PROVIDER"] == "cuda"


def test_mounted_paths_and_dockerfile_targets_exist() -> None:
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and "loadtest-results" not in source:  # results: created by the run
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
        build = service.get("build")
        if build:
            dockerfile = ROOT / build["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            if "target" in build:
                assert re.search(rf"^FROM .+ AS {build['target']}$", dockerfile.read_text(), re.M), name


def stages(dockerfile: Path) -> dict[str, list[str]]:
    """Instructions of each stage (``FROM`` line continuations joined), by stage name."""
    text = dockerfile.read_text(encoding="utf-8").replace("\\\n", " ")
    result: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1] if " AS " in line else line
            result[current] = []
        elif line and not line.startswith("#") and current:
            result[current].append(line)
    return result


def test_serving_images_run_as_a_user_with_a_health_check_that_parses() -> None:
    serving = 0
    for dockerfile in DOCKERFILES:
        for name, instructions in stages(dockerfile).items():
            commands = [i for i in instructions if i.startswith(("CMD ", "HEALTHCHECK "))]
            users = [i.split()[1] for i in instructions if i.startswith("USER ")]
            if not commands:
                continue
            assert users and users[-1] not in ("root", "0"), f"{dockerfile.name} {name} runs as root"
            for instruction in commands:
                parses(json.loads(instruction[instruction.index("["):]))
            if any(i.startswith("CMD ") and '"serve"]' in i for i in instructions):
                serving += 1
                assert any(i.startswith("HEALTHCHECK ") for i in instructions), f"{dockerfile.name} {name}"
    assert serving == 2  # the CPU and the GPU translator


def test_the_health_check_command_against_a_live_server(harness: ServerHarness) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert nmt_main(["translate", "--server", harness.address, "--health"]) == 0
    assert out.getvalue().strip() == "SERVING"
    assert nmt_main(["translate", "--server", harness.address, "--health", "no-such-model"]) == 2  # NOT_FOUND


def test_the_trainer_command_exits_once_models_exist(repository: Path) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert nmt_main(["serve", "--demo", "--demo-only", "--model-repository", str(repository),
                         "--demo-runs", str(repository / "runs")]) == 0
    assert "demo models ready" in out.getvalue()


def test_the_demo_builds_only_what_a_cut_short_build_left_out(model_version_dir: Path, repository: Path,
                                                               tmp_path: Path) -> None:
    from nmt.demo import DEMO_MODELS, missing_demo_models

    assert missing_demo_models(tmp_path / "empty") == list(DEMO_MODELS)
    partial = tmp_path / "partial"
    shutil.copytree(model_version_dir, partial / "demo-transformer" / "1")
    assert missing_demo_models(partial) == ["demo-bahdanau"]
    assert missing_demo_models(repository) == []  # models of one's own: served as they are


# ---- scaling out: the gRPC proxy of the compose file and the Kubernetes manifests -------------------------

K8S = ROOT / "deploy" / "k8s"
CRDS = {"monitoring.coreos.com/v1"}  # custom resources: no Kubernetes schema to validate against


def manifests() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.rglob("*.yaml")) for doc in yaml.safe_load_all(path.read_text("utf-8")) if doc]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in manifests() if doc["kind"] == kind]


def test_compose_runs_replicas_behind_the_nginx_grpc_proxy() -> None:
    proxy, translator = services()["grpc-proxy"], services()["translator"]
    assert "./deploy/nginx/translator.conf:/etc/nginx/conf.d/default.conf:ro" in proxy["volumes"]
    assert "./deploy/nginx/translator-http.conf:/etc/nginx/conf.d/http.conf:ro" in proxy["volumes"]
    assert proxy["ports"] == ["50051:50051", "8080:8080"] and "ports" not in translator  # replicas publish none
    assert translator["deploy"]["replicas"] >= 2
    assert proxy["depends_on"]["translator"]["condition"] == "service_healthy"
    master = services()["locust-master"]["command"]
    assert master[master.index("--address") + 1] == "grpc-proxy:50051"


def test_nginx_accepts_the_proxy_files_as_the_compose_stack_mounts_them(tmp_path: Path) -> None:
    """Debian's ``nginx -T`` on ``deploy/nginx/*.conf`` unchanged: each linked under the name the compose file
    mounts it as in the image's ``/etc/nginx/conf.d``, included inside ``http {}`` as the image's ``nginx.conf``
    does (:func:`deploy.nginx.main_config`), and ``translator`` resolving to two replicas as Docker's DNS
    answers for the service: a hosts file bind-mounted on ``/etc/hosts`` in a private mount namespace."""
    from deploy.nginx import CONFIG, HTTP_CONFIG, main_config

    if NGINX is None:
        pytest.skip("nginx is not installed (.ci/run installs it when run as root)")
    unshare = [shutil.which("unshare") or "unshare", "--mount", "--map-root-user"]
    if subprocess.run([*unshare, "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no private mount namespace here (`unshare --mount --map-root-user` is refused)")
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    for volume in services()["grpc-proxy"]["volumes"]:
        source, target = volume.split(":")[:2]
        if target.startswith(IMAGE_CONF_D):
            (conf_d / target.removeprefix(IMAGE_CONF_D)).symlink_to(ROOT / source)
    assert {p.name: p.resolve() for p in conf_d.iterdir()} == {"default.conf": CONFIG, "http.conf": HTTP_CONFIG}
    config, hosts = tmp_path / "nginx.conf", tmp_path / "hosts"
    config.write_text(main_config(conf_d, tmp_path), encoding="utf-8")
    hosts.write_text("127.0.0.2 translator\n127.0.0.3 translator\n", encoding="utf-8")
    # The namespace maps only root: workers as root, since nginx's default (nobody) cannot own its temp paths there.
    script = 'mount --bind "$1" /etc/hosts && exec "$2" -T -c "$3" -e "$4" -g "user root;"'
    result = subprocess.run([*unshare, "sh", "-c", script, "sh", str(hosts), NGINX, str(config),
                             str(tmp_path / "error.log")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "[warn]" not in result.stderr, result.stderr
    for name, shipped in (("default.conf", CONFIG), ("http.conf", HTTP_CONFIG)):  # -T prints what it read
        assert f"# configuration file {conf_d / name}:\n{shipped.read_text(encoding='utf-8')}" in result.stdout


def test_kubernetes_manifests_are_valid_for_a_current_kubernetes() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    kinds = set()
    for doc in manifests():
        kinds.add(doc["kind"])
        if doc["apiVersion"] not in CRDS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema violation
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor",
            "PersistentVolumeClaim", "Job", "Ingress", "ConfigMap"} <= kinds


def test_kubernetes_translators_drain_and_probe_as_the_server_does() -> None:
    from server.frontend.app import STOP_SECONDS
    from server.protos import SERVICE_NAME

    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    assert set(deployments) == {"translator", "translator-gpu"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        parses(container["command"])
        config = ServerConfig.from_env({e["name"]: e["value"] for e in container["env"]})
        port = int(config.listen.rsplit(":", 1)[1])
        assert config.metrics_listen.startswith("0.0.0.0:") and config.model_repository == "/models"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (name, probe)
        assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME  # NOT_SERVING from a drain's start
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + config.grace_seconds + STOP_SECONDS
        assert config.max_connection_age > 0  # clients balancing over DNS re-resolve and find new pods
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == config.metrics_listen.rsplit(":", 1)[1]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (config.provider, gpus) == (("cuda", 1) if name == "translator-gpu" else ("cpu", None))
        if config.frontends:  # a core for each front-end, and the engine core's decode and encoder threads
            assert float(container["resources"]["requests"]["cpu"]) >= config.frontends + 2, name
    gpu = deployments["translator-gpu"]["spec"]["template"]["spec"]["containers"][0]
    assert ServerConfig.from_env({e["name"]: e["value"] for e in gpu["env"]}).frontends == 4  # as measured on an H200


def mebibytes(quantity: str) -> float:
    """A Kubernetes memory quantity (``1536Mi``, ``2Gi``) in MiB."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Mi|Gi)", quantity).groups()
    return float(number) * (1024 if unit == "Gi" else 1)


def test_the_cpu_translators_memory_follows_the_measured_peak() -> None:
    """The CPU Deployment's memory request holds the sustained peak the export benchmark measured for an
    OPUS-MT-sized replica with the defaults, and its limit leaves a margin above it (benchmarks/README.md)."""
    table = (ROOT / "benchmarks" / "README.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| (defaults: `--ort-prepack main`)"))
    peak = float(row.split("|")[4].split()[0].replace(",", ""))  # the "sustained peak" column, MiB
    [deployment] = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "translator"]
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert mebibytes(resources["requests"]["memory"]) >= peak
    assert mebibytes(resources["limits"]["memory"]) >= 1.25 * peak


def test_kubernetes_service_budget_and_autoscaler_select_the_translators() -> None:
    from server.metrics import ServerMetrics

    labels = [d["spec"]["template"]["metadata"]["labels"] for d in of_kind("Deployment")]
    [service] = of_kind("Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS answers every pod, clients balance per call
    for selector in (service["spec"]["selector"], of_kind("PodDisruptionBudget")[0]["spec"]["selector"]["matchLabels"]):
        assert all(selector.items() <= pod.items() for pod in labels)
    [monitor] = of_kind("ServiceMonitor")
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}

    exported = {metric.name for metric in ServerMetrics().registry.collect()}
    adapter = yaml.safe_load(of_kind("ConfigMap")[0]["data"]["config.yaml"])
    served = {rule["name"]["as"] for rule in adapter["rules"]}
    targets = {hpa["spec"]["scaleTargetRef"]["name"] for hpa in of_kind("HorizontalPodAutoscaler")}
    assert targets == {"translator", "translator-gpu"}
    for hpa in of_kind("HorizontalPodAutoscaler"):
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])  # load per pod, not CPU
        assert names <= served and names <= exported, names
