"""Python stubs for ``proto/translation/v1/translation.proto``, generated at import time.

The proto is the single source of truth and no generated file is committed. At import the proto is
compiled by the protoc bundled with ``grpcio-tools`` into a temporary directory and run from there, so a
read-only install, a fresh clone and concurrent processes all work, and the stubs can never be stale.
protoc runs as a process of its own (``python -m grpc_tools.protoc``, about 0.1 s): a serving process
never loads the compiler, which would stay mapped in it for nothing (8 MiB of every server, front-end
and client process).
protoc's include path is the proto root (``<repo>/proto``, or ``$NMT_PROTO_PATH``) and the
``google/protobuf`` well-known types alone: the server compiles the contract from ``proto/`` as a client
in another language does, the imported ``google/api`` and ``google/rpc`` files included. The generated
modules are registered as ``translation.v1.translation_pb2`` / ``_pb2_grpc``, the names the generated
code itself imports; the messages they import (``google.api.annotations_pb2``, ``google.rpc.status_pb2``)
are googleapis-common-protos' modules, which describe the same files.

Only the gRPC edge (``server/frontend/convert.py``, ``server/frontend/app.py``, clients) imports this module; the
scheduler and the engine work on :mod:`server.types`.

For editors and type checkers, ``python -m server.protos --out DIR`` writes the same stubs plus
``.pyi`` type stubs into ``DIR`` (keep ``DIR`` out of git).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path
from types import ModuleType

from google.protobuf.descriptor import ServiceDescriptor

PROTO_FILE = "translation/v1/translation.proto"
SERVICE_NAME = "translation.v1.Translator"


def proto_root() -> Path:
    """The directory holding ``translation/v1/translation.proto``."""
    candidates = [os.environ.get("NMT_PROTO_PATH", ""), str(Path(__file__).resolve().parent.parent / "proto")]
    for candidate in candidates:
        if candidate and (Path(candidate) / PROTO_FILE).is_file():
            return Path(candidate).resolve()
    raise ImportError(
        f"cannot find {PROTO_FILE}: looked in {[c for c in candidates if c]}; set NMT_PROTO_PATH to the proto root"
    )


def _protoc(proto_file: str, out: Path, *outputs: str) -> None:
    """Compile ``<proto root>/<proto_file>`` into ``out`` with protoc's ``--<output>_out`` for each output.

    The include path is the proto root and the well-known types bundled with grpcio-tools, nothing else.
    """
    args = [f"-I{proto_root()}", f"-I{files('grpc_tools') / '_proto'}",
            *(f"--{output}_out={out}" for output in outputs), proto_file]
    result = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise ImportError(f"protoc failed: {' '.join(args)}: {result.stderr.strip()}")


def _run(source_file: Path, module_name: str) -> ModuleType:
    """A module named ``module_name`` running protoc's generated ``source_file``."""
    module = ModuleType(module_name)
    source = source_file.read_text(encoding="utf-8")
    exec(compile(source, f"<{module_name}>", "exec"), module.__dict__)  # noqa: S102 - protoc's own output
    return module


def _load() -> tuple[ModuleType, ModuleType]:
    """The message and service modules of :data:`PROTO_FILE`, as ``translation.v1.translation_pb2`` / ``_pb2_grpc``.

    The service module imports the messages by that name (``from translation.v1 import translation_pb2``), so
    they and their parent packages are in ``sys.modules`` before it runs.
    """
    folder, _, stem = PROTO_FILE.removesuffix(".proto").rpartition("/")
    package = folder.replace("/", ".")
    parts = package.split(".")
    for name in (".".join(parts[:depth]) for depth in range(1, len(parts) + 1)):
        if name not in sys.modules:
            sys.modules[name] = ModuleType(name)
            sys.modules[name].__path__ = []  # a package with nothing to find on disk
    with tempfile.TemporaryDirectory(prefix="nmt-protos-") as out:
        _protoc(PROTO_FILE, Path(out), "python", "grpc_python")
        modules = []
        for suffix in ("_pb2", "_pb2_grpc"):
            name = f"{package}.{stem}{suffix}"
            sys.modules[name] = _run(Path(out, folder, f"{stem}{suffix}.py"), name)
            modules.append(sys.modules[name])
    return modules[0], modules[1]


pb2, pb2_grpc = _load()


def translator_descriptor() -> ServiceDescriptor:
    """The ``translation.v1.Translator`` service descriptor (its methods and their options)."""
    return pb2.DESCRIPTOR.services_by_name[SERVICE_NAME.rpartition(".")[2]]


def method_types(service: str = SERVICE_NAME) -> dict[str, str]:
    """The service's methods and their gRPC types (``UNARY``, ``BIDI_STREAMING``, ...), from the proto."""
    descriptor = pb2.DESCRIPTOR.services_by_name[service.rpartition(".")[2]]
    types = {(False, False): "UNARY", (True, False): "CLIENT_STREAMING", (False, True): "SERVER_STREAMING",
             (True, True): "BIDI_STREAMING"}
    return {m.name: types[(m.client_streaming, m.server_streaming)] for m in descriptor.methods}


def compile_messages(proto_file: str, module_name: str) -> ModuleType:
    """The message classes (no service stubs) of ``<proto root>/<proto_file>``, as module ``module_name``.

    For protos whose package cannot be registered under its own name, such as
    ``grpc/reflection/v1/reflection.proto`` (``grpc`` is grpcio's package): the ``_pb2`` module protoc
    writes is run under ``module_name``; its descriptors join the default pool, as any generated
    module's do.
    """
    with tempfile.TemporaryDirectory(prefix="nmt-protos-") as out:
        _protoc(proto_file, Path(out), "python")
        return _run(Path(out, proto_file.removesuffix(".proto") + "_pb2.py"), module_name)


def write_stubs(out_dir: str | Path) -> list[Path]:
    """Generate ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` into ``out_dir`` (for IDEs); return the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _protoc(PROTO_FILE, out, "python", "pyi", "grpc_python")
    return sorted(p for p in out.rglob("*") if p.is_file())


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the translation.v1 Python stubs and type stubs (for IDEs).")
    parser.add_argument("--out", required=True, help="output directory (keep it out of git)")
    for path in write_stubs(parser.parse_args().out):
        print(path)
