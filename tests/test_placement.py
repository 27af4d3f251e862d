"""CUDA placement checked without a GPU: every graph each GPU precision writes, read against the CUDA kernel
table of the pinned ONNX Runtime (:mod:`server.engine.device`, ``server/engine/data/cuda_kernels_ort-1.31.toml``).

fp32 and fp16 are the precisions that run on CUDA; an int8 version is refused there at load
(``tests/test_gpu.py::test_an_int8_version_is_refused_on_cuda``: its ``MatMulInteger`` nodes have no CUDA
kernel), so it is not read here. ``tests/test_gpu.py`` checks the same prediction against ONNX Runtime's
profile where a CUDA session runs.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from common.model_format.manifest import read_manifest
from server.engine.device import Unplaced, load_kernel_table, nodes_without_cuda_kernel, shape_arithmetic
from server.engine.session_graphs import needs_portable_attention, session_graph

ROOT = Path(__file__).resolve().parent.parent
GRAPH_FILES = {"transformer": {"encoder.onnx", "decoder.onnx", "decoder_attention.onnx", "decoder_forced.onnx"},
               "bahdanau": {"encoder.onnx", "decoder.onnx", "decoder_attention.onnx"}}
GQA = "com.microsoft.GroupQueryAttention"


def unplaced_by_graph(version_dir: Path) -> dict[str, list[tuple[str, str]]]:
    """Graph file -> (op, node) of each node without a CUDA kernel, over every graph the manifest names."""
    files = set(read_manifest(version_dir).graphs.values())
    assert files == {path.name for path in version_dir.glob("*.onnx")}
    return {name: [(u.op, u.node) for u in nodes_without_cuda_kernel(onnx.load(version_dir / name))]
            for name in sorted(files)}


def test_the_table_stands_for_the_pinned_onnxruntime_gpu():
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"]["gpu"]
    table = load_kernel_table()
    assert gpu_extra == [f"onnxruntime-gpu=={table.version}"]
    assert table.source.startswith("https://github.com/microsoft/onnxruntime/blob/")


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_fp16_every_node_has_a_cuda_kernel(arch, fp16_models):
    assert read_manifest(fp16_models[arch]).precision == "fp16"
    assert unplaced_by_graph(fp16_models[arch]) == dict.fromkeys(sorted(GRAPH_FILES[arch]), [])
    for name in GRAPH_FILES[arch]:  # so CUDA sessions open the files as exported
        assert not needs_portable_attention(onnx.load(fp16_models[arch] / name, load_external_data=False))


def test_fp32_transformer_decoder_group_query_attention_has_no_cuda_kernel(tiny_models):
    """As exported, an fp32 version's decoder self-attention is GroupQueryAttention (the CPU's fastest form),
    which has no fp32 CUDA kernel (the CUDA kernel takes fp16/bf16 only: seen on an H200 with onnxruntime-gpu
    1.31.1, where every layer's self-attention ran on the CPU provider). Asserted exactly: the tiny model's
    2 layers, in the two step graphs; the forced decoder (MultiHeadAttention) and the encoder are placed."""
    unplaced = unplaced_by_graph(tiny_models["transformer"])
    layers = [(GQA, "self_attention_0"), (GQA, "self_attention_1")]
    assert unplaced == {"decoder.onnx": layers, "decoder_attention.onnx": layers, "decoder_forced.onnx": [],
                        "encoder.onnx": []}


def test_fp32_transformer_is_placed_once_its_self_attention_is_portable(tiny_models):
    """What an fp32 version's sessions open on CUDA (``Engine.load``'s default there): the step graphs with
    their self-attention in standard operators (:mod:`server.engine.session_graphs`). Every node of
    every graph then has a CUDA kernel."""
    version = tiny_models["transformer"]
    for name in sorted(GRAPH_FILES["transformer"]):
        graph = session_graph(version / name, ort.SessionOptions(), None, on_cuda=True)
        model = onnx.load(graph) if isinstance(graph, str) else onnx.load_from_string(graph)
        assert nodes_without_cuda_kernel(model) == [], name
        assert isinstance(graph, bytes) == (name in ("decoder.onnx", "decoder_attention.onnx"))


def test_fp32_bahdanau_every_node_has_a_cuda_kernel(tiny_models):
    assert unplaced_by_graph(tiny_models["bahdanau"]) == dict.fromkeys(sorted(GRAPH_FILES["bahdanau"]), [])


def _tiny_graph() -> onnx.ModelProto:
    """x [N, 4] float. Shape arithmetic: Shape -> Gather -> Cast int32 -> Clip (int32: no CUDA kernel) ->
    Cast int64 -> Concat, the new shape of a Reshape. On data: the same Clip on int32 data; a com.microsoft
    FusedMatMul (ONNX shape inference does not type its output) and a Not on that float output; Det (no
    CUDA kernel at all)."""
    const = helper.make_tensor
    initializers = [const("zero", TensorProto.INT64, [1], [0]), const("minus_one", TensorProto.INT64, [1], [-1]),
                    const("w", TensorProto.FLOAT, [4, 4], [0.0] * 16)]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["rows"], name="gather", axis=0),
        helper.make_node("Cast", ["rows"], ["rows32"], name="cast_int32", to=TensorProto.INT32),
        helper.make_node("Clip", ["rows32"], ["clipped32"], name="clip_shape"),
        helper.make_node("Cast", ["clipped32"], ["clipped"], name="cast_int64", to=TensorProto.INT64),
        helper.make_node("Concat", ["clipped", "minus_one"], ["new_shape"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "new_shape"], ["reshaped"], name="reshape"),
        helper.make_node("Cast", ["reshaped"], ["data32"], name="cast_data", to=TensorProto.INT32),
        helper.make_node("Clip", ["data32"], ["y"], name="clip_data"),
        helper.make_node("FusedMatMul", ["x", "w"], ["product"], name="fused_matmul", domain="com.microsoft"),
        helper.make_node("Not", ["product"], ["z"], name="not_float"),
        helper.make_node("Slice", ["x", "zero", "minus_one"], ["sliced"], name="slice"),
        helper.make_node("Det", ["w"], ["det"], name="det"),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None) for name in ("y", "z", "det", "sliced")],
        initializers)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_known_answer_on_a_hand_built_graph():
    model = _tiny_graph()
    assert shape_arithmetic(model) == {"shape", "gather", "cast_int32", "clip_shape", "cast_int64", "concat"}
    found = nodes_without_cuda_kernel(model)
    assert [(u.node, u.op) for u in found] == [("clip_data", "ai.onnx.Clip"), ("not_float", "ai.onnx.Not"),
                                               ("det", "ai.onnx.Det")]
    assert found[0] == Unplaced("clip_data", "ai.onnx.Clip", "input 0 (data32) is int32; the CUDA kernel's T takes "
                                "double, float, float16, int64, int8, uint64, uint8")
    assert found[1].reason.startswith("input 0 (product) is float;")  # typed through the com.microsoft node
    assert found[2].reason == "no CUDA kernel in the table"


def test_a_graph_opset_outside_the_tables_entry_is_reported():
    model = _tiny_graph()
    model.opset_import[0].version = 21  # Reshape's entry is [14, 18]
    reasons = {u.node: u.reason for u in nodes_without_cuda_kernel(model)}
    assert reasons["reshape"] == "the table's kernel covers opsets (14, 18), not 21"
