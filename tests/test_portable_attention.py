"""The decoder self-attention in standard operators (:mod:`server.engine.session_graphs`), which an fp32
version runs on CUDA because ONNX Runtime's ``GroupQueryAttention`` CUDA kernel takes fp16/bf16 only.

Checked here on the CPU, where both forms run: the rewritten graphs decode exactly as the fused ones (same
tokens, scores and attention within 1e-5) for greedy and beam search, n-best, length penalty, target
prefixes and a mixed batch whose rows sit at different positions; and only graphs that need it are
rewritten. ``tests/test_placement.py`` checks that every node of the rewritten graphs has a CUDA kernel,
``tests/test_gpu.py`` that a CUDA session runs them all there.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from common.errors import NmtError
from server.engine.engine import Engine
from server.engine.session_graphs import (
    EXTERNAL_DATA_FOLDER,
    GQA,
    inline_self_attention,
    needs_portable_attention,
    session_graph,
)
from server.types import DecodingOptions, SentenceRequest
from tests.test_engine import TEXTS

TOLERANCE = 1e-5
LONGER = TEXTS + ["one two three four five six seven eight nine ten", "ten nine"]


@pytest.fixture(scope="module")
def fused_and_portable(tiny_models) -> tuple[Engine, Engine]:
    version = tiny_models["transformer"]
    return (Engine.load(version, provider="cpu", intra_op_threads=1),
            Engine.load(version, provider="cpu", intra_op_threads=1, portable_attention=True))


def _same(fused, portable) -> None:
    for a, b in zip(fused, portable, strict=True):
        assert [h.token_ids for h in b.hypotheses] == [h.token_ids for h in a.hypotheses]
        for x, y in zip(a.hypotheses, b.hypotheses, strict=True):
            np.testing.assert_allclose(y.token_scores, x.token_scores, atol=TOLERANCE)
            assert y.score == pytest.approx(x.score, abs=TOLERANCE)
            if x.attention is not None:
                np.testing.assert_allclose(y.attention.weights, x.attention.weights, atol=TOLERANCE)


def test_the_portable_engine_has_no_fused_self_attention_left(tiny_models, fused_and_portable):
    version = tiny_models["transformer"]
    for name in ("decoder.onnx", "decoder_attention.onnx"):
        graph = session_graph(version / name, ort.SessionOptions(), True, on_cuda=False)
        assert isinstance(graph, bytes)
        model = onnx.load_from_string(graph)
        assert GQA not in {node.op_type for node in model.graph.node}
        assert [node.op_type for node in model.graph.node].count("ScatterElements") == 2 * 2  # K and V, 2 layers
    assert session_graph(version / "encoder.onnx", ort.SessionOptions(), True, on_cuda=True) == str(
        version / "encoder.onnx")  # nothing to rewrite for CUDA: the file itself


@pytest.mark.parametrize("beam,hypotheses", [(1, 1), (2, 2), (4, 1), (4, 3), (8, 2)])
def test_decodes_as_the_fused_operator(fused_and_portable, beam, hypotheses):
    fused, portable = fused_and_portable
    options = DecodingOptions(beam_size=beam, num_hypotheses=hypotheses, return_attention=True, length_penalty=0.6)
    _same(fused.translate(LONGER, options), portable.translate(LONGER, options))


def test_rows_at_different_positions_in_one_step(fused_and_portable):
    """Target prefixes of different lengths put the rows of one batch at different positions: each row
    writes its own slot and attends over its own entries."""
    fused, portable = fused_and_portable
    options = DecodingOptions(beam_size=3, num_hypotheses=2, return_attention=True)

    def requests(engine: Engine) -> list[SentenceRequest]:
        prefixes = ["", "one", "three four five", "", "eight nine", "one two three four", ""]
        return [SentenceRequest(engine.tokenize(text), options, text=text, target_prefix=engine.target_prefix(prefix))
                for text, prefix in zip(LONGER, prefixes, strict=True)]

    fused_out, portable_out = (engine.translate_batch(requests(engine)).translations for engine in fused_and_portable)
    _same(fused_out, portable_out)


def test_only_graphs_without_a_cuda_kernel_are_rewritten_by_default(tiny_models, tmp_path):
    version = tiny_models["transformer"]
    decoder = onnx.load(version / "decoder.onnx", load_external_data=False)
    assert needs_portable_attention(decoder)  # fp32: GroupQueryAttention's CUDA kernel takes fp16/bf16
    options = ort.SessionOptions()
    assert isinstance(session_graph(version / "decoder.onnx", options, None, on_cuda=True), bytes)
    assert options.get_session_config_entry(EXTERNAL_DATA_FOLDER) == str(version)
    on_cpu = onnx.load_from_string(session_graph(version / "decoder.onnx", ort.SessionOptions(), None, on_cuda=False))
    assert GQA in {node.op_type for node in on_cpu.graph.node}  # the CPU keeps the fused self-attention
    assert not any(needs_portable_attention(onnx.load(version / name, load_external_data=False))
                   for name in ("encoder.onnx", "decoder_forced.onnx"))


def test_a_node_the_rewrite_does_not_cover_is_refused(tiny_models):
    decoder = onnx.load(tiny_models["transformer"] / "decoder.onnx", load_external_data=False)
    node = next(node for node in decoder.graph.node if node.op_type == GQA)
    node.attribute.append(onnx.helper.make_attribute("do_rotary", 1))
    with pytest.raises(NmtError, match="rotary"):
        inline_self_attention(decoder)
