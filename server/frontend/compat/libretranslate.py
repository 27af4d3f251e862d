"""LibreTranslate's API (as its server and its clients speak it: ``libretranslatepy``, Weblate, browser add-ons).

* ``POST /translate``: ``q`` (a string or a list), ``source`` (a code or ``auto``), ``target``, ``format``
  (``text`` or ``html``), ``alternatives`` (how many other translations besides the best: the n-best of a
  beam of ``alternatives + 1``), ``api_key``; JSON or a form. Answers ``{"translatedText": ...}`` (a string,
  or a list for a list), with ``detectedLanguage`` (``{"language", "confidence"}``, confidence 0-100) for
  ``auto`` and ``alternatives`` when asked.
* ``POST /detect``: ``q`` -> ``[{"language", "confidence"}]``, the served source languages best first.
* ``GET /languages``: ``[{"code", "name", "targets"}]``, the served source languages.

Errors are ``{"error": message}`` with LibreTranslate's statuses: 400 for a bad request (a missing
parameter, an unserved language pair), 403 for a missing or refused ``api_key`` where tokens are on, 429 when
the server is full, 500 otherwise (503 while it drains). ``api_key`` is the service's bearer token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from server.frontend.compat.common import Caller, CompatError, Failed, deadline, form_or_json, language_name
from server.protos import pb2

FORMATS = {"text": pb2.TEXT_FORMAT_PLAIN, "html": pb2.TEXT_FORMAT_HTML}
MAX_ALTERNATIVES = 7  # with the best, a beam of at most 8 (--max-beam's default)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class LibreTranslateApi:
    """The routes above, calling the servicer through ``caller``."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/translate", self.translate)
        app.router.add_post("/detect", self.detect)
        app.router.add_get("/languages", self.languages)

    async def _params(self, request: web.Request) -> tuple[dict[str, Any], dict[str, str], float | None]:
        """The request's parameters, the headers of its native call (``api_key`` as its bearer token) and the
        deadline of a ``grpc-timeout`` header."""
        params = await form_or_json(request)
        headers = dict(request.headers)
        key = params.get("api_key")
        if isinstance(key, str) and key and "Authorization" not in request.headers:
            headers["Authorization"] = f"Bearer {key}"
        return params, headers, deadline(request)

    async def translate(self, request: web.Request) -> web.Response:
        try:
            params, headers, timeout = await self._params(request)
            message, batch = self._translate_request(params)
        except CompatError as error:
            return _error(error.status, error.message)
        response, context = await self.caller.call("Translate", message, "libretranslate:translate", headers,
                                                   timeout)
        if isinstance(response, Failed):
            return _error(response.status, response.message, context.headers())
        texts = [t.hypotheses[0].text if t.hypotheses else "" for t in response.translations]
        body: dict[str, Any] = {"translatedText": texts if batch else texts[0]}
        if message.source_language == "auto":
            detected = [{"confidence": round(100 * t.detected_confidence, 1), "language": t.detected_language}
                        for t in response.translations]
            body["detectedLanguage"] = detected if batch else detected[0]
        if message.options.num_hypotheses > 1:
            others = [[h.text for h in t.hypotheses[1:]] for t in response.translations]
            body["alternatives"] = others if batch else others[0]
        return web.json_response(body, headers=context.headers())

    @staticmethod
    def _translate_request(params: dict[str, Any]) -> tuple[Any, bool]:
        """The ``TranslateRequest`` of ``/translate``'s parameters, and whether ``q`` was a list."""
        for name in ("q", "source", "target"):
            if params.get(name) in (None, "", []):
                raise CompatError(400, f"Invalid request: missing {name} parameter")
        q = params["q"]
        batch = isinstance(q, list)
        texts = q if batch else [q]
        if not all(isinstance(text, str) for text in texts):
            raise CompatError(400, "Invalid request: q must be a string or a list of strings")
        text_format = str(params.get("format") or "text").lower()
        if text_format not in FORMATS:
            raise CompatError(400, f"Invalid request: format {text_format!r} is not one of text, html")
        try:
            alternatives = int(params.get("alternatives") or 0)
        except (TypeError, ValueError):
            raise CompatError(400, "Invalid request: alternatives must be an integer") from None
        if not 0 <= alternatives <= MAX_ALTERNATIVES:
            raise CompatError(400, f"Invalid request: alternatives must be 0-{MAX_ALTERNATIVES}")
        options = pb2.DecodingOptions()
        if alternatives:
            options.beam_size = options.num_hypotheses = alternatives + 1
        return pb2.TranslateRequest(texts=texts, source_language=str(params["source"]),
                                    target_language=str(params["target"]), text_format=FORMATS[text_format],
                                    options=options), batch

    async def detect(self, request: web.Request) -> web.Response:
        try:
            params, headers, timeout = await self._params(request)
            q = params.get("q")
            if q in (None, ""):
                raise CompatError(400, "Invalid request: missing q parameter")
            if not isinstance(q, str):
                raise CompatError(400, "Invalid request: q must be a string")
        except CompatError as error:
            return _error(error.status, error.message)
        response, context = await self.caller.call("DetectLanguage", pb2.DetectLanguageRequest(texts=[q]),
                                                   "libretranslate:detect", headers, timeout)
        if isinstance(response, Failed):
            return _error(response.status, response.message, context.headers())
        [ranked] = response.texts
        return web.json_response([{"confidence": round(100 * d.confidence, 1), "language": d.language}
                                  for d in ranked.languages], headers=context.headers())

    async def languages(self, request: web.Request) -> web.Response:
        try:
            _, headers, timeout = await self._params(request)
        except CompatError as error:
            return _error(error.status, error.message)
        response, context = await self.caller.call("ListLanguages", pb2.ListLanguagesRequest(),
                                                   "libretranslate:languages", headers, timeout)
        if isinstance(response, Failed):
            return _error(response.status, response.message, context.headers())
        targets: dict[str, list[str]] = {}
        for pair in response.pairs:  # every language is listed, a target-only one with no targets (as clients
            targets.setdefault(pair.source_language, []).append(pair.target_language)  # check both ends there)
            targets.setdefault(pair.target_language, [])
        return web.json_response([{"code": code, "name": language_name(code), "targets": sorted(codes)}
                                  for code, codes in sorted(targets.items())], headers=context.headers())
