"""Python stubs for ``proto/translation/v1/translation.proto``, generated at import time.

The proto is the single source of truth and no generated file is committed. At import the proto is
compiled in memory by the protoc bundled with ``grpcio-tools`` (``grpc.protos_and_services``):
nothing is written to disk, so a read-only install, a fresh clone and concurrent processes all work,
and the stubs can never be stale. The proto root (``<repo>/proto``, or ``$NMT_PROTO_PATH``) is
appended to ``sys.path`` because that is the include path the runtime compiler searches; the
generated modules are registered as ``translation.v1.translation_pb2`` / ``_pb2_grpc``, the names
the generated code itself imports.

Only the gRPC edge (``server/convert.py``, ``server/app.py``, clients) imports this module; the
scheduler and the engine work on :mod:`server.types`.

For editors and type checkers, ``python -m server.protos --out DIR`` writes the same stubs plus
``.pyi`` type stubs into ``DIR`` (keep ``DIR`` out of git).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import grpc
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


def _load() -> tuple[ModuleType, ModuleType]:
    root = str(proto_root())
    if root not in sys.path:
        sys.path.append(root)  # appended, never prepended: it must not shadow installed packages
    return grpc.protos_and_services(PROTO_FILE)


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

    For protos whose package cannot be imported under its own name, such as
    ``grpc/reflection/v1/reflection.proto`` (``grpc`` is grpcio's package, so ``grpc.protos()`` cannot
    import ``grpc.reflection.v1.reflection_pb2``): protoc writes the ``_pb2`` module into a temporary
    directory and it is run under ``module_name``; its descriptors join the default pool, as any
    generated module's do.
    """
    import tempfile
    from importlib.resources import files

    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="nmt-protos-") as out:
        args = ["protoc", f"-I{proto_root()}", f"-I{files('grpc_tools') / '_proto'}", f"--python_out={out}",
                proto_file]
        if protoc.main(args) != 0:
            raise ImportError(f"protoc failed: {' '.join(args)}")
        source = (Path(out) / proto_file).with_name(Path(proto_file).stem + "_pb2.py").read_text(encoding="utf-8")
    module = ModuleType(module_name)
    exec(compile(source, f"<{proto_file}>", "exec"), module.__dict__)  # noqa: S102 - protoc's own output
    return module


def write_stubs(out_dir: str | Path) -> list[Path]:
    """Generate ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` into ``out_dir`` (for IDEs); return the files."""
    from importlib.resources import files

    from grpc_tools import protoc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from google.rpc import status_pb2

    include = str(files("grpc_tools") / "_proto")
    common = str(Path(status_pb2.__file__).parents[2])  # googleapis-common-protos: google/rpc/status.proto
    args = [
        "protoc",
        f"-I{proto_root()}",
        f"-I{include}",
        f"-I{common}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        PROTO_FILE,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out.rglob("*") if p.is_file())


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the translation.v1 Python stubs and type stubs (for IDEs).")
    parser.add_argument("--out", required=True, help="output directory (keep it out of git)")
    for path in write_stubs(parser.parse_args().out):
        print(path)
