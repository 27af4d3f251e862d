"""Given target tokens in one decoder pass: Score, target prefixes and the alternatives at a prefix's end.

A sentence whose target prefix ends with EOS (Score's whole translations) is read off one forced pass and
never searched. A prefix of one piece (a many-to-many model's target-language token, alone) is forced by the
search's first step through the main decoder: a pass would cost the same one position, in a session whose kernels
read the stored weights where the main decoder's read their packed copies (so the version's weights would be held
twice). A prefix of ``n > 1`` pieces runs as one pass over the positions ``start, p1 .. pn`` (each position's
log-probability of the next given piece, the alignment attention, the decoder state after them, and
the whole distribution after ``pn``); the search then resumes at step ``n`` from that state, its first
step read off the pass (:class:`server.engine.step_model.Resume`), exactly as if it had forced the pieces one step
at a time. With alternatives the pass's state and last distribution go to the next-word search
(below), each of whose words becomes a hypothesis of its own.

:func:`decode_batch` is the static batch. Under continuous batching, :func:`admit` lets sentences with a
prefix join a running decode (:class:`server.engine.decode.RunningDecode`) after a pass over ``start, p1 ..
p(n-1)``: the decode feeds ``pn`` with its other rows, since a step read off the pass would have to run
apart from them; whole targets and alternatives (:func:`runs_apart`) go through :func:`decode_batch` on their own.

A Transformer exported with ``decoder_forced.onnx`` runs each pass as one call; other models (the RNN,
versions exported before that graph) step through the given tokens with :func:`stepwise_force`, a lean
loop without beam bookkeeping.

**Alternatives at a target prefix's end (``return_alternatives``): an editor's next-word suggestions.**

A word is what SentencePiece writes between two spaces: a piece that starts a word, then the pieces that
continue it, up to the next piece that starts a word or the end of the sentence
(:class:`server.completion.WordPieces`). After the prefix's forced pass,
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

from common.model_format.decoding import normalized_score
from server.completion import WIDTH, WordPieces
from server.controls import process
from server.engine.decode import RunningDecode, beam_search
from server.engine.step_model import BeamSentence, ForcedOutput, Resume, StepModel, StepOutput
from server.types import ScoredSequence, SearchResult

FLOOR = 0.01  # a word less likely than this times the most likely next word is not offered
NEG_INF = -np.inf


def stepwise_force(model: StepModel, inputs: np.ndarray, targets: np.ndarray, static: dict[str, Any],
                   state: dict[str, Any], need_attention: bool) -> ForcedOutput:
    """:meth:`StepModel.force` one step per position: ``inputs``/``targets`` int64 [R, T]."""
    rows, length = inputs.shape
    scores = np.zeros((rows, length), dtype=np.float32)
    attention = []
    for t in range(length):
        out = model.step(np.ascontiguousarray(inputs[:, t]), static, state, need_attention, 1, full=True)
        scores[:, t] = np.take_along_axis(out.log_probs, targets[:, t : t + 1], 1)[:, 0]
        if out.attention is not None:
            attention.append(out.attention)
        state = out.state
    return ForcedOutput(scores, out.log_probs, np.stack(attention, 1) if attention else None, state)


def runs_apart(s: BeamSentence, eos_id: int) -> bool:
    """Whether ``s`` cannot join a running decode (:func:`admit`): a whole target (its forced pass is its
    result) or alternatives (the pass branches it into several hypotheses); :func:`decode` them."""
    forced = s.controls.forced
    return bool(s.alternatives) or (bool(forced) and forced[-1] == eos_id)


def decode_batch(model: StepModel, encoded: dict[str, Any], sentences: Sequence[BeamSentence], *, start_id: int,
                 eos_id: int, pad_id: int, joiners: frozenset[int] = frozenset()) -> list[SearchResult | None]:
    """The engine's entry point for a static batch: :func:`server.engine.decode.beam_search` for sentences that
    may have target prefixes, whole targets and alternatives
    (``BeamSentence.alternatives``), their given tokens run as forced passes (see the module docstring);
    each sentence keeps its own beam size and attention. Sentences needing the same pass length go through
    it, and then the search, together."""
    results: list[SearchResult | None] = [None] * len(sentences)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, s in enumerate(sentences):
        forced = s.controls.forced
        if s.alternatives:
            key = ("alternatives", len(forced) + 1)
        elif forced and forced[-1] == eos_id:
            key = ("whole", 0)  # any lengths together: the causal pass ignores padding after a row's end
        elif len(forced) > 1 and s.controls.repetition_penalty == 1.0:
            key = ("prefix", len(forced))
        else:  # no prefix, or one piece (see the module docstring); or a repetition penalty, which needs logits the
            key = ("plain", 0)  # forced pass does not return: the search forces the prefix step by step
        groups.setdefault(key, []).append(i)
    settings = dict(start_id=start_id, eos_id=eos_id, joiners=joiners)
    for (kind, _), members in groups.items():
        rows = np.array(members)
        chosen = encoded if len(members) == len(sentences) else model.select_rows(encoded, rows)
        group = [sentences[i] for i in members]
        if kind == "plain":
            found = beam_search(model, chosen, group, **settings)
        else:
            found = _forced_group(model, chosen, group, kind, pad_id, settings)
        for i, result in zip(members, found, strict=True):
            results[i] = result
    return results


def admit(decode: RunningDecode, encoded: dict[str, Any], sentences: Sequence[BeamSentence], tags: Sequence[Any],
          *, start_id: int) -> None:
    """Admit ``sentences`` (none :func:`runs_apart`) to a running ``decode``: those with a target prefix of
    ``n`` pieces after one forced pass over the start token and its first ``n - 1`` pieces (one pass per
    prefix length), resuming at step ``n`` from the pass's state (:class:`Resume` without a first step:
    the search feeds the last piece with the other rows, so they may join a decode already running)."""
    model = decode.model
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sentences):
        forced = len(s.controls.forced)
        groups.setdefault(forced if forced > 1 else 0, []).append(i)  # one piece: the search's first step forces it
    for length, members in sorted(groups.items()):
        chosen = encoded if len(members) == len(sentences) else model.select_rows(encoded, np.array(members))
        group, group_tags = [sentences[i] for i in members], [tags[i] for i in members]
        if not length:
            decode.admit(chosen, group, group_tags)
            continue
        prefix = np.array([s.controls.forced for s in group], dtype=np.int64)
        inputs = np.concatenate([np.full((len(group), 1), start_id, dtype=np.int64), prefix[:, :-1]], 1)
        out = model.force(inputs, prefix, {name: chosen[name] for name in model.static_names},
                          {name: chosen[name] for name in model.state_names}, any(s.need_attention for s in group))
        decode.admit(chosen, group, group_tags, Resume(prefix, out.target_log_probs, out.attention, out.state))


def _forced_group(model: StepModel, encoded: dict[str, Any], group: list[BeamSentence], kind: str, pad_id: int,
                  settings: dict[str, Any]) -> list[SearchResult | None]:
    """One group of :func:`decode`: its forced pass, then the search (or nothing, for whole targets)."""
    start_id, need_attention = settings["start_id"], any(s.need_attention for s in group)
    given = [list(s.controls.forced) for s in group]
    length = max(len(g) for g in given) + (kind != "whole")
    inputs = np.full((len(group), max(length, 1)), pad_id, dtype=np.int64)
    targets = np.full_like(inputs, pad_id)
    for r, tokens in enumerate(given):
        inputs[r, : len(tokens) + 1] = ([start_id] + tokens)[: length]
        targets[r, : len(tokens)] = tokens
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    out = model.force(inputs, targets, static, state, need_attention)
    if kind == "whole":
        return [None if _cancelled(s) else SearchResult([_given(s, tokens, out, r)])
                for r, (s, tokens) in enumerate(zip(group, given, strict=True))]
    prefix = np.array([tokens for tokens in given], dtype=np.int64).reshape(len(group), len(given[0]))
    attention = out.attention[:, : prefix.shape[1]] if out.attention is not None else None
    if kind == "prefix":  # the pass ran the search's first step too: its distribution is the last one
        n = prefix.shape[1]
        first = StepOutput(np.empty((len(group), 0), dtype=np.int64), np.empty((len(group), 0)), np.empty(0),
                           out.attention[:, n] if out.attention is not None else None, out.state, out.last_log_probs)
        resume = Resume(prefix, out.target_log_probs[:, :n], attention, out.state, first)
        return beam_search(model, encoded, group, resume=resume, **settings)
    return alternatives(model, encoded, group, prefix, out, settings)


def _given(s: BeamSentence, tokens: list[int], out: ForcedOutput, r: int) -> ScoredSequence:
    """A whole given target (ending with EOS) read off row ``r`` of its forced pass."""
    scores = out.target_log_probs[r, : len(tokens)].astype(np.float64)
    return ScoredSequence(tokens=tokens, score=float(normalized_score(scores.sum(), len(tokens), s.length_penalty)),
                          token_scores=scores.tolist(),
                          attention=out.attention[r, : len(tokens)].copy() if s.need_attention else None)


def _cancelled(sentence: BeamSentence) -> bool:
    return sentence.is_cancelled is not None and sentence.is_cancelled()


# ---- alternatives at a prefix's end ----------------------------------------------------------------------------

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
