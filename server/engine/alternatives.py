"""Alternatives at a target prefix's end (``return_alternatives``): an editor's next-word suggestions.

A word is what SentencePiece writes between two spaces: a piece that starts a word, then the pieces that
continue it, up to the next piece that starts a word or the end of the sentence
(:class:`server.completion.WordPieces`). After the prefix's forced pass (:mod:`server.engine.forced`),
:func:`next_words` runs a small beam search over the next word's pieces, :data:`WIDTH` x ``count`` partial
words wide. A partial word ends where ending it (a word start or the end of the sentence next, their
probabilities added) is at least as likely as any one piece that would go on with it, and it spells more
than the word-start mark alone; its probability is that of its pieces times that of its end. (Summed over
a large vocabulary, a word start keeps some probability after any piece, label smoothing's share, so a
word cut short, "Apr" before "il", would otherwise count as a word.) The end of the sentence right after
the prefix is a "word" too: the translation ends there. :func:`rank_words` joins the spellings of one word
(two piece sequences that spell it add up), ranks the words by probability and drops those under
:data:`FLOOR` times the most likely one, so fewer than ``count`` come back rather than junk. Each word is
then given, and continued by the search (the sentence's beam size) from the state after it, its next
piece a word start or the end of the sentence; the hypothesis' score is the word's log-probability.

The first piece is whatever the prefix allows under the sentence's controls: after a prefix that ends
with whitespace, or none, a word start (the engine gives such a prefix the completion of a word boundary,
:meth:`WordPieces.boundary`); inside a word, the pieces that spell it out (:mod:`server.completion`), so
the alternatives are that word's completions; after punctuation, any piece (the word may go on: "25." ->
"25.04.2045").
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from server.completion import WIDTH, WordPieces
from server.controls import process
from server.engine.decode import beam_search
from server.engine.step_model import BeamSentence, ForcedOutput, Resume, StepModel, StepOutput
from server.types import ScoredSequence, SearchResult

FLOOR = 0.01  # a word less likely than this times the most likely next word is not offered
NEG_INF = -np.inf


@dataclass
class Word:
    """A finished next word of sentence ``sentence`` (its row in the group)."""

    sentence: int
    tokens: list[int]  # its pieces, or [EOS]
    scores: list[float]  # each piece's log-probability (the distribution searched)
    log_prob: float  # the word's: its pieces', and its end's (a word start or EOS next; all its spellings found)
    attention: np.ndarray | None  # float32 [len(tokens), S]
    row: int  # its row in the output of the word search's step after it (EOS: unused)


@dataclass
class _Partial:
    """The partial words the word search holds, one per row, all ``m`` pieces long."""

    sentence: np.ndarray  # int64 [L]: each row's sentence
    tokens: np.ndarray  # int64 [L, m]
    scores: np.ndarray  # float [L, m]
    log_prob: np.ndarray  # float [L]
    attention: np.ndarray | None  # float32 [L, m, S]


def rank_words(words: Sequence[Word], count: int, pieces: WordPieces) -> list[Word]:
    """The distinct words among ``words`` (spellings of one word joined, their probabilities added, the
    most likely spelling kept), most likely first, at least :data:`FLOOR` times the most likely, at most
    ``count``."""
    merged: dict[str, Word] = {}
    for word in sorted(words, key=lambda w: -w.log_prob):
        key = pieces.spell(word.tokens)
        if key in merged:
            merged[key].log_prob = float(np.logaddexp(merged[key].log_prob, word.log_prob))
        else:
            merged[key] = replace(word)
    ranked = sorted(merged.values(), key=lambda w: -w.log_prob)
    return [w for w in ranked if w.log_prob >= ranked[0].log_prob + math.log(FLOOR)][:count]


def next_words(model: StepModel, encoded: dict[str, Any], group: Sequence[BeamSentence], prefix: np.ndarray,
               out: ForcedOutput, eos_id: int) -> tuple[list[list[Word]], list[StepOutput]]:
    """The word search (see the module docstring) after each sentence's ``prefix`` (int64 [G, n]), from the
    forced pass ``out`` over it: every word it finished, per sentence, and the model output of each of its
    steps (``[m - 1]``: after the words of ``m`` pieces, which :attr:`Word.row` indexes)."""
    n = prefix.shape[1]
    pieces = group[0].alternatives.words
    controls = [s.controls for s in group]
    need_attention = out.attention is not None
    static = {name: encoded[name] for name in model.static_names}
    searched = process(out.last_log_probs, prefix, controls, n, eos_id)  # [L, V]: after each partial word
    attention = out.attention[:, n] if need_attention else None  # [L, S]: the attention of the piece next
    state = out.state  # after each partial word
    words: list[list[Word]] = [[] for _ in group]
    for g in np.flatnonzero(searched[:, eos_id] > NEG_INF).tolist():  # the translation ends at the prefix
        words[g].append(Word(g, [eos_id], [float(searched[g, eos_id])], float(searched[g, eos_id]),
                             attention[g : g + 1] if need_attention else None, g))
    partial = _Partial(np.arange(len(group)), np.zeros((len(group), 0), dtype=np.int64), np.zeros((len(group), 0)),
                       np.zeros(len(group)), np.zeros((len(group), 0, attention.shape[1]), dtype=np.float32)
                       if need_attention else None)
    outputs: list[StepOutput] = []
    while True:
        m = partial.tokens.shape[1]
        going = ~pieces.ends if m else np.arange(searched.shape[1]) != eos_id  # the pieces that go on with a word
        if m:
            end = np.logaddexp.reduce(searched[:, pieces.ends], axis=1)  # a word start or EOS next
            ending = (end > NEG_INF) & (end >= searched[:, going].max(1)) & ~pieces.bare[partial.tokens].all(1)
            for r in np.flatnonzero(ending).tolist():
                g = int(partial.sentence[r])
                words[g].append(Word(g, partial.tokens[r].tolist(), partial.scores[r].tolist(),
                                     float(partial.log_prob[r] + end[r]),
                                     partial.attention[r] if need_attention else None, r))
        rows, chosen, values = _extend(partial, searched, np.flatnonzero(going), group, words, n)
        if not len(rows):
            return words, outputs
        partial = _Partial(partial.sentence[rows], np.concatenate([partial.tokens[rows], chosen[:, None]], 1),
                           np.concatenate([partial.scores[rows], searched[rows, chosen][:, None]], 1), values,
                           np.concatenate([partial.attention[rows], attention[rows][:, None]], 1)
                           if need_attention else None)
        step = model.step(chosen, model.select_rows(static, partial.sentence), model.select_rows(state, rows),
                          need_attention, 1, full=True)
        outputs.append(step)
        history = np.concatenate([prefix[partial.sentence], partial.tokens], 1)
        searched = process(step.log_probs, history, [controls[g] for g in partial.sentence], n + m + 1, eos_id)
        attention, state = step.attention, step.state


def _extend(partial: _Partial, searched: np.ndarray, going: np.ndarray, group: Sequence[BeamSentence],
            words: list[list[Word]], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The partial words of one more piece the word search keeps: for each sentence with room for it, its
    :data:`WIDTH` x ``count`` most likely extensions of ``partial`` by a piece in ``going`` that can still
    make a word worth offering (:func:`_bound`). Returns their parent rows, pieces and log-probabilities."""
    rows, chosen, values = [], [], []
    for g in np.unique(partial.sentence).tolist():
        count = group[g].alternatives.count
        if n + partial.tokens.shape[1] + 1 >= group[g].limit():  # no room for one more piece and the word's end
            continue
        mine = np.flatnonzero(partial.sentence == g)
        candidates = (partial.log_prob[mine, None] + searched[mine][:, going]).ravel()
        best = np.argsort(-candidates, kind="stable")[: WIDTH * count]
        best = best[(candidates[best] > NEG_INF) & (candidates[best] >= _bound(words[g], count, group[g]))]
        rows += mine[best // len(going)].tolist()
        chosen += going[best % len(going)].tolist()
        values += candidates[best].tolist()
    return np.array(rows, dtype=np.int64), np.array(chosen, dtype=np.int64), np.array(values)


def _bound(words: Sequence[Word], count: int, s: BeamSentence) -> float:
    """The log-probability a partial word of ``s`` needs to be worth going on with (a word is never more
    likely than its pieces so far): :data:`FLOOR` times the most likely word found, and, once ``count``
    words are found, the least likely of them."""
    ranked = rank_words(words, len(words), s.alternatives.words) if words else []
    if not ranked:
        return NEG_INF
    floor = ranked[0].log_prob + math.log(FLOOR)
    return max(floor, ranked[count - 1].log_prob) if len(ranked) >= count else floor


def alternatives(model: StepModel, encoded: dict[str, Any], group: list[BeamSentence], prefix: np.ndarray,
                 out: ForcedOutput, settings: dict[str, Any]) -> list[SearchResult | None]:
    """Each sentence's next words (:func:`next_words`, :func:`rank_words`), each continued by the search
    to one hypothesis whose score is the word's log-probability, most likely first."""
    n, eos_id = prefix.shape[1], settings["eos_id"]
    found, outputs = next_words(model, encoded, group, prefix, out, eos_id)
    chosen = [rank_words(words, s.alternatives.count, s.alternatives.words) for words, s in zip(found, group,
                                                                                                strict=True)]
    prefix_scores = out.target_log_probs[:, :n].astype(np.float64)
    continued: dict[tuple[int, int], SearchResult | None] = {}  # (sentence, rank) -> its word continued
    by_length: dict[int, list[tuple[int, int]]] = {}
    for g, words in enumerate(chosen):
        for i, word in enumerate(words):
            if word.tokens == [eos_id]:
                continued[g, i] = SearchResult([_ended(word, group[g], prefix, prefix_scores, out)])
            else:
                by_length.setdefault(len(word.tokens), []).append((g, i))
    for m, keys in by_length.items():
        words = [chosen[g][i] for g, i in keys]
        continued.update(zip(keys, _continue(model, encoded, group, prefix, prefix_scores, out, outputs[m - 1],
                                             words, settings), strict=True))
    results: list[SearchResult | None] = []
    for g, (s, words) in enumerate(zip(group, chosen, strict=True)):
        mine = [continued[g, i] for i in range(len(words))]
        if (s.is_cancelled is not None and s.is_cancelled()) or any(r is None for r in mine):
            results.append(None)
            continue
        results.append(SearchResult([replace(r.hypotheses[0], score=word.log_prob)
                                     for r, word in zip(mine, words, strict=True) if r.hypotheses]))
    return results


def _ended(word: Word, s: BeamSentence, prefix: np.ndarray, prefix_scores: np.ndarray,
           out: ForcedOutput) -> ScoredSequence:
    """The hypothesis of the end of the sentence right after the prefix."""
    g, n = word.sentence, prefix.shape[1]
    return ScoredSequence(tokens=[*prefix[g].tolist(), *word.tokens], score=word.log_prob,
                          token_scores=[*prefix_scores[g].tolist(), *word.scores],
                          attention=out.attention[g, : n + 1].copy() if s.need_attention else None)


def _continue(model: StepModel, encoded: dict[str, Any], group: list[BeamSentence], prefix: np.ndarray,
              prefix_scores: np.ndarray, out: ForcedOutput, after: StepOutput, words: list[Word],
              settings: dict[str, Any]) -> list[SearchResult | None]:
    """Words of one length given and continued by the search from the word search's step ``after`` them
    (their :attr:`Word.row`), the next piece a word start or the end of the sentence."""
    n, m = prefix.shape[1], len(words[0].tokens)
    sentences = np.array([w.sentence for w in words], dtype=np.int64)
    rows = np.array([w.row for w in words], dtype=np.int64)
    tokens = np.concatenate([prefix[sentences], np.array([w.tokens for w in words], dtype=np.int64)], 1)
    scores = np.concatenate([prefix_scores[sentences], np.array([w.scores for w in words])], 1)
    attention = None
    if out.attention is not None:
        attention = np.concatenate([out.attention[sentences, :n], np.stack([w.attention for w in words])], 1)
    state = model.select_rows(after.state, rows)
    first = StepOutput(np.empty((len(words), 0), dtype=np.int64), np.empty((len(words), 0)), np.empty(0),
                       after.attention[rows] if after.attention is not None else None, state, after.log_probs[rows])
    subs = []
    for w, forced in zip(words, tokens.tolist(), strict=True):
        s = group[w.sentence]
        controls = replace(s.controls, forced=tuple(forced), completion=s.alternatives.words.boundary(n + m))
        subs.append(replace(s, num_hypotheses=1, alternatives=None, controls=controls))
    return beam_search(model, model.select_rows(encoded, sentences), subs,
                       resume=Resume(tokens, scores, attention, state, first), **settings)
