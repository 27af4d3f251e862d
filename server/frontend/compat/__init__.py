"""The HTTP APIs that existing tools speak (LibreTranslate, DeepL), on the HTTP face, as adapters onto the
Translator's own methods: each turns its request into a ``TranslateRequest`` (or another of the proto's
messages), calls the servicer through the interceptor under a method label of its own (so authentication,
limits, the scheduler, metrics and logs are the native calls'), and writes the answer in its API's shapes and
status codes. ``--compat-apis`` says which are served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from server.frontend.compat.common import Caller
from server.frontend.compat.deepl import DeepLApi
from server.frontend.compat.libretranslate import LibreTranslateApi
from server.frontend.interceptor import RequestInterceptor

FACES = {"libretranslate": LibreTranslateApi, "deepl": DeepLApi}  # server.config.COMPAT_APIS


def compat_routes(app: web.Application, servicer: Any, interceptor: RequestInterceptor, apis: Sequence[str]) -> None:
    """Add the routes of each API in ``apis`` (:data:`server.config.COMPAT_APIS`) to ``app``."""
    caller = Caller(servicer, interceptor)
    for name in apis:
        FACES[name](caller).add_routes(app)
