"""The step graphs computed on [rows, features] (:func:`export.flat_rows.flatten_rows`): the same outputs with
fewer nodes, the position axis kept only where an operator needs it."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from common.model_format.manifest import read_manifest
from export.flat_rows import flatten_rows

D, V = 8, 11


def step_like_graph() -> onnx.ModelProto:
    """A step graph's shape on [rows, 1, D]: embeddings of [rows] ids, a block whose query a 3-D-only reader
    (a ``Reshape``, standing for an attention operator) takes, a feed-forward block of 2-D ``Gemm`` between
    ``Squeeze`` and ``Unsqueeze``, layer norms, and the position picked for the output projection."""
    rng = np.random.default_rng(0)
    weights = {"table": (V, D), "w_q": (D, D), "w_o": (D, D), "w_1": (D, 2 * D), "w_2": (2 * D, D), "lm": (V, D)}
    initializers = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
                    for name, shape in weights.items()]
    initializers += [numpy_helper.from_array(value, name) for name, value in {
        "axis": np.array([1], dtype=np.int64), "zero": np.array(0, dtype=np.int64), "scale": np.array(2.0, np.float32),
        "gamma": np.ones(D, np.float32), "b_q": np.zeros(D, np.float32), "b_1": np.full(2 * D, 0.1, np.float32),
        "shape": np.array([0, 1, 2, D // 2], dtype=np.int64)}.items()]
    ms = "com.microsoft"
    nodes = [
        helper.make_node("Unsqueeze", ["ids", "axis"], ["ids3"]),
        helper.make_node("Gather", ["table", "ids3"], ["emb"]),
        helper.make_node("Mul", ["emb", "scale"], ["x0"]),
        helper.make_node("Squeeze", ["x0", "axis"], ["x0_rows"]),
        helper.make_node("Gemm", ["x0_rows", "w_q", "b_q"], ["q_rows"]),
        helper.make_node("Unsqueeze", ["q_rows", "axis"], ["q"]),
        helper.make_node("Reshape", ["q", "shape"], ["q4"]),  # the attention operator's stand-in: 3-D only
        helper.make_node("Reshape", ["q4", "back"], ["attended"]),
        helper.make_node("MatMul", ["attended", "w_o"], ["o"]),
        helper.make_node("SkipLayerNormalization", ["o", "x0", "gamma"], ["x1"], domain=ms),
        helper.make_node("Squeeze", ["x1", "axis"], ["x1_rows"]),
        helper.make_node("Gemm", ["x1_rows", "w_1", "b_1"], ["h_rows"]),
        helper.make_node("Unsqueeze", ["h_rows", "axis"], ["h"]),
        helper.make_node("Sigmoid", ["h"], ["gate"]),
        helper.make_node("Mul", ["h", "gate"], ["silu"]),
        helper.make_node("MatMul", ["silu", "w_2"], ["f"]),
        helper.make_node("SkipLayerNormalization", ["f", "x1", "gamma"], ["x2"], domain=ms),
        helper.make_node("Gather", ["x2", "zero"], ["last"], axis=1),
        helper.make_node("Gemm", ["last", "lm"], ["logits"], transB=1),
    ]
    initializers.append(numpy_helper.from_array(np.array([0, 1, D], dtype=np.int64), "back"))
    graph = helper.make_graph(nodes, "step", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", V]),
                               helper.make_tensor_value_info("x1", TensorProto.FLOAT, ["rows", 1, D])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ms, 1)])


def run(model: onnx.ModelProto, ids: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": ids})


def test_the_flat_graph_computes_the_same_with_fewer_nodes():
    model = step_like_graph()
    ids = np.array([3, 7, 0, 10], dtype=np.int64)
    expected = run(model, ids)
    flat = onnx.ModelProto.FromString(model.SerializeToString())
    removed = flatten_rows(flat)
    onnx.checker.check_model(flat)
    for ours, theirs in zip(run(flat, ids), expected, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    ops = collections.Counter(node.op_type for node in flat.graph.node)
    # gone: the ids' Unsqueeze, both Squeezes before the Gemms, the feed-forward Unsqueeze and the position
    # Gather; added: a Squeeze after the 3-D block, and an Unsqueeze that gives the graph output its shape
    assert removed == len(model.graph.node) - len(flat.graph.node) == 3
    assert ops["Squeeze"] == 1 and ops["Unsqueeze"] == 2 and ops["Gather"] == 1
    assert [o.name for o in flat.graph.output] == ["logits", "x1"]


def test_an_exported_step_graph_keeps_the_position_axis_only_around_attention(tiny_models):
    """Per decoder layer: an ``Unsqueeze`` before and a ``Squeeze`` after each attention operator, nothing in
    the feed-forward block; the manifest records the nodes as traced and as written."""
    version = Path(tiny_models["transformer"])
    manifest = read_manifest(version)
    decoder = onnx.load(str(version / manifest.graphs["decoder"]), load_external_data=False)
    ops = collections.Counter(node.op_type for node in decoder.graph.node)
    layers = ops["GroupQueryAttention"]
    assert layers and ops["MultiHeadAttention"] == layers
    assert ops["Unsqueeze"] == ops["Squeeze"] == 2 * layers
    assert manifest.node_counts["decoder"]["written"] < manifest.node_counts["decoder"]["traced"]
