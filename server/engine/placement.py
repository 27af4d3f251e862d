"""Which nodes of an ONNX graph have no CUDA kernel in ONNX Runtime, read without a GPU.

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

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import onnx
from onnx import TensorProto, shape_inference

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
