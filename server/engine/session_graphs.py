"""What a session opens for a graph file: the file as exported, or the graph rewritten for its provider.

A version's files are exported once and serve every provider; where one provider's kernel of a fused operator
is slow or missing, the session's copy of the graph (never the file) has that operator in standard ones:

* **CUDA, fp32 versions**: the decoder's ``GroupQueryAttention`` has no fp32 CUDA kernel, so its self-attention
  is written out (:func:`server.engine.portable_attention.inline_self_attention`).
* **The CPU**: ``com.microsoft.SkipLayerNormalization`` becomes ``Add`` + ``LayerNormalization``
  (:func:`split_skip_layer_norms`). ONNX Runtime's CPU kernel of the fused operator is the slower one
  (1.32.0 on an AVX-512 host, 256 features: 87 us against 25 us for 128 rows, 24 against 9.5 for 32, level
  for one; benchmarks/README.md), and a layer normalization runs after every attention and feed-forward block
  of both the encoder and the decoder. The bias goes in first, so ONNX Runtime folds a ``MatMul`` that feeds it
  into a ``Gemm``. CUDA keeps the fused kernel.

A rewritten graph is opened from memory, so the session's options are told where the version's external
weights lie (:data:`EXTERNAL_DATA_FOLDER`).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import helper

from server.engine.portable_attention import inline_self_attention, needs_portable_attention

SKIP_LAYER_NORM = "SkipLayerNormalization"
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
EMBEDDED_LIMIT = 1 << 20  # bytes of weights inside a graph file above which the CPU opens the file as it is


def _embedded_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers stored inside the graph file (versions exported before ``weights.bin`` keep
    every weight there: a rewritten copy would hold them twice while its session opens)."""
    return sum(t.ByteSize() for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)


def split_skip_layer_norms(model: onnx.ModelProto) -> int:
    """Rewrite each ``com.microsoft.SkipLayerNormalization`` of ``model`` whose mean and inverse standard
    deviation outputs nobody reads (the export's) as ``Add`` (input + bias, when it has one), ``Add`` (+ skip;
    the sum keeps the fused node's fourth output name when it has one) and ``LayerNormalization`` over the last
    axis with the same epsilon, in place; returns how many."""
    graph = model.graph
    if not any(o.domain in ("", "ai.onnx") and o.version >= 17 for o in model.opset_import):
        return 0  # no LayerNormalization before opset 17 (every export since the fused graphs is 17 or later)
    read = {name for node in graph.node for name in node.input} | {output.name for output in graph.output}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in graph.node:
        outputs = [*node.output, "", "", ""][:4]
        if node.op_type != SKIP_LAYER_NORM or node.domain != "com.microsoft" or any(
                name in read for name in outputs[1:3] if name):
            nodes.append(node)
            continue
        x, skip, gamma, beta, bias = [*node.input, "", "", ""][:5]
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-12)  # the contrib op's default
        name = node.name or f"skip_layer_norm_{rewritten}"
        total = outputs[3] or f"{name}_sum"
        if bias:
            nodes.append(helper.make_node("Add", [x, bias], [f"{name}_biased"], name=f"{name}_bias"))
            x = f"{name}_biased"
        nodes.append(helper.make_node("Add", [x, skip], [total], name=f"{name}_skip"))
        nodes.append(helper.make_node("LayerNormalization", [total, gamma, *([beta] if beta else [])], [outputs[0]],
                                      name=f"{name}_norm", axis=-1, epsilon=epsilon))
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def session_graph(path: Path, options: ort.SessionOptions, portable: bool | None, *, on_cuda: bool) -> str | bytes:
    """What ``InferenceSession`` opens for the graph file ``path`` (module docstring): the file itself, or the
    serialized graph rewritten for its provider. ``portable`` forces the self-attention rewrite on (``True``) or
    off (``False``); ``None`` rewrites where the session goes to CUDA and needs it (:func:`needs_portable_attention`).
    On the CPU the fused layer normalizations are split, except in a graph file that holds its weights itself
    (over :data:`EMBEDDED_LIMIT` bytes: versions exported before ``weights.bin``), which opens as it is."""
    model = onnx.load(path, load_external_data=False)
    changed = False
    if portable or (portable is None and on_cuda and needs_portable_attention(model)):
        changed = inline_self_attention(model) > 0
    if not on_cuda and _embedded_bytes(model) <= EMBEDDED_LIMIT:
        changed = split_skip_layer_norms(model) > 0 or changed
    if not changed:
        return str(path)
    options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(path.parent))
    return model.SerializeToString()
