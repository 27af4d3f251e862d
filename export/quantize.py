"""Reduced-precision copies of an exported graph: dynamic int8 (CPUs) and fp16 (GPUs)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import onnx
from onnx import TensorProto

from common.errors import NmtError
from export.fp16_casts import block_fp16_inputs, fold_casts
from export.graph_passes import gemm_to_matmul, undo_one_position_gemms
from export.tracing import MAX_IR_VERSION, quiet


def quantize_int8(source: Path, target: Path, *, per_channel: bool) -> None:
    """Dynamic int8 quantization of the MatMul weights (GRU and attention kernels stay fp32)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
    undo_one_position_gemms(model)
    gemm_to_matmul(model)
    prepared = target.with_suffix(".fp32.onnx")
    onnx.save(model, str(prepared))
    try:
        with quiet():
            quantize_dynamic(
                prepared, target, op_types_to_quantize=["MatMul"], per_channel=per_channel,
                weight_type=QuantType.QInt8,
                # onnx shape inference cannot type the outputs of com.microsoft ops; all tensors are float
                extra_options={"DefaultTensorType": TensorProto.FLOAT},
            )
    except Exception as error:
        raise NmtError(f"int8 quantization of {source.name} failed: {type(error).__name__}: {error}") from error
    finally:
        prepared.unlink(missing_ok=True)
    quantized = onnx.load(str(target))
    quantized.ir_version = min(quantized.ir_version, MAX_IR_VERSION)
    # quantize_dynamic's shape inference pins dynamic sizes it can compute (top_k's default 1 becomes a fixed
    # [batch, 1] top_ids); the engine binds outputs by their declared shapes, so keep the exported ones
    declared = {value.name: value.type for value in [*model.graph.input, *model.graph.output]}
    for value in [*quantized.graph.input, *quantized.graph.output]:
        if value.name in declared:
            value.type.CopyFrom(declared[value.name])
    onnx.save(quantized, str(target))


# computed in fp32 inside an fp16 graph: the normalisations whose sums lose small terms in fp16 (ONNX Runtime's
# LayerNorm-type kernels and MultiHeadAttention accumulate in fp32 themselves), and TopK, so that the scores
# and the order of the served candidates come from fp32 log-probabilities
FP32_OPS = ("Softmax", "LogSoftmax", "ReduceMean", "TopK")


def convert_fp16(source: Path, target: Path, fp16_io: Collection[str] = ()) -> None:
    """fp16 weights and activations, with :data:`FP32_OPS` (and ONNX Runtime's own block list) kept in fp32.

    The graph's inputs and outputs stay fp32 (``keep_io_types``), so the serving engine and the manifest's
    I/O contract do not change; casts at the edges cost a few microseconds per step. The converter leaves in
    fp16 a blocked node whose input it could not type (the forced pass's softmaxes): those are blocked here
    (:func:`export.fp16_casts.block_fp16_inputs`), and the chains between fp32 operators and fp32 outputs are
    folded (:func:`export.fp16_casts.fold_casts`: log-probabilities, top-k and EOS scores come out of the fp32
    operators as they are, not through fp16 and back). Except ``fp16_io`` (:func:`export.stages._fp16_io`):
    the in-place KV cache buffers, fp16 like the GroupQueryAttention that reads and writes them in place
    (a cast in between would copy the whole cache every step; CUDA's kernel takes only fp16/bf16), and the
    cross-attention keys and values that the encoder writes once and the decoders read at every step."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    blocked = [*DEFAULT_OP_BLOCK_LIST, *FP32_OPS]
    model = onnx.load(str(source))
    keep = [value.name for value in [*model.graph.input, *model.graph.output] if value.name not in set(fp16_io)]
    try:
        with quiet():
            converted = convert_float_to_float16(model, keep_io_types=keep, op_block_list=blocked,
                                                 disable_shape_infer=True)
    except Exception as error:
        raise NmtError(f"fp16 conversion of {source.name} failed: {type(error).__name__}: {error}") from error
    # the converter types a blocked node's output by the graph output it feeds (fp16): let ONNX Runtime infer it
    kept_fp32 = {output for node in converted.graph.node if node.op_type in blocked for output in node.output}
    value_info = [info for info in converted.graph.value_info if info.name not in kept_fp32]
    del converted.graph.value_info[:]
    converted.graph.value_info.extend(value_info)
    block_fp16_inputs(converted, FP32_OPS)
    fold_casts(converted, FP32_OPS)
    if converted.ir_version > MAX_IR_VERSION:
        converted.ir_version = MAX_IR_VERSION
    onnx.save(converted, str(target))
