"""What a session opens for a graph file: the file as exported, or the graph rewritten for its provider.

A version's files are exported once and serve every provider; where one provider's kernel of a fused operator
is slow or missing, the session's copy of the graph (never the file) has that operator in standard ones:

* **CUDA, fp32 versions**: the decoder's ``GroupQueryAttention`` has no fp32 CUDA kernel, so its self-attention
  is written out (:func:`server.engine.session_graphs.inline_self_attention`).
* **The CPU**: ``com.microsoft.SkipLayerNormalization`` becomes ``Add`` + ``LayerNormalization``
  (:func:`split_skip_layer_norms`). ONNX Runtime's CPU kernel of the fused operator is the slower one
  (on ONNX Runtime 1.32's CPU kernels several times slower at 32 rows and more, level at one;
  benchmarks/README.md), and a layer normalization runs after every attention and feed-forward block
  of both the encoder and the decoder. The bias goes in first, so ONNX Runtime folds a ``MatMul`` that feeds it
  into a ``Gemm``. CUDA keeps the fused kernel.

A rewritten graph is opened from memory, so the session's options are told where the version's external
weights lie (:data:`EXTERNAL_DATA_FOLDER`).


**Decoder self-attention in standard operators**, over the in-place KV cache, for a provider whose
``GroupQueryAttention`` kernel does not take the cache's element type.

An exported Transformer step graph keeps its self-attention cache in place with
``com.microsoft.GroupQueryAttention`` (:func:`export.transformer_graphs.use_inplace_cache`): each row writes
its new key and value at its own position of a ``[batch, heads, capacity, head_dim]`` buffer that the
engine binds as both ``past_*`` and ``present_*``. ONNX Runtime's CUDA kernel of that operator takes
fp16/bf16 only, so in an **fp32** version every layer's self-attention would run on the CPU provider and
the whole cache would cross the bus at every step (measured on an H200: 0.14x Hugging Face ``generate``).

:func:`inline_self_attention` rewrites each such node, when the version is loaded for that provider, into
operators that every provider has in fp32 (the exported files stay as they are, so one version serves
both the CPU, where the fused operator is fastest, and CUDA):

* ``ScatterElements`` writes the new key and value at each row's ``positions[r]`` along the capacity axis.
  Its output is the graph's ``present_*``, which the engine binds to the memory of ``past_*``; ONNX
  Runtime's kernels skip their input-to-output copy when the two are one buffer, so only the new entry
  is written, as with the fused operator.
* ``FusedMatMul(q, Kᵀ, alpha=scale)`` over the whole capacity, plus a bias of ``-inf`` on every slot past
  the row's position, ``Softmax``, ``MatMul`` with V. Slots beyond a row's position hold stale or zero
  entries; the bias gives them weight exactly 0, so each row attends over its ``positions[r] + 1``
  entries, as the fused operator does.

The reshapes between ``[batch, 1, heads * head_dim]`` and ``[batch, heads, 1, head_dim]`` move only a
dimension of size 1, so they are views, not copies. The cost against the fused operator is attention
over the full capacity (a power of two at most twice the longest row) instead of each row's length.
"""

from __future__ import annotations

import math
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from common.errors import NmtError
from server.engine.device import nodes_without_cuda_kernel

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


GQA = "GroupQueryAttention"


_PREFIX = "portable_attention"


def needs_portable_attention(model: onnx.ModelProto) -> bool:
    """Whether a ``GroupQueryAttention`` node of ``model`` has no CUDA kernel for its element types."""
    return any(u.op == f"com.microsoft.{GQA}" for u in nodes_without_cuda_kernel(model))


def inline_self_attention(model: onnx.ModelProto) -> int:
    """Rewrite every ``GroupQueryAttention`` node of ``model`` in place (module docstring); returns how many.

    Each node must be the export's: ``num_heads == kv_num_heads``, no rotary embedding, softcap or window,
    query either packed Q/K/V (key and value empty) or separate, and past key and value caches that are
    graph inputs of shape ``[batch, heads, capacity, head_dim]``. Each row's slot is read from the graph's
    ``positions`` input (what the export feeds ``seqlens_k``). Nodes only the fused operator read (its
    ``seqlens_k`` and ``total_sequence_length``) are removed."""
    graph = model.graph
    inputs = {i.name: i.type.tensor_type for i in graph.input}
    layers: list[list[onnx.NodeProto]] = []
    shapes = set()
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != GQA or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        heads = int(attrs["num_heads"])
        past = inputs.get(node.input[3])
        if attrs.get("kv_num_heads", heads) != heads or any(attrs.get(name) for name in _UNSUPPORTED) or \
                any(node.input[7:]) or any(node.output[3:]) or past is None or len(past.shape.dim) != 4 or \
                not past.shape.dim[3].dim_value:
            raise NmtError(f"self-attention node {node.name!r} uses GroupQueryAttention features the portable "
                           "rewrite does not cover (grouped heads, rotary embedding, softcap, windows, extra inputs "
                           "or outputs, a cache that is not a [batch, heads, capacity, head_dim] graph input)")
        head_dim = past.shape.dim[3].dim_value
        shapes.add((heads, head_dim, past.elem_type, node.input[3]))
        scale = attrs.get("scale") or 1.0 / math.sqrt(head_dim)
        layer = _attention(f"{_PREFIX}_{len(layers)}", node, scale)
        layers.append(layer)
        nodes.extend(layer)
    if not layers:
        return 0
    if "positions" not in inputs:
        raise NmtError("the step graph has no positions input; the portable self-attention needs each row's position")
    if len({shape[:3] for shape in shapes}) != 1:
        raise NmtError("the self-attention layers differ in heads, head size or cache type")
    heads, head_dim, cache_type, past_key = min(shapes, key=lambda shape: shape[3])
    del graph.node[:]
    graph.node.extend(_shared(past_key) + nodes)
    graph.initializer.extend(_constants(heads, head_dim, cache_type))
    _remove_dead_nodes(graph)
    return len(layers)


_UNSUPPORTED = ("do_rotary", "softcap", "local_window_size", "smooth_softmax", "qk_output")


_SLOT_INDEX = f"{_PREFIX}_slot_index"  # [batch, heads, 1, head_dim] int64: each row's position, repeated


_SLOT_BIAS = f"{_PREFIX}_slot_bias"  # [batch, 1, 1, capacity]: 0 up to each row's position, -inf after


_HEAD_SHAPE = f"{_PREFIX}_head_shape"  # [batch, 1, heads * head_dim] <-> [batch, heads, 1, head_dim]


_MODEL_SHAPE = f"{_PREFIX}_model_shape"


def _constants(heads: int, head_dim: int, cache_type: int) -> list[onnx.TensorProto]:
    p = _PREFIX
    return [
        helper.make_tensor(f"{p}_row_shape", TensorProto.INT64, [4], [-1, 1, 1, 1]),
        helper.make_tensor(f"{p}_entry_shape", TensorProto.INT64, [4], [1, heads, 1, head_dim]),
        helper.make_tensor(f"{p}_column_shape", TensorProto.INT64, [2], [-1, 1]),
        helper.make_tensor(f"{p}_bias_shape", TensorProto.INT64, [4], [0, 1, 1, -1]),
        helper.make_tensor(f"{p}_capacity_axis", TensorProto.INT64, [], [2]),
        helper.make_tensor(f"{p}_zero", TensorProto.INT64, [], [0]),
        helper.make_tensor(f"{p}_one", TensorProto.INT64, [], [1]),
        helper.make_tensor(f"{p}_open", cache_type, [], [0.0]),
        helper.make_tensor(f"{p}_closed", cache_type, [], [-math.inf]),
        helper.make_tensor(_HEAD_SHAPE, TensorProto.INT64, [4], [0, heads, 1, head_dim]),
        helper.make_tensor(_MODEL_SHAPE, TensorProto.INT64, [3], [0, 1, heads * head_dim]),
    ]


def _shared(past_key: str) -> list[onnx.NodeProto]:
    """What every layer reads: the scatter index of each row's slot and the bias that closes later slots."""
    p = _PREFIX
    return [
        helper.make_node("Reshape", ["positions", f"{p}_row_shape"], [f"{p}_row_positions"]),
        helper.make_node("Expand", [f"{p}_row_positions", f"{p}_entry_shape"], [_SLOT_INDEX]),
        helper.make_node("Shape", [past_key], [f"{p}_cache_shape"]),
        helper.make_node("Gather", [f"{p}_cache_shape", f"{p}_capacity_axis"], [f"{p}_capacity"], axis=0),
        helper.make_node("Range", [f"{p}_zero", f"{p}_capacity", f"{p}_one"], [f"{p}_slots"]),
        helper.make_node("Reshape", ["positions", f"{p}_column_shape"], [f"{p}_column_positions"]),
        helper.make_node("GreaterOrEqual", [f"{p}_column_positions", f"{p}_slots"], [f"{p}_open_slots"]),
        helper.make_node("Where", [f"{p}_open_slots", f"{p}_open", f"{p}_closed"], [f"{p}_bias_rows"]),
        helper.make_node("Reshape", [f"{p}_bias_rows", f"{p}_bias_shape"], [_SLOT_BIAS]),
    ]


def _attention(name: str, node: onnx.NodeProto, scale: float) -> list[onnx.NodeProto]:
    query, key, value, past_key, past_value = node.input[:5]
    output, present_key, present_value = node.output[:3]
    nodes = []
    if not key:  # packed Q/K/V [batch, 1, 3 * heads * head_dim], in that order
        query, key, value = f"{name}_q", f"{name}_k", f"{name}_v"
        nodes.append(helper.make_node("Split", [node.input[0]], [query, key, value], axis=2, num_outputs=3))
    return nodes + [
        helper.make_node("Reshape", [query, _HEAD_SHAPE], [f"{name}_q4"]),
        helper.make_node("Reshape", [key, _HEAD_SHAPE], [f"{name}_k4"]),
        helper.make_node("Reshape", [value, _HEAD_SHAPE], [f"{name}_v4"]),
        helper.make_node("ScatterElements", [past_key, _SLOT_INDEX, f"{name}_k4"], [present_key], axis=2),
        helper.make_node("ScatterElements", [past_value, _SLOT_INDEX, f"{name}_v4"], [present_value], axis=2),
        helper.make_node("FusedMatMul", [f"{name}_q4", present_key], [f"{name}_scores"], domain="com.microsoft",
                         transB=1, alpha=scale),
        helper.make_node("Add", [f"{name}_scores", _SLOT_BIAS], [f"{name}_masked"]),
        helper.make_node("Softmax", [f"{name}_masked"], [f"{name}_weights"], axis=-1),
        helper.make_node("MatMul", [f"{name}_weights", present_value], [f"{name}_context"]),
        helper.make_node("Reshape", [f"{name}_context", _MODEL_SHAPE], [output]),
    ]


def _remove_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes none of whose outputs is read (by a node or as a graph output), until none is left."""
    while True:
        read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        live = [node for node in graph.node if any(name in read for name in node.output)]
        if len(live) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(live)
