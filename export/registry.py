"""The graph exporters by architecture name.

Each architecture module defines one function ``(model, opset) -> GraphSet`` (:mod:`export.graphs`);
adding an architecture means one module and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable

from common.errors import NmtError
from export.bahdanau_graphs import export_bahdanau
from export.graphs import GraphSet
from export.transformer_graphs import export_transformer

GraphExporter = Callable[..., GraphSet]  # (model, opset, store=None) -> GraphSet
EXPORTERS: dict[str, GraphExporter] = {"transformer": export_transformer, "bahdanau": export_bahdanau}


def graph_exporter(arch: str) -> GraphExporter:
    """The graph exporter of architecture ``arch``."""
    if arch not in EXPORTERS:
        raise NmtError(f"no ONNX exporter for architecture {arch!r}; known: {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[arch]
