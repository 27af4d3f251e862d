"""Protobuf messages <-> the plain dataclasses of :mod:`server.types`, at the servicer's edge.

With :mod:`server.frontend.app` (which registers the services), the only server module that imports
:mod:`server.protos`: validation, the scheduler and the engine work on dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.rpc import status_pb2

from server.frontend.glossary_store import StoredGlossary
from server.protos import pb2
from server.types import GlossaryEntry, Hypothesis, RequestedOptions, TranslateCall, Translation
from server.versions import VersionIndex


def score_from_pb(request: Any) -> TranslateCall:
    """``ScoreRequest`` -> :class:`TranslateCall`: greedy decoding forced through each target and its end of
    sentence, with scores (and attention when asked)."""
    return TranslateCall(
        texts=list(request.texts), model=request.model, model_version=request.model_version,
        target_language=request.target_language, target_prefixes=list(request.targets), score=True,
        options=RequestedOptions(beam_size=1, return_scores=True, return_attention=request.return_attention,
                                 length_penalty=request.length_penalty),
    )


def from_pb(request: Any) -> TranslateCall:
    """``TranslateRequest`` -> :class:`TranslateCall`."""
    return TranslateCall(
        texts=list(request.texts),
        model=request.model,
        model_version=request.model_version,
        target_language=request.target_language,
        source_language=request.source_language,
        target_prefixes=list(request.target_prefixes),
        options=options_from_pb(request.options) if request.HasField("options") else DEFAULT_OPTIONS,
        text_format=TEXT_FORMATS.get(request.text_format, ""),
        splitting=SPLITTING.get(request.sentence_splitting, ""),
        untranslated_elements=tuple(request.untranslated_elements),
        block_elements=tuple(request.block_elements),
        glossary=tuple(entries_from_pb(request.glossary)),
        glossary_id=request.glossary_id,
        do_not_translate=tuple(request.do_not_translate),
    )


def entries_from_pb(entries: Any) -> list[GlossaryEntry]:
    return [GlossaryEntry(e.source, e.target, e.case_insensitive) for e in entries]


def glossary_pb(stored: StoredGlossary, *, entries: bool) -> Any:
    """A stored glossary -> ``Glossary`` message (its entries only with ``entries``)."""
    message = pb2.Glossary(glossary_id=stored.glossary_id, source_language=stored.source_language,
                           target_language=stored.target_language, entry_count=len(stored.entries),
                           name=stored.name)
    message.update_time.FromNanoseconds(stored.written_ns)
    if entries:
        message.entries.extend(pb2.GlossaryEntry(source=e.source, target=e.target, case_insensitive=e.case_insensitive)
                               for e in stored.entries)
    return message


# enum numbers -> server.types.TranslateCall's strings; a number the proto does not name (a newer client) is ""
TEXT_FORMATS = {0: "text", 1: "text", 2: "html", 3: "xml"}
SPLITTING = {0: "", 1: "sentences", 2: "no_newlines", 3: "off"}


DEFAULT_OPTIONS = RequestedOptions()  # a request without options: every field at its default


def options_from_pb(o: Any) -> RequestedOptions:
    """``DecodingOptions`` message -> :class:`RequestedOptions`."""
    return RequestedOptions(
        beam_size=o.beam_size, num_hypotheses=o.num_hypotheses, max_length=o.max_length,
        length_penalty=o.length_penalty, return_attention=o.return_attention, return_scores=o.return_scores,
        min_length=o.min_length, repetition_penalty=o.repetition_penalty,
        no_repeat_ngram_size=o.no_repeat_ngram_size, disable_unk=o.disable_unk,
        suppress_sequences=tuple(o.suppress_sequences), sampling_topk=o.sampling_topk,
        sampling_topp=o.sampling_topp, sampling_temperature=o.sampling_temperature,
        sampling_seed=o.sampling_seed, patience=o.patience, return_alternatives=o.return_alternatives,
    )


def glossary_list_pb(stored: Sequence[StoredGlossary]) -> Any:
    return pb2.ListGlossariesResponse(glossaries=[glossary_pb(g, entries=False) for g in stored])


def deleted_glossary_pb() -> Any:
    return pb2.DeleteGlossaryResponse()


def hypothesis_to_pb(hypothesis: Hypothesis, *, return_scores: bool, return_attention: bool) -> Any:
    """:class:`Hypothesis` -> ``Hypothesis`` message (scores and attention only when asked for)."""
    attention = hypothesis.attention
    message = pb2.Hypothesis(text=hypothesis.text, tokens=hypothesis.words, subword_tokens=hypothesis.tokens,
                             terms_missed=not hypothesis.terms_met)
    if return_scores:
        message.score = float(hypothesis.score)
        message.token_scores.extend(float(s) for s in hypothesis.token_scores)
    if return_attention and attention is not None:
        weights = attention.weights
        message.attention.target_length = int(weights.shape[0])
        message.attention.source_length = int(weights.shape[1])
        message.attention.weights.extend(weights.astype(float).ravel(order="C").tolist())
        message.attention.word_alignments.extend(
            pb2.WordAlignment(source_index=a.source_index, target_index=a.target_index) for a in attention.alignments
        )
        message.attention.pharaoh = attention.pharaoh()
    return message


def to_pb(translations: Sequence[Translation], model: Any, options: RequestedOptions) -> Any:
    """Translations by ``model`` -> ``TranslateResponse`` (the words are the engine's, copied)."""
    response = pb2.TranslateResponse(model=model.name, model_version=model.version)
    asked = {"return_scores": options.return_scores, "return_attention": options.return_attention}
    for translation in translations:
        item = response.translations.add()
        item.source_tokens.extend(translation.source_words)
        item.detected_language = translation.detected_language
        item.detected_confidence = translation.detected_confidence
        item.terms.extend(pb2.AppliedTerm(source=t.source, target=t.target) for t in translation.terms)
        item.hypotheses.extend(hypothesis_to_pb(h, **asked) for h in translation.hypotheses)
        for segment in translation.segments:
            spans = item.segments.add(source_start=segment.source[0], source_end=segment.source[1],
                                      target_start=segment.target[0], target_end=segment.target[1])
            if segment.translation.hypotheses is not translation.hypotheses:  # else they are the text's, above
                spans.source_tokens.extend(segment.translation.source_words)
                spans.hypotheses.extend(hypothesis_to_pb(h, **asked) for h in segment.translation.hypotheses)
        if translation.document is not None and options.return_attention:
            document = translation.document
            item.source_words.extend(pb2.TextWord(text=w.text, start=w.start, end=w.end, segment=w.segment)
                                     for w in document.source_words)
            item.target_words.extend(pb2.TextWord(text=w.text, start=w.start, end=w.end, segment=w.segment)
                                     for w in document.target_words)
            item.word_alignments.extend(pb2.WordAlignment(source_index=a.source_index, target_index=a.target_index)
                                        for a in document.alignments)
    return response


def error_response_pb(code: grpc.StatusCode, message: str) -> Any:
    """A ``TranslateResponse`` that carries one stream request's error instead of translations."""
    return pb2.TranslateResponse(error=status_pb2.Status(code=code.value[0], message=message))


def model_info_pb(model: Any, *, is_default: bool, max_beam: int) -> Any:
    """:class:`ModelVersion` -> ``ModelInfo`` message."""
    defaults, training = model.defaults, model.training
    bleu = training.get("test_bleu")
    return pb2.ModelInfo(
        name=model.name,
        version=model.version,
        architecture=str(model.manifest_value("architecture")),
        source_language=str(model.manifest_value("source_language")),
        target_language=str(model.manifest_value("target_language")),
        is_default=is_default,
        is_latest=model.is_latest,
        execution_provider=model.provider,
        precision=str(model.manifest_value("precision")),
        default_beam_size=min(int(defaults.get("beam_size", 1) or 1), max_beam),
        max_beam_size=max_beam,
        test_bleu=float(bleu) if isinstance(bleu, int | float) else 0.0,
        training_corpus=str(training.get("corpus") or ""),
        device=model.device,
        onnxruntime_build=model.runtime_build,
        target_languages=list(model.manifest_value("target_languages", [])),
        source_languages=list(model.manifest_value("source_languages", [])),
    )


def model_list_pb(repository: VersionIndex, *, max_beam: int,
                  allows: Callable[[str], bool] = lambda name: True) -> Any:
    """Every loaded version of the models ``allows`` (by name) -> ``ListModelsResponse``."""
    return pb2.ListModelsResponse(models=[
        model_info_pb(mv, is_default=mv.name == repository.default_model, max_beam=max_beam)
        for mv in repository if allows(mv.name)
    ])


def language_list_pb(routes: Any) -> Any:
    """:meth:`server.routing.Router.routes` -> ``ListLanguagesResponse``, by source then target."""
    return pb2.ListLanguagesResponse(pairs=[
        pb2.LanguagePair(source_language=route.source, target_language=route.target, model=route.model,
                         models=list(route.models))
        for _, route in sorted(routes.items())
    ])


def detection_pb(ranked: Sequence[Sequence[Any]]) -> Any:
    """Each text's :class:`server.frontend.detection.Detection` list -> ``DetectLanguageResponse``."""
    return pb2.DetectLanguageResponse(texts=[
        pb2.DetectedLanguages(languages=[pb2.LanguageScore(language=d.language, confidence=d.confidence)
                                         for d in detections])
        for detections in ranked
    ])
