"""The interface every translation model implements (the architectures and checkpoint I/O import it).

Decoding (reference search, ONNX export, the serving engine) only talks to this interface:
``encode`` once, then ``decode_step`` one target token at a time with an incremental state that
``reorder_state`` rearranges when beams are pruned. States are flat ``dict[str, Tensor]`` whose
tensors all have the batch (or beam) on dimension 0, so reordering is generic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor, nn

EncoderOutput = dict[str, Tensor]
DecoderState = dict[str, Tensor]


class Seq2SeqModel(nn.Module, ABC):
    """Encoder-decoder with incremental decoding.

    Shapes: ``B`` batch, ``S`` source length, ``T`` target length, ``V`` vocabulary.
    """

    arch: str
    config: Any

    @abstractmethod
    def encode(self, src: Tensor) -> EncoderOutput:
        """``src`` [B, S] int64 (padded with pad id) -> encoder output tensors (batch first)."""

    @abstractmethod
    def init_state(self, enc: EncoderOutput) -> DecoderState:
        """Decoder state before the first step (precomputes everything that depends on the source only)."""

    @abstractmethod
    def decode_step(
        self, tokens: Tensor, state: DecoderState, need_attention: bool = False
    ) -> tuple[Tensor, Tensor | None, DecoderState]:
        """One step: previous tokens [B] -> (logits [B, V], cross-attention [B, S] or None, new state)."""

    @abstractmethod
    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced decoding: ``src`` [B, S], ``tgt_in`` [B, T] -> logits [B, T, V]."""

    @staticmethod
    def reorder_state(state: DecoderState, index: Tensor) -> DecoderState:
        """Select/duplicate rows of every state tensor (beam pruning, batch shrinking)."""
        return {name: value.index_select(0, index) for name, value in state.items()}
