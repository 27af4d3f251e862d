"""Lexically constrained beam search: every hypothesis a sentence returns contains given runs of target tokens.

A sentence's constraints (``Controls.constraints``) are token sequences, one per occurrence of a glossary term in
its source (the term's target as the target tokenizer writes it at a word start). Each hypothesis carries its
:class:`Progress` through them; EOS is allowed only to a hypothesis that has written all of them, so whatever
the search returns meets them (where none can within the output limit, see :func:`select_constrained`).

The selection is dynamic beam allocation (Post & Vilar 2018, as fairseq's ``LexicallyConstrainedBeamSearch``):
the candidates are the sentence's ``2 x beam`` best continuations, every row's tokens that advance an unmet
term and every row's best token; they are grouped into *banks* by how many constraint tokens they have written,
and the beam's slots are dealt out across the banks, the most advanced bank first, each bank's candidates by
score. A hypothesis that has written more of its terms thus keeps a place beside better-scored ones that have
written less, and the words around a term are the model's own choice given the term.

Matching is greedy: a term counts when its last token is written (the longest term completed at that token,
when several are), and its tokens then count for no other term; a run that breaks off is abandoned (its tokens
count for nothing), and a token may start a term anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from server.controls import top_k
from server.engine.step_model import NEG_INF


@dataclass(frozen=True)
class Progress:
    """One hypothesis' way through its sentence's terms."""

    met: tuple[int, ...]  # per distinct term: its occurrences written
    partial: tuple[tuple[int, int], ...] = ()  # (term, tokens of it written) of the runs in progress


class Terms:
    """A sentence's constraints: the distinct token runs and how many times each must be written."""

    def __init__(self, constraints: Sequence[Sequence[int]]) -> None:
        if any(not run for run in constraints):
            raise ValueError("a constraint has no tokens")
        runs: dict[tuple[int, ...], int] = {}
        for run in constraints:
            runs[tuple(run)] = runs.get(tuple(run), 0) + 1
        self.runs = list(runs)
        self.need = list(runs.values())
        self.total = sum(n * len(run) for run, n in zip(self.runs, self.need, strict=True))  # tokens to write

    def start(self) -> Progress:
        return Progress(tuple(0 for _ in self.runs))

    def done(self, p: Progress) -> bool:
        return all(m >= n for m, n in zip(p.met, self.need, strict=True))

    def written(self, p: Progress) -> int:
        """Constraint tokens written (the bank): the terms met, and the longest run in progress."""
        met = sum(min(m, n) * len(run) for m, n, run in zip(p.met, self.need, self.runs, strict=True))
        return met + max((j for _, j in p.partial), default=0)

    def wanted(self, p: Progress) -> set[int]:
        """The tokens that advance an unmet term: the next token of each run in progress, the first of each term."""
        tokens = {self.runs[c][j] for c, j in p.partial}
        tokens.update(run[0] for run, m, n in zip(self.runs, p.met, self.need, strict=True) if m < n)
        return tokens

    def advance(self, p: Progress, token: int) -> Progress:
        """``p`` after ``token`` (see the module docstring for the rules)."""
        open_runs = [(c, j + 1) for c, j in p.partial if self.runs[c][j] == token]
        open_runs += [(c, 1) for c, (run, m, n) in enumerate(zip(self.runs, p.met, self.need, strict=True))
                      if m < n and run[0] == token and (c, 1) not in open_runs]
        complete = [(j, c) for c, j in open_runs if j == len(self.runs[c])]
        if complete:
            _, c = max(complete, key=lambda jc: (jc[0], -jc[1]))
            met = list(p.met)
            met[c] += 1
            return Progress(tuple(met))
        return Progress(p.met, tuple(sorted(open_runs)))

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
                       given: bool, beam: int, eos_id: int, last: bool) -> ConstrainedChoice:
    """The next hypotheses of one sentence under ``terms``: its rows' ``states`` and summed scores ``totals``
    [width], the step's distribution ``log_probs`` [width, V] (the controls applied). ``given``: the step is
    part of a forced prefix (its token adds nothing to the score). ``last``: the sentence's last step, where only
    EOS may follow: every row ends, and a hypothesis that has not met its terms ends too, flagged (the caller
    returns such hypotheses only when none met them: a sentence whose terms cannot fit its output limit)."""
    width = len(states)
    eos = log_probs[:, eos_id]
    if last:
        finished = [(r, float(totals[r] + (0.0 if given else eos[r])), float(eos[r]), terms.done(states[r]))
                    for r in range(width) if totals[r] > NEG_INF and eos[r] > NEG_INF]
        return ConstrainedChoice(sorted(finished, key=lambda f: -f[1]), [], NEG_INF)
    added = np.where(np.isfinite(log_probs), 0.0, NEG_INF) if given else log_probs.copy()
    done = [terms.done(s) for s in states]
    added[[r for r in range(width) if not done[r]], eos_id] = NEG_INF  # EOS only once the terms are met
    scores = totals[:, None] + added
    flat = scores.reshape(1, -1)
    best, _ = top_k(flat, 2 * beam)
    vocabulary = log_probs.shape[1]
    candidates = {(int(i) // vocabulary, int(i) % vocabulary) for i in best[0]}
    for r in range(width):
        if totals[r] == NEG_INF:
            continue
        candidates.update((r, t) for t in terms.wanted(states[r]))
        row = scores[r].copy()
        row[eos_id] = NEG_INF
        candidates.add((r, int(np.argmax(row))))
    ranked = sorted((c for c in candidates if scores[c] > NEG_INF), key=lambda c: (-scores[c], c))
    finished: list[tuple[int, float, float, bool]] = []
    banks: dict[int, list[tuple[int, int, Progress]]] = {}
    live_before = 0
    for r, t in ranked[: 2 * beam]:  # EOS finishes as in the unconstrained selection: ahead of the beam-th live
        if t == eos_id:
            if live_before < beam:
                finished.append((r, float(scores[r, t]), float(log_probs[r, t]), True))
        else:
            live_before += 1
    for r, t in ranked:
        if t != eos_id:
            p = terms.advance(states[r], t)
            banks.setdefault(terms.written(p), []).append((r, t, p))
    dealt: list[tuple[int, int, Progress]] = []
    order = sorted(banks, reverse=True)
    depth = 0
    while len(dealt) < beam and any(depth < len(banks[b]) for b in order):
        for b in order:  # the most advanced bank first, each bank's best first
            if depth < len(banks[b]) and len(dealt) < beam:
                dealt.append(banks[b][depth])
        depth += 1
    dealt.sort(key=lambda c: (-scores[c[0], c[1]], c[0], c[1]))
    live = [(r, t, float(log_probs[r, t]), float(scores[r, t]), p) for r, t, p in dealt]
    return ConstrainedChoice(finished, live, live[0][3] if live else NEG_INF)
