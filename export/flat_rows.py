"""A Transformer step graph computed on [rows, features] instead of [rows, 1, features].

A step decoder decodes one position per row, so its tensors carry a position axis of size 1, and every
2-D ``Gemm`` (:func:`export.graph_passes.one_position_gemms`) sits between a ``Squeeze`` and an
``Unsqueeze`` of that axis. ONNX Runtime runs those as nodes of their own: on the CPU each costs a few
microseconds of dispatch, which at batch 1 is what a step's small products cost. :func:`flatten_rows`
drops the axis wherever nothing needs it: the embeddings, the residual stream, the layer norms and the
feed-forward blocks run on [rows, features]; only the attention operators (which take [rows, 1, hidden]
queries) get an ``Unsqueeze`` before and a ``Squeeze`` after. Per decoder layer that is 4 such nodes
instead of 6, and the embeddings' two ``Unsqueeze`` and the final position ``Gather`` go.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.graph_passes import prune

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "Erf", "Cast", "QuickGelu", "Gelu", "FastGelu"}
FLAT_AXES = "flat_rows_axis"  # the [1] axes initializer of the Squeeze and Unsqueeze this pass adds


def flatten_rows(model: onnx.ModelProto) -> int:
    """Compute ``model`` (a step graph whose rows each hold one position) on [rows, features] where its
    operators allow (see the module docstring), in place. Returns the number of nodes removed."""
    graph = model.graph
    before = len(graph.node)
    small = {i.name: numpy_helper.to_array(i) for i in graph.initializer
             if i.data_location != onnx.TensorProto.EXTERNAL and len(i.dims) <= 1}
    ranks = {i.name: len(i.dims) for i in graph.initializer}
    rowwise = {i.name for i in graph.input if len(i.type.tensor_type.shape.dim) in (1, 2)}  # no position axis
    flat: dict[str, str] = {}  # a [rows, 1, ...] tensor -> the name of its [rows, ...] equivalent
    alias: dict[str, str] = {}  # a dropped node's output -> the tensor that replaces it
    twins: dict[str, str] = {}  # a replaced node's output -> its flat output (re-expanded if still read)
    nodes: list[onnx.NodeProto] = []

    def is_position_axis(name: str) -> bool:
        return name in small and small[name].tolist() == [1]

    def flat_of(name: str) -> str:
        """The flat equivalent of a [rows, 1, ...] tensor that has none yet: a Squeeze of it."""
        if name not in flat:
            flat[name] = f"{name}__flat"
            nodes.append(helper.make_node("Squeeze", [name, FLAT_AXES], [flat[name]], name=flat[name]))
        return flat[name]

    def replace(node: onnx.NodeProto, inputs: list[str]) -> None:
        outputs = [f"{output}__flat" if output else "" for output in node.output]
        twin = helper.make_node(node.op_type, inputs, outputs, name=f"{node.name or node.output[0]}__flat",
                                domain=node.domain)
        twin.attribute.extend(node.attribute)
        nodes.append(twin)
        for output, renamed in zip(node.output, outputs, strict=True):
            if output:
                flat[output] = twins[output] = renamed
                rowwise.add(renamed)

    for node in graph.node:
        node.input[:] = [alias.get(name, name) for name in node.input]
        op, inputs = node.op_type, list(node.input)
        is_flat = [name in flat for name in inputs]
        if op == "Unsqueeze" and inputs[0] in rowwise and is_position_axis(inputs[1]):
            flat[node.output[0]] = inputs[0]
            nodes.append(node)  # kept while an attention operator (or an output) reads it
        elif op == "Squeeze" and inputs[0] in flat and is_position_axis(inputs[1]):
            alias[node.output[0]] = flat[inputs[0]]
        elif (op == "Gather" and inputs[0] in flat and _attribute(node, "axis", 0) == 1
              and inputs[1] in small and small[inputs[1]].ndim == 0 and small[inputs[1]].item() == 0):
            alias[node.output[0]] = flat[inputs[0]]  # position 0 of [rows, 1, features]: the rows themselves
        elif op == "Gather" and _attribute(node, "axis", 0) == 0 and inputs[1] in flat and inputs[0] in ranks:
            replace(node, [inputs[0], flat[inputs[1]]])  # a table's rows for [rows] indices, not [rows, 1]
        elif op in ELEMENTWISE and any(is_flat) and all(
                f or ranks.get(name, 3) <= 1 for name, f in zip(inputs, is_flat, strict=True)):
            replace(node, [flat.get(name, name) for name in inputs])
        elif op == "MatMul" and is_flat[0] and ranks.get(inputs[1]) == 2:
            replace(node, [flat[inputs[0]], inputs[1]])
        elif op == "SkipLayerNormalization" and (is_flat[0] or is_flat[1]) and all(
                ranks.get(name, 0) <= 1 for name in inputs[2:]):
            replace(node, [flat_of(inputs[0]), flat_of(inputs[1]), *inputs[2:]])
        else:
            nodes.append(node)
            if op == "Gemm":  # 2-D in, 2-D out
                rowwise.add(node.output[0])
    for output in graph.output:
        if output.name in alias:  # a graph output keeps its name: the tensor that replaced it is copied out
            nodes.append(helper.make_node("Identity", [alias[output.name]], [output.name]))
    del graph.node[:]
    graph.node.extend(nodes)
    _expand_where_read(model, twins)
    graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), FLAT_AXES))
    prune(model)
    return before - len(graph.node)


def _expand_where_read(model: onnx.ModelProto, twins: dict[str, str]) -> None:
    """Give the [rows, 1, ...] tensors that a replaced node made and something still reads back (an
    ``Unsqueeze`` of the flat one, right after it), so no node is computed twice."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    made = {output for node in graph.node for output in node.output}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        for output in node.output:
            original = output.removesuffix("__flat")
            if output != original and twins.get(original) == output and original in read and original not in made:
                nodes.append(helper.make_node("Unsqueeze", [output, FLAT_AXES], [original], name=f"{original}__rows"))
    del graph.node[:]
    graph.node.extend(nodes)


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


