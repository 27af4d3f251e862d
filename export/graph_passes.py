"""Edits of exported ONNX graphs (all in place): pruning, transpose cancelling, packing parallel
projections (and feeding the packed Q/K/V to the attention operator), folding the output bias and the
embedding scale into constants, a one-position step's biased projections into ``Gemm``, SiLU as one operator,
Gemm -> MatMul for quantization, and op counts (the fp16 conversion's own edits: :mod:`export.fp16_casts`; the
decoder's in-graph top-k and logits outputs: :mod:`export.decoder_outputs`).

A pass that reads weights takes ``base_dir``, the directory of the graph's external data: the export edits
graphs whose weights stay in the traced graphs' file, each read when a pass needs it (the graph's weights
are never all in memory)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from export.tracing import MAX_IR_VERSION

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators
ONE_POSITION_AXIS = "one_position_axis"  # the axis initializer of one_position_gemms' Squeeze/Unsqueeze
FUSED_STANDARD_OPS = {"LayerNormalization", "GRU", "LSTM", "RNN", "Attention", "RMSNormalization"}


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Each tensor name -> the node producing it."""
    return {output: node for node in graph.node for output in node.output if output}


def prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop nodes, initializers and value infos that no graph output depends on (in place)."""
    graph = model.graph
    needed = {output.name for output in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(output in needed for output in node.output):
            keep.append(node)
            needed.update(name for name in node.input if name)
            for attribute in node.attribute:  # subgraphs (If/Loop) read outer names implicitly
                if attribute.type == onnx.AttributeProto.GRAPH:
                    needed.update(_subgraph_inputs(attribute.g))
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    for index in reversed(range(len(graph.initializer))):  # deleted in place: rebuilding the list would copy
        if graph.initializer[index].name not in needed:  # every weight (and protobuf frees none of it until
            del graph.initializer[index]  # the whole model goes)
    infos = [info for info in graph.value_info if info.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return model


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    names = {name for node in graph.node for name in node.input}
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= _subgraph_inputs(attribute.g)
    return names


def remove_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """A copy of ``model`` without graph output ``name`` (and whatever only it needed)."""
    clone = onnx.ModelProto()
    clone.CopyFrom(model)
    outputs = [output for output in clone.graph.output if output.name != name]
    del clone.graph.output[:]
    clone.graph.output.extend(outputs)
    return prune(clone)


def cancel_transposes(model: onnx.ModelProto) -> int:
    """Bypass ``Transpose(Transpose(x, p), q)`` pairs that compose to the identity; returns how many."""
    graph = model.graph
    made = producers(graph)
    rename: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Transpose" or not node.input:
            continue
        inner = made.get(node.input[0])
        if inner is None or inner.op_type != "Transpose":
            continue
        outer_perm, inner_perm = perm(node), perm(inner)
        if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
            continue
        if [inner_perm[axis] for axis in outer_perm] == list(range(len(outer_perm))):
            rename[node.output[0]] = inner.input[0]
    if rename:
        graph_outputs = {output.name for output in graph.output}
        rename = {old: new for old, new in rename.items() if old not in graph_outputs}
        for node in graph.node:
            for position, name in enumerate(node.input):
                if name in rename:
                    node.input[position] = rename[name]
        prune(model)
    return len(rename)


def pack_parallel_matmuls(model: onnx.ModelProto, base_dir: str | Path = "") -> int:
    """Merge the projections that read the same input into one (in place): ``MatMul(x, W_i) [+ b_i]``
    for i = 1..n with constant 2-D ``W_i`` becomes ``Split(MatMul(x, [W_1 ... W_n]) [+ [b_1 ... b_n]])``,
    whose pieces keep the original output names. Attention's query/key/value projections and the
    cross-attention key/value projections of every decoder layer are such groups: one wide product
    uses both cores where the narrow ones leave one idle, and costs one kernel launch instead of n.
    Returns the number of MatMuls removed."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in graph.output}

    def bias_of(matmul: onnx.NodeProto) -> tuple[onnx.NodeProto, str] | None:
        """The ``Add(matmul, b)`` with constant 1-D ``b`` that alone reads this MatMul's output, and ``b``."""
        users = consumers.get(matmul.output[0], [])
        if len(users) != 1 or users[0].op_type != "Add" or matmul.output[0] in graph_outputs:
            return None
        add = users[0]
        bias = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
        return (add, bias) if bias in initializers and len(initializers[bias].dims) == 1 else None

    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if (node.op_type == "MatMul" and node.input[1] in initializers
                and len(initializers[node.input[1]].dims) == 2):
            groups.setdefault(node.input[0], []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(first member) -> the nodes taking its place
    removed: set[int] = set()
    merged = 0
    for index, (source, members) in enumerate(groups.items()):
        biases = [bias_of(member) for member in members]
        if len(members) < 2 or any(biases) != all(biases):
            continue
        name = f"packed_{index}"
        weights = [onnx.numpy_helper.to_array(initializers[member.input[1]], str(base_dir)) for member in members]
        graph.initializer.extend([
            onnx.numpy_helper.from_array(np.concatenate(weights, axis=1), f"{name}_weight"),
            onnx.numpy_helper.from_array(np.array([w.shape[1] for w in weights], dtype=np.int64), f"{name}_split"),
        ])
        nodes = [helper.make_node("MatMul", [source, f"{name}_weight"], [f"{name}_product"], name=name)]
        ends = members
        if all(biases):
            adds = [add for add, _ in biases]
            packed_bias = np.concatenate([onnx.numpy_helper.to_array(initializers[b], str(base_dir))
                                          for _, b in biases])
            graph.initializer.append(onnx.numpy_helper.from_array(packed_bias, f"{name}_bias"))
            nodes.append(helper.make_node("Add", [f"{name}_product", f"{name}_bias"], [f"{name}_biased"],
                                          name=f"{name}_add"))
            removed.update(id(add) for add in adds)
            ends = adds
        nodes.append(helper.make_node("Split", [nodes[-1].output[0], f"{name}_split"],
                                      [end.output[0] for end in ends], axis=-1, name=f"{name}_split"))
        replaced[id(members[0])] = nodes
        removed.update(id(member) for member in members)
        merged += len(members) - 1
    if not merged:
        return 0
    # the packed nodes take the first member's place: every member and consumer comes after it
    order: list[onnx.NodeProto] = []
    for node in graph.node:
        order.extend(replaced.get(id(node), []))
        if id(node) not in removed:
            order.append(node)
    del graph.node[:]
    graph.node.extend(order)
    prune(model)
    return merged


def reader_counts(graph: onnx.GraphProto) -> Counter[str]:
    """How many node inputs read each tensor name."""
    return Counter(name for node in graph.node for name in node.input)


def perm(node: onnx.NodeProto) -> list[int] | None:
    """A Transpose node's ``perm`` attribute (None when absent)."""
    for attribute in node.attribute:
        if attribute.name == "perm":
            return list(attribute.ints)
    return None


def set_io_shapes(model: onnx.ModelProto, shapes: dict[str, Sequence[int | str]]) -> None:
    """Overwrite the declared shapes of graph inputs/outputs (the exporter sometimes records the
    example's sizes for dynamic axes) and drop intermediate shape annotations."""
    for value in [*model.graph.input, *model.graph.output]:
        if value.name not in shapes:
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for size in shapes[value.name]:
            dim = dims.add()
            if isinstance(size, str):
                dim.dim_param = size
            else:
                dim.dim_value = size
    del model.graph.value_info[:]


def gemm_to_matmul(model: onnx.ModelProto) -> int:
    """Rewrite ``Gemm(x, W, b, transB=1)`` with constant ``W`` as ``MatMul(x, W^T) + b`` (in place), so
    dynamic quantization, which skips Gemm, covers those layers too. Returns the number rewritten."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "Gemm"
            or node.input[1] not in initializers
            or attributes.get("transA", 0)
            or attributes.get("alpha", 1.0) != 1.0
            or attributes.get("beta", 1.0) != 1.0
        ):
            nodes.append(node)
            continue
        weight = onnx.numpy_helper.to_array(initializers[node.input[1]])
        if attributes.get("transB", 0):
            weight = weight.T
        name = f"{node.input[1]}__matmul_{rewritten}"
        graph.initializer.append(onnx.numpy_helper.from_array(np.ascontiguousarray(weight), name))
        product = node.output[0] + "__matmul" if len(node.input) > 2 and node.input[2] else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}_matmul"))
        if product != node.output[0]:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    prune(model)
    return rewritten


def count_ops(model: onnx.ModelProto) -> Counter[str]:
    """Nodes by op type."""
    return Counter(node.op_type for node in model.graph.node)


def fused_op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Counts of the fused operators in a graph: every ``com.microsoft`` op plus standard fused ops."""
    counts: Counter[str] = Counter()
    for node in model.graph.node:
        if node.domain == MS_DOMAIN:
            counts[f"com.microsoft.{node.op_type}"] += 1
        elif node.op_type in FUSED_STANDARD_OPS:
            counts[node.op_type] += 1
    return dict(sorted(counts.items()))


def save_graph(model: onnx.ModelProto, path: Path) -> None:
    """Save with the IR version capped at what the supported onnxruntime reads."""
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(path))


def pack_attention_inputs(model: onnx.ModelProto, base_dir: str | Path = "") -> int:
    """Feed each ``GroupQueryAttention`` whose query, key and value are the pieces of one ``Split`` (a
    projection packed by :func:`pack_parallel_matmuls`) the packed tensor itself, as the operator's packed
    QKV input (in place): the Split goes, and the packed weight's and bias's column blocks are put in
    query, key, value order. Returns the number of attention nodes changed."""
    graph = model.graph
    made = producers(graph)
    initializers = {init.name: init for init in graph.initializer}
    readers = reader_counts(graph)
    changed = 0
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 3:
            continue
        split = made.get(node.input[0])
        if (split is None or split.op_type != "Split" or sorted(split.output) != sorted(node.input[:3])
                or any(readers[name] != 1 for name in split.output)):
            continue
        blocks = (onnx.numpy_helper.to_array(initializers[split.input[1]], str(base_dir)) if len(split.input) > 1
                  else None)
        if blocks is None or len(set(blocks.tolist())) != 1:
            continue
        order = [list(split.output).index(name) for name in node.input[:3]]  # q, k, v among the pieces
        source = made.get(split.input[0])
        add = source if source is not None and source.op_type == "Add" else None
        matmul = made.get(add.input[0]) if add is not None else source
        if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in initializers:
            continue
        targets = [matmul.input[1]] + ([add.input[1]] if add is not None else [])
        if any(name not in initializers or readers[name] != 1 for name in targets):
            continue
        for name in targets:
            array = onnx.numpy_helper.to_array(initializers[name], str(base_dir))
            pieces = np.split(array, 3, axis=-1)
            initializers[name].CopyFrom(onnx.numpy_helper.from_array(
                np.concatenate([pieces[i] for i in order], axis=-1), name))
        node.input[0], node.input[1], node.input[2] = split.input[0], "", ""
        changed += 1
    if changed:
        prune(model)
    return changed


def _fed_by_one(model: onnx.ModelProto, op_type: str, producer_type: str
                ) -> Iterator[tuple[onnx.NodeProto, onnx.NodeProto, onnx.TensorProto]]:
    """``(node, producer, constant)`` for each ``op_type`` node whose inputs are a ``producer_type`` node's
    output (read by nothing else, not a graph output) and a constant: the pairs a folding pass may merge
    by giving ``producer`` the node's output and removing the node."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    made = producers(graph)
    readers = reader_counts(graph)
    outputs = {output.name for output in graph.output}
    for node in list(graph.node):
        if node.op_type != op_type:
            continue
        for position in (0, 1):
            producer, constant = made.get(node.input[position]), node.input[1 - position]
            if (producer is not None and producer.op_type == producer_type and constant in initializers
                    and readers[producer.output[0]] == 1 and producer.output[0] not in outputs):
                yield node, producer, initializers[constant]
                break


def _bypass(model: onnx.ModelProto, node: onnx.NodeProto, producer: onnx.NodeProto) -> None:
    """``producer`` takes over ``node``'s output and ``node`` goes."""
    producer.output[0] = node.output[0]
    model.graph.node.remove(node)


def fold_output_bias(model: onnx.ModelProto, base_dir: str | Path = "") -> int:
    """``Add(Gemm(x, W), b)`` with constant ``b`` of one row (the output layer's ``final_logits_bias``) becomes
    ``Gemm(x, W, b)`` (in place): one operator less per step. Returns the number folded."""
    folded = 0
    for add, gemm, bias in _fed_by_one(model, "Add", "Gemm"):
        attributes = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
        values = onnx.numpy_helper.to_array(bias, str(base_dir))
        if (len(gemm.input) > 2 or attributes.get("beta", 1.0) != 1.0 or values.ndim > 2
                or (values.ndim == 2 and values.shape[0] != 1)):
            continue
        name = f"{bias.name}__gemm_bias"
        model.graph.initializer.append(onnx.numpy_helper.from_array(values.reshape(-1), name))
        gemm.input.append(name)
        _bypass(model, add, gemm)
        folded += 1
    if folded:
        prune(model)
    return folded


def digest(values: np.ndarray) -> bytes:
    """What two equal tensors share: element type and bytes (hashed in place, no copy of a large tensor)."""
    hashed = hashlib.sha256(values.dtype.str.encode())
    hashed.update(memoryview(np.ascontiguousarray(values)).cast("B"))
    return hashed.digest()


def fold_embedding_scale(model: onnx.ModelProto, keep: Collection[bytes] = (), base_dir: str | Path = "") -> int:
    """``Mul(Gather(table, ids), s)`` with constant scalar ``s`` and a table only that Gather reads becomes
    ``Gather(table · s, ids)`` (in place): the same products, computed once at export instead of every step.
    A table whose :func:`digest` is in ``keep`` (a tied embedding, equal to the output projection's weight:
    :mod:`export.shared_tensors`) stays as it is. Returns the number folded."""
    initializers = {init.name: init for init in model.graph.initializer}
    readers = reader_counts(model.graph)
    folded = 0
    for mul, gather, scale in _fed_by_one(model, "Mul", "Gather"):
        table = initializers.get(gather.input[0])
        if table is None or readers[table.name] != 1:
            continue
        factor, values = (onnx.numpy_helper.to_array(tensor, str(base_dir)) for tensor in (scale, table))
        if factor.size != 1 or factor.dtype != values.dtype or (keep and digest(values) in keep):
            continue
        table.CopyFrom(onnx.numpy_helper.from_array(values * factor.reshape(()), table.name))
        _bypass(model, mul, gather)
        folded += 1
    if folded:
        prune(model)
    return folded


def one_position_gemms(model: onnx.ModelProto) -> int:
    """``Add(MatMul(x, W), b)`` with constant 2-D ``W`` and 1-D ``b`` becomes
    ``Unsqueeze(Gemm(Squeeze(x, 1), W, b), 1)`` (in place), for step graphs whose projections all read
    [rows, 1, K] (a Transformer's step decoder: one target position). ONNX Runtime folds a bias into a
    ``Gemm`` only for 2-D inputs, and the ``Squeeze``/``Unsqueeze`` pair costs less than the ``Add``
    (they only relabel the buffer): SMALL decoder, 1.06-1.15x at batch 1, 1.0-1.1x at 8 and 32. Returns the number
    rewritten. :func:`undo_one_position_gemms` reverses it (int8 quantization fuses the bias itself)."""
    axis = ONE_POSITION_AXIS
    initializers = {init.name: init for init in model.graph.initializer}
    rewritten = 0
    for add, matmul, bias in list(_fed_by_one(model, "Add", "MatMul")):
        weight = initializers.get(matmul.input[1])
        if weight is None or len(weight.dims) != 2 or len(bias.dims) != 1:
            continue
        if not rewritten:
            model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), axis))
        rows, product = f"{matmul.name}_rows", f"{matmul.name}_gemm"
        at = list(model.graph.node).index(matmul)
        model.graph.node.insert(at, helper.make_node("Squeeze", [matmul.input[0], axis], [rows], name=rows))
        matmul.CopyFrom(helper.make_node("Gemm", [rows, matmul.input[1], bias.name], [product], name=product))
        add.CopyFrom(helper.make_node("Unsqueeze", [product, axis], [add.output[0]], name=f"{matmul.name}_unsqueeze"))
        rewritten += 1
    return rewritten


def undo_one_position_gemms(model: onnx.ModelProto) -> int:
    """``Unsqueeze(Gemm(Squeeze(x, 1), W, b), 1)`` made by :func:`one_position_gemms` back to
    ``Add(MatMul(x, W), b)`` (in place): dynamic int8 quantization fuses the bias into its
    ``DynamicQuantizeMatMul`` on 3-D inputs, so there the Squeeze/Unsqueeze pairs would only add operators.
    Returns the number restored."""
    graph = model.graph
    made = producers(graph)
    readers = reader_counts(graph)
    restored = 0
    for unsqueeze in list(graph.node):
        gemm = made.get(unsqueeze.input[0]) if unsqueeze.op_type == "Unsqueeze" else None
        squeeze = made.get(gemm.input[0]) if gemm is not None and gemm.op_type == "Gemm" else None
        if (squeeze is None or squeeze.op_type != "Squeeze" or unsqueeze.input[1:] != [ONE_POSITION_AXIS]
                or squeeze.input[1:] != [ONE_POSITION_AXIS] or readers[gemm.output[0]] != 1
                or readers[squeeze.output[0]] != 1 or len(gemm.input) != 3):
            continue
        product = f"{gemm.name}_product"
        x, weight, bias = squeeze.input[0], gemm.input[1], gemm.input[2]
        gemm.CopyFrom(helper.make_node("MatMul", [x, weight], [product], name=product))
        unsqueeze.CopyFrom(helper.make_node("Add", [product, bias], [unsqueeze.output[0]], name=f"{product}_bias"))
        restored += 1
    if restored:
        prune(model)
    return restored


def fuse_silu(model: onnx.ModelProto) -> int:
    """``Mul(x, Sigmoid(x))`` (SiLU, the "swish" of Marian models) becomes ONNX Runtime's ``QuickGelu`` with
    ``alpha`` 1, ``x * sigmoid(alpha * x)``, which has CPU and CUDA kernels: one operator a feed-forward block
    instead of two (in place). Returns the number fused."""
    graph = model.graph
    made = producers(graph)
    readers = reader_counts(graph)
    outputs = {output.name for output in graph.output}
    fused = 0
    for node in list(graph.node):
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        for position in (0, 1):
            sigmoid, x = made.get(node.input[position]), node.input[1 - position]
            if (sigmoid is not None and sigmoid.op_type == "Sigmoid" and sigmoid.input[0] == x
                    and readers[sigmoid.output[0]] == 1 and sigmoid.output[0] not in outputs):
                quick = helper.make_node("QuickGelu", [x], [node.output[0]], name=f"{node.name or node.output[0]}_silu",
                                         domain=MS_DOMAIN, alpha=1.0)
                graph.node.insert(list(graph.node).index(node), quick)
                graph.node.remove(node)
                graph.node.remove(sigmoid)
                fused += 1
                break
    if fused and not any(opset.domain == MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return fused
