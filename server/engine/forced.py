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
(:mod:`server.engine.alternatives`), each of whose words becomes a hypothesis of its own.

:func:`decode` is the static batch. Under continuous batching, :func:`admit` lets sentences with a
prefix join a running decode (:class:`server.engine.decode.RunningDecode`) after a pass over ``start, p1 ..
p(n-1)``: the decode feeds ``pn`` with its other rows, since a step read off the pass would have to run
apart from them; whole targets and alternatives (:func:`runs_apart`) go through :func:`decode` on their own.

A Transformer exported with ``decoder_forced.onnx`` runs each pass as one call; other models (the RNN,
versions exported before that graph) step through the given tokens with :func:`stepwise_force`, a lean
loop without beam bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.model_format.decoding import normalized_score
from server.engine.alternatives import alternatives
from server.engine.decode import RunningDecode, beam_search
from server.engine.step_model import BeamSentence, ForcedOutput, Resume, StepModel, StepOutput
from server.types import ScoredSequence, SearchResult


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
                 eos_id: int, pad_id: int) -> list[SearchResult | None]:
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
    settings = dict(start_id=start_id, eos_id=eos_id)
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
