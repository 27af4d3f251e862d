"""DeepL's API v2 (as its official clients speak it: ``deepl-python``, Weblate, CAT tools), over the served models.

* ``POST /v2/translate``: ``text`` (a list; form or JSON), ``target_lang`` (``DE``, ``EN-US``: a regional variant
  falls back to its language), ``source_lang`` (absent: detected), ``split_sentences`` (``1``: at sentence ends
  and newlines, ``nonewlines``, ``0``: not at all; with ``tag_handling`` the default is ``nonewlines``, as
  DeepL's), ``tag_handling`` (``html``, ``xml``), ``ignore_tags`` (copied unchanged: Weblate's ``<x id="N"/>``
  placeholders), ``splitting_tags`` (separate sentences), ``non_splitting_tags`` and ``outline_detection``
  (accepted: elements that are not blocks are inline here anyway), ``preserve_formatting`` (accepted: the gaps
  between sentences are always kept as they are), ``formality`` (``default``, ``prefer_more``,
  ``prefer_less`` accepted, as for a language without formality; ``more`` and ``less`` are 400: the models
  have no formality to choose), ``context`` (accepted, not read: a model translates one sentence at a time),
  ``model_type`` and ``show_billed_characters`` (accepted). Answers ``{"translations": [{"text",
  "detected_source_language", "billed_characters"}]}``.
* ``GET /v2/languages`` (``type=source`` or ``target``): the served languages, upper-cased, with their names.
* ``GET /v2/usage``: the characters this replica translated for the DeepL API since it started, and a
  ``character_limit`` of :data:`NO_LIMIT` (the service has no quota).
* ``glossary_id`` (with ``source_lang``, as DeepL's) on ``/v2/translate``: a stored glossary's terms are held in
  every translation (docs/glossaries.md).
* Glossaries (the server's ``--glossary-dir``; writing needs a token allowed to write glossaries where tokens are
  on): ``POST /v2/glossaries`` (``name``, ``source_lang``, ``target_lang``, ``entries``, ``entries_format``
  ``tsv`` or ``csv``; the id is made here, the name kept in the file), ``GET /v2/glossaries``, ``GET`` and
  ``DELETE /v2/glossaries/{id}``, ``GET /v2/glossaries/{id}/entries`` (TSV), ``GET
  /v2/glossary-language-pairs`` (the served pairs); an unknown id is DeepL's 404.

``Authorization: DeepL-Auth-Key KEY`` (or ``auth_key`` in the form) is the service's bearer token. Errors are
``{"message": ...}`` with DeepL's statuses: 400 (a bad parameter, an unserved language), 403 (a missing or
refused key where tokens are on), 413 (a body over the limit), 429 (the server is full), 500, 503 (draining);
456 (quota exceeded) never happens.
"""

from __future__ import annotations

import csv
import datetime
import io
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from aiohttp import web

from common.glossary_file import write_entries
from server.frontend.compat.common import Caller, CompatError, Failed, deadline, form_or_json, language_name
from server.protos import pb2

SPLITTING = {"0": pb2.SPLIT_OFF, "1": pb2.SPLIT_SENTENCES, "nonewlines": pb2.SPLIT_NO_NEWLINES}
FORMATS = {"html": pb2.TEXT_FORMAT_HTML, "xml": pb2.TEXT_FORMAT_XML}
FORMALITY = ("default", "prefer_more", "prefer_less")  # accepted; "more"/"less" ask for what no model does
NO_LIMIT = 10**12  # GET /v2/usage's character_limit: the service counts characters but has no quota
AUTH_SCHEME = "DeepL-Auth-Key "


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"message": message}, status=status, headers=headers)


def _names(value: Any) -> list[str]:
    """A tags parameter: a comma-separated string, or a list of them."""
    items = value if isinstance(value, list) else [value] if value else []
    return [name.strip() for item in items for name in str(item).split(",") if name.strip()]


def _flag(params: dict[str, Any], name: str) -> None:
    """Check that a boolean parameter DeepL accepts is one (``0``/``1``, ``true``/``false``)."""
    value = params.get(name)
    if value is not None and str(value).lower() not in ("0", "1", "true", "false"):
        raise CompatError(400, f"Value for '{name}' not supported.")


class DeepLApi:
    """The routes above, calling the servicer through ``caller``."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.characters = 0  # translated through this API by this process (GET /v2/usage)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v2/translate", self.translate)
        app.router.add_get("/v2/languages", self.languages)
        app.router.add_post("/v2/languages", self.languages)
        app.router.add_get("/v2/usage", self.usage)
        app.router.add_post("/v2/usage", self.usage)
        app.router.add_post("/v2/glossaries", self.create_glossary)
        app.router.add_get("/v2/glossaries", self.list_glossaries)
        app.router.add_get("/v2/glossaries/{glossary_id}", self.get_glossary)
        app.router.add_delete("/v2/glossaries/{glossary_id}", self.delete_glossary)
        app.router.add_get("/v2/glossaries/{glossary_id}/entries", self.glossary_entries)
        app.router.add_get("/v2/glossary-language-pairs", self.glossary_pairs)

    async def _params(self, request: web.Request) -> tuple[dict[str, Any], dict[str, str], float | None]:
        """The parameters, the native call's headers (the DeepL key as its bearer token) and its deadline."""
        params = await form_or_json(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "authorization"}
        given = request.headers.get("Authorization", "")
        key = given[len(AUTH_SCHEME):].strip() if given.startswith(AUTH_SCHEME) else params.get("auth_key")
        if isinstance(key, str) and key:
            headers["Authorization"] = f"Bearer {key}"
        elif given.lower().startswith("bearer "):
            headers["Authorization"] = given
        return params, headers, deadline(request)

    async def translate(self, request: web.Request) -> web.Response:
        try:
            params, headers, timeout = await self._params(request)
            message = self._translate_request(params)
        except CompatError as error:
            return _error(error.status, error.message)
        response, context = await self.caller.call("Translate", message, "deepl:translate", headers, timeout)
        if isinstance(response, Failed):
            return _error(response.status, response.message, context.headers())
        translations = []
        for text, translation in zip(message.texts, response.translations, strict=True):
            source = translation.detected_language or message.source_language
            translations.append({"detected_source_language": source.upper(),
                                 "text": translation.hypotheses[0].text if translation.hypotheses else "",
                                 "billed_characters": len(text)})
            self.characters += len(text)
        return web.json_response({"translations": translations}, headers=context.headers())

    @staticmethod
    def _translate_request(params: dict[str, Any]) -> Any:
        """The ``TranslateRequest`` of ``/v2/translate``'s parameters (CompatError: DeepL's 400)."""
        texts = params.get("text")
        texts = texts if isinstance(texts, list) else [texts] if texts is not None else []
        if not texts:
            raise CompatError(400, "Parameter 'text' not specified.")
        if not all(isinstance(t, str) for t in texts):
            raise CompatError(400, "Parameter 'text' must be a list of strings.")
        target = params.get("target_lang")
        if not target or not isinstance(target, str):
            raise CompatError(400, "Value for 'target_lang' not supported.")
        source = params.get("source_lang") or "auto"
        tag_handling = str(params.get("tag_handling") or "").lower()
        if tag_handling and tag_handling not in FORMATS:
            raise CompatError(400, "Value for 'tag_handling' not supported.")
        split = str(params.get("split_sentences") or ("nonewlines" if tag_handling else "1")).lower()
        if split not in SPLITTING:
            raise CompatError(400, "Value for 'split_sentences' not supported.")
        formality = str(params.get("formality") or "default").lower()
        if formality not in FORMALITY:
            raise CompatError(400, "'formality' is not supported for the given 'target_lang': the models have no "
                                   "formality to choose; use prefer_more or prefer_less to accept either.")
        glossary_id = params.get("glossary_id") or ""
        if glossary_id and not params.get("source_lang"):
            raise CompatError(400, "Use of a glossary requires the source_lang parameter to be specified.")
        for name in ("preserve_formatting", "outline_detection", "show_billed_characters"):
            _flag(params, name)
        ignored, splitting = _names(params.get("ignore_tags")), _names(params.get("splitting_tags"))
        if (ignored or splitting) and not tag_handling:
            raise CompatError(400, "ignore_tags and splitting_tags need tag_handling (html or xml).")
        return pb2.TranslateRequest(
            texts=texts, source_language=str(source).lower(), target_language=target.lower(),
            text_format=FORMATS.get(tag_handling, pb2.TEXT_FORMAT_PLAIN), sentence_splitting=SPLITTING[split],
            untranslated_elements=ignored, block_elements=splitting, glossary_id=str(glossary_id))

    async def languages(self, request: web.Request) -> web.Response:
        try:
            params, headers, timeout = await self._params(request)
        except CompatError as error:
            return _error(error.status, error.message)
        kind = str(params.get("type") or "source").lower()
        if kind not in ("source", "target"):
            return _error(400, "Value for 'type' not supported.")
        response, context = await self.caller.call("ListLanguages", pb2.ListLanguagesRequest(), "deepl:languages",
                                                   headers, timeout)
        if isinstance(response, Failed):
            return _error(response.status, response.message, context.headers())
        codes = sorted({p.source_language if kind == "source" else p.target_language for p in response.pairs})
        entries = [{"language": code.upper(), "name": language_name(code)} for code in codes]
        if kind == "target":
            for entry in entries:
                entry["supports_formality"] = False
        return web.json_response(entries, headers=context.headers())

    async def usage(self, request: web.Request) -> web.Response:
        try:
            _, headers, timeout = await self._params(request)
        except CompatError as error:
            return _error(error.status, error.message)
        # the key is checked as for any call: ListLanguages is the cheapest call that authenticates
        response, context = await self.caller.call("ListLanguages", pb2.ListLanguagesRequest(), "deepl:usage",
                                                   headers, timeout)
        if isinstance(response, Failed):
            return _error(response.status, response.message, context.headers())
        return web.json_response({"character_count": self.characters, "character_limit": NO_LIMIT},
                                 headers=context.headers())

    # ---- glossaries ----------------------------------------------------------------------------------------

    async def _glossary_call(self, request: web.Request, method: str, message: Any,
                             label: str) -> tuple[Any, Mapping[str, str]] | web.Response:
        """A native glossary call for a glossary route: its response and headers, or the DeepL error (an
        unknown glossary is DeepL's 404)."""
        try:
            _, headers, timeout = await self._params(request)
        except CompatError as error:
            return _error(error.status, error.message)
        response, context = await self.caller.call(method, message, label, headers, timeout)
        if isinstance(response, Failed):
            status = 404 if response.code == grpc.StatusCode.NOT_FOUND else response.status
            return _error(status, response.message, context.headers())
        return response, context.headers()

    async def create_glossary(self, request: web.Request) -> web.Response:
        try:
            params = await form_or_json(request)
            message = pb2.CreateGlossaryRequest(glossary=_glossary_from(params))
        except CompatError as error:
            return _error(error.status, error.message)
        answer = await self._glossary_call(request, "CreateGlossary", message, "deepl:glossaries")
        if isinstance(answer, web.Response):
            return answer
        return web.json_response(_glossary_info(answer[0]), status=201, headers=answer[1])

    async def list_glossaries(self, request: web.Request) -> web.Response:
        answer = await self._glossary_call(request, "ListGlossaries", pb2.ListGlossariesRequest(), "deepl:glossaries")
        if isinstance(answer, web.Response):
            return answer
        return web.json_response({"glossaries": [_glossary_info(g) for g in answer[0].glossaries]}, headers=answer[1])

    async def get_glossary(self, request: web.Request) -> web.Response:
        message = pb2.GetGlossaryRequest(glossary_id=request.match_info["glossary_id"])
        answer = await self._glossary_call(request, "GetGlossary", message, "deepl:glossaries")
        if isinstance(answer, web.Response):
            return answer
        return web.json_response(_glossary_info(answer[0]), headers=answer[1])

    async def glossary_entries(self, request: web.Request) -> web.Response:
        message = pb2.GetGlossaryRequest(glossary_id=request.match_info["glossary_id"])
        answer = await self._glossary_call(request, "GetGlossary", message, "deepl:glossaries")
        if isinstance(answer, web.Response):
            return answer
        text = write_entries([(e.source, e.target, False) for e in answer[0].entries])
        return web.Response(text=text, content_type="text/tab-separated-values", headers=answer[1])

    async def delete_glossary(self, request: web.Request) -> web.Response:
        message = pb2.DeleteGlossaryRequest(glossary_id=request.match_info["glossary_id"])
        answer = await self._glossary_call(request, "DeleteGlossary", message, "deepl:glossaries")
        if isinstance(answer, web.Response):
            return answer
        return web.Response(status=204, headers=answer[1])

    async def glossary_pairs(self, request: web.Request) -> web.Response:
        answer = await self._glossary_call(request, "ListLanguages", pb2.ListLanguagesRequest(), "deepl:glossaries")
        if isinstance(answer, web.Response):
            return answer
        pairs = sorted({(p.source_language, p.target_language) for p in answer[0].pairs})
        return web.json_response({"supported_languages": [{"source_lang": s, "target_lang": t} for s, t in pairs]},
                                 headers=answer[1])


def _glossary_from(params: dict[str, Any]) -> Any:
    """The native ``Glossary`` of ``POST /v2/glossaries``' parameters (CompatError: DeepL's 400). The id is
    made here (DeepL's ids are the service's; the name is the caller's)."""
    name, entries = params.get("name"), params.get("entries")
    source, target = params.get("source_lang"), params.get("target_lang")
    for field, value in (("name", name), ("source_lang", source), ("target_lang", target), ("entries", entries)):
        if not value or not isinstance(value, str):
            raise CompatError(400, f"Parameter '{field}' not specified.")
    entries_format = str(params.get("entries_format") or "tsv").lower()
    if entries_format not in ("tsv", "csv"):
        raise CompatError(400, "Value for 'entries_format' not supported.")
    source, target = source.lower().split("-")[0], target.lower().split("-")[0]
    reader = csv.reader(io.StringIO(entries), **({} if entries_format == "csv"
                                                   else {"delimiter": "\t", "quoting": csv.QUOTE_NONE}))
    rows = []
    try:
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            # DeepL's CSV may name the pair in two more columns: they must be the glossary's
            if len(row) not in (2, 4) or len(row) == 4 and [c.strip().lower() for c in row[2:]] != [source, target]:
                raise CompatError(400, f"Invalid glossary entries: line {reader.line_num} is not source and target "
                                       f"separated by {'a comma' if entries_format == 'csv' else 'a tab'}.")
            rows.append(pb2.GlossaryEntry(source=row[0].strip(), target=row[1].strip()))
    except csv.Error as error:
        raise CompatError(400, f"Invalid glossary entries: line {reader.line_num}: {error}.") from error
    return pb2.Glossary(glossary_id=str(uuid.uuid4()), name=name, source_language=source, target_language=target,
                        entries=rows)


def _glossary_info(glossary: Any) -> dict[str, Any]:
    """DeepL's ``GlossaryInfo`` of a native ``Glossary``."""
    written = datetime.datetime.fromtimestamp(glossary.update_time.ToMilliseconds() / 1000, tz=datetime.UTC)
    return {"glossary_id": glossary.glossary_id, "name": glossary.name or glossary.glossary_id, "ready": True,
            "source_lang": glossary.source_language, "target_lang": glossary.target_language,
            "creation_time": written.isoformat(timespec="milliseconds"), "entry_count": glossary.entry_count}
