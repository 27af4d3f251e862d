"""``source_language: "auto"``: the texts' language, among the languages the service translates.

The detector is py3langid (BSD-3-Clause; a naive Bayes model over byte n-grams for 140 languages, shipped
inside the package: nothing is downloaded), loaded on first use. What the model reads is detected: markup and
placeholders are left out (:func:`server.frontend.documents.translate.read_document`).

A text's language is the served candidate with the highest probability, its confidence that probability
renormalized over the candidates (with one candidate, 1). It cannot be told, and the request gets the
configured default (``--detect-default``) or INVALID_ARGUMENT, when the text has fewer than
:data:`MIN_LETTERS` letters, when the confidence is under :data:`MIN_CONFIDENCE`, or when the text is plainly
a language no model translates (:data:`FOREIGN` of all the detector's probability): a translation from the
wrong language, or the text echoed back, is never an answer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from server.errors import InvalidArgument
from server.frontend.documents.model import ATOM, TextFormat
from server.frontend.documents.translate import read_document
from server.routing import primary

MIN_LETTERS = 3  # a text with fewer letters says nothing of its language
MIN_CONFIDENCE = 0.5  # the chosen candidate's share of the candidates' probability
FOREIGN = 0.9  # a language no model translates, this sure, is not taken for a served one
DETECT_CHARS = 2000  # the first characters of a text are enough to tell its language


@dataclass(frozen=True)
class Detection:
    language: str  # a served source language, as the router spells it
    confidence: float  # 0-1 (module docstring)


class LanguageDetector:
    """py3langid's identifier, loaded once per process on first use (about 0.5 s)."""

    def __init__(self) -> None:
        self._identifier = None
        self._lock = threading.Lock()

    def _ranker(self):  # noqa: ANN202 - py3langid has no type hints
        with self._lock:
            if self._identifier is None:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier

                self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
            return self._identifier

    def probabilities(self, text: str) -> dict[str, float]:
        """Every language the detector knows -> its probability for ``text`` (summing to 1)."""
        return {language: float(p) for language, p in self._ranker().rank(text[:DETECT_CHARS])}

    def rank(self, text: str, candidates: Sequence[str]) -> list[Detection]:
        """``candidates`` (served codes) by their confidence for ``text``, best first; none where the text has
        too few letters or is plainly in a language no candidate is (module docstring)."""
        if sum(c.isalpha() for c in text[:DETECT_CHARS]) < MIN_LETTERS or not candidates:
            return []
        probabilities = self.probabilities(text)
        known = {c: probabilities.get(c, probabilities.get(primary(c), 0.0)) for c in candidates}
        total = sum(known.values())
        top, top_p = max(probabilities.items(), key=lambda item: item[1])
        if total <= 0 or (top_p >= FOREIGN and primary(top) not in map(primary, known)):
            return []
        return sorted((Detection(c, p / total) for c, p in known.items()), key=lambda d: -d.confidence)

    def detect(self, text: str, candidates: Sequence[str]) -> Detection | None:
        """``text``'s language among ``candidates``, or None where it cannot be told."""
        ranked = self.rank(text, candidates)
        return ranked[0] if ranked and ranked[0].confidence >= MIN_CONFIDENCE else None


def model_text(text: str, text_format: TextFormat) -> str:
    """What the model would read of ``text``: markup, and placeholders, left out."""
    document = read_document(text, text_format, "text")
    return " ".join("".join(run.chars).replace(ATOM, " ") for run in document.runs)


def detect_texts(detector: LanguageDetector, texts: Sequence[str], text_format: TextFormat,
                 candidates: Sequence[str], default: str) -> list[Detection]:
    """One :class:`Detection` per text; all of one language (INVALID_ARGUMENT otherwise). A text that cannot be
    told takes ``default`` (confidence 0) where it is set and served, else the request is INVALID_ARGUMENT."""
    detections = []
    for i, text in enumerate(texts):
        found = detector.detect(model_text(text, text_format), candidates)
        if found is None:
            if default and default in candidates:
                found = Detection(default, 0.0)
            else:
                served = ", ".join(candidates) or "none"
                raise InvalidArgument(f"the language of texts[{i}] cannot be told (too short, too uncertain, or "
                                      f"not one translated here: {served}); name source_language")
        detections.append(found)
    languages = sorted({d.language for d in detections})
    if len(languages) > 1:
        raise InvalidArgument(f"the texts are in several languages ({', '.join(languages)}): send one request "
                              "per language")
    return detections
