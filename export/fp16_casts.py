"""The fp16 conversion's edits of its own output (all in place): the fp32 operators ONNX Runtime's converter left in
fp16 where it could not type their input (:func:`block_fp16_inputs`), and the cast chains it leaves between fp32
operators and the fp32 graph outputs (:func:`fold_casts`). :func:`export.quantize.convert_fp16` runs both."""

from __future__ import annotations

from collections.abc import Collection

import onnx
from onnx import TensorProto, helper

from export.graph_passes import producers, prune


def block_fp16_inputs(model: onnx.ModelProto, fp32_ops: Collection[str]) -> int:
    """Each ``fp32_ops`` node whose first input is not known to be fp32 (:func:`_fp32_values`: an fp16
    conversion that could not type the input left the node in fp16) computes in fp32 between a ``Cast`` of
    that input to fp32 and a ``Cast`` of its first output back to fp16, what its readers were given (in
    place); :func:`fold_casts` then folds the chains this leaves. Returns the number of nodes so blocked."""
    graph = model.graph
    outputs = {output.name for output in graph.output}
    _sort_nodes(graph)  # each node's input decided before its readers' are
    blocked = 0
    for node in list(graph.node):
        if (node.op_type not in fp32_ops or node.output[0] in outputs
                or node.input[0] in _fp32_values(graph, fp32_ops)):
            continue
        source, out = node.input[0], node.output[0]
        node.input[0], node.output[0] = f"{out}__input_fp32", f"{out}__fp32"
        graph.node.extend([
            helper.make_node("Cast", [source], [node.input[0]], name=f"{out}__input_fp32", to=TensorProto.FLOAT),
            helper.make_node("Cast", [node.output[0]], [out], name=f"{out}__fp16", to=TensorProto.FLOAT16)])
        blocked += 1
    return blocked


def fold_casts(model: onnx.ModelProto, fp32_ops: Collection[str]) -> int:
    """The cast chains an fp16 conversion leaves between fp32 operators (``fp32_ops``, whose first output is
    fp32) and the fp32 graph outputs, folded (in place). Returns the number of ``Cast`` nodes removed:

    * ``Cast(fp32)`` of ``Cast(fp16)`` of an fp32 value reads the value itself: no round trip through fp16,
      which cost two kernels and rounded the value;
    * ``Gather(Cast(fp16)(x), i)`` read only by a ``Cast(fp32)`` gathers from ``x``;
    * two ``Cast`` s of one value to one type are one, and a ``Cast`` of a ``Cast`` to the same type is none.

    A value counts as fp32 only where that is known (:func:`_fp32_values`); nothing else is folded.

    An fp32 graph output so fed is renamed onto the fp32 value's producer. The nodes are then sorted (the
    converter lists its casts after their readers, and a value may now be read before its new producer) and
    what nothing reads any more is pruned."""
    graph = model.graph
    before = sum(node.op_type == "Cast" for node in graph.node)
    while _fold_one_cast(graph, fp32_ops):
        pass
    _sort_nodes(graph)
    prune(model)
    return before - sum(node.op_type == "Cast" for node in graph.node)


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None


def _fold_one_cast(graph: onnx.GraphProto, fp32_ops: Collection[str]) -> bool:
    """One folding of :func:`fold_casts`, if any applies."""
    made = producers(graph)
    outputs = {output.name for output in graph.output}
    fixed = outputs | {value.name for value in graph.input} | {init.name for init in graph.initializer}
    fp32 = _fp32_values(graph, fp32_ops)

    def fp32_source(name: str) -> str | None:  # x, where ``name`` is Cast(fp16)(x) of an fp32 x
        node = made.get(name)
        if node is not None and _cast_to(node) == TensorProto.FLOAT16 and node.input[0] in fp32:
            return node.input[0]
        return None

    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for node in graph.node:
        inner = made.get(node.input[0])
        if (node.op_type == "Cast" and inner is not None and _cast_to(inner) == _cast_to(node)
                and node.output[0] not in outputs):  # a cast to the type its input already has
            _read_instead(graph, node.output[0], inner.output[0])
            graph.node.remove(node)
            return True
        if _cast_to(node) == TensorProto.FLOAT and (source := fp32_source(node.input[0])) is not None:
            if node.output[0] not in outputs:
                _read_instead(graph, node.output[0], source)
            elif source not in fixed:
                _rename(graph, source, node.output[0])
            else:
                continue
            graph.node.remove(node)
            return True
        if node.op_type == "Gather" and node.output[0] not in outputs and (
                source := fp32_source(node.input[0])) is not None:
            casts = readers.get(node.output[0], [])
            if len(casts) == 1 and _cast_to(casts[0]) == TensorProto.FLOAT:
                node.input[0], node.output[0] = source, casts[0].output[0]
                graph.node.remove(casts[0])
                return True
    seen: dict[tuple[str, int | None], onnx.NodeProto] = {}
    for node in graph.node:
        if node.op_type != "Cast":
            continue
        twin = seen.setdefault((node.input[0], _cast_to(node)), node)
        if twin is not node:
            keep, drop = (twin, node) if node.output[0] not in outputs else (node, twin)
            if drop.output[0] in outputs:
                continue
            _read_instead(graph, drop.output[0], keep.output[0])
            graph.node.remove(drop)
            return True
    return False


def _fp32_values(graph: onnx.GraphProto, fp32_ops: Collection[str]) -> set[str]:
    """The values known to be fp32: fp32 graph inputs and initializers, ``Cast(fp32)`` outputs, and the first
    output of an ``fp32_ops`` node whose first input is one (the converter leaves a node of theirs in fp16 where
    it could not type its input)."""
    fp32 = {value.name for value in graph.input if value.type.tensor_type.elem_type == TensorProto.FLOAT}
    fp32 |= {init.name for init in graph.initializer if init.data_type == TensorProto.FLOAT}
    grown = True
    while grown:
        before = len(fp32)
        fp32 |= {node.output[0] for node in graph.node if _cast_to(node) == TensorProto.FLOAT
                 or (node.op_type in fp32_ops and node.input[0] in fp32)}
        grown = len(fp32) > before
    return fp32


def _read_instead(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node that reads ``old`` reads ``new``."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """The value ``old`` (a node's output, not a graph input or output) is called ``new``."""
    _read_instead(graph, old, new)
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new


def _sort_nodes(graph: onnx.GraphProto) -> None:
    """The nodes in an order where each comes after the producers of its inputs (stable otherwise)."""
    made = producers(graph)
    placed: set[int] = set()
    order: list[onnx.NodeProto] = []

    def place(node: onnx.NodeProto) -> None:
        stack = [(node, False)]
        while stack:
            current, ready = stack.pop()
            if id(current) in placed:
                continue
            if ready:
                placed.add(id(current))
                order.append(current)
                continue
            stack.append((current, True))
            stack.extend((made[name], False) for name in reversed(current.input)
                         if name in made and id(made[name]) not in placed)

    for node in graph.node:
        place(node)
    del graph.node[:]
    graph.node.extend(order)
