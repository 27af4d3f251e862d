"""The import graph keeps the data's path: no circles, and arrows only point down the design's picture.

``server/`` never imports ``training/``, ``export/`` or torch; ``training/`` never imports ``server/``;
``export/`` takes only the serving engine (and the types of its API) from ``server/``, to verify what
it wrote. Imports inside functions count: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "nmt", "training", "export", "server", "clients", "loadtests")
# The floors of the design, bottom up: a module imports only from its own floor and the ones below. The model
# format and the shared base stand on nothing; the ``nmt`` command stands on everything.
FLOORS = {"common": 0, "server": 1, "training": 1, "clients": 2, "export": 2, "loadtests": 3, "nmt": 4}
# what export/ may take from server/: the engine it verifies with, and the types of the engine's API
EXPORT_MAY_USE = {"server.engine.engine", "server.engine.step_model", "server.types"}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every module name an ``import`` or ``from ... import`` statement of the file names, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> third-party top-level packages)."""
    modules = project_modules()
    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = imported_names(path)
        edges[module] = {name for name in names if name in modules and name != module}
        external[module] = {name.split(".")[0] for name in names if name.split(".")[0] not in PACKAGES}
    return edges, external


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, frontier = set(), [start]
    while frontier:
        for target in edges[frontier.pop()]:
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    return seen


def test_the_import_graph_has_no_circles() -> None:
    edges, _ = import_graph()
    assert len(edges) > 40  # the walk found the project
    assert circles(edges) == []


def arrows_up(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a lower floor to a higher one (:data:`FLOORS`)."""
    floor = {module: FLOORS[module.split(".")[0]] for module in edges}
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if floor[b] > floor[a])


def test_no_arrow_points_up_a_floor() -> None:
    edges, _ = import_graph()
    assert set(FLOORS) == set(PACKAGES)
    assert arrows_up(edges) == []
    assert arrows_up({"common.errors": {"nmt.cli"}, "nmt.cli": set()}) == ["common.errors -> nmt.cli"]  # it can fail


def test_the_benchmarks_import_no_circle() -> None:
    """The benchmark scripts import each other by file name (``nmt bench`` puts the folder on the path)."""
    scripts = {path.stem: path for path in (ROOT / "benchmarks").glob("*.py")}
    edges = {name: {n.split(".")[0] for n in imported_names(path)} & set(scripts) - {name}
             for name, path in scripts.items()}
    assert len(edges) > 5 and circles(edges) == []


def test_arrows_point_down_the_design() -> None:
    edges, external = import_graph()
    for module in edges:
        package = module.split(".")[0]
        closure = reachable(edges, module) | {module}
        if package == "server":
            assert not {m for m in closure if m.split(".")[0] in ("training", "export")}, module
            assert not any("torch" in external[m] for m in closure), f"{module} reaches torch"
        if package == "training":
            assert not {m for m in edges[module] if m.split(".")[0] in ("server", "export")}, module
        if package == "export":
            assert {m for m in edges[module] if m.split(".")[0] == "server"} <= EXPORT_MAY_USE, module
        if package == "common":  # the shared format and base stand on nothing of the project
            assert all(m.startswith("common.") for m in edges[module]), module


# server/: three parts and what they share. The front-end (gRPC, HTTP, tokenizing, responses) never reaches the
# engine, the engine core or ONNX Runtime; the core and the engine never reach the front-end; the shared
# modules at server/'s top (configuration, types, errors, metrics, the text side, the IPC) reach none of the
# three parts.
SERVER_PARTS = ("server.frontend", "server.core", "server.engine")
PART_MAY_NOT_REACH = {
    "server.frontend": ("server.core", "server.engine"),
    "server.core": ("server.frontend",),
    "server.engine": ("server.frontend", "server.core"),
}


def part_of(module: str) -> str | None:
    """The part of ``server/`` a module belongs to (None: shared at the top, or not in server/)."""
    return next((part for part in SERVER_PARTS if module == part or module.startswith(part + ".")), None)


def test_the_server_parts_keep_apart() -> None:
    edges, external = import_graph()
    server = [m for m in edges if m.split(".")[0] == "server"]
    assert {part_of(m) for m in server} == {*SERVER_PARTS, None}
    for module in server:
        part = part_of(module)
        closure = reachable(edges, module) | {module}
        forbidden = PART_MAY_NOT_REACH.get(part, SERVER_PARTS) if module != "server" else ()
        crossing = sorted(m for m in closure if any(m == f or m.startswith(f + ".") for f in forbidden))
        assert not crossing, f"{module} reaches {crossing}"
        if part != "server.core" and part != "server.engine":
            assert not any("onnxruntime" in external[m] for m in closure), f"{module} reaches onnxruntime"
    # the checker itself can fail: the engine reaches ONNX Runtime, the core the engine
    assert "onnxruntime" in external["server.engine.engine"]
    assert "server.engine.engine" in reachable(edges, "server.core.repository")


def test_a_planted_circle_is_found() -> None:
    """The checker itself can fail."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_serving_and_clients_never_load_torch() -> None:
    """What a serving-only install runs (every server and client module, the ``nmt`` parser) leaves
    torch unloaded; the same check run on a training module proves the probe sees torch."""
    serving = [m for m in project_modules() if m.split(".")[0] in ("server", "clients")]
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    importlib.import_module(name)\n"
             "from nmt.cli import build_parser\n"
             "build_parser()\n"
             "print('torch' in sys.modules)\n")
    for modules, loads_torch in ((serving, False), (["training.models.checkpoint"], True)):
        result = subprocess.run([sys.executable, "-c", probe, *modules], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(loads_torch), modules


# what can run code while loading data: pickle and the loaders built on it
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
UNPICKLING_CALLS = {"load", "loads"}  # np.load / torch.load / pickle.loads ...


def unpickling_uses(path: Path) -> list[str]:
    """Imports of pickle-based modules and ``X.load(...)`` calls on numpy or torch in one file."""
    found = sorted(name for name in imported_names(path) if name.split(".")[0] in UNPICKLING_MODULES)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in UNPICKLING_CALLS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in {"np", "numpy", "torch"}):
            found.append(f"{node.func.value.id}.{node.func.attr} (line {node.lineno})")
    return found


def test_nothing_on_the_serving_path_unpickles(tmp_path: Path) -> None:
    """Models reach the server as ONNX and SentencePiece protobufs and JSON; no serving module may load a
    pickle. The probe finds a planted one."""
    serving = {m: p for m, p in project_modules().items()
               if m.split(".")[0] in ("server", "clients") or m.startswith("common.model_format")}
    assert serving
    assert {m: unpickling_uses(p) for m, p in serving.items() if unpickling_uses(p)} == {}
    planted = tmp_path / "planted.py"
    planted.write_text("import numpy as np\nimport pickle\nnp.load('x.npy', allow_pickle=True)\n")
    assert unpickling_uses(planted) == ["pickle", "np.load (line 3)"]
