"""The text side of a model version: tokenizing, target prefixes, language tokens and detokenizing.

What the serving layer does per request besides decoding (:mod:`server.frontend.translate`) needs the model's
tokenizer and manifest only, never ONNX Runtime: a :class:`TextCodec` is built from a version's directory
(:meth:`TextCodec.load`) by every process that answers requests, while the engine core decodes token ids
(:mod:`server.engine.engine`). The engine holds one too (its smoke test and its convenience ``translate``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

from common.model_format.manifest import Manifest, read_manifest
from common.model_format.tokenizer import AnyTokenizer, load_tokenizer
from server.alignment import merge_to_words, segment_words
from server.completion import WordPieces, build_completion, piece_index, split_partial_word
from server.errors import InvalidArgument
from server.routing import language_key
from server.types import Hypothesis, SearchResult, SentenceRequest, TargetPrefix, Translation


@dataclass(frozen=True)
class LanguageTokens:
    """The tokens that ask a multilingual model for a language pair."""

    source: tuple[int, ...] = ()  # before the source's pieces (Marian's >>xx<<, a many-to-many model's source code)
    lead: tuple[int, ...] = ()  # the decoder's forced first tokens (a many-to-many model's target code)
    source_end: tuple[int, ...] = ()  # after the source's EOS (NLLB's legacy placement of the source code)


NO_LANGUAGE_TOKENS = LanguageTokens()


class TextCodec:
    """Text <-> token ids of one model version (its tokenizer and manifest)."""

    def __init__(self, manifest: Manifest, tokenizer: AnyTokenizer) -> None:
        self.manifest = manifest
        self.tokenizer = tokenizer
        ids = manifest.special_ids
        self.eos_id = ids["eos"]
        self.words = WordPieces(tokenizer.pieces(range(manifest.vocab_size)), self.eos_id)  # which ids start a word

    @classmethod
    def load(cls, version_dir: str | Path, *, verify: bool = True) -> TextCodec:
        """The codec of ``models/<name>/<version>/`` (``verify``: check the sha256 of every listed file)."""
        manifest = read_manifest(Path(version_dir), verify=verify)
        return cls(manifest, load_tokenizer(Path(version_dir), manifest.tokenizer_type))

    def tokenize(self, text: str) -> list[int]:
        """Subword ids of ``text`` (EOS excluded)."""
        return self.tokenizer.encode(text)

    def target_prefix(self, text: str, *, whole: bool = False) -> TargetPrefix:
        """A target prefix, tokenized: when it ends inside a word (no whitespace or punctuation at its end),
        the text before that word is forced and the word is completed (:mod:`server.completion`); a word no
        pieces spell, and a ``whole`` translation (Score), are tokenized as they are. Whether it ends with
        whitespace is kept beside its pieces (the tokenizer drops it): alternatives then start a word."""
        head, word = ("", "") if whole else split_partial_word(text)
        if word:
            ids = self.tokenizer.encode_target(head) if head.strip() else []
            completion = build_completion(word, not head or head[-1].isspace(), len(ids), self._piece_index)
            if completion is not None:
                return TargetPrefix(tuple(ids), completion)
        return TargetPrefix(tuple(self.tokenizer.encode_target(text)), spaced=not whole and text[-1:].isspace())

    @functools.cached_property
    def _piece_index(self) -> dict[str, list[tuple[int, str]]]:
        """The target pieces a partial word is spelt with (not padding, start, end or unknown)."""
        ids = self.manifest.special_ids
        special = {ids["pad"], ids["bos"], ids["eos"], ids["decoder_start"], ids["unk"]}
        return piece_index(self.tokenizer.pieces(range(self.manifest.vocab_size)), special)

    def language_tokens(self, source: str, target: str) -> LanguageTokens:
        """The tokens that ask for ``source -> target`` (either empty: the model's default). A many-to-many model
        (``target_language_token: decoder``): its source code's token first in the source (after its EOS where
        ``source_language_token`` is ``end``), its target code's as the decoder's forced first token. A
        multilingual Marian model: ``>>target<<`` before the source. Others:
        none. A code the model does not serve is InvalidArgument naming those it does."""
        manifest = self.manifest
        if manifest.target_language_token == "decoder":
            codes = manifest.language_tokens
            source_code = self._served("source_language", source or manifest.source_language, manifest.source_languages)
            target_code = self._served("target_language", target or manifest.target_language, manifest.target_languages)
            if manifest.source_language_token == "end":
                return LanguageTokens((), (codes[target_code],), (codes[source_code],))
            return LanguageTokens((codes[source_code],), (codes[target_code],))
        languages = manifest.target_languages
        if not target or (not languages and target == manifest.target_language):
            return LanguageTokens()
        token = self.tokenizer.language_id(target) if languages else None
        if token is None:
            known = ", ".join(languages or [manifest.target_language])
            raise InvalidArgument(f"target_language {target!r} is not served by {manifest.name}; choose {known}")
        return LanguageTokens((token,))

    def _served(self, field: str, code: str, codes: list[str]) -> str:
        """``code`` as the model spells it (compared ignoring case, ``-`` for ``_``); else InvalidArgument."""
        key = language_key(code)
        for known in codes:
            if language_key(known) == key:
                return known
        raise InvalidArgument(f"{field} {code!r} is not served by {self.manifest.name}; choose {', '.join(codes)}")


    def to_translation(self, request: SentenceRequest, result: SearchResult) -> Translation:
        """Detokenize one sentence's result: pieces, text and words (computed once here, see
        :func:`server.alignment.segment_words`) and word-level attention over those same words."""
        source_pieces = self.tokenizer.pieces(request.source_ids)
        source_words = segment_words(source_pieces, request.text)
        hypotheses = []
        lead = request.target_prefix.lead
        for hyp in result.hypotheses:
            if lead:  # the model's target-language token: decoded, not part of the translation
                hyp = replace(hyp, tokens=hyp.tokens[lead:], token_scores=hyp.token_scores[lead:],
                              attention=None if hyp.attention is None else hyp.attention[lead:])
            ids = hyp.tokens[:-1] if hyp.tokens and hyp.tokens[-1] == self.eos_id else hyp.tokens
            pieces = self.tokenizer.pieces(ids)
            text = self.tokenizer.decode(ids)
            words = segment_words(pieces, text)
            attention = None
            if hyp.attention is not None:
                attention = merge_to_words(hyp.attention[:, : len(source_pieces) + 1], source_pieces, pieces,
                                           source_words, words)
            hypotheses.append(
                Hypothesis(
                    text=text,
                    tokens=pieces,
                    words=words,
                    token_ids=list(ids),
                    score=hyp.score,
                    token_scores=hyp.token_scores,
                    attention=attention,
                    terms_met=hyp.terms_met,
                )
            )
        return Translation(source_tokens=source_pieces, source_words=source_words, hypotheses=hypotheses)
