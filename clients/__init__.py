"""Python client of the ``translation.v1.Translator`` service, and the ``nmt translate`` command.

::

    from clients import TranslatorClient

    with TranslatorClient("127.0.0.1:50051") as client:
        [result] = client.translate("one two", attention=True)
        print(result.hypotheses[0].text, result.hypotheses[0].attention.pharaoh)

The names below are loaded on first use (PEP 562), so importing :mod:`clients.translate_cli` to build
``nmt --help`` does not import grpc.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TranslatorClient": "clients.client",
    "AsyncTranslatorClient": "clients.client",
    "RetryPolicy": "clients.client",
    "TranslationError": "clients.messages",
    "Translation": "clients.messages",
    "Hypothesis": "clients.messages",
    "Segment": "clients.messages",
    "TextWord": "clients.messages",
    "Attention": "clients.messages",
    "ModelInfo": "clients.messages",
    "GlossaryInfo": "clients.messages",
    "StreamDelta": "clients.messages",
    "alignment_grid": "clients.render",
    "save_heatmap": "clients.render",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clients' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
