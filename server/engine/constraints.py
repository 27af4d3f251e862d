"""Lexically constrained beam search: every hypothesis a sentence returns contains given runs of target tokens.

A sentence's constraints (``Controls.constraints``) are token sequences, one per occurrence of a glossary term in
its source (the term's target as the target tokenizer writes it at a word start). Each hypothesis carries its
:class:`Progress` through them; EOS is allowed only to a hypothesis that has written all of them, so whatever
the search returns meets them (where none can within the output limit, see :func:`select_constrained`).

The selection is dynamic beam allocation (Post & Vilar 2018, as fairseq's ``LexicallyConstrainedBeamSearch``):
the candidates are the sentence's ``2 x beam`` best continuations, every row's tokens that advance an unmet
term and every row's best token; they are grouped into *banks* by their progress, and the beam's slots are
dealt out across the banks, the most advanced bank first, each bank's candidates by score. A hypothesis that
has written more of its terms thus keeps a place beside better-scored ones that have written less, and the
words around a term are the model's own choice given the term.

Banks count whole terms: ``2 x terms met``, plus one while a term is being written. A term's token that the
search takes against the model (a candidate only because it advances a term, not among the model's best)
commits the hypothesis to that term: its next tokens are the term's until it is written. Counting tokens
instead (one bank per constraint token, as the paper does) needs a beam wider than the constraint tokens:
with fewer slots than banks the least advanced banks, where the model's own translation is, get none, and
what survives is the term written early followed by whatever comes after it. With whole terms a sentence
needs ``2 x terms + 1`` slots (:func:`server.frontend.glossary.constrained_beam`) whatever the term's length.

Matching is greedy: a term counts when its last token is written (the longest term completed at that token,
when several are), and its tokens then count for no other term; a run the model wrote on its own may break
off (its tokens then count for nothing), and a token may start a term anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from server.engine.step_model import NEG_INF


@dataclass(frozen=True)
class Progress:
    """One hypothesis' way through its sentence's terms."""

    met: tuple[int, ...]  # per distinct term: its occurrences written
    partial: tuple[tuple[int, int], ...] = ()  # (term, tokens of it written) of the runs in progress
    committed: tuple[int, int] | None = None  # (term, tokens written) of the run it must finish


class Terms:
    """A sentence's constraints: the distinct token runs and how many times each must be written."""

    def __init__(self, constraints: Sequence[Sequence[int]], sources: Sequence[tuple[int, int]] = ()) -> None:
        if any(not run for run in constraints):
            raise ValueError("a constraint has no tokens")
        if sources and len(sources) != len(constraints):
            raise ValueError("constraint_sources needs one source span per constraint")
        runs: dict[tuple[int, ...], int] = {}
        spans: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, run in enumerate(constraints):
            runs[tuple(run)] = runs.get(tuple(run), 0) + 1
            if sources:
                spans.setdefault(tuple(run), []).append(tuple(sources[i]))  # type: ignore[arg-type]
        self.runs = list(runs)
        self.need = list(runs.values())
        self.sources = [spans[run] for run in self.runs] if sources else None  # per distinct term
        self._met_tokens: dict[tuple[int, ...], int] = {}  # bank's cache: terms met -> their tokens

    def start(self) -> Progress:
        return Progress(tuple(0 for _ in self.runs))

    def done(self, p: Progress) -> bool:
        return all(m >= n for m, n in zip(p.met, self.need, strict=True))

    def bank(self, p: Progress) -> int:
        """Constraint tokens written: the terms met, and the longest run in progress."""
        met = self._met_tokens.get(p.met)
        if met is None:
            met = self._met_tokens[p.met] = sum(min(m, n) * len(run)
                                                for m, n, run in zip(p.met, self.need, self.runs, strict=True))
        return met + max((j for _, j in p.partial), default=0)

    def next_token(self, p: Progress) -> int | None:
        """The one token a hypothesis committed to a term may write next (None: it is not committed)."""
        return None if p.committed is None else self.runs[p.committed[0]][p.committed[1]]

    def placed(self, attention: np.ndarray | None) -> list[bool]:
        """Per distinct term: whether the search may start it against the model's choice at a step whose
        attention over the source (one row's) is ``attention``: where it peaks on one of the term's
        occurrences in the source; every term without source spans or attention."""
        if self.sources is None or attention is None:
            return [True] * len(self.runs)
        peak = int(np.argmax(attention))
        return [any(a <= peak < b for a, b in spans) for spans in self.sources]

    def wanted(self, p: Progress, placed: Sequence[bool] | None = None) -> set[int]:
        """The tokens that advance an unmet term: the next token of each run in progress, the first of each term
        (of those ``placed`` allows, when given)."""
        tokens = {self.runs[c][j] for c, j in p.partial}
        tokens.update(run[0] for c, (run, m, n) in enumerate(zip(self.runs, p.met, self.need, strict=True))
                      if m < n and (placed is None or placed[c]))
        return tokens

    def advance(self, p: Progress, token: int, commit: bool = False) -> Progress:
        """``p`` after ``token`` (see the module docstring for the rules); ``commit``: the search took ``token``
        because it advances a term, so the hypothesis now writes the longest run it advances to its end."""
        open_runs = [(c, j + 1) for c, j in p.partial if self.runs[c][j] == token]
        open_runs += [(c, 1) for c, (run, m, n) in enumerate(zip(self.runs, p.met, self.need, strict=True))
                      if m < n and run[0] == token and (c, 1) not in open_runs]
        complete = [(j, c) for c, j in open_runs if j == len(self.runs[c])]
        if complete:
            _, c = max(complete, key=lambda jc: (jc[0], -jc[1]))
            met = list(p.met)
            met[c] += 1
            return Progress(tuple(met))
        committed = None
        if p.committed is not None:
            committed = (p.committed[0], p.committed[1] + 1)
        elif commit and open_runs:
            committed = max(open_runs, key=lambda cj: (cj[1], -cj[0]))
        return Progress(p.met, tuple(sorted(open_runs)), committed)

    def follow(self, tokens: Sequence[int]) -> Progress:
        """The progress after ``tokens`` from the start (a forced pass's tokens)."""
        p = self.start()
        for token in tokens:
            p = self.advance(p, int(token))
        return p


@dataclass
class ConstrainedChoice:
    """One step's selection for one sentence."""

    finished: list[tuple[int, float, float, bool]]  # (row, summed score, EOS's log-probability, terms met)
    live: list[tuple[int, int, float, float, Progress]]  # (row, token, its log-probability, summed score,
    # progress), best first, at most ``beam``
    best_live: float  # the best live candidate's summed score (NEG_INF: none)


def select_constrained(terms: Terms, states: Sequence[Progress], totals: np.ndarray, log_probs: np.ndarray,
                       given: bool, beam: int, eos_id: int, last: bool,
                       attention: np.ndarray | None = None) -> ConstrainedChoice:
    """The next hypotheses of one sentence under ``terms``: its rows' ``states`` and summed scores ``totals``
    [width], the step's distribution ``log_probs`` [width, V] (the controls applied). ``given``: the step is
    part of a forced prefix (its token adds nothing to the score). ``last``: the sentence's last step, where only
    EOS may follow: every row ends, and a hypothesis that has not met its terms ends too, flagged (the caller
    returns such hypotheses only when none met them: a sentence whose terms cannot fit its output limit).
    ``attention`` [width, source]: the step's attention, which places the terms that have source spans
    (:meth:`Terms.placed`); a row whose best token is EOS may start any term (it would end otherwise)."""
    width = len(states)
    eos = log_probs[:, eos_id]
    if last:
        finished = [(r, float(totals[r] + (0.0 if given else eos[r])), float(eos[r]), terms.done(states[r]))
                    for r in range(width) if totals[r] > NEG_INF and eos[r] > NEG_INF]
        return ConstrainedChoice(sorted(finished, key=lambda f: -f[1]), [], NEG_INF)
    added = np.where(np.isfinite(log_probs), 0.0, NEG_INF) if given else log_probs.copy()
    done = [terms.done(s) for s in states]
    added[[r for r in range(width) if not done[r]], eos_id] = NEG_INF  # EOS only once the terms are met
    for r, state in enumerate(states):
        token = terms.next_token(state)
        if token is not None:  # committed to a term: its next token only
            keep = added[r, token]
            added[r] = NEG_INF
            added[r, token] = keep
    scores = totals[:, None] + added
    flat = scores.ravel()
    count = min(2 * beam, flat.size)
    vocabulary = log_probs.shape[1]
    natural = {divmod(int(i), vocabulary) for i in np.argpartition(flat, flat.size - count)[flat.size - count:]}
    eos_scores = scores[:, eos_id].copy()
    scores[:, eos_id] = NEG_INF
    row_best = scores.argmax(axis=1)  # each row's best token but EOS
    scores[:, eos_id] = eos_scores
    ending = log_probs.argmax(axis=1) == eos_id
    wanted: dict[int, set[int]] = {}  # the tokens the search adds for a row (placed)
    advancing: dict[int, set[int]] = {}  # the tokens that advance one of its terms at all
    for r in range(width):
        if totals[r] == NEG_INF:
            continue
        placed = None if ending[r] else terms.placed(attention[r] if attention is not None else None)
        advancing[r] = terms.wanted(states[r])
        wanted[r] = advancing[r] if placed is None or all(placed) else terms.wanted(states[r], placed)
        natural.add((r, int(row_best[r])))
    candidates = natural.union((r, t) for r, tokens in wanted.items() for t in tokens)
    value = {c: float(scores[c]) for c in candidates}
    ranked = sorted((c for c in candidates if value[c] > NEG_INF), key=lambda c: (-value[c], c))
    finished: list[tuple[int, float, float, bool]] = []
    banks: dict[int, list[tuple[int, int, Progress]]] = {}
    live_before = 0
    for r, t in ranked[: 2 * beam]:  # EOS finishes as in the unconstrained selection: ahead of the beam-th live
        if t == eos_id:
            if live_before < beam:
                finished.append((r, value[r, t], float(log_probs[r, t]), True))
        else:
            live_before += 1
    for r, t in ranked:
        if t == eos_id:
            continue
        state = states[r]
        if t in advancing[r] or state.committed is not None or state.partial:
            p = terms.advance(state, t, commit=(r, t) not in natural)
        else:  # a token no term wants, from a row in no run: nothing changes
            p = state
        banks.setdefault(terms.bank(p), []).append((r, t, p))
    dealt: list[tuple[int, int, Progress]] = []
    order = sorted(banks, reverse=True)
    depth = 0
    while len(dealt) < beam and any(depth < len(banks[b]) for b in order):
        for b in order:  # the most advanced bank first, each bank's best first
            if depth < len(banks[b]) and len(dealt) < beam:
                dealt.append(banks[b][depth])
        depth += 1
    dealt.sort(key=lambda c: (-value[c[0], c[1]], c[0], c[1]))
    live = [(r, t, float(log_probs[r, t]), value[r, t], p) for r, t, p in dealt]
    return ConstrainedChoice(finished, live, live[0][3] if live else NEG_INF)
