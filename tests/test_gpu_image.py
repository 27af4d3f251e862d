"""The GPU image's CUDA matches the CUDA its onnxruntime-gpu links, checked without Docker or the network.

Each onnxruntime-gpu release links one CUDA major (1.31.1: ``libcudart.so.13``); a base image of another major
starts a container whose CUDA provider cannot load. The pin lives in pyproject.toml's ``gpu`` extra, what each
version links in ``docker/onnxruntime-gpu.toml`` (read from the wheels); ``docker/Dockerfile.gpu``, the README,
docs/gpu.md and the deployment files are checked against those two.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile.gpu"
FACTS = ROOT / "docker" / "onnxruntime-gpu.toml"
README, GPU_PAGE, OPERATIONS = ROOT / "README.md", ROOT / "docs" / "gpu.md", ROOT / "docs" / "operations.md"
DEPLOYMENT = [ROOT / "docker-compose.yml", ROOT / "deploy" / "k8s" / "translator-gpu.yaml"]
DISTRIBUTION = "onnxruntime-gpu"
BASE_IMAGE = re.compile(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(\w+)-runtime-ubuntu[\d.]+$", re.MULTILINE)
SPEC = re.compile(r"onnxruntime-gpu\s*(==|>=|<=|~=|!=|>|<)\s*([\w.]+)")


def pinned_version() -> str:
    """The exact onnxruntime-gpu version of pyproject.toml's ``gpu`` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    [requirement] = [Requirement(r) for r in project["optional-dependencies"]["gpu"]
                     if Requirement(r).name == DISTRIBUTION]
    [spec] = requirement.specifier
    assert spec.operator == "==", f"the gpu extra must pin one version (one CUDA major), not {requirement}"
    return spec.version


def facts() -> dict[str, str | int]:
    """What the pinned version links, from docker/onnxruntime-gpu.toml."""
    version = pinned_version()
    versions = tomllib.loads(FACTS.read_text(encoding="utf-8"))["versions"]
    assert version in versions, f"{FACTS.name} has no entry for onnxruntime-gpu {version}: read its wheel first"
    return versions[version]


def cuda_of(entry: dict[str, str | int]) -> tuple[int, ...]:
    """``(major,)`` or ``(major, minor)`` of an entry's CUDA."""
    return tuple(int(part) for part in str(entry["cuda"]).split("."))


def test_the_gpu_extra_pins_a_version_whose_facts_are_recorded() -> None:
    entry = facts()
    assert cuda_of(entry)[0] >= 12 and entry["cudnn"] >= 9 and entry["source"]


def test_the_base_image_has_the_cuda_major_onnxruntime_gpu_links() -> None:
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    [(major, minor, _, flavour)] = BASE_IMAGE.findall(dockerfile)
    cuda = cuda_of(facts())
    assert int(major) == cuda[0], f"nvidia/cuda {major}.{minor}; onnxruntime-gpu {pinned_version()}: CUDA {cuda[0]}"
    assert (int(major), int(minor)) >= cuda, f"the image's CUDA {major}.{minor} is older than the wheel's build"
    assert flavour == "cudnn", "the cudnn flavour of nvidia/cuda carries the cuDNN the CUDA provider loads"


def test_the_dockerfile_installs_the_pinned_version() -> None:
    specs = SPEC.findall(DOCKERFILE.read_text(encoding="utf-8"))
    assert specs and set(specs) == {("==", pinned_version())}, specs


def test_every_stated_cuda_and_cudnn_major_agrees() -> None:
    entry = facts()
    for path in [DOCKERFILE, *DEPLOYMENT]:
        text = path.read_text(encoding="utf-8")
        assert set(re.findall(r"CUDA (\d+)\b", text)) <= {str(cuda_of(entry)[0])}, path.name
        assert set(re.findall(r"cuDNN (\d+)\b", text)) <= {str(entry["cudnn"])}, path.name


def test_the_docs_state_the_pinned_pair() -> None:
    readme = GPU_PAGE.read_text(encoding="utf-8")
    version, entry = pinned_version(), facts()
    major = cuda_of(entry)[0]
    for page in (README, GPU_PAGE):
        assert set(SPEC.findall(page.read_text(encoding="utf-8"))) == {("==", version)}, page.name
    assert re.findall(r"pinned onnxruntime-gpu ([\w.]+) links CUDA (\d+)", readme) == [(version, str(major))]
    [row] = [line for line in OPERATIONS.read_text(encoding="utf-8").splitlines()
             if line.startswith("| `translator-gpu`")]
    assert f"CUDA {major} + cuDNN {entry['cudnn']}, onnxruntime-gpu {version})" in row, row


def test_an_installed_onnxruntime_gpu_requires_the_recorded_cuda() -> None:
    """Where the pinned wheel is installed (a GPU host), its own METADATA confirms the recorded CUDA major."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("onnxruntime-gpu is not installed here; docker/onnxruntime-gpu.toml records its METADATA")
    if distribution.version != pinned_version():
        pytest.skip(f"onnxruntime-gpu {distribution.version} installed, {pinned_version()} pinned")
    runtime = [Requirement(r) for r in distribution.requires or []
               if Requirement(r).name.startswith("nvidia-cuda-runtime")]
    assert runtime, "no nvidia-cuda-runtime requirement in the wheel's METADATA"
    assert {str(s.version).split(".")[0] for r in runtime for s in r.specifier} == {str(cuda_of(facts())[0])}
