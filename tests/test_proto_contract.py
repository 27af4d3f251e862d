"""The contract compiles from ``proto/`` alone with the toolchains other languages' clients use.

A client team copies ``proto/`` and points its compiler at it: every file ``translation.proto`` imports must be
there, apart from the ``google/protobuf`` well-known types that every protoc and protobufjs carries. Node's
``@grpc/proto-loader`` (protobufjs) is installed from the npm registry into a cache folder keyed by its version;
Debian's ``protoc`` runs where it is installed (``.ci/run`` installs it). The server compiles its stubs from the
proto root alone too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from server.protos import PROTO_FILE, SERVICE_NAME, method_types

PROTO = Path(__file__).resolve().parent.parent / "proto"
PROTO_LOADER = "0.8.1"  # @grpc/proto-loader, the loader of grpc-js
METHODS = {"Translate", "TranslateStream", "ListModels", "Score", "TranslateStreaming", "ListLanguages",
           "DetectLanguage", "CreateGlossary", "ListGlossaries", "GetGlossary", "DeleteGlossary"}
LOAD = """
const loader = require("@grpc/proto-loader");
const [root, file, service] = process.argv.slice(1);
const definition = loader.loadSync(file, {includeDirs: [root]});
const methods = Object.entries(definition[service]).map(([name, m]) => [name, [m.requestStream, m.responseStream]]);
console.log(JSON.stringify(Object.fromEntries(methods)));
"""
STREAMING = {(False, False): "UNARY", (True, False): "CLIENT_STREAMING", (False, True): "SERVER_STREAMING",
             (True, True): "BIDI_STREAMING"}


@pytest.fixture(scope="module")
def node_modules(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``node_modules`` holding ``@grpc/proto-loader@PROTO_LOADER``, installed once per cache."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node or npm not installed: the Node.js client check needs both")
    name = f"npm-grpc-proto-loader-{PROTO_LOADER}"
    cache = getattr(pytestconfig, "cache", None)
    prefix = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    installed = prefix / "node_modules" / "@grpc" / "proto-loader" / "package.json"
    if not installed.is_file() or json.loads(installed.read_text(encoding="utf-8"))["version"] != PROTO_LOADER:
        subprocess.run(["npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        f"@grpc/proto-loader@{PROTO_LOADER}"], check=True, capture_output=True, timeout=300)
    return prefix / "node_modules"


def test_grpc_js_proto_loader_loads_the_contract_from_proto_alone(node_modules: Path) -> None:
    result = subprocess.run(["node", "-e", LOAD, str(PROTO), PROTO_FILE, SERVICE_NAME], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "NODE_PATH": str(node_modules)})
    assert result.returncode == 0, result.stderr
    methods = {name: STREAMING[tuple(streams)] for name, streams in json.loads(result.stdout).items()}
    assert set(methods) == METHODS
    assert methods == method_types()  # what the server compiled


@pytest.mark.skipif(shutil.which("protoc") is None,
                    reason="protoc not installed (Debian: protobuf-compiler, libprotobuf-dev); .ci/run installs it")
def test_protoc_compiles_the_contract_with_only_the_proto_folder(tmp_path: Path) -> None:
    descriptors = tmp_path / "contract.pb"
    result = subprocess.run(["protoc", f"-I{PROTO}", "--include_imports", f"--descriptor_set_out={descriptors}",
                             PROTO_FILE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    files = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file}
    [service] = [s for s in files[PROTO_FILE].service if f"{files[PROTO_FILE].package}.{s.name}" == SERVICE_NAME]
    assert {m.name for m in service.method} == METHODS
    assert {"google/api/annotations.proto", "google/api/http.proto", "google/rpc/status.proto"} <= set(files)


def test_the_server_compiles_its_stubs_from_the_proto_root_alone(tmp_path: Path) -> None:
    """With an imported file missing from the proto root, the stubs do not compile: no other include path."""
    root = tmp_path / "proto"
    shutil.copytree(PROTO, root)
    load = [sys.executable, "-c", "from server.protos import method_types; print(sorted(method_types()))"]
    env = {**os.environ, "NMT_PROTO_PATH": str(root)}
    loaded = subprocess.run(load, capture_output=True, text=True, timeout=120, env=env, cwd=PROTO.parent)
    assert loaded.returncode == 0 and loaded.stdout.strip() == str(sorted(METHODS)), loaded.stderr
    (root / "google" / "rpc" / "status.proto").unlink()
    missing = subprocess.run(load, capture_output=True, text=True, timeout=120, env=env, cwd=PROTO.parent)
    assert missing.returncode != 0 and "protoc failed" in missing.stderr, missing.stderr
