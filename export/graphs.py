"""What an architecture's graph exporter returns (see :mod:`export.registry` for the exporters)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from common.model_format.manifest import StateTensor


@dataclass
class GraphSet:
    """What an architecture exporter produces: three graphs (four with a forced pass) and their I/O description."""

    encoder: onnx.ModelProto
    decoder: onnx.ModelProto
    decoder_attention: onnx.ModelProto
    decoder_static: list[str]
    decoder_state: list[StateTensor]
    static_src_axes: dict[str, int]
    attention_total: int  # attention blocks that have a fused ONNX Runtime lowering (all must be fused)
    attention_fused: int
    decoder_forced: onnx.ModelProto | None = None  # the decoder over given positions in one call (Transformer)
    decoder_positions: str = ""  # the decoder's per-row position input (a "buffer" state), else ""

    def release(self) -> dict[str, onnx.ModelProto]:
        """:meth:`graphs`, no longer held here: the caller frees each graph when done with it."""
        graphs = self.graphs()
        self.encoder = self.decoder = self.decoder_attention = self.decoder_forced = None  # type: ignore[assignment]
        return graphs

    def graphs(self) -> dict[str, onnx.ModelProto]:
        graphs = {"encoder": self.encoder, "decoder": self.decoder, "decoder_attention": self.decoder_attention}
        return graphs | ({"decoder_forced": self.decoder_forced} if self.decoder_forced is not None else {})
