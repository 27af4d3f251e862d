"""Dynamic int8 quantization of an exported graph's MatMul weights (GRU and attention kernels stay fp32)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto

from export.graph_passes import gemm_to_matmul
from export.tracing import MAX_IR_VERSION, quiet
from nmt.errors import NmtError


def quantize_int8(source: Path, target: Path, *, per_channel: bool) -> None:
    """Dynamic int8 quantization of the MatMul weights (GRU and attention kernels stay fp32)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
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
    if quantized.ir_version > MAX_IR_VERSION:
        quantized.ir_version = MAX_IR_VERSION
        onnx.save(quantized, str(target))
