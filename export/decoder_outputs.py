"""The outputs a decoder step graph gives the serving search (edits in place): each row's ``top_k`` best tokens and
their log-probabilities and EOS's log-probability instead of the whole distribution (:func:`add_top_k`), and the
logits under the ``log_probs`` for the controls that scale them (:func:`add_logits`)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from common.errors import NmtError
from common.model_format.manifest import LOGITS_OUTPUT, TOP_K_INPUT, TOP_K_OUTPUTS
from export.graph_passes import producers


def add_top_k(model: onnx.ModelProto, eos_id: int) -> None:
    """Give a decoder step graph the outputs the serving search reads instead of the whole
    distribution (in place): ``top_ids`` / ``top_log_probs`` [batch, top_k], the ``top_k`` best tokens
    of each row (``TopK``: best first, ties to the lower id, like arg-max), and ``eos_log_prob`` [batch]
    for rows that must end. ``top_k`` is an int64 [1] input defaulting to 1; ``log_probs`` stays an output
    (the parity checks read it) but is no longer copied out of ONNX Runtime at every step."""
    graph = model.graph
    ids, top_scores, eos_scores = TOP_K_OUTPUTS
    graph.input.append(helper.make_tensor_value_info(TOP_K_INPUT, TensorProto.INT64, [1]))
    graph.initializer.extend([
        onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), TOP_K_INPUT),  # the default
        onnx.numpy_helper.from_array(np.array(eos_id, dtype=np.int64), "eos_id"),
    ])
    graph.node.extend([
        helper.make_node("TopK", ["log_probs", TOP_K_INPUT], [top_scores, ids], axis=-1, largest=1, sorted=1),
        helper.make_node("Gather", ["log_probs", "eos_id"], [eos_scores], axis=1),
    ])
    graph.output.extend([
        helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "top_k"]),
        helper.make_tensor_value_info(top_scores, TensorProto.FLOAT, ["batch", "top_k"]),
        helper.make_tensor_value_info(eos_scores, TensorProto.FLOAT, ["batch"]),
    ])


def add_logits(model: onnx.ModelProto) -> None:
    """Give a decoder step graph a ``logits`` [batch, vocab] output (in place): the input of the ``LogSoftmax``
    that makes ``log_probs``, renamed, so no node is added (requests that do not fetch it cost nothing more).
    For the controls that scale logits before the softmax (the repetition penalty, as CTranslate2 and
    Hugging Face do); the engine fetches it only while such a control is on."""
    graph = model.graph
    node = producers(graph).get("log_probs")
    if node is None or node.op_type != "LogSoftmax":
        raise NmtError(f"the decoder's log_probs come from {node.op_type if node else 'nothing'}, not LogSoftmax: "
                       "cannot expose its logits")
    old = node.input[0]
    if old in {value.name for value in graph.input}:
        raise NmtError(f"the decoder's LogSoftmax reads the graph input {old!r}: cannot expose its logits")
    for other in graph.node:
        other.input[:] = [LOGITS_OUTPUT if name == old else name for name in other.input]
        other.output[:] = [LOGITS_OUTPUT if name == old else name for name in other.output]
    for value in [*graph.value_info, *graph.output]:
        if value.name == old:
            value.name = LOGITS_OUTPUT
    if LOGITS_OUTPUT not in {output.name for output in graph.output}:
        value = onnx.ValueInfoProto()
        value.CopyFrom(next(output for output in graph.output if output.name == "log_probs"))  # float [batch, vocab]
        value.name = LOGITS_OUTPUT
        graph.output.append(value)
