"""The graphs a version's sessions open on each provider (:mod:`server.engine.session_graphs`): on the CPU every
``SkipLayerNormalization`` is split into ``Add`` + ``LayerNormalization`` and computes what the fused operator
computes; CUDA keeps the fused operator; a node whose statistics outputs are read stays as it is."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from server.engine import session_graphs
from server.engine.session_graphs import SKIP_LAYER_NORM, session_graph, split_skip_layer_norms

TOLERANCE = 1e-5


def _ops(graph: str | bytes) -> Counter[str]:
    model = onnx.load(graph) if isinstance(graph, str) else onnx.load_from_string(graph)
    return Counter(node.op_type for node in model.graph.node)


def _session(graph: str | bytes, options: ort.SessionOptions) -> ort.InferenceSession:
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", ["encoder.onnx", "decoder.onnx", "decoder_attention.onnx", "decoder_forced.onnx"])
def test_cpu_sessions_open_every_layer_norm_unfused(tiny_models, name):
    path = Path(tiny_models["transformer"]) / name
    fused = _ops(str(path))
    assert fused[SKIP_LAYER_NORM] > 0
    on_cpu = _ops(session_graph(path, ort.SessionOptions(), None, on_cuda=False))
    assert on_cpu[SKIP_LAYER_NORM] == 0
    assert on_cpu["LayerNormalization"] == fused["LayerNormalization"] + fused[SKIP_LAYER_NORM]
    on_cuda = session_graph(path, ort.SessionOptions(), None, on_cuda=True)
    assert _ops(on_cuda)[SKIP_LAYER_NORM] == fused[SKIP_LAYER_NORM]  # CUDA keeps the fused kernel


def test_the_split_encoder_and_forced_decoder_compute_what_the_fused_ones_do(tiny_models):
    """The exported files against the graphs the CPU's sessions open, on the same inputs."""
    version = Path(tiny_models["transformer"])
    src = np.random.default_rng(1).integers(4, 40, (3, 7)).astype(np.int64)
    src[2, 5:] = 0  # padding
    ids = np.random.default_rng(0).integers(4, 40, (3, 5)).astype(np.int64)

    def run(split: bool) -> list[np.ndarray]:
        def open_graph(name: str) -> ort.InferenceSession:
            options = ort.SessionOptions()
            graph = session_graph(version / name, options, None, on_cuda=False) if split else str(version / name)
            assert isinstance(graph, bytes) == split
            return _session(graph, options)

        encoder, forced = open_graph("encoder.onnx"), open_graph("decoder_forced.onnx")
        encoded = dict(zip((o.name for o in encoder.get_outputs()), encoder.run(None, {"src_ids": src}), strict=True))
        feeds = {i.name: encoded[i.name] for i in forced.get_inputs() if i.name in encoded}
        feeds.update(input_ids=ids, target_ids=np.roll(ids, -1, axis=1))
        return list(encoded.values()) + forced.run(None, feeds)

    fused_outputs, split_outputs = run(split=False), run(split=True)
    assert len(fused_outputs) == len(split_outputs) > 4
    for fused, split in zip(fused_outputs, split_outputs, strict=True):
        if fused.dtype.kind == "f":
            np.testing.assert_allclose(split, fused, atol=TOLERANCE)
        else:
            np.testing.assert_array_equal(split, fused)


def _graph(read_mean: bool) -> onnx.ModelProto:
    """x, skip [4, 8] -> SkipLayerNormalization (gamma, beta, bias) -> y; its input+skip+bias sum feeds a Mul
    (``twice``); with ``read_mean`` its mean output is a graph output as well."""
    d = 8
    weights = np.random.default_rng(2).standard_normal((3, d)).astype(np.float32)
    outputs = ["y", "mean" if read_mean else "", "", "sum"]
    nodes = [helper.make_node(SKIP_LAYER_NORM, ["x", "skip", "gamma", "beta", "bias"], outputs,
                              domain="com.microsoft", epsilon=1e-3),
             helper.make_node("Mul", ["sum", "two"], ["twice"])]
    results = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in ["y", "twice"] + (["mean"] if read_mean else [])]
    graph = helper.make_graph(
        nodes, "skip", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, d]) for n in ("x", "skip")], results,
        [numpy_helper.from_array(w, n) for w, n in zip(weights, ("gamma", "beta", "bias"), strict=True)]
        + [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_bias_beta_epsilon_and_the_sum_output_carry_over():
    model = _graph(read_mean=False)
    rng = np.random.default_rng(3)
    feeds = {name: rng.standard_normal((4, 8)).astype(np.float32) for name in ("x", "skip")}
    expected = _session(model.SerializeToString(), ort.SessionOptions()).run(None, feeds)
    assert split_skip_layer_norms(model) == 1
    assert [node.op_type for node in model.graph.node] == ["Add", "Add", "LayerNormalization", "Mul"]
    got = _session(model.SerializeToString(), ort.SessionOptions()).run(None, feeds)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(b, a, atol=TOLERANCE)


def test_a_node_whose_statistics_are_read_stays_fused():
    model = _graph(read_mean=True)
    assert split_skip_layer_norms(model) == 0
    assert [node.op_type for node in model.graph.node] == [SKIP_LAYER_NORM, "Mul"]


def test_a_graph_holding_its_weights_opens_as_it_is_above_the_limit(tiny_models, tmp_path, monkeypatch):
    """A version exported before ``weights.bin`` keeps its weights in each graph file: above the limit its CPU
    session opens the file rather than a rewritten copy that would hold every weight twice."""
    model = onnx.load(Path(tiny_models["transformer"]) / "encoder.onnx")  # the weights read into the graph
    embedded = tmp_path / "encoder.onnx"
    onnx.save(model, embedded)
    assert isinstance(session_graph(embedded, ort.SessionOptions(), None, on_cuda=False), bytes)  # a tiny model
    monkeypatch.setattr(session_graphs, "EMBEDDED_LIMIT", 0)
    assert session_graph(embedded, ort.SessionOptions(), None, on_cuda=False) == str(embedded)
