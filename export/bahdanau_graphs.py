"""ONNX graphs of the RNN encoder-decoder with attention (Bahdanau / Luong scores).

The recurrent layers export as ONNX ``GRU`` nodes (PyTorch's gate order and ``linear_before_reset=1``
are handled by the exporter): two in the encoder (forward and, over each sentence reversed within its
length, backward), one with sequence length 1 in the decoder step. No Loop or Scan anywhere.

Graph I/O (the contract of :mod:`common.model_format.manifest`):

* encoder: ``src_ids`` int64 [batch, src_len] -> ``memory`` [batch, src_len, 2 * encoder_hidden],
  ``keys`` [batch, src_len, K] (``U h``, computed once per sentence; ``K`` = attention_dim for additive,
  decoder_hidden for general, 2 * encoder_hidden for dot), ``src_mask`` int32 [batch, src_len]
  (1 = token, 0 = pad), and the initial decoder state ``hidden`` [batch, decoder_hidden]
  (``tanh(W_init h_backward)``) and ``context`` [batch, 2 * encoder_hidden] (zeros);
* decoder step: ``input_ids`` int64 [batch], ``memory``, ``keys``, ``src_mask``, ``hidden``, ``context``
  -> ``log_probs`` [batch, vocab], ``hidden_out``, ``context_out`` (+ ``attention`` [batch, src_len]).
  The step does the GRU cell, ``W s``, tanh, ``v``, softmax, the context and the output layer only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from common.errors import NmtError
from common.model_format.manifest import StateTensor
from common.model_format.weights import WeightStore
from export.graph_passes import count_ops, remove_output, set_io_shapes
from export.graphs import GraphSet
from export.tracing import example_source, stored, torch_to_onnx, untie
from training.models.bahdanau import Bahdanau

STATIC = ["memory", "keys", "src_mask"]
STATE = [("hidden", "hidden_out"), ("context", "context_out")]
UNROLLED = {"Loop", "Scan", "If"}


class EncoderGraph(nn.Module):
    """src_ids -> (memory, keys, src_mask, hidden, context)."""

    def __init__(self, model: Bahdanau) -> None:
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor) -> tuple[Tensor, ...]:
        state = self.model.init_state(self.model.encode(src_ids))
        return state["memory"], state["keys"], state["src_mask"].to(torch.int32), state["hidden"], state["context"]


class StepGraph(nn.Module):
    """(input_ids, memory, keys, src_mask, hidden, context) -> (log_probs, hidden_out, context_out, attention)."""

    def __init__(self, model: Bahdanau) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: Tensor, memory: Tensor, keys: Tensor, src_mask: Tensor, hidden: Tensor, context: Tensor
    ) -> tuple[Tensor, ...]:
        state = {"memory": memory, "keys": keys, "src_mask": src_mask != 0, "hidden": hidden, "context": context}
        logits, attention, state = self.model.decode_step(input_ids, state, need_attention=True)
        return logits.log_softmax(-1), state["hidden"], state["context"], attention


def export_bahdanau(model: Bahdanau, opset: int, store: WeightStore | None = None) -> GraphSet:
    """The encoder and decoder step graphs of ``model`` (see the module docstring for their I/O); with
    ``store``, their weights go there (:meth:`WeightStore.externalize`)."""
    cfg = model.config
    model = untie(model, "generator", "tgt_embed")
    src = example_source(cfg)
    with torch.no_grad():
        state = model.init_state(model.encode(src))
    batch = torch.export.Dim("batch", min=1, max=4096)
    src_len = torch.export.Dim("src_len", min=1, max=4096)

    encoder = torch_to_onnx(
        EncoderGraph(model), (src,), input_names=["src_ids"], output_names=[*STATIC, "hidden", "context"],
        dynamic_shapes=({0: batch, 1: src_len},), opset=opset, what="Bahdanau encoder", store=store,
    )
    step_inputs = (src[:, 0], state["memory"], state["keys"], state["src_mask"].to(torch.int32),
                   state["hidden"], state["context"])
    decoder_attention = torch_to_onnx(
        StepGraph(model), step_inputs,
        input_names=["input_ids", *STATIC, "hidden", "context"],
        output_names=["log_probs", "hidden_out", "context_out", "attention"],
        dynamic_shapes=({0: batch}, {0: batch, 1: src_len}, {0: batch, 1: src_len}, {0: batch, 1: src_len},
                        {0: batch}, {0: batch}),
        opset=opset, what="Bahdanau decoder step", store=store,
    )
    decoder = remove_output(decoder_attention, "attention")

    memory_dim = 2 * cfg.encoder_hidden
    key_dim = state["keys"].shape[-1]
    shapes = {
        "src_ids": ["batch", "src_len"], "src_mask": ["batch", "src_len"], "input_ids": ["batch"],
        "memory": ["batch", "src_len", memory_dim], "keys": ["batch", "src_len", key_dim],
        "hidden": ["batch", cfg.decoder_hidden], "hidden_out": ["batch", cfg.decoder_hidden],
        "context": ["batch", memory_dim], "context_out": ["batch", memory_dim],
        "log_probs": ["batch", cfg.vocab_size], "attention": ["batch", "src_len"],
    }
    for graph in (encoder, decoder, decoder_attention):
        set_io_shapes(graph, shapes)
        if UNROLLED & set(count_ops(graph)):
            raise NmtError(f"the exported Bahdanau graph contains {UNROLLED & set(count_ops(graph))} nodes")
    if count_ops(encoder)["GRU"] != 2 or count_ops(decoder)["GRU"] != 1:
        raise NmtError(f"expected 2 GRU nodes in the encoder and 1 in the decoder step, found "
                       f"{count_ops(encoder)['GRU']} and {count_ops(decoder)['GRU']}")
    encoder, decoder, decoder_attention = (stored(graph, store) for graph in (encoder, decoder, decoder_attention))
    return GraphSet(
        encoder=encoder,
        decoder=decoder,
        decoder_attention=decoder_attention,
        decoder_static=list(STATIC),
        decoder_state=[StateTensor(input=name, output=output, init="encoder") for name, output in STATE],
        static_src_axes={"memory": 1, "keys": 1, "src_mask": 1},
        attention_total=0,  # additive/Luong attention has no fused ONNX Runtime kernel (a few small ops)
        attention_fused=0,
    )
