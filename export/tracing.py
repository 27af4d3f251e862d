"""PyTorch -> ONNX: tracing with ``torch.onnx.export(dynamo=True)`` and ONNX Runtime's fusions, and the
example inputs and model copies the architecture exporters trace."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from common.errors import NmtError
from common.model_format.weights import MIN_BYTES, WEIGHTS_FILE, WeightStore
from training.models.interface import Seq2SeqModel

MAX_IR_VERSION = 10  # what onnxruntime >= 1.20 reads; onnx 1.23 would write a newer one for edited graphs
PLAIN_DTYPES = frozenset(map(np.dtype, ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8",
                                        "bool")))  # laid out in ONNX's raw data as NumPy lays them out


def example_source(config: Any) -> Tensor:
    """Export example ``src`` [3, 7]: one row padded after an early EOS, so padding is traced; its sizes
    differ from every static dimension so the exporter cannot confuse dynamic axes with them."""
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, max(config.vocab_size, 5), (3, 7), generator=generator)
    src[:, -1] = config.eos_id
    src[1, 4:] = config.pad_id
    src[1, 3] = config.eos_id
    return src


def untie(model: Seq2SeqModel, projection: str, embedding: str) -> Seq2SeqModel:
    """``model`` (in eval mode) with its output projection given a parameter of its own over the
    embedding's storage (no copy; numerically the same model). Returns ``model``.

    A projection tied to the embedding is traced as one initializer read by both a Gather and a transposed
    MatMul/Gemm; dynamic int8 quantization then rewrites the shared tensor and breaks the Gather. Untied,
    they are two initializers of equal bytes, which :func:`common.model_format.weights.store_once` stores once.
    """
    layer = getattr(model.eval(), projection)
    if layer.weight is getattr(model, embedding).weight:
        layer.weight = nn.Parameter(layer.weight.detach(), requires_grad=False)
    return model


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Silence the exporter's progress prints, warnings and log lines; yields what it printed."""
    buffer = io.StringIO()
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            warnings.simplefilter("ignore")
            yield buffer
    finally:
        logging.disable(disabled)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch with ``count`` intra-op threads (tiny decoding steps are far slower with more on a busy host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def stored(graph: onnx.ModelProto, store: WeightStore | None) -> onnx.ModelProto:
    """``graph`` with every weight in ``store`` (without one: as it is): :func:`torch_to_onnx` wrote the traced
    ones there already; this takes those the edits after tracing added, and rebuilds the message small."""
    return store.externalize(graph) if store is not None else graph


def raw_bytes(tensor: Any) -> bytes | memoryview:
    """An ``onnx_ir`` tensor's raw data (little-endian bytes): a view of its memory where that is laid out
    as ONNX lays it out (no copy of a 119 MiB embedding while it is written), else ``tobytes()``."""
    try:
        array = tensor.numpy()
    except (TypeError, ValueError, RuntimeError):  # a type NumPy cannot hold
        return tensor.tobytes()
    if array.dtype not in PLAIN_DTYPES or array.dtype.byteorder == ">" or not array.flags.c_contiguous:
        return tensor.tobytes()
    return memoryview(array.reshape(-1)).cast("B")


def torch_to_onnx(
    module: nn.Module,
    args: tuple[Any, ...],
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: tuple[Any, ...],
    opset: int,
    fuse: bool = False,
    what: str = "graph",
    store: WeightStore | None = None,
) -> onnx.ModelProto:
    """``torch.onnx.export(dynamo=True)``, then (``fuse``) ONNX Runtime fusions via onnxscript's
    ``optimize_for_ort`` (attention -> ``com.microsoft.MultiHeadAttention``, residual + LayerNorm ->
    ``SkipLayerNormalization``). With ``store``, the weights are written there straight from the traced
    tensors and the graph refers to them (external data): no serialized copy of the weights is made."""
    import onnx_ir as ir

    module.eval()
    with quiet() as printed, torch.no_grad():
        try:
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, input_names=list(input_names),
                output_names=list(output_names), dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
            )
            model = program.model
            if fuse:
                from onnxscript.rewriter.ort_fusions import optimize_for_ort

                model, _ = optimize_for_ort(model)
        except Exception as error:  # the exporter raises many types; all mean "this graph did not export"
            tail = printed.getvalue().strip().splitlines()[-5:]
            raise NmtError(f"exporting the {what} failed: {type(error).__name__}: {str(error)[:2000]}"
                           + ("\n" + "\n".join(tail) if tail else "")) from error
    if store is not None:
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.dtype == ir.DataType.STRING:
                continue
            raw = raw_bytes(tensor)
            if len(raw) >= MIN_BYTES:
                offset, length = store.put(tensor.dtype.value, raw)
                value.const_value = ir.ExternalTensor(WEIGHTS_FILE, offset, length, tensor.dtype, shape=tensor.shape,
                                                      name=value.name)
    proto = ir.serde.serialize_model(model)
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    return proto
