"""Graph edits that keep equal weights one tensor across a version's graphs, so that
:class:`common.model_format.weights.WeightStore` stores (and the server loads) each once.

A model whose output projection shares the embedding (Marian, OPUS-MT, this project's Transformer) is
traced as separate, equal tensors: the ``Gather`` tables of the encoder and the decoders and the decoders'
``Gemm(x, W, transB=1)`` weight (the forced pass projects its positions as rows of one 2-D product, so
that it reads ``W`` as stored, not a transposed copy). :func:`gemm_weights` finds the projection weights;
``fold_embedding_scale`` leaves a table equal to one of them unscaled (one ``Mul`` per step instead of a
scaled copy of the vocabulary's embedding).

The self-attention projections packed into one ``MatMul`` (:func:`export.graph_passes.pack_parallel_matmuls`)
come out in query, key, value order in the step graphs (their attention operator wants it) but in another
order in the forced pass; :func:`align_packed_blocks` puts the forced pass's blocks in the step graphs'
order (and its ``Split``'s outputs with them).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.graph_passes import digest, reader_counts


def gemm_weights(models: Iterable[onnx.ModelProto], base_dir: str | Path = "") -> set[bytes]:
    """Digests of the 2-D constant weights read by ``Gemm(x, W, transB=1)`` in ``models`` (external data
    under ``base_dir``)."""
    found = set()
    for model in models:
        initializers = {init.name: init for init in model.graph.initializer}
        for node in model.graph.node:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Gemm" and attributes.get("transB") == 1 and node.input[1] in initializers:
                weight = initializers[node.input[1]]
                if len(weight.dims) == 2:
                    found.add(digest(numpy_helper.to_array(weight, str(base_dir))))
    return found


def packed_blocks(models: Iterable[onnx.ModelProto], parts: int = 3, base_dir: str | Path = "",
                  ) -> set[tuple[bytes, ...]]:
    """The :func:`digest` of each column block of every 2-D ``MatMul`` weight of ``models`` whose columns split
    into ``parts`` equal blocks, block by block in stored order."""
    found = set()
    for model in models:
        initializers = {init.name: init for init in model.graph.initializer}
        for node in model.graph.node:
            weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
            if weight is not None and len(weight.dims) == 2 and weight.dims[1] % parts == 0:
                blocks = np.split(numpy_helper.to_array(weight, str(base_dir)), parts, axis=1)
                found.add(tuple(digest(block) for block in blocks))
    return found


def align_packed_blocks(model: onnx.ModelProto, references: Collection[tuple[bytes, ...]],
                        base_dir: str | Path = "") -> int:
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
        weight = numpy_helper.to_array(initializers[matmul.input[1]], str(base_dir))
        if weight.ndim != 2 or weight.shape[1] % parts or (len(split.input) > 1 and len(set(
                numpy_helper.to_array(initializers[split.input[1]], str(base_dir)).tolist())) != 1):
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
            pieces = np.split(numpy_helper.to_array(initializers[name], str(base_dir)), parts, axis=-1)
            initializers[name].CopyFrom(numpy_helper.from_array(np.concatenate([pieces[i] for i in order], axis=-1),
                                                                name))
        split.output[:] = [split.output[i] for i in order]
        aligned += 1
    return aligned
