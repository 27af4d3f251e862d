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
