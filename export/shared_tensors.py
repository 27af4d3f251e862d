"""Graph edits that keep equal weights one tensor across a version's graphs, so that
:class:`nmt.model_format.weights.WeightStore` stores (and the server loads) each once.

A model whose output projection shares the embedding (Marian, OPUS-MT, this project's Transformer) is
traced as separate, equal tensors: the ``Gather`` tables of the encoder and the decoders, the step
decoders' ``Gemm(x, W, transB=1)`` weight, and the forced pass's ``MatMul(x, Wᵀ)`` with ``Wᵀ`` folded into
a new constant. :func:`gemm_weights` finds the projection weights; ``fold_embedding_scale`` leaves a table
equal to one of them unscaled (one ``Mul`` per step instead of a scaled copy of the vocabulary's
embedding), and :func:`transposed_projection_as_gemm` turns the forced pass's ``MatMul(x, Wᵀ)`` into
``Gemm(x, W, transB=1)`` over the same ``W``.

The self-attention projections packed into one ``MatMul`` (:func:`export.graph_passes.pack_parallel_matmuls`)
come out in query, key, value order in the step graphs (their attention operator wants it) but in another
order in the forced pass; :func:`align_packed_blocks` puts the forced pass's blocks in the step graphs'
order (and its ``Split``'s outputs with them).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.graph_passes import digest, prune, reader_counts


def gemm_weights(models: Iterable[onnx.ModelProto]) -> set[bytes]:
    """Digests of the 2-D constant weights read by ``Gemm(x, W, transB=1)`` in ``models``."""
    found = set()
    for model in models:
        initializers = {init.name: init for init in model.graph.initializer}
        for node in model.graph.node:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Gemm" and attributes.get("transB") == 1 and node.input[1] in initializers:
                weight = initializers[node.input[1]]
                if len(weight.dims) == 2:
                    found.add(digest(numpy_helper.to_array(weight)))
    return found


def transposed_projection_as_gemm(model: onnx.ModelProto, weights: Collection[bytes]) -> int:
    """``MatMul(x, C)`` with constant 2-D ``C`` whose transpose is one of ``weights`` becomes
    ``Reshape(Gemm(Reshape(x, [-1, K]), Cᵀ, transB=1), x's leading axes + [N])`` (in place), ``Cᵀ`` stored as
    it is elsewhere. Returns the number rewritten."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    readers = reader_counts(graph)
    rewritten = 0
    for node in list(graph.node):
        constant = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        if constant is None or len(constant.dims) != 2 or readers[constant.name] != 1:
            continue
        transposed = np.ascontiguousarray(numpy_helper.to_array(constant).T)
        if digest(transposed) not in weights:
            continue
        depth, width = constant.dims
        name = node.name or node.output[0]
        flat, product, lead, shape = (f"{name}_flat", f"{name}_gemm", f"{name}_lead", f"{name}_shape")
        constant.CopyFrom(numpy_helper.from_array(transposed, constant.name))
        graph.initializer.extend([
            numpy_helper.from_array(np.array([-1, depth], dtype=np.int64), f"{name}_flat_shape"),
            numpy_helper.from_array(np.array([width], dtype=np.int64), f"{name}_width"),
        ])
        at = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, new in enumerate([
            helper.make_node("Reshape", [node.input[0], f"{name}_flat_shape"], [flat], name=flat),
            helper.make_node("Gemm", [flat, constant.name], [product], name=product, transB=1),
            helper.make_node("Shape", [node.input[0]], [lead], name=lead, end=-1),
            helper.make_node("Concat", [lead, f"{name}_width"], [shape], name=shape, axis=0),
            helper.make_node("Reshape", [product, shape], [node.output[0]], name=f"{name}_unflat"),
        ]):
            graph.node.insert(at + offset, new)
        rewritten += 1
    if rewritten:
        prune(model)
    return rewritten


def packed_blocks(models: Iterable[onnx.ModelProto], parts: int = 3) -> set[tuple[bytes, ...]]:
    """The :func:`digest` of each column block of every 2-D ``MatMul`` weight of ``models`` whose columns split
    into ``parts`` equal blocks, block by block in stored order."""
    found = set()
    for model in models:
        initializers = {init.name: init for init in model.graph.initializer}
        for node in model.graph.node:
            weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
            if weight is not None and len(weight.dims) == 2 and weight.dims[1] % parts == 0:
                found.add(tuple(digest(block) for block in np.split(numpy_helper.to_array(weight), parts, axis=1)))
    return found


def align_packed_blocks(model: onnx.ModelProto, references: Collection[tuple[bytes, ...]]) -> int:
    """``Split(MatMul(x, W) [+ b])`` into equal pieces whose ``W`` holds the blocks of a reference in another
    order: ``W``'s (and ``b``'s) blocks and the ``Split``'s outputs are put in the reference's order (in
    place; the same values reach every reader). Returns the number of weights reordered."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    made = {output: node for node in graph.node for output in node.output}
    readers = reader_counts(graph)
    by_set = {frozenset(blocks): blocks for blocks in references}
    aligned = 0
    for split in graph.node:
        if split.op_type != "Split":
            continue
        add = made.get(split.input[0])
        matmul = made.get(add.input[0]) if add is not None and add.op_type == "Add" else add
        if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in initializers:
            continue
        parts = len(split.output)
        weight = numpy_helper.to_array(initializers[matmul.input[1]])
        if weight.ndim != 2 or weight.shape[1] % parts or (len(split.input) > 1 and len(set(
                numpy_helper.to_array(initializers[split.input[1]]).tolist())) != 1):
            continue
        blocks = [digest(block) for block in np.split(weight, parts, axis=1)]
        target = by_set.get(frozenset(blocks))
        if target is None or tuple(blocks) == target or len(set(blocks)) != parts:
            continue
        order = [blocks.index(block) for block in target]  # new block i = old block order[i]
        names = [matmul.input[1]] + ([add.input[1]] if add is not matmul else [])
        if any(name not in initializers or readers[name] != 1 for name in names):
            continue
        for name in names:
            pieces = np.split(numpy_helper.to_array(initializers[name]), parts, axis=-1)
            initializers[name].CopyFrom(numpy_helper.from_array(np.concatenate([pieces[i] for i in order], axis=-1),
                                                                name))
        split.output[:] = [split.output[i] for i in order]
        aligned += 1
    return aligned
