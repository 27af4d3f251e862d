"""Execution providers as they really run: what this ONNX Runtime build offers, what a session got, why not.

``get_available_providers()`` lists what the build was compiled with, not what can run: with
``onnxruntime-gpu`` installed and the CUDA or cuDNN libraries missing it still lists CUDA, and a session
asked for CUDA silently falls back to the CPU. So the provider reported anywhere is taken from the
sessions' own ``get_providers()`` (:func:`session_provider`), and :func:`check_provider` turns an
explicit ``cuda`` that did not get CUDA into an error naming the library that failed to load.


**Placement**: which nodes of an ONNX graph have no CUDA kernel in ONNX Runtime, read without a GPU.

ONNX Runtime places a node on the CUDA provider only where that provider registered a kernel for the node's
operator, opset and element types; any other node silently runs on the CPU provider, and its inputs and
outputs cross the bus. :func:`nodes_without_cuda_kernel` reads a graph's nodes and the element types of
their inputs and outputs and checks them against a kernel table copied from ONNX Runtime's
``docs/OperatorKernels.md`` (:data:`CUDA_KERNELS`, which names its source and release).

**Shape arithmetic is left out** (:func:`shape_arithmetic`). ONNX Runtime runs a ``Shape`` node's output
and the small integer computations on it (``Gather`` of one dimension, ``Cast``, ``Unsqueeze``, ``Concat``
into a new shape) on the CPU on purpose: they read no tensor's data, and the kernels that take them
(``Reshape``'s shape, ``Slice``'s starts) read them from host memory. The rule, exactly: a node is shape
arithmetic when

1. it is a ``Shape`` or ``Size`` node, or
2. every input it has is a constant (an initializer or a ``Constant`` node's output) or an output of a
   shape-arithmetic node, at least one input is the latter, and every output is an integer tensor (int32 or
   int64) of rank 0 or 1 as ONNX shape inference finds it (an output whose type or rank is unknown does not
   qualify).

Rule 2's output condition keeps out what only looks like shape arithmetic: a ``ConstantOfShape`` or
``Expand`` that materialises a mask or a batch from a shape, or a float ``Cast`` of a dimension that feeds
arithmetic on data, is checked like any other node (a 1-D int64 ``Range`` of positions is shape arithmetic).
``Constant`` nodes are never checked (ONNX Runtime folds them into initializers).

A node without a name is reported (and named by :func:`with_node_names`) as its op type and index:
"Cast#11".

Nodes inside subgraphs (``If``, ``Loop`` bodies) are not read; the exported graphs have none.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, shape_inference

from common.errors import NmtError

log = logging.getLogger("nmt.server")


CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


PROVIDER_NAMES = {"cpu": CPU, "cuda": CUDA}


# ONNX Runtime's messages when an arena cannot grow (BFCArena, the CUDA allocator, cudaMalloc)
OUT_OF_MEMORY_MARKERS = ("Failed to allocate memory", "out of memory", "CUDNN_STATUS_ALLOC_FAILED",
                         "CUBLAS_STATUS_ALLOC_FAILED")


@dataclass(frozen=True)
class DeviceSettings:
    """Where a model version's sessions run (from :class:`server.config.ServerConfig`)."""

    provider: str = "auto"  # auto, cpu or cuda
    device_id: int = 0  # CUDA device ordinal
    gpu_mem_limit: int = 0  # bytes each session's CUDA arena may hold; 0: no limit
    cuda_tf32: bool = False  # let CUDA use TF32 for fp32 MatMul/Conv (faster, ~1e-3 relative error)


def provider_list(settings: DeviceSettings) -> list[Any]:
    """The ``providers`` argument of ``InferenceSession``: CUDA with its options (then CPU for the nodes
    CUDA has no kernel for), or the CPU alone. Raises :class:`NmtError` for an unknown provider."""
    requested = settings.provider
    if requested not in ("auto", *PROVIDER_NAMES):
        raise NmtError(f"unknown execution provider {requested!r}; choose auto, cpu or cuda")
    if requested == "cpu" or (requested == "auto" and CUDA not in ort.get_available_providers()):
        return [CPU]
    options = {"device_id": str(settings.device_id), "arena_extend_strategy": "kSameAsRequested",
               "use_tf32": "1" if settings.cuda_tf32 else "0"}
    if settings.gpu_mem_limit:
        options["gpu_mem_limit"] = str(settings.gpu_mem_limit)
    return [(CUDA, options), CPU]


def session_provider(sessions: dict[str, ort.InferenceSession]) -> str:
    """The provider every session really runs on first; :class:`NmtError` if they disagree."""
    got = {role: session.get_providers()[0] for role, session in sessions.items()}
    if len(set(got.values())) != 1:
        raise NmtError(f"the sessions of one model version run on different providers: {got}")
    return next(iter(got.values()))


def check_provider(requested: str, providers: list[Any], got: str) -> None:
    """Raise when an explicit ``cuda`` did not get CUDA; log when ``auto`` fell back to the CPU."""
    wanted = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
    if got == wanted:
        return
    reason = cuda_unavailable_reason()
    if requested == "auto":
        log.warning("CUDA listed by onnxruntime but sessions run on the CPU; serving on the CPU",
                    extra={"fields": {"provider": got, "reason": reason}})
        return
    raise NmtError(f"execution provider {requested} requested but the sessions run on {got}: {reason}")


def probe_provider(settings: DeviceSettings) -> str:
    """Open a one-node session with ``settings`` before any model loads: an explicit ``cuda`` that does not
    really run fails here, at start-up (:class:`NmtError`), instead of refusing every version; ``auto``
    logs its fallback. Returns the provider the session got."""
    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the fallback is reported by check_provider, in the JSON log
    providers = provider_list(settings)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    got = session.get_providers()[0]
    check_provider(settings.provider, providers, got)
    return got


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot run in this process: the build lacks it, or the library that fails to load."""
    library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if CUDA not in ort.get_available_providers() or not library.exists():
        return (f"this onnxruntime build ({runtime_build()}) has no CUDA provider; install onnxruntime-gpu "
                "alone (see the README)")
    try:
        ctypes.CDLL(str(library))
    except OSError as error:  # names the missing dependency, e.g. libcudnn.so.9 or libcublasLt.so.12
        return f"cannot load {library.name}: {error}"
    return "the CUDA provider loads but no session got it (no GPU visible, or the driver is too old?)"


def runtime_build() -> str:
    """``onnxruntime-gpu 1.20.1 (GPU)``: the installed distribution(s), version and build device."""
    installed = [name for name in ("onnxruntime", "onnxruntime-gpu") if _installed(name)]
    return f"{'+'.join(installed) or 'onnxruntime'} {ort.__version__} ({ort.get_device()})"


def log_runtime() -> None:
    """Log the ONNX Runtime build and its providers at start-up; warn when the CPU and GPU distributions
    are both installed (they share one ``onnxruntime`` package and the last installed wins)."""
    fields = {"onnxruntime": runtime_build(), "available_providers": ort.get_available_providers()}
    log.info("onnxruntime", extra={"fields": fields})
    if _installed("onnxruntime") and _installed("onnxruntime-gpu"):
        log.warning("onnxruntime and onnxruntime-gpu are both installed and overwrite each other's files; "
                    "keep onnxruntime-gpu only", extra={"fields": fields})


def is_out_of_memory(error: BaseException) -> bool:
    """Is ``error`` ONNX Runtime failing to allocate device (or arena) memory?"""
    text = str(error)
    return any(marker in text for marker in OUT_OF_MEMORY_MARKERS)


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


CUDA_KERNELS = Path(__file__).resolve().parent / "data" / "cuda_kernels_ort-1.31.toml"


ONNX_DOMAIN = "ai.onnx"


SHAPE_SOURCES = frozenset({"Shape", "Size"})


_SHAPE_VALUE_TYPES = frozenset({TensorProto.INT32, TensorProto.INT64})


_LITERAL = "tensor("  # an argument of a fixed type in the table: "tensor(int64)"


def element_type_name(elem_type: int) -> str:
    """ONNX's element type as OperatorKernels.md spells it: TensorProto.FLOAT16 -> "float16"."""
    return TensorProto.DataType.Name(elem_type).lower()


@dataclass(frozen=True)
class OpKernel:
    """One operator's CUDA kernel entry (see the data file's header for the fields)."""

    versions: tuple[int, int]  # opsets it covers, both ends included
    inputs: tuple[str, ...]  # each input's type constraint (or "tensor(x)"); the last one repeats
    outputs: tuple[str, ...]
    types: dict[str, frozenset[str]]  # constraint -> element types the kernel takes

    def covers(self, opset: int) -> bool:
        return self.versions[0] <= opset <= self.versions[1]

    def input_constraint(self, index: int) -> str:
        return self.inputs[min(index, len(self.inputs) - 1)]

    def output_constraint(self, index: int) -> str:
        return self.outputs[min(index, len(self.outputs) - 1)]

    def allowed(self, constraint: str) -> frozenset[str] | None:
        """The element types ``constraint`` allows, or None when the kernel does not constrain it."""
        if constraint.startswith(_LITERAL):
            return frozenset({constraint[len(_LITERAL):-1]})
        return self.types.get(constraint)


@dataclass(frozen=True)
class KernelTable:
    version: str  # the ONNX Runtime release it stands for
    source: str  # where it was read
    ops: dict[tuple[str, str], OpKernel]  # (domain, op type) -> its kernel


def _versions(text: str) -> tuple[int, int]:
    """OperatorKernels.md's opset column: "13+", "13" or "[13, 18]"."""
    if text.endswith("+"):
        return int(text[:-1]), 10**6
    if text.startswith("["):
        low, high = text.strip("[]").split(",")
        return int(low), int(high)
    return int(text), int(text)


@cache
def load_kernel_table(path: Path = CUDA_KERNELS) -> KernelTable:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    ops = {
        (domain, op): OpKernel(_versions(entry["versions"]), tuple(entry["inputs"]), tuple(entry["outputs"]),
                               {name: frozenset(types) for name, types in entry.get("types", {}).items()})
        for domain, entries in data["ops"].items() for op, entry in entries.items()
    }
    return KernelTable(version=data["version"], source=data["source"], ops=ops)


@dataclass(frozen=True)
class Unplaced:
    """A node the CUDA provider has no kernel for, and why."""

    node: str  # the node's name (its op type and index where it has none)
    op: str  # "com.microsoft.GroupQueryAttention"
    reason: str


def _domain(domain: str) -> str:
    return domain or ONNX_DOMAIN


def _node_name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


def with_node_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose unnamed nodes carry the names this module reports them by ("Cast#11", the op
    type and the node's index), so that a session of the copy names them so in its profile."""
    named = onnx.ModelProto()
    named.CopyFrom(model)
    for index, node in enumerate(named.graph.node):
        node.name = _node_name(node, index)
    return named


@dataclass(frozen=True)
class _Value:
    elem_type: int | None  # None: unknown
    rank: int | None


def _values(model: onnx.ModelProto, table: KernelTable) -> dict[str, _Value]:
    """Every tensor's element type and rank: the graph's declarations, ONNX shape inference, and for what
    inference cannot reach (anything after a com.microsoft node) the kernel table's type constraints."""
    values: dict[str, _Value] = {}

    def learn(info: onnx.ValueInfoProto) -> None:
        tensor = info.type.tensor_type
        rank = len(tensor.shape.dim) if tensor.HasField("shape") else None
        values[info.name] = _Value(tensor.elem_type or None, rank)

    inferred = shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    for info in [*inferred.graph.value_info, *model.graph.value_info, *model.graph.input, *model.graph.output]:
        learn(info)
    for tensor in model.graph.initializer:
        values[tensor.name] = _Value(tensor.data_type, len(tensor.dims))
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    for node in model.graph.node:  # ONNX graphs are sorted: inputs before the nodes that read them
        if node.op_type == "Constant":
            values[node.output[0]] = _constant_value(node)
            continue
        kernel = table.ops.get((_domain(node.domain), node.op_type))
        if kernel is None or not kernel.covers(opsets.get(_domain(node.domain), 0)):
            continue
        bound: dict[str, int] = {}
        for index, name in enumerate(node.input):
            if name and values.get(name, _Value(None, None)).elem_type is not None:
                bound.setdefault(kernel.input_constraint(index), values[name].elem_type)  # type: ignore[arg-type]
        for index, name in enumerate(node.output):
            if not name or values.get(name, _Value(None, None)).elem_type is not None:
                continue
            elem_type = _derived_output_type(node, kernel, kernel.output_constraint(index), bound)
            values[name] = _Value(elem_type, values[name].rank if name in values else None)
    return values


def _constant_value(node: onnx.NodeProto) -> _Value:
    for attribute in node.attribute:
        if attribute.name == "value":
            return _Value(attribute.t.data_type, len(attribute.t.dims))
        if attribute.name in ("value_int", "value_ints"):
            return _Value(TensorProto.INT64, 0 if attribute.name == "value_int" else 1)
        if attribute.name in ("value_float", "value_floats"):
            return _Value(TensorProto.FLOAT, 0 if attribute.name == "value_float" else 1)
    return _Value(None, None)


def _derived_output_type(node: onnx.NodeProto, kernel: OpKernel, constraint: str, bound: dict[str, int]) -> int | None:
    if node.op_type == "Cast":
        return next((a.i for a in node.attribute if a.name == "to"), None)
    if node.op_type == "ConstantOfShape":
        return next((a.t.data_type for a in node.attribute if a.name == "value"), TensorProto.FLOAT)
    if constraint in bound:
        return bound[constraint]
    allowed = kernel.allowed(constraint)
    if allowed is not None and len(allowed) == 1:
        return getattr(TensorProto, next(iter(allowed)).upper())
    return None


def shape_arithmetic(model: onnx.ModelProto, values: dict[str, _Value] | None = None) -> set[str]:
    """The names of the graph's shape-arithmetic nodes (the module docstring's rule)."""
    values = values if values is not None else _values(model, load_kernel_table())
    constants = {t.name for t in model.graph.initializer}
    constants.update(n.output[0] for n in model.graph.node if n.op_type == "Constant")
    shape_values: set[str] = set()
    names: set[str] = set()
    for index, node in enumerate(model.graph.node):
        if node.op_type == "Constant":
            continue
        inputs = [name for name in node.input if name]
        if node.op_type in SHAPE_SOURCES:
            qualifies = True
        else:
            qualifies = (any(name in shape_values for name in inputs)
                         and all(name in shape_values or name in constants for name in inputs)
                         and all(_is_shape_value(values.get(name)) for name in node.output if name))
        if qualifies:
            names.add(_node_name(node, index))
            shape_values.update(name for name in node.output if name)
    return names


def _is_shape_value(value: _Value | None) -> bool:
    return (value is not None and value.elem_type in _SHAPE_VALUE_TYPES
            and value.rank is not None and value.rank <= 1)


def nodes_without_cuda_kernel(model: onnx.ModelProto, table: KernelTable | None = None) -> list[Unplaced]:
    """The nodes of ``model`` (shape arithmetic and ``Constant`` left out) that ``table`` has no CUDA kernel
    for: the operator is not there, the graph's opset is outside its entry, or an input's or output's element
    type is not one its type constraint allows (or is unknown). In graph order."""
    table = table or load_kernel_table()
    values = _values(model, table)
    skipped = shape_arithmetic(model, values)
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    found = []
    for index, node in enumerate(model.graph.node):
        name = _node_name(node, index)
        if node.op_type == "Constant" or name in skipped:
            continue
        op = f"{_domain(node.domain)}.{node.op_type}"
        reason = _why_unplaced(node, table.ops.get((_domain(node.domain), node.op_type)),
                               opsets.get(_domain(node.domain), 0), values)
        if reason:
            found.append(Unplaced(name, op, reason))
    return found


def _why_unplaced(node: onnx.NodeProto, kernel: OpKernel | None, opset: int, values: dict[str, _Value]) -> str:
    if kernel is None:
        return "no CUDA kernel in the table"
    if not kernel.covers(opset):
        return f"the table's kernel covers opsets {kernel.versions}, not {opset}"
    arguments = [("input", i, name, kernel.input_constraint(i)) for i, name in enumerate(node.input)]
    arguments += [("output", i, name, kernel.output_constraint(i)) for i, name in enumerate(node.output)]
    for kind, index, name, constraint in arguments:
        allowed = kernel.allowed(constraint)
        if not name or allowed is None:
            continue
        elem_type = values.get(name, _Value(None, None)).elem_type
        if elem_type is None:
            return f"{kind} {index} ({name}): element type unknown"
        if element_type_name(elem_type) not in allowed:
            return (f"{kind} {index} ({name}) is {element_type_name(elem_type)}; the CUDA kernel's {constraint} "
                    f"takes {', '.join(sorted(allowed))}")
    return ""
