"""Graph edits that keep a tied embedding one tensor across a version's graphs, so that
:func:`nmt.model_format.weights.store_once` stores (and the server loads) it once.

A model whose output projection shares the embedding (Marian, OPUS-MT, this project's Transformer) is
traced as separate, equal tensors: the ``Gather`` tables of the encoder and the decoders, the step
decoders' ``Gemm(x, W, transB=1)`` weight, and the forced pass's ``MatMul(x, Wᵀ)`` with ``Wᵀ`` folded into
a new constant. :func:`gemm_weights` finds the projection weights; ``fold_embedding_scale`` leaves a table
equal to one of them unscaled (one ``Mul`` per step instead of a scaled copy of the vocabulary's
embedding), and :func:`transposed_projection_as_gemm` turns the forced pass's ``MatMul(x, Wᵀ)`` into
``Gemm(x, W, transB=1)`` over the same ``W``.
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
