"""ONNX export: fused graphs, parity with PyTorch, the manifest and the model repository rules.

Session fixtures train two tiny models (Transformer, Bahdanau) for a few seconds on generated
number words, save them as training runs (best.pt, spm.model, summary.json, test.tsv) and export
each once; the tests then inspect those model versions.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from common.errors import NmtError
from common.model_format.layout import GRAPH_FILES, MANIFEST_FILE, OPTIONAL_GRAPH_FILES, next_version
from common.model_format.manifest import LOGITS_OUTPUT, ManifestError, read_manifest, sha256_file
from common.model_format.tokenizer import EOS_ID, PAD_ID, Tokenizer
from common.model_format.weights import WEIGHTS_FILE, stored_tensors
from export.fp16_casts import fold_casts
from export.graph_passes import fuse_silu, one_position_gemms, pack_parallel_matmuls, undo_one_position_gemms
from export.graphs import GraphSet
from export.options import LOGIT_TOLERANCE, ExportOptions
from export.pipeline import export_model
from export.quantize import FP32_OPS, convert_fp16
from export.registry import EXPORTERS, graph_exporter
from export.sources import load_inputs
from export.verify import check_parity, engine_step_log_probs, engine_translate_ids, torch_reference
from nmt.cli import main as nmt_main
from server.engine.engine import Engine
from server.types import DecodingOptions, SentenceRequest, TargetPrefix
from training.models.checkpoint import load_checkpoint, save_checkpoint
from training.search import translate_ids

PARITY_SENTENCES = 8


def held_out_ids(run_dir, count=PARITY_SENTENCES):
    tokenizer = Tokenizer.load(run_dir)
    lines = (run_dir / "test.tsv").read_text(encoding="utf-8").splitlines()[:count]
    sources = [tokenizer.encode(line.split("\t")[0]) + [EOS_ID] for line in lines]
    targets = [tokenizer.encode(line.split("\t")[1]) for line in lines]
    return sources, targets


def sessions(version_dir):
    return {role: ort.InferenceSession(str(version_dir / name), providers=["CPUExecutionProvider"])
            for role, name in GRAPH_FILES.items()}


def run_graph(session, feeds):
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


# ------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_export_matches_pytorch(arch, tiny_runs, tiny_models):
    """Re-check the written version: logits and attention within 1e-4, identical greedy and beam-4 output."""
    model, _ = load_checkpoint(tiny_runs[arch] / "best.pt")
    manifest = read_manifest(tiny_models[arch])
    engine = Engine.load(tiny_models[arch], provider="cpu")
    sources, targets = held_out_ids(tiny_runs[arch])
    with torch_reference(model, sources, targets) as reference:
        report = check_parity(reference, engine)
    assert report.max_logit_diff <= LOGIT_TOLERANCE and report.max_attention_diff <= LOGIT_TOLERANCE
    assert report.greedy_match == (len(sources), len(sources))
    assert report.beam4_match == (len(sources), len(sources))
    assert report.teacher_forced_steps > len(sources)
    for source in sources[:3]:  # the whole hypothesis, attention included
        reference = translate_ids(model, source, beam_size=4, num_hypotheses=2, need_attention=True)
        candidate = engine_translate_ids(engine, source, beam_size=4, num_hypotheses=2, need_attention=True)
        assert [h.tokens for h in candidate] == [h.tokens for h in reference]
        for ours, theirs in zip(candidate, reference, strict=True):
            assert ours.score == pytest.approx(theirs.score, abs=1e-4)
            torch.testing.assert_close(torch.from_numpy(ours.attention), theirs.attention, atol=1e-4, rtol=0)
    assert manifest.parity["greedy_match"] == f"{PARITY_SENTENCES}/{PARITY_SENTENCES}"
    assert manifest.parity["beam4_match"] == f"{PARITY_SENTENCES}/{PARITY_SENTENCES}"
    assert manifest.parity["max_logit_diff"] <= LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_one_step_by_hand(arch, tiny_runs, tiny_models):
    """The graph contract with raw numpy feeds, as the serving engine drives it (batch with padding)."""
    model, _ = load_checkpoint(tiny_runs[arch] / "best.pt")
    manifest = read_manifest(tiny_models[arch])
    graphs = sessions(tiny_models[arch])
    src = np.array([[5, 6, 7, 8, EOS_ID], [9, 10, EOS_ID, PAD_ID, PAD_ID]], dtype=np.int64)
    encoded = run_graph(graphs["encoder"], {"src_ids": src})
    feeds = {name: encoded[name] for name in manifest.decoder_static}
    for entry in manifest.decoder_state:
        if entry.init == "encoder":
            feeds[entry.input] = encoded[entry.input]
            continue
        shape = [2, *entry.shape]
        if entry.init == "buffer":  # the in-place cache: a buffer of capacity 5, rows at their positions
            shape[entry.capacity_axis] = 5
        feeds[entry.input] = np.zeros(shape, dtype=entry.dtype)
    with torch.no_grad():
        state = model.init_state(model.encode(torch.from_numpy(src)))
        for step, token in enumerate((manifest.special_ids["decoder_start"], 11, 12)):
            tokens = np.array([token, token], dtype=np.int64)
            if manifest.decoder_positions:
                feeds[manifest.decoder_positions] = np.array([step, step])
            logits, attention, state = model.decode_step(torch.from_numpy(tokens), state, need_attention=True)
            out = run_graph(graphs["decoder_attention"], {"input_ids": tokens, **feeds})
            plain = run_graph(graphs["decoder"], {"input_ids": tokens, **feeds})
            assert "attention" not in plain
            np.testing.assert_allclose(out["log_probs"], logits.log_softmax(-1).numpy(), atol=1e-4, rtol=0)
            np.testing.assert_allclose(plain["log_probs"], out["log_probs"], atol=1e-6, rtol=0)
            np.testing.assert_allclose(out["attention"], attention.numpy(), atol=1e-4, rtol=0)
            np.testing.assert_allclose(out["attention"].sum(-1), 1.0, atol=1e-5)
            assert (out["attention"][1, 3:] == 0).all(), "padding gets exactly zero attention"
            for entry in manifest.decoder_state:
                feeds[entry.input] = out[entry.output]
    if arch == "transformer":  # [batch, heads, capacity, head_dim]: 3 steps written, the rest untouched
        assert feeds["past_key_0"].shape == (2, 4, 5, 8)
        torch.testing.assert_close(torch.from_numpy(feeds["past_key_0"][:, :, :3]), state["self_key.0"])
        assert (feeds["past_key_0"][:, :, 3:] == 0).all()


def test_attention_rows_sum_to_one(tiny_runs, tiny_models):
    for arch, version_dir in tiny_models.items():
        manifest = read_manifest(version_dir)
        engine = Engine.load(version_dir, provider="cpu")
        sources, _ = held_out_ids(tiny_runs[arch])
        src = np.full((len(sources), max(map(len, sources))), PAD_ID, dtype=np.int64)
        for i, row in enumerate(sources):
            src[i, : len(row)] = row
        encoded = engine.model.encode(src)
        static = {name: encoded[name] for name in engine.model.static_names}
        state = {name: encoded[name] for name in engine.model.state_names}
        tokens = np.full(len(sources), manifest.special_ids["decoder_start"], dtype=np.int64)
        for _ in range(4):
            log_probs, attention, state = engine_step_log_probs(engine, tokens, static, state, need_attention=True)
            attention = torch.from_numpy(attention)
            torch.testing.assert_close(attention.sum(-1), torch.ones(len(sources)), atol=1e-5, rtol=0)
            assert (attention[torch.from_numpy(src == PAD_ID)] == 0).all()
            tokens = log_probs.argmax(-1)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_alignment_attention_matches_pytorch_on_a_padded_mixed_length_batch(arch, tiny_runs, tiny_models):
    """The served attention (standard operators, no provider-specific optional output) equals PyTorch's
    within 1e-4 at every real position of a padded batch of different lengths, step after step."""
    model, _ = load_checkpoint(tiny_runs[arch] / "best.pt")
    engine = Engine.load(tiny_models[arch], provider="cpu")
    if arch == "transformer":  # no MultiHeadAttention node is asked for its optional qk output
        graph = onnx.load(str(tiny_models[arch] / engine.manifest.graphs["decoder_attention"])).graph
        assert all(len(node.output) <= 3 for node in graph.node if node.op_type == "MultiHeadAttention")
    sources, _ = held_out_ids(tiny_runs[arch])
    src = np.full((len(sources), max(map(len, sources))), PAD_ID, dtype=np.int64)
    for i, row in enumerate(sources):
        src[i, : len(row)] = row
    assert len(set(map(len, sources))) > 2, "the batch mixes lengths"
    encoded = engine.model.encode(src)
    static = {name: encoded[name] for name in engine.model.static_names}
    state = {name: encoded[name] for name in engine.model.state_names}
    tokens = np.full(len(sources), engine.start_id, dtype=np.int64)
    real = torch.from_numpy(src != PAD_ID)
    with torch.no_grad():
        torch_state = model.init_state(model.encode(torch.from_numpy(src)))
        for _ in range(5):
            _, expected, torch_state = model.decode_step(torch.from_numpy(tokens), torch_state, need_attention=True)
            log_probs, attention, state = engine_step_log_probs(engine, tokens, static, state, need_attention=True)
            attention = torch.from_numpy(attention)
            torch.testing.assert_close(attention[real], expected[real], atol=1e-4, rtol=0)
            assert (attention[~real] == 0).all()
            tokens = log_probs.argmax(-1)


# ------------------------------------------------------------------------------------------ fused graphs


def test_transformer_attention_is_fused(tiny_runs, tiny_models):
    manifest = read_manifest(tiny_models["transformer"])
    cfg = manifest.dimensions
    total = cfg["encoder_layers"] + 2 * cfg["decoder_layers"]
    assert manifest.attention_blocks == {"fused": total, "total": total}
    mha, gqa = "com.microsoft.MultiHeadAttention", "com.microsoft.GroupQueryAttention"
    assert manifest.fused_ops["encoder"][mha] == cfg["encoder_layers"]
    for role in ("decoder", "decoder_attention"):  # cross-attention, and self-attention over the in-place cache
        assert manifest.fused_ops[role][mha] == manifest.fused_ops[role][gqa] == cfg["decoder_layers"]
    assert manifest.fused_ops["decoder"]["com.microsoft.SkipLayerNormalization"] >= 2 * cfg["decoder_layers"]
    for role, name in GRAPH_FILES.items():
        graph = onnx.load(str(tiny_models["transformer"] / name)).graph
        ops = [node.op_type for node in graph.node]
        assert ops.count("MultiHeadAttention") == manifest.fused_ops[role][mha]
        assert "Softmax" not in ops or role == "decoder_attention", f"unfused attention left in {role}"
        for node in graph.node:  # encoder and cross-attention get the padding as key_padding_mask, not a bias
            if node.op_type == "MultiHeadAttention" and len(node.input) <= 6:
                assert node.input[4] == "src_mask" and node.input[5:6] in ([], [""]), (role, list(node.input))
        assert "Where" not in ops or role == "decoder_attention"
        if role != "encoder":
            for node in graph.node:  # cross K/V go to the fused op 4-D, straight from the graph inputs
                if node.op_type == "MultiHeadAttention" and node.input[1].startswith("cross_key_"):
                    assert node.input[2].startswith("cross_value_")
            consumers = {i for node in graph.node if node.op_type != "MultiHeadAttention" for i in node.input}
            alignment = {f"cross_key_{cfg['alignment_layer'] % cfg['decoder_layers']}"} \
                if role == "decoder_attention" else set()  # read once, untransposed, by the alignment MatMul
            assert {name for name in consumers if name.startswith("cross_")} == alignment, "per-step copy of K/V"
            for node in graph.node:  # self-attention reads and writes the cache buffers as graph I/O (no copy)
                if node.op_type == "GroupQueryAttention":
                    layer = node.input[3].rsplit("_", 1)[1]
                    assert list(node.input[3:5]) == [f"past_key_{layer}", f"past_value_{layer}"]
                    assert list(node.output[1:]) == [f"present_key_{layer}", f"present_value_{layer}"]


def test_projections_of_one_input_are_packed(tiny_models):
    """Self-attention Q/K/V read one input and run as one MatMul; so do the encoder's cross K/V of
    every decoder layer."""
    manifest = read_manifest(tiny_models["transformer"])
    layers = manifest.dimensions["decoder_layers"]
    for role in ("encoder", "decoder"):
        graph = onnx.load(str(tiny_models["transformer"] / GRAPH_FILES[role])).graph
        sources = [node.input[0] for node in graph.node if node.op_type == "MatMul"]
        assert len(sources) == len(set(sources)), f"{role}: MatMuls reading the same input are not packed"
    decoder = onnx.load(str(tiny_models["transformer"] / GRAPH_FILES["decoder"])).graph
    made = {output: node for node in decoder.node for output in node.output}
    attention = [node for node in decoder.node if node.op_type == "GroupQueryAttention"]
    assert len(attention) == layers
    for node in attention:  # the packed projection (+ its bias) is the operator's packed QKV input: no Split
        assert made[node.input[0]].op_type in {"MatMul", "Add", "Unsqueeze"} and node.input[1:3] == ["", ""]
    assert not any(node.op_type == "Split" for node in decoder.node)


def test_output_bias_is_folded_and_the_tied_embedding_is_one_tensor(tiny_models):
    """The decoder step's output layer adds its bias inside the Gemm; its weight is the embedding table
    itself (the Transformer ties them), so the table is not stored scaled: the Gather reads the Gemm's
    range of weights.bin and a Mul scales the rows it picks (parity is checked by the export)."""
    version = tiny_models["transformer"]
    decoder = onnx.load(str(version / GRAPH_FILES["decoder"]), load_external_data=False).graph
    made = {output: node for node in decoder.node for output in node.output}
    gemm = made[LOGITS_OUTPUT]
    assert gemm.op_type == "Gemm" and len(gemm.input) == 3
    offsets = {tensor.name: tensor.offset for tensor in stored_tensors(version / GRAPH_FILES["decoder"])}
    gathers = [made[name] for node in decoder.node if node.op_type == "Mul" for name in node.input
               if name in made and made[name].op_type == "Gather" and made[name].input[0] in offsets]
    assert [offsets[gather.input[0]] for gather in gathers] == [offsets[gemm.input[1]]]  # one scaled table: W


def test_step_projections_add_their_bias_inside_a_gemm(tiny_models):
    """In the Transformer's step decoders no bias Add follows a MatMul of constant weights: each biased
    projection is a Gemm over the squeezed [rows, K] input (parity is checked by the export)."""
    for role in ("decoder", "decoder_attention"):
        graph = onnx.load(str(tiny_models["transformer"] / GRAPH_FILES[role])).graph
        initializers = {init.name for init in graph.initializer}
        made = {output: node for node in graph.node for output in node.output}
        for node in graph.node:
            if node.op_type == "Add":
                assert not any(made.get(name) is not None and made[name].op_type == "MatMul"
                               and made[name].input[1] in initializers for name in node.input), node.name
        assert sum(node.op_type == "Gemm" for node in graph.node) > 1


def test_one_position_gemms_keep_the_values():
    """x [rows, 1, 3]: a biased projection (rewritten) and an unbiased one (left alone) give what they gave."""
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), name) for name in "wv"]
    inits.append(onnx.numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"))
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["p"]), onnx.helper.make_node("Add", ["b", "p"], ["y"]),
             onnx.helper.make_node("MatMul", ["x", "v"], ["z"])]
    outputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in "yz"]
    graph = onnx.helper.make_graph(nodes, "step", [onnx.helper.make_tensor_value_info(
        "x", onnx.TensorProto.FLOAT, ["rows", 1, 3])], outputs, inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=10)
    x = rng.standard_normal((5, 1, 3)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert one_position_gemms(model) == 1
    assert [node.op_type for node in model.graph.node] == ["Squeeze", "Gemm", "Unsqueeze", "MatMul"]
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert undo_one_position_gemms(model) == 1  # as int8 quantization wants it
    assert [node.op_type for node in model.graph.node] == ["MatMul", "Add", "MatMul"]
    undone = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for old, new, back in zip(before, after, undone, strict=True):
        assert new.shape == old.shape
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(back, old)


def _scoring_tail(path: Path) -> None:
    """A step graph's tail in fp32, saved to ``path``: h [rows, 8] -> logits; log-probabilities (LogSoftmax),
    their top 3 (TopK) and EOS's (Gather), each a graph output."""
    helper, T = onnx.helper, onnx.TensorProto
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32) * 3, "w"),
             onnx.numpy_helper.from_array(np.array([3], dtype=np.int64), "k"),
             onnx.numpy_helper.from_array(np.array(2, dtype=np.int64), "eos")]
    nodes = [helper.make_node("MatMul", ["h", "w"], ["logits"]),
             helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
             helper.make_node("TopK", ["log_probs", "k"], ["top_log_probs", "top_ids"]),
             helper.make_node("Gather", ["log_probs", "eos"], ["eos_log_prob"], axis=1)]
    outputs = [helper.make_tensor_value_info(name, T.FLOAT, None)
               for name in ("logits", "log_probs", "top_log_probs", "eos_log_prob")]
    outputs.append(helper.make_tensor_value_info("top_ids", T.INT64, None))
    graph = helper.make_graph(nodes, "tail", [helper.make_tensor_value_info("h", T.FLOAT, ["rows", 8])], outputs,
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))


def test_fp16_conversion_keeps_the_scores_in_fp32_without_round_trips(tmp_path):
    """The converter left the fp32 LogSoftmax and TopK outputs going through fp16 and back (two kernels, and
    scores rounded to 11 bits); folded, the scores are the fp32 operators' own, and no cast is repeated."""
    _scoring_tail(tmp_path / "fp32.onnx")
    convert_fp16(tmp_path / "fp32.onnx", tmp_path / "fp16.onnx")
    graph = onnx.load(str(tmp_path / "fp16.onnx")).graph
    casts = [node for node in graph.node if node.op_type == "Cast"]
    assert len(casts) == 2, [(node.input[0], node.output[0]) for node in casts]  # h to fp16, the logits back
    assert not {node.input[0] for node in casts} & {node.output[0] for node in casts}, "a cast of a cast"
    h = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "fp16.onnx"), providers=["CPUExecutionProvider"])
    logits, log_probs, top, eos, ids = session.run(
        ["logits", "log_probs", "top_log_probs", "eos_log_prob", "top_ids"], {"h": h})
    exact = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(log_probs, exact, rtol=0, atol=1e-5)  # fp16 rounding would be ~1e-3 off
    np.testing.assert_array_equal(top, np.take_along_axis(log_probs, ids, axis=1))
    np.testing.assert_array_equal(eos, log_probs[:, 2])


def _cast_to_fp32(graph: onnx.GraphProto, name: str) -> bool:
    """Whether ``name`` is made in fp32: by a Cast to fp32, or by an fp32 operator reading such a value."""
    node = next((node for node in graph.node if name in node.output), None)
    if node is None or node.op_type not in ("Cast", *FP32_OPS):
        return False
    if node.op_type == "Cast":
        return next(a.i for a in node.attribute if a.name == "to") == onnx.TensorProto.FLOAT
    return _cast_to_fp32(graph, node.input[0])


def test_fold_casts_leaves_a_value_of_unknown_type_alone():
    """``x`` comes from a graph input in fp16: a Cast to fp16 and back is not a round trip of an fp32 value."""
    helper, T = onnx.helper, onnx.TensorProto
    nodes = [helper.make_node("Softmax", ["x"], ["p"]), helper.make_node("Cast", ["p"], ["p16"], to=T.FLOAT16),
             helper.make_node("Cast", ["p16"], ["y"], to=T.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT16, [2, 3])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    assert fold_casts(model, FP32_OPS) == 0
    assert [node.op_type for node in model.graph.node] == ["Softmax", "Cast", "Cast"]


def test_silu_becomes_one_quick_gelu_with_the_same_values():
    """x * sigmoid(x), written either way round, becomes QuickGelu(alpha=1); a Sigmoid read elsewhere too stays."""
    helper, T = onnx.helper, onnx.TensorProto
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["a"]),
             helper.make_node("Sigmoid", ["a"], ["t"]), helper.make_node("Mul", ["t", "a"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["u"]), helper.make_node("Mul", ["b", "u"], ["c"])]
    outputs = [helper.make_tensor_value_info(name, T.FLOAT, None) for name in ("c", "u")]
    graph = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("x", T.FLOAT, [4, 6])], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32) * 4
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert fuse_silu(model) == 2  # the third Sigmoid is a graph output as well
    assert [node.op_type for node in model.graph.node] == ["QuickGelu", "QuickGelu", "Sigmoid", "Mul"]
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for old, new in zip(before, after, strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-6)


def _projection_graph(with_bias: list[bool]) -> onnx.ModelProto:
    """x [batch, 3] -> one MatMul (+ optional bias Add) per entry of ``with_bias``, plus an unrelated MatMul."""
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    for i, bias in enumerate(with_bias):
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal((3, i + 2)).astype(np.float32), f"w{i}"))
        nodes.append(onnx.helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]))
        name = f"p{i}"
        if bias:
            inits.append(onnx.numpy_helper.from_array(rng.standard_normal(i + 2).astype(np.float32), f"b{i}"))
            nodes.append(onnx.helper.make_node("Add", [f"b{i}", f"p{i}"], [f"y{i}"]))  # bias first: either side
            name = f"y{i}"
        nodes.append(onnx.helper.make_node("Relu", [name], [f"out{i}"]))
        outputs.append(onnx.helper.make_tensor_value_info(f"out{i}", onnx.TensorProto.FLOAT, None))
    inits.append(onnx.numpy_helper.from_array(rng.standard_normal((2, 2)).astype(np.float32), "w_other"))
    nodes.append(onnx.helper.make_node("MatMul", ["out0", "w_other"], ["other"]))
    outputs.append(onnx.helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, None))
    graph = onnx.helper.make_graph(nodes, "projections", [onnx.helper.make_tensor_value_info(
        "x", onnx.TensorProto.FLOAT, ["batch", 3])], outputs, inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("with_bias", [[True, True, True], [False, False]])
def test_pack_parallel_matmuls_keeps_every_output(with_bias):
    model = _projection_graph(with_bias)
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert pack_parallel_matmuls(model) == len(with_bias) - 1
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Split") == 1 and ops.count("Add") == int(with_bias[0])
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for old, new in zip(before, after, strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-6)


def test_pack_parallel_matmuls_leaves_mixed_bias_groups_alone():
    model = _projection_graph([True, False])
    assert pack_parallel_matmuls(model) == 0
    assert [node.op_type for node in model.graph.node].count("MatMul") == 3


def test_unfused_attention_is_refused(tiny_runs, tiny_repository, monkeypatch):
    real = graph_exporter("transformer")

    def partly_fused(model, opset, store=None):
        graphs = GraphSet(onnx.ModelProto(), onnx.ModelProto(), onnx.ModelProto(), [], [], {},
                          attention_total=6, attention_fused=5)
        return graphs

    monkeypatch.setitem(EXPORTERS, "transformer", partly_fused)  # in this process: the stages run here
    with pytest.raises(NmtError, match="5 of 6 attention blocks"):
        export_model(ExportOptions(checkpoint=str(tiny_runs["transformer"]), name="unfused",
                                   model_repository=str(tiny_repository), progress=False, stage_processes=False))
    assert not (tiny_repository / "unfused").exists(), "a failed export leaves nothing behind"
    assert real is not partly_fused


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_the_manifest_records_each_graphs_node_count(tiny_models, arch):
    manifest = read_manifest(tiny_models[arch])
    assert set(manifest.node_counts) == set(manifest.graphs)
    for role, name in manifest.graphs.items():
        graph = onnx.load(str(tiny_models[arch] / name), load_external_data=False).graph
        assert manifest.node_counts[role]["written"] == len(graph.node)
        assert manifest.node_counts[role]["traced"] > 0


def test_bahdanau_uses_gru_nodes(tiny_models):
    manifest = read_manifest(tiny_models["bahdanau"])
    assert manifest.fused_ops["encoder"]["GRU"] == 2
    assert manifest.fused_ops["decoder"]["GRU"] == 1
    for name in GRAPH_FILES.values():
        graph = onnx.load(str(tiny_models["bahdanau"] / name)).graph
        ops = {node.op_type for node in graph.node}
        assert not ops & {"Loop", "Scan", "If"}
        if name != "encoder.onnx":
            assert "MatMul" in ops and "Tanh" in ops and "Softmax" in ops  # only W s, tanh, v, softmax, context
            assert not ops & {"GatherElements", "Range"}, "encoder-side work leaked into the step"


# --------------------------------------------------------------------------------------------- manifest


def test_manifest_contents(tiny_runs, tiny_models):
    manifest = read_manifest(tiny_models["transformer"])
    tokenizer = Tokenizer.load(tiny_runs["transformer"])
    assert manifest.format == "nmt-model/2" and manifest.name == "tiny-transformer" and manifest.version == "1"
    assert manifest.architecture == "transformer" and manifest.precision == "fp32"
    assert (manifest.source_language, manifest.target_language) == ("en", "de")
    assert manifest.vocab_size == tokenizer.vocab_size == manifest.dimensions["vocab_size"]
    assert manifest.special_ids == {"pad": 0, "unk": 1, "bos": 2, "eos": 3, "decoder_start": 2}
    assert manifest.opset == 18 and manifest.onnxruntime_version == ort.__version__
    assert manifest.graphs == {**GRAPH_FILES, **OPTIONAL_GRAPH_FILES}  # the Transformer has a forced pass
    assert manifest.decoder_static == ["src_mask", "cross_key_0", "cross_value_0", "cross_key_1", "cross_value_1"]
    state = {entry.input: entry for entry in manifest.decoder_state}
    assert list(state) == ["past_key_0", "past_value_0", "past_key_1", "past_value_1"]
    assert state["past_key_1"].output == "present_key_1"
    assert (state["past_key_1"].init, state["past_key_1"].shape, state["past_key_1"].dtype) == (
        "buffer", [4, 0, 8], "float32")
    assert state["past_key_1"].capacity_axis == 2 and manifest.decoder_positions == "positions"
    assert manifest.static_src_axes["src_mask"] == 1 and manifest.static_src_axes["cross_key_0"] == 2
    assert manifest.training == {"corpus": "numbers", "valid_bleu": 50.0, "test_bleu": 40.0, "steps": 150,
                                 "checkpoint_step": 150}
    assert manifest.quantization is None
    assert manifest.defaults == {"beam_size": 4, "length_penalty": 1.0, "max_length": 256}
    assert set(manifest.files) == {*GRAPH_FILES.values(), *OPTIONAL_GRAPH_FILES.values(), WEIGHTS_FILE, "spm.model"}
    assert manifest.parity["max_forced_diff"] <= manifest.parity["tolerance"]
    exported_tokenizer = (tiny_models["transformer"] / "spm.model").read_bytes()
    assert exported_tokenizer == (tiny_runs["transformer"] / "spm.model").read_bytes()
    raw = json.loads((tiny_models["transformer"] / MANIFEST_FILE).read_text())
    assert raw["decoder_state"][0] == {"input": "past_key_0", "output": "present_key_0", "init": "buffer",
                                      "shape": [4, 0, 8], "dtype": "float32", "capacity_axis": 2}

    bahdanau = read_manifest(tiny_models["bahdanau"])
    assert bahdanau.decoder_static == ["memory", "keys", "src_mask"]
    assert [(e.input, e.output, e.init) for e in bahdanau.decoder_state] == [
        ("hidden", "hidden_out", "encoder"), ("context", "context_out", "encoder")]
    encoder = ort.InferenceSession(str(tiny_models["bahdanau"] / "encoder.onnx"), providers=["CPUExecutionProvider"])
    assert {o.name for o in encoder.get_outputs()} == {"memory", "keys", "src_mask", "hidden", "context"}
    assert [i.name for i in encoder.get_inputs()] == ["src_ids"]


def test_tampered_files_are_rejected(tiny_models, tmp_path):
    copy = tmp_path / "1"
    shutil.copytree(tiny_models["bahdanau"], copy)
    read_manifest(copy)
    with open(copy / "decoder.onnx", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ManifestError, match="decoder.onnx does not match its sha256"):
        read_manifest(copy)
    (copy / "decoder.onnx").unlink()
    with pytest.raises(ManifestError, match="decoder.onnx is listed .* but missing"):
        read_manifest(copy)
    data = json.loads((copy / MANIFEST_FILE).read_text())
    del data["decoder_state"]
    (copy / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="missing required fields: decoder_state"):
        read_manifest(copy, verify=False)
    (copy / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="cannot read"):
        read_manifest(copy)
    with pytest.raises(ManifestError, match="not a model version"):
        read_manifest(tmp_path)


# ----------------------------------------------------------------------------------- repository rules


def test_refuses_to_overwrite_and_numbers_versions(tiny_runs, tiny_models, tiny_repository, capsys):
    before = (tiny_models["transformer"] / MANIFEST_FILE).read_bytes()
    with pytest.raises(NmtError, match="already exists; use --force"):
        export_model(ExportOptions(stage_processes=False,
                                   checkpoint=str(tiny_runs["transformer"]), name="tiny-transformer", version="1",
                                   model_repository=str(tiny_repository), progress=False))
    status = nmt_main(["export", "--no-stage-processes",
                       str(tiny_runs["transformer"]), "--name", "tiny-transformer", "--version", "1",
                       "--model-repository", str(tiny_repository), "--no-progress"])
    assert status == 2 and "already exists" in capsys.readouterr().err
    assert (tiny_models["transformer"] / MANIFEST_FILE).read_bytes() == before
    assert next_version(tiny_repository / "tiny-transformer") == "2"
    assert next_version(tiny_repository / "no-such-model") == "1"
    assert not [p for p in (tiny_repository / "tiny-transformer").iterdir() if p.name.startswith(".")]


def test_checkpoint_problems_are_clear_errors(tiny_runs, tmp_path):
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(tiny_runs["bahdanau"] / "best.pt", lonely / "model.pt")
    options = dict(name="x", model_repository=str(tmp_path / "models"), progress=False, stage_processes=False)
    with pytest.raises(NmtError, match="tokenizer not found"):
        export_model(ExportOptions(checkpoint=str(lonely / "model.pt"), **options))
    with pytest.raises(NmtError, match="holds no best.pt"):
        export_model(ExportOptions(checkpoint=str(tmp_path), **options))
    (lonely / "best.pt").write_bytes(b"junk")
    shutil.copy(tiny_runs["bahdanau"] / "spm.model", lonely / "spm.model")
    with pytest.raises(NmtError, match="cannot read checkpoint"):
        export_model(ExportOptions(checkpoint=str(lonely), **options))
    with pytest.raises(NmtError, match="bad model name"):
        export_model(ExportOptions(checkpoint=str(lonely), **{**options, "name": "../x"}))
    assert not (tmp_path / "models").exists()


def test_failed_export_leaves_nothing(tiny_runs, tiny_repository, monkeypatch):
    def broken(model, opset, store=None):
        raise NmtError("exporting the graph failed: boom")

    monkeypatch.setitem(EXPORTERS, "bahdanau", broken)
    (tiny_repository / "tiny-bahdanau").mkdir(exist_ok=True)
    before = sorted(p.name for p in (tiny_repository / "tiny-bahdanau").iterdir())
    with pytest.raises(NmtError, match="boom"):
        export_model(ExportOptions(checkpoint=str(tiny_runs["bahdanau"]), name="tiny-bahdanau",
                                   model_repository=str(tiny_repository), progress=False, stage_processes=False))
    assert sorted(p.name for p in (tiny_repository / "tiny-bahdanau").iterdir()) == before


# ----------------------------------------------------------------------------------------- quantization


def test_int8_export_records_quantization(tiny_runs, tmp_path):
    # its own repository: an int8 version in the session's shared one would be served by later tests' servers
    tiny_repository = tmp_path / "models"
    stale = tiny_repository / "tiny-transformer" / "int8"
    stale.mkdir(parents=True)
    (stale / "leftover.txt").write_text("an older export")
    result = export_model(ExportOptions(stage_processes=False,
                                        checkpoint=str(tiny_runs["transformer"]), name="tiny-transformer",
                                        version="int8", model_repository=str(tiny_repository), quantize="int8",
                                        force=True, parity_sentences=4, bleu_sentences=12, progress=False))
    assert result.version_dir == stale and not (stale / "leftover.txt").exists(), "--force replaces the directory"
    manifest = read_manifest(result.version_dir)
    assert manifest.precision == "int8"
    q = manifest.quantization
    assert set(q) >= {"bleu_fp32", "bleu_int8", "delta", "test_sentences"}
    assert q["test_sentences"] == 12 and q["delta"] == pytest.approx(q["bleu_int8"] - q["bleu_fp32"], abs=0.011)
    assert q["bleu_fp32"] > 0
    assert manifest.parity["precision"] == "int8" and manifest.parity["enforced"] is False
    assert manifest.parity["fp32"]["max_logit_diff"] <= LOGIT_TOLERANCE
    assert manifest.parity["max_logit_diff"] > 0
    ops = {node.op_type for node in onnx.load(str(result.version_dir / "decoder.onnx")).graph.node}
    assert ops & {"DynamicQuantizeMatMul", "MatMulInteger"}, ops
    assert manifest.attention_blocks["fused"] == manifest.attention_blocks["total"]
    engine = Engine.load(result.version_dir, provider="cpu")
    sources, _ = held_out_ids(tiny_runs["transformer"], 2)
    hypothesis = engine_translate_ids(engine, sources[0], beam_size=2, need_attention=True)[0]
    assert hypothesis.tokens[-1] == EOS_ID
    torch.testing.assert_close(torch.from_numpy(hypothesis.attention).sum(-1), torch.ones(len(hypothesis.tokens)),
                               atol=1e-5, rtol=0)


# fp16 keeps 11 significant bits (unit roundoff 2**-11 ~ 4.9e-4): activations and logits of magnitude ~10-20 round by
# ~0.01, so log-probabilities differ from fp32 PyTorch by about 1e-2 (measured 0.011 on the tiny Transformer); the
# attention, a mean of fp32 softmaxes over fp16 scores, by under 1e-3 (measured 6.5e-4). The bounds leave 5x room.
FP16_LOGIT_TOLERANCE = 5e-2
FP16_ATTENTION_TOLERANCE = 5e-3


def test_fp16_export_keeps_parity_on_the_cpu_and_records_bleu(tiny_runs, tiny_repository, fp16_models):
    version_dir = fp16_models["transformer"]
    manifest = read_manifest(version_dir)
    assert manifest.precision == "fp16" and manifest.parity["precision"] == "fp16"
    assert 0 < manifest.parity["max_logit_diff"] <= FP16_LOGIT_TOLERANCE
    assert manifest.parity["max_attention_diff"] <= FP16_ATTENTION_TOLERANCE
    assert manifest.parity["greedy_match"] == f"{PARITY_SENTENCES}/{PARITY_SENTENCES}"
    q = manifest.quantization
    assert q["test_sentences"] == 12 and q["delta"] == pytest.approx(q["bleu_fp16"] - q["bleu_fp32"], abs=0.011)
    for role, name in GRAPH_FILES.items():
        graph = onnx.load(str(version_dir / name)).graph
        weights = [t for t in graph.initializer if len(t.dims) == 2 and min(t.dims) > 1]
        assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights), role
        io = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
        fp16_io = {name for name in io if name.startswith(("past_", "present_", "cross_"))}
        assert onnx.TensorProto.FLOAT16 not in {io[name] for name in set(io) - fp16_io}, "the I/O contract stays"
        assert {io[name] for name in fp16_io} <= {onnx.TensorProto.FLOAT16}, "the cache and cross K/V: no casts"
        casts = {node.output[0]: node.input[0] for node in graph.node if node.op_type == "Cast"}
        if role == "decoder":  # positions and capacity to int32 for GroupQueryAttention, the logits to fp32
            assert len(casts) == 3, sorted(casts)
        assert not [out for out, source in casts.items() if source in casts], f"{role}: a cast of a cast"
        for node in graph.node:  # computed in fp32 (export.quantize.FP32_OPS), the converter's misses included
            if node.op_type in FP32_OPS:
                assert _cast_to_fp32(graph, node.input[0]), f"{role}: {node.op_type} reads {node.input[0]}"
        for node in graph.node:
            if node.op_type == "GroupQueryAttention":
                assert node.input[3].startswith("past_key_") and node.output[1].startswith("present_key_")
    assert {entry.dtype for entry in manifest.decoder_state} == {"float16"}
    # the forced pass hands its K/V to the fp16 buffers as they are (fp16 outputs) and resumes from them
    forced = onnx.load(str(version_dir / OPTIONAL_GRAPH_FILES["decoder_forced"])).graph
    assert {v.type.tensor_type.elem_type for v in forced.output if v.name.startswith("present_")} == {
        onnx.TensorProto.FLOAT16}
    assert manifest.parity["max_forced_diff"] <= FP16_LOGIT_TOLERANCE
    engine = Engine.load(version_dir, provider="cpu", intra_op_threads=1)
    [whole] = engine.translate(["three four five"])
    prefix = SentenceRequest(engine.tokenize("three four five"), DecodingOptions(beam_size=4),
                             target_prefix=TargetPrefix(tuple(whole.hypotheses[0].token_ids[:2])))
    [continued] = engine.translate_batch([prefix]).translations
    assert continued.hypotheses[0].token_ids[:2] == whole.hypotheses[0].token_ids[:2]
    with pytest.raises(NmtError, match="exclude each other"):
        export_model(ExportOptions(stage_processes=False,
                                   checkpoint=str(tiny_runs["transformer"]), name="x", precision="fp16",
                                   quantize="int8", model_repository=str(tiny_repository), progress=False))


def test_a_second_bahdanau_export_in_one_process_keeps_source_lengths_dynamic(tiny_models, tiny_runs, tmp_path):
    """``tiny_models`` exported this run once in this process already; a second export traced the encoder's
    source length as a constant (torch.arange over it), and its parity check then failed on other lengths."""
    result = export_model(ExportOptions(stage_processes=False, checkpoint=str(tiny_runs["bahdanau"]), name="again",
                                        model_repository=str(tmp_path), parity_sentences=PARITY_SENTENCES,
                                        progress=False))
    session = ort.InferenceSession(str(result.version_dir / "encoder.onnx"), providers=["CPUExecutionProvider"])
    for length in (1, 5, 23):
        src = np.full((2, length), 7, dtype=np.int64)
        src[:, -1] = EOS_ID
        memory = session.run(None, {"src_ids": src})[0]
        assert memory.shape[:2] == (2, length)


def confident_copy(run, directory):
    """``run`` with half its vocabulary pushed to log-probabilities of -2,000 to -4,000 (``final_logits_bias``), as
    a confident model puts most of a large vocabulary far down: one float32 step there is 1.2e-4 to 2.4e-4."""
    shutil.copytree(run, directory)
    model, _ = load_checkpoint(directory / "best.pt")
    bias = -(2000 + 2000 * torch.rand(model.final_logits_bias.shape, generator=torch.Generator().manual_seed(0)))
    bias[:, : model.config.vocab_size // 2] = 0
    with torch.no_grad():
        model.final_logits_bias.copy_(bias)
    save_checkpoint(directory / "best.pt", model, step=1, valid_bleu=50.0)
    return directory, model


def test_a_confident_model_passes_parity_and_a_corrupted_graph_fails(tiny_runs, tmp_path):
    """Compared absolutely, this model's log-probabilities differed by 2.4e-4 and its export was refused; relative
    to their magnitude beyond 1 they differ by ~1e-6. A graph with one weight matrix scaled by 1 % still fails."""
    run, model = confident_copy(tiny_runs["transformer"], tmp_path / "run")
    result = export_model(ExportOptions(stage_processes=False,
                                        checkpoint=str(run), name="confident", model_repository=str(tmp_path / "m"),
                                        parity_sentences=PARITY_SENTENCES, progress=False))
    assert result.manifest.parity["max_logit_diff"] <= LOGIT_TOLERANCE
    assert result.manifest.parity["max_forced_diff"] <= LOGIT_TOLERANCE

    broken = tmp_path / "broken"
    shutil.copytree(result.version_dir, broken)
    decoder = onnx.load(str(broken / "decoder.onnx"))
    weight = max((t for t in decoder.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2),
                 key=lambda t: np.prod(t.dims))
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) * 1.01, weight.name))
    onnx.save(decoder, str(broken / "decoder.onnx"))
    manifest = json.loads((broken / MANIFEST_FILE).read_text())
    manifest["files"]["decoder.onnx"] = sha256_file(broken / "decoder.onnx")  # a wrong graph, not a damaged file
    (broken / MANIFEST_FILE).write_text(json.dumps(manifest))
    sources, targets = held_out_ids(tiny_runs["transformer"])
    with torch_reference(model, sources, targets) as reference:
        report = check_parity(reference, Engine.load(broken, provider="cpu"))
    assert report.max_logit_diff > 10 * LOGIT_TOLERANCE and not report.ok()


def test_releasing_the_model_frees_weights_that_others_still_reference(tiny_runs):
    """The export frees the PyTorch model before it loads a version; the exporter's libraries keep references
    to some of a traced module's parameters, so releasing empties every parameter in place."""
    inputs = load_inputs(ExportOptions(stage_processes=False, checkpoint=str(tiny_runs["transformer"]), progress=False))
    kept = [*inputs.model.parameters(), *inputs.model.buffers()]  # as onnxscript's fusion rules keep some
    assert sum(tensor.numel() for tensor in kept) > 10_000
    inputs.release_model()
    assert inputs.model is None and all(tensor.numel() == 0 for tensor in kept)
    assert inputs.arch == "transformer" and inputs.config.vocab_size > 0  # what later stages read stays


def test_a_refused_export_names_the_measure_and_the_way_out(tiny_runs, tmp_path):
    with pytest.raises(NmtError) as refused:  # the Bahdanau model: it traces in half the Transformer's time
        export_model(ExportOptions(stage_processes=False, checkpoint=str(tiny_runs["bahdanau"]), name="strict",
                                   model_repository=str(tmp_path), parity_sentences=2, parity_tolerance=1e-12,
                                   progress=False))
    message = str(refused.value)
    assert "|onnx - torch| / max(1, |torch|)" in message and "--parity-tolerance relaxes it" in message
    assert not (tmp_path / "strict").exists() or not any((tmp_path / "strict").iterdir())


def test_traced_weights_are_written_from_their_own_memory_byte_for_byte() -> None:
    """``raw_bytes`` (what the tracer writes into the weight store) equals ``tobytes()`` for every tensor, and
    is a view of the tensor's memory where its layout is ONNX's (no copy of a large embedding)."""
    import ml_dtypes
    import onnx_ir as ir

    from export.tracing import raw_bytes

    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensors = {"contiguous": ir.Tensor(weights), "transposed": ir.Tensor(weights.T),
               "bfloat16": ir.Tensor(weights.astype(ml_dtypes.bfloat16)), "bool": ir.Tensor(weights > 5),
               "torch": ir.Tensor(torch.arange(6, dtype=torch.float32).reshape(2, 3), dtype=ir.DataType.FLOAT)}
    for name, tensor in tensors.items():
        assert bytes(raw_bytes(tensor)) == tensor.tobytes(), name
    view = raw_bytes(tensors["contiguous"])
    assert isinstance(view, memoryview) and np.shares_memory(np.asarray(view), weights)
    assert isinstance(raw_bytes(tensors["transposed"]), bytes)  # not laid out as ONNX lays it out: a copy


def test_the_exporting_process_imports_none_of_the_stages_libraries(tiny_runs, tmp_path: Path) -> None:
    """By default the check, the PyTorch stages and the verification run in processes of their own
    (``export.stages``), each gone before the next: the process that calls ``export_model`` never imports
    torch, ONNX Runtime or transformers, and gets the verified version."""
    script = (
        "import sys\n"
        "from export.options import ExportOptions\n"
        "from export.pipeline import export_model\n"
        f"result = export_model(ExportOptions(checkpoint={str(tiny_runs['transformer'])!r}, name='apart', "
        f"model_repository={str(tmp_path)!r}, progress=False, parity_sentences={PARITY_SENTENCES}))\n"
        "print(result.version_dir, result.manifest.parity['greedy_match'], "
        "[name for name in ('torch', 'onnxruntime', 'transformers') if name in sys.modules])\n"
    )
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent).stdout.splitlines()[-1]
    assert printed == f"{tmp_path / 'apart' / '1'} {PARITY_SENTENCES}/{PARITY_SENTENCES} []"
    assert read_manifest(tmp_path / "apart" / "1").parity["enforced"] is True
