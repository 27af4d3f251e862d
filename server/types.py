"""Plain data passed between the gRPC edge, the scheduler and the decoding engine (no protobufs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from server.completion import Completion
from server.controls import Controls


@dataclass(frozen=True)
class DecodingOptions:
    """Per-sentence decoding options, already validated and with defaults filled in."""

    beam_size: int = 1
    num_hypotheses: int = 1
    max_length: int = 256  # absolute cap on generated tokens (EOS included)
    length_penalty: float = 1.0  # score = log-prob sum / length ** length_penalty
    return_attention: bool = False
    controls: Controls = field(default_factory=Controls)  # without ``forced`` (per sentence: its target prefix)
    patience: float = 1.0
    return_alternatives: bool = False  # num_hypotheses alternatives at the prefix's end, each continued


@dataclass(frozen=True)
class RequestedOptions:
    """Decoding options as sent (0 / 0.0 = the model's default), not yet validated."""

    beam_size: int = 0
    num_hypotheses: int = 0
    max_length: int = 0
    length_penalty: float = 0.0
    return_attention: bool = False
    return_scores: bool = False
    min_length: int = 0
    repetition_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    disable_unk: bool = False
    suppress_sequences: tuple[str, ...] = ()
    sampling_topk: int = 0
    sampling_topp: float = 0.0
    sampling_temperature: float = 0.0
    sampling_seed: int = 0
    patience: float = 0.0
    return_alternatives: bool = False


@dataclass(frozen=True)
class TranslateCall:
    """One translation request as sent: texts, the model (version) asked for ("" = default) and options."""

    texts: list[str]
    model: str = ""
    model_version: str = ""
    options: RequestedOptions = field(default_factory=RequestedOptions)
    target_language: str = ""  # a multilingual model's target language ("" = none)
    source_language: str = ""  # the texts' language, or "auto" ("" = the model's)
    target_prefixes: list[str] = field(default_factory=list)  # none, or one per text ("" = none)
    text_format: str = "text"  # server.frontend.documents.model.TextFormat's values
    splitting: str = ""  # server.frontend.documents.segmenter.Splitting's values; "": the default for the request
    untranslated_elements: tuple[str, ...] = ()  # markup: elements copied unchanged, beside the built-in ones
    block_elements: tuple[str, ...] = ()  # markup: elements that separate sentences, beside the built-in blocks
    score: bool = False  # Score: ``target_prefixes`` are whole translations, forced through the end of sentence
    glossary: tuple[GlossaryEntry, ...] = ()  # inline entries (server.frontend.glossary)
    glossary_id: str = ""  # a stored glossary (server.frontend.glossary_store)
    do_not_translate: tuple[str, ...] = ()  # terms kept verbatim


@dataclass(frozen=True)
class GlossaryEntry:
    """One glossary entry; ``target == source`` is a do-not-translate term."""

    source: str
    target: str
    case_insensitive: bool = False


@dataclass(frozen=True)
class AppliedTerm:
    """A glossary term found in a source text and required in every hypothesis of its translation."""

    source: str  # as the text has it
    target: str


@dataclass(frozen=True)
class TargetPrefix:
    """One text's target prefix, tokenized: the pieces forced first, then the partial word they end with."""

    ids: tuple[int, ...] = ()
    completion: Completion | None = None  # the word the prefix ends inside (server.completion)
    spaced: bool = False  # the text ends with whitespace, which its pieces cannot show: its last word is finished
    # the first ``lead`` ids are a many-to-many model's target-language token (generate's forced_bos_token_id):
    # decoded and counted like a forced piece, never returned (server.text.TextCodec.to_translation drops them)
    lead: int = 0

    def steps(self) -> int:
        """Decoding steps the prefix can take at most (forced pieces and the pieces spelling the word)."""
        return len(self.ids) + (self.completion.steps() if self.completion is not None else 0)

    def led(self, tokens: tuple[int, ...]) -> TargetPrefix:
        """This prefix after the model's target-language ``tokens``."""
        if not tokens:
            return self
        completion = self.completion
        if completion is not None:
            completion = Completion(completion.text, completion.start + len(tokens), completion.states)
        return TargetPrefix((*tokens, *self.ids), completion, self.spaced, self.lead + len(tokens))


@dataclass
class WordAlignment:
    source_index: int  # word position in the source
    target_index: int  # word position in the hypothesis


@dataclass
class Attention:
    """Word-level cross-attention of one hypothesis: ``weights`` [target words, source words], rows sum to 1.

    ``source_words`` and ``target_words`` are the translation's ``source_words`` and the hypothesis' ``words``.
    """

    source_words: list[str]
    target_words: list[str]
    weights: np.ndarray
    alignments: list[WordAlignment]
    subword_weights: np.ndarray  # [target tokens incl. EOS, source tokens incl. EOS]

    def pharaoh(self) -> str:
        """Hard alignments as ``src-tgt`` pairs (Pharaoh format)."""
        return " ".join(f"{a.source_index}-{a.target_index}" for a in self.alignments)


@dataclass
class Hypothesis:
    text: str
    tokens: list[str]  # subword pieces, EOS excluded
    words: list[str]  # words of ``text`` (server.alignment.segment_words)
    token_ids: list[int]  # EOS excluded
    score: float  # length-normalised log-probability
    token_scores: list[float]  # log-probability of each token, EOS included (len(tokens) + 1)
    attention: Attention | None = None
    terms_met: bool = True  # False: the sentence's glossary terms did not fit its output limit (see ScoredSequence)


@dataclass
class Translation:
    source_tokens: list[str]  # subword pieces, EOS excluded
    source_words: list[str]  # words of the source text (server.alignment.segment_words)
    hypotheses: list[Hypothesis]
    segments: list[Segment] = field(default_factory=list)  # a text read as a document: its sentences
    document: DocumentAlignment | None = None  # a document's words and alignments (return_attention)
    detected_language: str = ""  # source_language "auto": the language detected (server.frontend.detection)
    detected_confidence: float = 0.0
    terms: list[AppliedTerm] = field(default_factory=list)  # the glossary terms found in the source, in order


@dataclass(frozen=True)
class Segment:
    """One sentence of a text: its ``[start, end)`` in the text and in the translated text (code points of
    the text content: markup left out, character references decoded) and its own translation."""

    source: tuple[int, int]
    target: tuple[int, int]
    translation: Translation


@dataclass(frozen=True)
class DocumentWord:
    text: str
    start: int  # code points in the text content, as Segment's spans
    end: int
    segment: int


@dataclass
class DocumentAlignment:
    """The words of a whole text and of its translation, and which source word each target word aligns to."""

    source_words: list[DocumentWord]
    target_words: list[DocumentWord]
    alignments: list[WordAlignment]


# A streaming sentence's stable prefix, whole, each time it grows: token ids, their log-probabilities and,
# when the sentence asked for attention, their cross-attention rows [tokens, source tokens incl. EOS] (else None).
StableReport = Callable[[list[int], list[float], np.ndarray | None], None]


@dataclass
class SentenceRequest:
    """One sentence handed to :meth:`server.engine.engine.Engine.translate_batch`.

    ``is_cancelled`` is polled between decoding steps; once it returns True the sentence leaves
    the running batch and its result is ``None``. ``on_stable`` (streaming, :data:`StableReport`) is called
    from the engine's worker thread after a step that grew the sentence's stable prefix.
    """

    source_ids: list[int]  # subword ids, EOS excluded (the engine appends it)
    options: DecodingOptions = field(default_factory=DecodingOptions)
    is_cancelled: Callable[[], bool] | None = None
    text: str = ""  # the original text, for its words ("": words merged from the subword pieces)
    target_prefix: TargetPrefix = field(default_factory=TargetPrefix)  # what decoding is forced through first
    on_stable: StableReport | None = None
    source_end: tuple[int, ...] = ()  # ids after EOS (NLLB's legacy placement of the source language)

    def source(self, eos_id: int) -> list[int]:
        """The ids the encoder reads."""
        return [*self.source_ids, eos_id, *self.source_end]


@dataclass
class ScoredSequence:
    """A finished hypothesis of the search: token ids and scores (text comes later, where the request came in)."""

    tokens: list[int]  # ends with EOS
    score: float
    token_scores: list[float]
    attention: np.ndarray | None = None  # [len(tokens), the sentence's source length]
    terms_met: bool = True  # False: the sentence's constraints did not fit its output limit (server.engine.constraints)


@dataclass
class SearchResult:
    hypotheses: list[ScoredSequence] = field(default_factory=list)
