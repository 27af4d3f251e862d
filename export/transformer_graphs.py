"""ONNX graphs of the Transformer with ONNX Runtime's fused attention.

Thin wrapper modules call the model's own submodules; ``torch.onnx.export(dynamo=True)`` traces them
and onnxscript's ``optimize_for_ort`` lowers every attention block to ``com.microsoft.MultiHeadAttention``
(encoder self-attention, decoder self-attention with ``past``/``present`` K/V, cross-attention) and
residual + LayerNorm pairs to ``SkipLayerNormalization``. Three edits follow on the ONNX graph:

* cross-attention reads the precomputed ``cross_key_{i}``/``cross_value_{i}`` [batch, heads, src_len,
  head_dim] directly (the fused op accepts that 4-D layout), instead of the rewriter's per-step
  transpose back to [batch, src_len, d_model];
* every attention node reads ``src_mask`` as its ``key_padding_mask`` instead of an additive padding
  bias rebuilt from it (in the decoder, at every step);
* ``decoder_attention.onnx`` computes the alignment layer's ``attention`` = mean over heads of
  softmax(q·kᵀ·scale), padding exactly 0, with standard operators from that layer's projected query and
  ``cross_key_i`` (not from MultiHeadAttention's optional ``qk`` output, which CUDA leaves unwritten
  when a key padding mask is given).

Graph I/O (the contract of :mod:`common.model_format.manifest`):

* encoder: ``src_ids`` int64 [batch, src_len] -> ``src_mask`` int32 [batch, src_len] (1 = token, 0 = pad),
  ``cross_key_{i}``, ``cross_value_{i}`` float32 [batch, heads, src_len, head_dim];
* decoder step: ``input_ids`` int64 [batch], ``positions`` int64 [batch] (each row's target position =
  its cached length), ``src_mask``, ``cross_*``, ``past_key_{i}``/``past_value_{i}`` [batch, heads,
  capacity, head_dim] -> ``log_probs`` [batch, vocab], ``present_key_{i}``/``present_value_{i}`` (the same
  shape: the past buffer with each row's new key/value written at its position) (+ ``attention``
  [batch, src_len]);
* decoder forced pass (``decoder_forced.onnx``): ``input_ids`` int64 [batch, tgt_len] (the decoder start
  then the given tokens), ``target_ids`` int64 [batch, tgt_len] (the token whose log-probability each
  position reports), ``src_mask``, ``cross_*`` -> ``target_log_probs`` [batch, tgt_len], ``last_log_probs``
  [batch, vocab] (the distribution after the last position), ``attention`` [batch, tgt_len, src_len] (the
  alignment layer's, computed with standard operators) and ``present_key_{i}``/``present_value_{i}``
  [batch, heads, tgt_len, head_dim]: the K/V of those positions, which the engine copies into the step
  decoder's ``past_*`` buffers (capacity >= tgt_len, each row's ``positions`` = tgt_len:
  ``OnnxStepModel.state_from_forced``), so step-wise search continues from them. Causal self-attention
  over all positions in one call (Score, target prefixes).

The self-attention KV cache is kept in place (:func:`use_inplace_cache`): each layer's self-attention is
``com.microsoft.GroupQueryAttention`` (num_heads = kv_num_heads) with ``seqlens_k`` = ``positions`` and
``total_sequence_length`` = the buffer's capacity. When the engine binds ``present_*`` to the memory of
``past_*`` (I/O binding), the kernel sees one buffer and writes only the new entry; each row attends
over its own ``positions[r] + 1`` entries, so rows of one step may be at different positions. Versions
exported before this layout (``past_len + 1`` concatenation, position read from ``past_key_0``'s shape)
stay loadable: the engine drives both (``Manifest.decoder_positions`` tells them apart).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import Tensor, nn

from common.errors import NmtError
from common.model_format.manifest import StateTensor
from common.model_format.weights import WeightStore
from export.graph_passes import cancel_transposes, count_ops, perm, producers, prune, set_io_shapes
from export.graphs import GraphSet
from export.tracing import example_source, stored, torch_to_onnx, untie
from training.models.transformer import Transformer

MHA = "MultiHeadAttention"
GQA = "GroupQueryAttention"
POSITIONS = "positions"


class EncoderGraph(nn.Module):
    """src_ids -> (src_mask, cross_key_0, cross_value_0, ...): the encoder plus every decoder layer's
    cross-attention K/V projection, computed once per sentence."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        state = model.init_state(model.encode(src_ids))
        outputs = [(src_ids != model.config.pad_id).to(torch.int32)]
        for i in range(len(model.decoder.layers)):
            outputs += [state[f"cross_key.{i}"], state[f"cross_value.{i}"]]
        return tuple(outputs)


class StepGraph(nn.Module):
    """One decoding step: (input_ids, positions, src_mask, cross K/V..., past K/V...) -> (log_probs, present
    K/V...). Traced with the concatenating cache (which the fusion turns into MultiHeadAttention with
    past/present); :func:`use_inplace_cache` then makes it the in-place one."""

    def __init__(self, model: Transformer, need_attention: bool = False) -> None:
        super().__init__()
        self.model = model
        self.need_attention = need_attention  # fallback only: unfused attention output of the alignment layer

    def forward(self, input_ids: Tensor, positions: Tensor, src_mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        layers = model.decoder.layers
        cross, past = tensors[: 2 * len(layers)], tensors[2 * len(layers) :]
        # Transformer.embed at each row's own position (one Gather of the table); the query length stays
        # a literal 1, which the attention fusion rules need.
        position = nn.functional.embedding(positions[:, None], model.position_rows(model.decoder))
        x = model.embed_with(model.decoder, input_ids[:, None], position)
        mask = (src_mask != 0)[:, None, None, :]
        alignment_layer = model.config.alignment_layer % len(layers)
        presents: list[Tensor] = []
        attention = None
        for i, layer in enumerate(layers):
            need = self.need_attention and i == alignment_layer
            x, key, value, weights = layer(
                x, past[2 * i], past[2 * i + 1], cross[2 * i], cross[2 * i + 1], mask, None, need
            )
            presents += [key, value]
            attention = weights if need else attention
        logits = model.lm_head(model.decoder.finished(x[:, 0])) + model.final_logits_bias
        outputs = (logits.log_softmax(-1), *presents)
        return outputs + (attention[:, 0],) if attention is not None else outputs


class ForcedGraph(nn.Module):
    """The decoder over ``tgt_len`` given positions in one call (see the module docstring for its I/O)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, target_ids: Tensor, src_mask: Tensor, *cross: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        layers = model.decoder.layers
        length = input_ids.shape[1]
        x = model.embed(input_ids, 0, model.decoder)
        mask = (src_mask != 0)[:, None, None, :]
        positions = torch.arange(length, device=input_ids.device)
        causal = positions[:, None] >= positions[None, :]
        attn = layers[0].self_attn
        empty = x.new_zeros(x.shape[0], attn.heads, 0, attn.head_dim)
        alignment_layer = model.config.alignment_layer % len(layers)
        presents: list[Tensor] = []
        attention = None
        for i, layer in enumerate(layers):
            x, key, value, weights = layer(x, empty, empty, cross[2 * i], cross[2 * i + 1], mask, causal,
                                           i == alignment_layer)
            presents += [key, value]
            attention = weights if weights is not None else attention
        # the positions as rows of one 2-D product: Gemm(x, W, transB=1) reads the projection as stored (a
        # 3-D one traces MatMul(x, Wᵀ) with a transposed copy of W, as large as the vocabulary's embedding)
        flat = model.lm_head(model.decoder.finished(x).reshape(-1, x.shape[-1])).reshape(x.shape[0], length, -1)
        log_probs = (flat + model.final_logits_bias).log_softmax(-1)
        target = log_probs.gather(2, target_ids[:, :, None])[:, :, 0]
        return (target, log_probs[:, -1], attention, *presents)


def _example_inputs(model: Transformer) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Example tensors whose dynamic sizes (batch 3, src_len 7, past_len 2) differ from every static one."""
    cfg = model.config
    src = example_source(cfg)
    with torch.no_grad():
        state = model.init_state(model.encode(src))
        for token in (cfg.decoder_start_id, 5 % cfg.vocab_size):
            _, _, state = model.decode_step(torch.full((3,), token), state)
    n = len(model.decoder.layers)
    cross = [state[f"{kind}.{i}"] for i in range(n) for kind in ("cross_key", "cross_value")]
    past = [state[f"{kind}.{i}"] for i in range(n) for kind in ("self_key", "self_value")]
    return src, (src != cfg.pad_id).to(torch.int32), cross, past


def _names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]


def _trace_to_input(graph: onnx.GraphProto, name: str) -> tuple[str | None, list[onnx.NodeProto]]:
    """Follow ``name`` back through Reshape/Transpose/Identity to a graph input; returns (input, chain)."""
    inputs = {value.name for value in graph.input}
    made = producers(graph)
    chain: list[onnx.NodeProto] = []
    while name not in inputs:
        node = made.get(name)
        if node is None or node.op_type not in ("Reshape", "Transpose", "Identity"):
            return None, chain
        chain.append(node)
        name = node.input[0]
    return name, chain


def _is_bnsh_to_bsd(chain: list[onnx.NodeProto]) -> bool:
    """Is ``chain`` (consumer first) ``Reshape(Transpose(x, [0, 2, 1, 3]))``: [B, H, S, Dh] -> [B, S, H*Dh]?"""
    ops = [node.op_type for node in chain if node.op_type != "Identity"]
    transposes = [node for node in chain if node.op_type == "Transpose"]
    return ops == ["Reshape", "Transpose"] and perm(transposes[0]) == [0, 2, 1, 3]


def feed_cross_kv_directly(model: onnx.ModelProto) -> list[int]:
    """Make each fused cross-attention node read ``cross_key_i``/``cross_value_i`` 4-D, as they come
    from the encoder (the rewriter emits Transpose + Reshape back to 3-D every step). Returns the
    decoder layers whose cross-attention is a fused node."""
    graph = model.graph
    layers: list[int] = []
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type != MHA or len(node.input) < 3:
            continue
        key, key_chain = _trace_to_input(graph, node.input[1])
        value, value_chain = _trace_to_input(graph, node.input[2])
        if key is None or not key.startswith("cross_key_"):
            continue
        layer = int(key.rsplit("_", 1)[1])
        if value != f"cross_value_{layer}":
            raise NmtError(f"cross-attention of decoder layer {layer} pairs {key} with {value}")
        if _is_bnsh_to_bsd(key_chain) and _is_bnsh_to_bsd(value_chain):
            node.input[1], node.input[2] = key, value  # MultiHeadAttention takes K/V as [B, H, S, Dh] too
        layers.append(layer)
    prune(model)
    return sorted(layers)


def _padding_condition(bias: str, made: dict[str, onnx.NodeProto], constants: dict[str, onnx.TensorProto]) -> bool:
    """Is ``bias`` the additive padding mask ``[Expand](Where(cond, 0, very negative))`` whose ``cond``
    comes from ``src_ids``/``src_mask`` through Equal/Not/Unsqueeze/Cast alone? (``made``: each
    tensor's producer; ``constants``: the initializers.)"""
    node = made.get(bias)
    if node is not None and node.op_type == "Expand":
        node = made.get(node.input[0])
    if node is None or node.op_type != "Where" or not all(name in constants for name in node.input[1:]):
        return False
    keep, drop = (float(onnx.numpy_helper.to_array(constants[name])) for name in node.input[1:])
    if keep != 0.0 or drop > -1e30:
        return False
    frontier = [node.input[0]]
    while frontier:
        name = frontier.pop()
        if name in ("src_ids", "src_mask") or name in constants:
            continue
        step = made.get(name)
        if step is None or step.op_type not in ("Equal", "Not", "Unsqueeze", "Cast"):
            return False
        frontier.extend(step.input)
    return True


def use_key_padding_mask(model: onnx.ModelProto) -> int:
    """Hand every fused attention node the ``src_mask`` (int32, 1 = token) as its ``key_padding_mask``
    instead of the additive [batch, 1, query, src_len] bias the rewriter builds from it: the graph no
    longer materialises that bias (once per step in the decoder), and ONNX Runtime's kernel applies the
    mask more cheaply. Returns the number of attention nodes changed."""
    graph = model.graph
    names = {value.name for value in [*graph.input, *graph.output]} | {o for node in graph.node for o in node.output}
    if "src_mask" not in names:
        return 0
    made, constants = producers(graph), {init.name: init for init in graph.initializer}
    changed = 0
    for node in graph.node:
        if (node.op_type == MHA and len(node.input) > 5 and node.input[5] and not node.input[4]
                and _padding_condition(node.input[5], made, constants)):
            node.input[4], node.input[5] = "src_mask", ""
            changed += 1
    prune(model)
    return changed


def cross_attention_node(model: onnx.ModelProto, layer: int) -> onnx.NodeProto | None:
    for node in model.graph.node:
        if node.op_type == MHA and len(node.input) > 1 and node.input[1] == f"cross_key_{layer}":
            return node
    return None


def self_attention_layers(model: onnx.ModelProto) -> list[int]:
    """Decoder layers whose self-attention is a fused node reading ``past_key_i`` (MultiHeadAttention as
    traced, GroupQueryAttention after :func:`use_inplace_cache`)."""
    layers = []
    for node in model.graph.node:
        past = {MHA: 6, GQA: 3}.get(node.op_type)
        if past is not None and len(node.input) > past and node.input[past].startswith("past_key_"):
            layers.append(int(node.input[past].rsplit("_", 1)[1]))
    return sorted(layers)


def use_inplace_cache(model: onnx.ModelProto, heads: int, layers: int) -> None:
    """Turn every decoder layer's fused self-attention ``MultiHeadAttention(q, k, v, past_key_i,
    past_value_i)`` (present = concat(past, new)) into ``GroupQueryAttention(q, k, v, past_key_i,
    past_value_i, seqlens_k, total_sequence_length)`` with ``num_heads = kv_num_heads = heads``: ``seqlens_k``
    is ``positions`` (int32: the row's cached length; its new entry goes there) and
    ``total_sequence_length`` the capacity of ``past_key_0`` (axis 2). Same arithmetic per row; present
    keeps the past's shape and, bound to the same memory, is the past buffer updated in place."""
    graph = model.graph
    rewritten = []
    for index, node in enumerate(graph.node):
        if node.op_type != MHA or len(node.input) <= 7 or not node.input[6].startswith("past_key_"):
            continue
        layer = int(node.input[6].rsplit("_", 1)[1])
        if any(node.input[3:6]) or node.input[7] != f"past_value_{layer}" or len(node.output) != 3:
            raise NmtError(f"decoder layer {layer}'s self-attention has a bias, a mask or an unexpected past; "
                           "the in-place cache takes plain q, k, v")
        scale = [a for a in node.attribute if a.name == "scale"]
        gqa = helper.make_node(GQA, [*node.input[:3], node.input[6], node.input[7], "cache_seqlens", "cache_capacity"],
                               list(node.output), name=f"self_attention_{layer}", domain="com.microsoft",
                               num_heads=heads, kv_num_heads=heads)
        gqa.attribute.extend(scale)
        graph.node[index].CopyFrom(gqa)
        rewritten.append(layer)
    if sorted(rewritten) != list(range(layers)):
        raise NmtError(f"the in-place KV cache needs every decoder layer's self-attention fused; layers "
                       f"{sorted(set(range(layers)) - set(rewritten))} were not")
    graph.initializer.append(helper.make_tensor("cache_capacity_axis", TensorProto.INT64, [], [2]))
    graph.node.insert(0, helper.make_node("Cast", [POSITIONS], ["cache_seqlens"], to=TensorProto.INT32))
    graph.node.insert(0, helper.make_node("Cast", ["cache_capacity_64"], ["cache_capacity"], to=TensorProto.INT32))
    graph.node.insert(0, helper.make_node("Gather", ["cache_shape", "cache_capacity_axis"], ["cache_capacity_64"]))
    graph.node.insert(0, helper.make_node("Shape", ["past_key_0"], ["cache_shape"]))
    prune(model)


def add_attention_output(model: onnx.ModelProto, node: onnx.NodeProto, head_dim: int) -> None:
    """Expose ``attention`` [batch, src_len]: mean over heads of softmax(q·kᵀ·scale), 0 where ``src_mask`` is 0.

    Built from standard operators beside the fused cross-attention ``node`` (whose projected query
    [batch, 1, d_model] and ``cross_key_i`` [batch, heads, src_len, head_dim] it reads), not from
    MultiHeadAttention's optional ``qk`` output: ONNX Runtime's CUDA kernel does not write ``qk`` when a
    key padding mask is given, so that output would be uninitialised memory on GPUs. Every provider runs
    these operators the same way."""
    if len(node.input) > 3 and node.input[3]:
        raise NmtError("the alignment layer's cross-attention has a packed Q/K/V bias; this export reads the "
                       "query after its bias")
    scale = next((a.f for a in node.attribute if a.name == "scale" and a.f), 1.0 / float(np.sqrt(head_dim)))
    graph = model.graph
    constants = [  # q [B, 1, H·Dh] -> [B, H, Dh, 1]: K [B, H, L, Dh] @ q = scores [B, H, L, 1], no transpose
        helper.make_tensor("attention_query_shape", TensorProto.INT64, [4], [0, -1, head_dim, 1]),
        helper.make_tensor("attention_scale", TensorProto.FLOAT, [], [scale]),
        helper.make_tensor("attention_mask_axes", TensorProto.INT64, [2], [1, 3]),
        helper.make_tensor("attention_head_axis", TensorProto.INT64, [1], [1]),
        helper.make_tensor("attention_column_axis", TensorProto.INT64, [1], [2]),
        helper.make_tensor("attention_minus_inf", TensorProto.FLOAT, [], [-np.inf]),
    ]
    graph.initializer.extend(constants)
    graph.node.extend([
        helper.make_node("Reshape", [node.input[0], "attention_query_shape"], ["attention_q"]),
        helper.make_node("MatMul", [node.input[1], "attention_q"], ["attention_dot"]),
        helper.make_node("Mul", ["attention_dot", "attention_scale"], ["attention_qk"]),
        helper.make_node("Cast", ["src_mask"], ["attention_keep"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["attention_keep", "attention_mask_axes"], ["attention_keep_4d"]),
        helper.make_node("Where", ["attention_keep_4d", "attention_qk", "attention_minus_inf"], ["attention_scores"]),
        helper.make_node("Softmax", ["attention_scores"], ["attention_probs"], axis=2),
        helper.make_node("ReduceMean", ["attention_probs", "attention_head_axis"], ["attention_mean"], keepdims=0),
        helper.make_node("Squeeze", ["attention_mean", "attention_column_axis"], ["attention"]),
    ])
    graph.output.append(helper.make_tensor_value_info("attention", TensorProto.FLOAT, ["batch", "src_len"]))


def _forced_graph(model: Transformer, src: Tensor, src_mask: Tensor, cross: list[Tensor], opset: int,
                  shapes: dict[str, list], store: WeightStore | None) -> onnx.ModelProto:
    """``decoder_forced.onnx``: :class:`ForcedGraph`, fused like the step decoder (the alignment layer's
    cross-attention stays unfused: its weights are an output)."""
    cfg = model.config
    layers, heads = cfg.decoder_layers, cfg.heads
    batch = torch.export.Dim("batch", min=1, max=4096)
    src_len = torch.export.Dim("src_len", min=1, max=cfg.max_positions)
    tgt_len = torch.export.Dim("tgt_len", min=1, max=cfg.max_positions)
    generator = torch.Generator().manual_seed(1)
    targets = torch.randint(4, max(cfg.vocab_size, 5), (src.shape[0], 5), generator=generator)  # tgt_len 5
    inputs = torch.cat([torch.full((src.shape[0], 1), cfg.decoder_start_id), targets[:, :-1]], 1)
    cross_names, present_names = _names("cross", layers), _names("present", layers)
    forced = torch_to_onnx(
        ForcedGraph(model), (inputs, targets, src_mask, *cross),
        input_names=["input_ids", "target_ids", "src_mask", *cross_names],
        output_names=["target_log_probs", "last_log_probs", "attention", *present_names],
        dynamic_shapes=({0: batch, 1: tgt_len}, {0: batch, 1: tgt_len}, {0: batch, 1: src_len},
                        tuple([{0: batch, 2: src_len}] * len(cross))),
        opset=opset, fuse=True, what="Transformer decoder forced pass", store=store,
    )
    feed_cross_kv_directly(forced)
    cancel_transposes(forced)
    use_key_padding_mask(forced)
    head_dim = cfg.d_model // heads
    set_io_shapes(forced, {**shapes, "input_ids": ["batch", "tgt_len"], "target_ids": ["batch", "tgt_len"],
                           "target_log_probs": ["batch", "tgt_len"], "last_log_probs": ["batch", cfg.vocab_size],
                           "attention": ["batch", "tgt_len", "src_len"],
                           **{name: ["batch", heads, "tgt_len", head_dim] for name in present_names}})
    return forced


def export_transformer(model: Transformer, opset: int, store: WeightStore | None = None) -> GraphSet:
    """The fused encoder and decoder step graphs of ``model`` (see the module docstring for their I/O).
    With ``store``, each graph's weights go there as soon as the graph is made (:func:`export.tracing.stored`)."""
    cfg = model.config
    layers, heads = cfg.decoder_layers, cfg.heads
    head_dim = cfg.d_model // heads
    model = untie(model, "lm_head", "shared")
    src, src_mask, cross, past = _example_inputs(model)
    batch = torch.export.Dim("batch", min=1, max=4096)
    src_len = torch.export.Dim("src_len", min=1, max=cfg.max_positions)
    past_len = torch.export.Dim("past_len", min=0, max=cfg.max_positions - 1)
    cross_names, past_names, present_names = _names("cross", layers), _names("past", layers), _names("present", layers)

    encoder = torch_to_onnx(
        EncoderGraph(model), (src,), input_names=["src_ids"], output_names=["src_mask", *cross_names],
        dynamic_shapes=({0: batch, 1: src_len},), opset=opset, fuse=True, what="Transformer encoder", store=store,
    )
    step_args = dict(
        input_names=["input_ids", POSITIONS, "src_mask", *cross_names, *past_names],
        dynamic_shapes=(
            {0: batch}, {0: batch}, {0: batch, 1: src_len},
            tuple([{0: batch, 2: src_len}] * len(cross) + [{0: batch, 2: past_len}] * len(past)),
        ),
        opset=opset, fuse=True, store=store,
    )
    step_inputs = (src[:, 0], torch.tensor([2, 2, 2]), src_mask, *cross, *past)
    decoder = torch_to_onnx(StepGraph(model), step_inputs, output_names=["log_probs", *present_names],
                            what="Transformer decoder step", **step_args)
    cross_layers = feed_cross_kv_directly(decoder)
    self_layers = self_attention_layers(decoder)
    use_inplace_cache(decoder, heads, layers)
    for graph in (encoder, decoder):
        cancel_transposes(graph)
        use_key_padding_mask(graph)

    shapes: dict[str, list] = {"src_ids": ["batch", "src_len"], "src_mask": ["batch", "src_len"],
                               "input_ids": ["batch"], POSITIONS: ["batch"], "log_probs": ["batch", cfg.vocab_size],
                               "attention": ["batch", "src_len"]}
    shapes.update({name: ["batch", heads, "src_len", head_dim] for name in cross_names})
    shapes.update({name: ["batch", heads, "capacity", head_dim] for name in [*past_names, *present_names]})
    set_io_shapes(encoder, shapes)
    set_io_shapes(decoder, shapes)
    encoder, decoder = stored(encoder, store), stored(decoder, store)

    alignment_layer = cfg.alignment_layer % layers
    if alignment_layer in cross_layers:  # standard operators beside the fused node give the attention
        decoder_attention = onnx.ModelProto()
        decoder_attention.CopyFrom(decoder)
        add_attention_output(decoder_attention, cross_attention_node(decoder_attention, alignment_layer), head_dim)
        decoder_attention = stored(decoder_attention, store)
    else:  # fallback (--allow-unfused): export the step again with the alignment layer unfused
        decoder_attention = torch_to_onnx(
            StepGraph(model, need_attention=True), step_inputs, output_names=["log_probs", *present_names, "attention"],
            what="Transformer decoder step with attention", **step_args,
        )
        feed_cross_kv_directly(decoder_attention)
        use_inplace_cache(decoder_attention, heads, layers)
        cancel_transposes(decoder_attention)
        use_key_padding_mask(decoder_attention)
        set_io_shapes(decoder_attention, shapes)
        decoder_attention = stored(decoder_attention, store)

    return GraphSet(
        encoder=encoder,
        decoder=decoder,
        decoder_attention=decoder_attention,
        decoder_forced=stored(_forced_graph(model, src, src_mask, cross, opset, shapes, store), store),
        decoder_static=["src_mask", *cross_names],
        decoder_state=[
            StateTensor(input=name, output=name.replace("past_", "present_"), init="buffer",
                        shape=[heads, 0, head_dim], dtype="float32", capacity_axis=2)
            for name in past_names
        ],
        decoder_positions=POSITIONS,
        static_src_axes={"src_mask": 1, **{name: 2 for name in cross_names}},
        attention_total=cfg.encoder_layers + 2 * layers,
        attention_fused=min(count_ops(encoder)[MHA], cfg.encoder_layers)
        + len(set(cross_layers)) + len(set(self_layers)),
    )
