"""A model version's weights stored once (``weights.bin``) and held once by its sessions.

The tiny exported versions of both architectures are inspected as written; ONNX Runtime sessions sharing one
buffer are measured by their process's RSS on graphs large enough to see (16 MiB weights).
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from common.model_format.manifest import ManifestError, read_manifest, sha256_file
from common.model_format.weights import ALIGNMENT, MIN_BYTES, WEIGHTS_FILE, store_once, stored_tensors
from export.graph_passes import digest, fold_embedding_scale
from export.shared_tensors import align_packed_blocks, packed_blocks
from server.config import PREPACK
from server.engine.engine import Engine
from server.types import DecodingOptions

TEXTS = ["one two three", "four hundred and five"]


def _initializers(graph_path: Path) -> list[onnx.TensorProto]:
    return list(onnx.load(str(graph_path)).graph.initializer)  # external data read from weights.bin


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_a_version_stores_each_weight_once(tiny_models, arch):
    version = tiny_models[arch]
    graphs = list(read_manifest(version).graphs.values())
    contents: dict[bytes, int] = {}
    every = 0
    for filename in graphs:
        inline = onnx.load(str(version / filename), load_external_data=False).graph.initializer
        assert all(len(t.raw_data) < MIN_BYTES for t in inline if t.data_location != onnx.TensorProto.EXTERNAL)
        for tensor in _initializers(version / filename):
            values = numpy_helper.to_array(tensor)
            if values.nbytes >= MIN_BYTES:
                contents[digest(values)] = values.nbytes
                every += values.nbytes
    ranges = {(t.offset, t.length) for filename in graphs for t in stored_tensors(version / filename)}
    assert len(ranges) == len(contents)  # one range per distinct content, and no two ranges equal
    unique, stored = sum(contents.values()), (version / WEIGHTS_FILE).stat().st_size
    assert unique <= stored < unique + ALIGNMENT * len(ranges)
    assert unique < 0.6 * every  # the decoder's weights were in two or three graphs, the embedding in all
    roles = read_manifest(version).graphs
    if "decoder_forced" in roles:  # the forced pass reads the step decoder's tensors, none of its own
        used = {role: {(t.offset, t.length) for t in stored_tensors(version / roles[role])} for role in roles}
        assert used["decoder_forced"] <= used["decoder"]


def test_a_version_with_its_weights_inside_the_graphs_is_refused(tiny_models, tmp_path):
    """A version written with the weights inside each graph (before ``weights.bin``) is refused at load, the
    message saying how to export it again; the same version stored once serves, with pre-packing on and off."""
    old = tmp_path / "old"
    shutil.copytree(tiny_models["transformer"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    for filename in manifest["graphs"].values():
        onnx.save(onnx.load(str(old / filename)), str(old / filename))  # the weights back inside
        manifest["files"][filename] = sha256_file(old / filename)
    (old / WEIGHTS_FILE).unlink()
    del manifest["files"][WEIGHTS_FILE]
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2))
    with pytest.raises(ManifestError, match="weights inside each graph .*export the model again from its training"):
        Engine.load(old, provider="cpu")
    options = DecodingOptions(beam_size=4, return_attention=True)
    engines = [Engine.load(tiny_models["transformer"], provider="cpu", prepack=prepack) for prepack in PREPACK]
    results = [[(h.token_ids, round(h.score, 4)) for t in engine.translate(TEXTS, options) for h in t.hypotheses]
               for engine in engines]
    assert results[0] == results[1] == results[2]


def test_a_changed_weights_file_is_refused(tiny_models, tmp_path):
    version = tmp_path / "version"
    shutil.copytree(tiny_models["bahdanau"], version)
    with open(version / WEIGHTS_FILE, "r+b") as weights:
        weights.seek(100)
        byte = weights.read(1)
        weights.seek(100)
        weights.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ManifestError, match=WEIGHTS_FILE):
        Engine.load(version, provider="cpu")


WIDTH = 2048  # a 16 MiB float32 weight: far above the noise of a process's RSS

_SESSIONS = """
import sys
from pathlib import Path
import numpy as np
import onnxruntime as ort
from server.engine.shared_weights import SharedWeights

def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))

directory, shared, width = Path(sys.argv[1]), sys.argv[2] == "shared", int(sys.argv[3])
x = np.ones((4, width), dtype=np.float32)
before = rss()
weights, sessions = SharedWeights(directory) if shared else None, []
for name in ("a.onnx", "b.onnx", "c.onnx"):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")
    if shared:
        weights.add_to(options, directory / name)
    sessions.append(ort.InferenceSession(str(directory / name), options, providers=["CPUExecutionProvider"]))
    sessions[-1].run(None, {"x": x})
print(rss() - before)
"""


def _three_graphs(directory: Path) -> None:
    """Three graphs that multiply by the same 16 MiB weight, each with a small weight of its own."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    for i, name in enumerate(("a", "b", "c")):
        own = np.full((WIDTH,), float(i), dtype=np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "own"], ["y"])], name,
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, WIDTH])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, WIDTH])],
            [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(own, "own")])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                  str(directory / f"{name}.onnx"))


def test_sessions_given_the_shared_weights_hold_them_once(tmp_path):
    """Three sessions over one ``weights.bin`` grow the process by one copy of the weight (measured: 1.7x
    it, sessions included); the same three graphs each holding the weight grow it by at least three
    (measured: 5.9x, each session also keeps its graph's bytes)."""
    inline, shared = tmp_path / "inline", tmp_path / "shared"
    for directory in (inline, shared):
        directory.mkdir()
        _three_graphs(directory)
    store_once(shared, ["a.onnx", "b.onnx", "c.onnx"])
    weight_bytes = WIDTH * WIDTH * 4
    assert (shared / WEIGHTS_FILE).stat().st_size < 1.01 * weight_bytes + 3 * ALIGNMENT + 3 * WIDTH * 4
    growth = {}
    for name, directory in (("inline", inline), ("shared", shared)):
        run = subprocess.run([sys.executable, "-c", _SESSIONS, str(directory), name, str(WIDTH)], capture_output=True,
                             text=True, timeout=120, check=True)
        growth[name] = int(run.stdout.split()[-1])
    assert growth["shared"] < 2 * weight_bytes, growth  # one copy, plus the sessions' own few MiB
    assert growth["inline"] > growth["shared"] + 2 * weight_bytes, growth  # at least two copies more


def test_a_tied_embedding_table_is_not_stored_scaled():
    table = np.arange(12, dtype=np.float32).reshape(6, 2)

    def model() -> onnx.ModelProto:
        graph = helper.make_graph(
            [helper.make_node("Gather", ["table", "ids"], ["rows"]), helper.make_node("Mul", ["rows", "s"], ["y"])],
            "embed", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [None])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 2])],
            [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array(3.0, np.float32), "s")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    untied, tied = model(), model()
    assert fold_embedding_scale(untied) == 1
    np.testing.assert_array_equal(numpy_helper.to_array(untied.graph.initializer[0]), table * 3)
    assert fold_embedding_scale(tied, keep={digest(table)}) == 0
    assert [node.op_type for node in tied.graph.node] == ["Gather", "Mul"]


def test_packed_projection_blocks_follow_the_step_graphs_order():
    """A forced pass's ``Split(MatMul(x, [k|v|q]) + b)`` reordered to the step graph's ``[q|k|v]``: the same
    values reach each reader, and the weight is the step graph's tensor."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3))
    bq, bk, bv = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
    step = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "step",
                             [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 4])],
                             [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 9])],
                             [numpy_helper.from_array(np.concatenate([q, k, v], axis=1), "w")])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["pb"]),
             helper.make_node("Split", ["pb"], ["key", "value", "query"], axis=1, num_outputs=3)]
    nodes += [helper.make_node("Relu", [name], [f"{name}_out"]) for name in ("query", "key", "value")]
    forced = helper.make_model(helper.make_graph(
        nodes, "forced", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, [None, 3])
         for name in ("query", "key", "value")],
        [numpy_helper.from_array(np.concatenate([k, v, q], axis=1), "w"),
         numpy_helper.from_array(np.concatenate([bk, bv, bq]), "b")]), opset_imports=[helper.make_opsetid("", 18)],
        ir_version=8)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    before = ort.InferenceSession(forced.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    step_model = helper.make_model(step, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    assert align_packed_blocks(forced, packed_blocks([step_model])) == 1
    weights = {init.name: numpy_helper.to_array(init) for init in forced.graph.initializer}
    np.testing.assert_array_equal(weights["w"], np.concatenate([q, k, v], axis=1))
    after = ort.InferenceSession(forced.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new, old)
    assert align_packed_blocks(forced, packed_blocks([step_model])) == 0  # aligned already


def test_the_sessions_outlive_the_engine_that_loaded_them(tiny_models):
    """The mapped weights belong to the step model, which holds the sessions: an engine built around the step
    model of a dropped one (as tests and wrappers do) still reads valid memory."""
    first = Engine.load(tiny_models["transformer"], provider="cpu")
    expected = [t.hypotheses[0].token_ids for t in first.translate(TEXTS, DecodingOptions(beam_size=2))]
    model, manifest, tokenizer = first.model, first.manifest, first.tokenizer
    del first
    gc.collect()
    again = Engine(manifest, tokenizer, model, "CPUExecutionProvider")
    assert [t.hypotheses[0].token_ids for t in again.translate(TEXTS, DecodingOptions(beam_size=2))] == expected
