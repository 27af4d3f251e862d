"""The client's plain results and the only place they meet protobufs.

:class:`Translation`, :class:`Hypothesis`, :class:`Attention` and :class:`ModelInfo` are what
:mod:`clients.client` returns; :class:`TranslationError` is what it raises. ``build_*`` make requests
from keyword arguments and ``*_from_pb`` turn responses into the dataclasses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from common.errors import NmtError
from server.protos import pb2


@dataclass(frozen=True)
class Attention:
    """Word-level cross-attention of one hypothesis.

    ``weights[t][s]`` is the attention of target word ``t`` (row) on source word ``s`` (column); each
    row sums to 1. ``alignments`` are the hard word alignments as ``(source_index, target_index)``
    pairs, the pairs ``pharaoh`` writes as ``"s-t s-t ..."``.
    """

    source_words: list[str]
    target_words: list[str]
    weights: list[list[float]]
    alignments: list[tuple[int, int]]
    pharaoh: str

    @property
    def shape(self) -> tuple[int, int]:
        """``(target words, source words)``."""
        return len(self.target_words), len(self.source_words)


@dataclass(frozen=True)
class Hypothesis:
    """One translation candidate.

    ``tokens`` are the target words (the rows of ``attention``), ``subword_tokens`` the model's pieces.
    ``score`` (length-normalised log-probability) and ``token_scores`` (per subword piece, end of sentence
    included) are ``None`` unless the call asked for ``scores``; ``attention`` is ``None`` unless it asked
    for ``attention``.
    """

    text: str
    tokens: list[str]
    subword_tokens: list[str]
    score: float | None = None
    token_scores: list[float] | None = None
    attention: Attention | None = None
    terms_missed: bool = False  # the glossary's terms did not fit within max_length (see the proto)


@dataclass(frozen=True)
class Segment:
    """One sentence of a text: ``[start, end)`` of it in the text and of its translation in the translated
    text (code points of the text content), and its own n-best (empty when the text is this one sentence:
    they are the Translation's)."""

    source: tuple[int, int]
    target: tuple[int, int]
    source_tokens: list[str]
    hypotheses: list[Hypothesis]


@dataclass(frozen=True)
class TextWord:
    """A word of a whole text or of its translation, with its span and the sentence that holds it."""

    text: str
    start: int
    end: int
    segment: int


@dataclass(frozen=True)
class Translation:
    """The translation of one text: its source words (the attention's columns) and hypotheses, best first;
    its sentences (``segments``) and, with ``attention``, the words of the whole text and translation and
    their alignments as ``(source_index, target_index)`` pairs into ``source_words`` / ``target_words``."""

    source_tokens: list[str]
    hypotheses: list[Hypothesis]
    model: str = ""  # the model and version that translated it
    model_version: str = ""
    segments: tuple[Segment, ...] = ()
    source_words: tuple[TextWord, ...] = ()
    target_words: tuple[TextWord, ...] = ()
    word_alignments: tuple[tuple[int, int], ...] = ()
    detected_language: str = ""  # source_language "auto": the language detected, and how sure (0-1)
    detected_confidence: float = 0.0
    terms: tuple[tuple[str, str], ...] = ()  # the glossary terms found in the text: (as written, its target)

    @property
    def best(self) -> Hypothesis:
        return self.hypotheses[0]


@dataclass(frozen=True)
class StreamDelta:
    """One message of a streamed translation (``TranslateStreaming``): the pieces its stable prefix added,
    their log-probabilities (``scores``) and the text of the words they closed; the last one also carries
    the whole translation, as ``translate`` returns it."""

    text: str
    pieces: list[str]
    token_scores: list[float] | None = None
    translation: Translation | None = None  # the last delta only


@dataclass(frozen=True)
class ModelInfo:
    """One loaded model version, as ``ListModels`` describes it."""

    name: str
    version: str
    architecture: str = ""
    source_language: str = ""
    target_language: str = ""
    target_languages: tuple[str, ...] = ()  # a multilingual model's choices for ``target_language``
    is_default: bool = False  # the model used when a request names none
    is_latest: bool = False  # the version used when a request names none
    execution_provider: str = ""
    precision: str = ""
    default_beam_size: int = 0
    max_beam_size: int = 0
    test_bleu: float = 0.0
    training_corpus: str = ""


class TranslationError(NmtError):
    """A call failed: ``code`` is its gRPC status, ``message`` the server's (or gRPC's) explanation.

    ``str(error)`` is ``"<STATUS>: <message>"``; ``request_id`` is the ``x-request-id`` the call carried
    (search the server's logs for it) and ``attempts`` how many attempts were made.
    """

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str | None = None, *,
                 attempts: int = 1) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.attempts = attempts

    def __reduce__(self) -> Any:  # picklable despite the keyword-only argument
        return _rebuild_error, (self.code, self.message, self.request_id, self.attempts)


def _rebuild_error(code: grpc.StatusCode, message: str, request_id: str | None, attempts: int) -> TranslationError:
    return TranslationError(code, message, request_id, attempts=attempts)



def _texts(texts: str | Iterable[str]) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    items = list(texts)
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is {type(text).__name__}, not str")
    return items


def _count(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an integer >= 0 (0: the model's default), got {value!r}")
    return value


def build_request(texts: str | Iterable[str], *, model: str = "", version: str = "", beam_size: int = 0,
                  num_hypotheses: int = 0, max_length: int = 0, length_penalty: float = 0.0,
                  attention: bool = False, scores: bool = False, target_language: str = "",
                  target_prefixes: Sequence[str] = (), alternatives: bool = False, text_format: str = "",
                  splitting: str = "", source_language: str = "", glossary: Glossary = (),
                  glossary_id: str = "", do_not_translate: Sequence[str] = ()) -> Any:
    """A ``TranslateRequest`` (zeros mean the model's defaults; ``source_language`` (or "auto") and
    ``target_language`` choose the model by language pair when ``model`` is empty, and ``target_language``
    picks a multilingual model's output language; ``target_prefixes``, none or one per text, force each
    translation's start; ``alternatives``: ``num_hypotheses`` alternatives for the next word after the prefix;
    ``text_format``: "text" (the default), "html" or "xml"; ``splitting``: "sentences" (the default),
    "no_newlines" or "off"; ``glossary``: source term -> target term (a mapping, or ``(source, target)`` and
    ``(source, target, case_insensitive)`` tuples), ``glossary_id``: a stored glossary, ``do_not_translate``:
    terms kept as they are)."""
    if text_format not in TEXT_FORMATS:
        raise ValueError(f"text_format must be one of {', '.join(repr(f) for f in TEXT_FORMATS if f)}, "
                         f"got {text_format!r}")
    if splitting not in SPLITTING:
        raise ValueError(f"splitting must be one of {', '.join(repr(f) for f in SPLITTING if f)}, got {splitting!r}")
    if not math.isfinite(length_penalty) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a finite number >= 0 (0: the model's default), "
                         f"got {length_penalty!r}")
    options = pb2.DecodingOptions(
        beam_size=_count("beam_size", beam_size), num_hypotheses=_count("num_hypotheses", num_hypotheses),
        max_length=_count("max_length", max_length), length_penalty=float(length_penalty),
        return_attention=bool(attention), return_scores=bool(scores), return_alternatives=bool(alternatives),
    )
    return pb2.TranslateRequest(texts=_texts(texts), model=model, model_version=version, options=options,
                                target_language=target_language, target_prefixes=list(target_prefixes),
                                text_format=TEXT_FORMATS[text_format], sentence_splitting=SPLITTING[splitting],
                                source_language=source_language, glossary=glossary_entries_pb(glossary),
                                glossary_id=glossary_id, do_not_translate=list(do_not_translate))


# a glossary as a client gives it: {source: target}, or (source, target[, case_insensitive]) tuples
Glossary = Mapping[str, str] | Sequence[tuple[str, str] | tuple[str, str, bool]]


def glossary_entries_pb(glossary: Glossary) -> list[Any]:
    rows = list(glossary.items()) if isinstance(glossary, Mapping) else list(glossary)
    entries = []
    for row in rows:
        if not isinstance(row, tuple | list) or len(row) not in (2, 3):
            raise ValueError(f"a glossary entry is (source, target) or (source, target, case_insensitive), got {row!r}")
        entries.append(pb2.GlossaryEntry(source=row[0], target=row[1], case_insensitive=bool(row[2:3] and row[2])))
    return entries


@dataclass(frozen=True)
class GlossaryInfo:
    """A stored glossary: its id, language pair, entry count and (``get_glossary``) its entries as
    ``(source, target, case_insensitive)``."""

    glossary_id: str
    source_language: str
    target_language: str
    entry_count: int
    entries: tuple[tuple[str, str, bool], ...] = ()
    name: str = ""  # its display name (its id where none was given)


def glossary_from_pb(message: Any) -> GlossaryInfo:
    return GlossaryInfo(message.glossary_id, message.source_language, message.target_language,
                        int(message.entry_count),
                        tuple((e.source, e.target, e.case_insensitive) for e in message.entries), message.name)


TEXT_FORMATS = {"": 0, "text": pb2.TEXT_FORMAT_PLAIN, "html": pb2.TEXT_FORMAT_HTML, "xml": pb2.TEXT_FORMAT_XML}
SPLITTING = {"": 0, "sentences": pb2.SPLIT_SENTENCES, "no_newlines": pb2.SPLIT_NO_NEWLINES, "off": pb2.SPLIT_OFF}


def build_score_request(texts: str | Iterable[str], targets: str | Iterable[str], *, model: str = "",
                        version: str = "", attention: bool = False, length_penalty: float = 0.0,
                        target_language: str = "") -> Any:
    """A ``ScoreRequest``: the texts and their given translations, one per text."""
    if not math.isfinite(length_penalty) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a finite number >= 0 (0: the model's default), "
                         f"got {length_penalty!r}")
    return pb2.ScoreRequest(texts=_texts(texts), targets=_texts(targets), model=model, model_version=version,
                            return_attention=bool(attention), length_penalty=float(length_penalty),
                            target_language=target_language)


def attention_from_pb(message: Any, source_words: Sequence[str], target_words: Sequence[str]) -> Attention:
    rows, columns = int(message.target_length), int(message.source_length)
    flat = list(message.weights)
    if len(flat) != rows * columns:
        raise TranslationError(grpc.StatusCode.INTERNAL, f"malformed attention: {len(flat)} weights for a "
                                                         f"{rows} x {columns} matrix")
    weights = [flat[r * columns:(r + 1) * columns] for r in range(rows)]
    # the server names the rows and columns by the hypothesis' tokens and the source tokens
    sources = list(source_words) if len(source_words) == columns else [str(i) for i in range(columns)]
    targets = list(target_words) if len(target_words) == rows else [str(i) for i in range(rows)]
    return Attention(
        source_words=sources,
        target_words=targets,
        weights=weights,
        alignments=[(int(a.source_index), int(a.target_index)) for a in message.word_alignments],
        pharaoh=message.pharaoh,
    )


def hypothesis_from_pb(message: Any, source_words: Sequence[str], *, scores: bool) -> Hypothesis:
    tokens = list(message.tokens)
    return Hypothesis(
        text=message.text,
        tokens=tokens,
        subword_tokens=list(message.subword_tokens),
        score=float(message.score) if scores else None,
        token_scores=[float(s) for s in message.token_scores] if scores else None,
        attention=attention_from_pb(message.attention, source_words, tokens)
        if message.HasField("attention") else None,
        terms_missed=message.terms_missed,
    )


def translations_from_pb(response: Any, *, scores: bool) -> list[Translation]:
    result = []
    for item in response.translations:
        source = list(item.source_tokens)
        segments = tuple(Segment(
            source=(s.source_start, s.source_end), target=(s.target_start, s.target_end),
            source_tokens=list(s.source_tokens),
            hypotheses=[hypothesis_from_pb(h, list(s.source_tokens), scores=scores) for h in s.hypotheses],
        ) for s in item.segments)
        result.append(Translation(
            source_tokens=source,
            hypotheses=[hypothesis_from_pb(h, source, scores=scores) for h in item.hypotheses],
            model=response.model,
            model_version=response.model_version,
            segments=segments,
            source_words=tuple(TextWord(w.text, w.start, w.end, w.segment) for w in item.source_words),
            target_words=tuple(TextWord(w.text, w.start, w.end, w.segment) for w in item.target_words),
            word_alignments=tuple((a.source_index, a.target_index) for a in item.word_alignments),
            detected_language=item.detected_language, detected_confidence=item.detected_confidence,
            terms=tuple((t.source, t.target) for t in item.terms),
        ))
    return result


def model_info_from_pb(message: Any) -> ModelInfo:
    return ModelInfo(
        name=message.name, version=message.version, architecture=message.architecture,
        source_language=message.source_language, target_language=message.target_language,
        is_default=message.is_default, is_latest=message.is_latest,
        execution_provider=message.execution_provider, precision=message.precision,
        default_beam_size=int(message.default_beam_size), max_beam_size=int(message.max_beam_size),
        test_bleu=float(message.test_bleu), training_corpus=message.training_corpus,
        target_languages=tuple(message.target_languages),
    )


def error_from_rpc(error: grpc.RpcError, request_id: str | None, attempts: int = 1) -> TranslationError:
    """An ``RpcError`` (sync or aio) -> :class:`TranslationError` with its status code and message."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = error.details() if callable(getattr(error, "details", None)) else None
    code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    return TranslationError(code, details or code.name.lower().replace("_", " "), request_id, attempts=attempts)


def delta_from_pb(message: Any, *, scores: bool) -> StreamDelta:
    """``TranslationDelta`` -> :class:`StreamDelta`."""
    translation = translations_from_pb(message.final, scores=scores)[0] if message.HasField("final") else None
    return StreamDelta(text=message.text, pieces=list(message.subword_tokens),
                       token_scores=list(message.token_scores) if scores else None, translation=translation)
