"""Lexically constrained beam search: every hypothesis a sentence returns contains given runs of target tokens.

A sentence's constraints (``Controls.constraints``) are token sequences, one per occurrence of a glossary term in
its source (the term's target as the target tokenizer writes it at a word start). Each hypothesis carries its
:class:`Progress` through them; EOS is allowed only to a hypothesis that has written all of them, so whatever
the search returns meets them (where none can within the output limit, see :func:`select_constrained`).

The selection is dynamic beam allocation (Post & Vilar 2018, as fairseq's ``LexicallyConstrainedBeamSearch``):
the candidates are the sentence's ``2 x beam`` best continuations, every row's tokens that advance an unmet
term and every row's best token; they are grouped into *banks* by the constraint tokens written (the terms
met and the longest run in progress), and the beam's slots are dealt out: the best candidate first, whatever
its bank, then across the banks, the most advanced bank first, each bank's candidates by score. A hypothesis
that has written more of its terms thus keeps a place beside better-scored ones that have written less, the
model's own best translation keeps its place however many banks there are, and the words around a term are
the model's own choice given the term. EOS finishes a hypothesis that has met its terms as in the unconstrained
search, counted among the hypotheses that have met theirs: when it ranks among their ``2 x beam`` best
continuations and fewer than ``beam`` live ones rank above it. (Counted among all, a term the model finds
costly would keep every hypothesis that wrote it from ending where the model ends it: those still without
the term score higher, and the ones with it would write on to the output limit.)

A term's token that the search takes against the model (a candidate only because it advances a term, not
among the model's best) commits the hypothesis to that term: its next tokens are the term's until it is
written, and while one hypothesis is committed to a term no other starts it against the model. Without
commitment the search writes a term's first pieces and drops them; without the one-at-a-time rule, copies of
the term started at successive steps fill one bank each and crowd out the translation.

Matching is greedy: a term counts when its last token is written (the longest term completed at that token,
when several are), and its tokens then count for no other term; a run the model wrote on its own may break
off (its tokens then count for nothing), and a token may start a term anew.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.engine.step_model import NEG_INF

# Term sets whose states stay made between sentences (:func:`_states`): a glossary's terms recur from sentence to
# sentence, and a sentence's first steps otherwise make every state and its transitions anew (misses there cost
# the selection more than the rest of its Python work)
TERM_SETS_KEPT = 256
_term_sets: OrderedDict[tuple[Any, ...], dict[tuple[Any, ...], Progress]] = OrderedDict()
_term_sets_lock = threading.Lock()


def _states(key: tuple[Any, ...]) -> dict[tuple[Any, ...], Progress]:
    """The states made for the term set ``key`` (its runs, their counts, the joiners), shared by every sentence
    with those terms, the least recently used set dropped past :data:`TERM_SETS_KEPT`."""
    with _term_sets_lock:
        states = _term_sets.get(key)
        if states is None:
            states = _term_sets[key] = {}
            if len(_term_sets) > TERM_SETS_KEPT:
                _term_sets.popitem(last=False)
        else:
            _term_sets.move_to_end(key)
        return states


class Progress:
    """One hypothesis' way through its sentence's terms, made by its :class:`Terms` only. What the selection
    asks of it at every step is worked out once, when it is made, or cached on it: the rows of a beam share
    few states, and every row's candidates ask about its state."""

    __slots__ = ("met", "partial", "committed", "closing", "done", "bank", "next_token", "wanted", "_placed",
                 "_after")

    def __init__(self, met: tuple[int, ...], partial: tuple[tuple[int, int], ...], committed: tuple[int, int] | None,
                 closing: bool, done: bool, bank: int, next_token: int | None, wanted: frozenset[int]) -> None:
        self.met = met  # per distinct term: its occurrences written
        self.closing = closing  # its last token ended a term: the next may not continue that word
        self.partial = partial  # (term, tokens of it written) of the runs in progress
        self.committed = committed  # (term, tokens written) of the run it must finish
        self.done = done  # every term met: EOS may follow
        self.bank = bank  # constraint tokens written: the terms met, and the longest run in progress
        self.next_token = next_token  # the one token it may write next, when committed
        self.wanted = wanted  # the tokens that advance an unmet term
        self._placed: dict[tuple[tuple[bool, ...], frozenset[int]], frozenset[int]] = {}  # (the terms placed
        # at the step's attention peak, busy terms) -> the tokens wanted there
        self._after: dict[tuple[int, bool], Progress] = {}  # (token, commit) -> the progress after it


class Terms:
    """A sentence's constraints: the distinct token runs and how many times each must be written."""

    def __init__(self, constraints: Sequence[Sequence[int]], sources: Sequence[tuple[int, int]] = (),
                 joiners: frozenset[int] = frozenset()) -> None:
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
        self.joiners = joiners  # the target pieces that continue the word before them (no word start, a letter
        # or digit first): none may follow a term's last piece, which would make the term part of a longer word
        # the states of these terms (what a state is and does depends only on the runs, counts and joiners)
        self._made = _states((tuple(self.runs), tuple(self.need), joiners))
        self._placed_at: dict[int | None, tuple[bool, ...]] = {}  # peak -> placed(peak)

    def start(self) -> Progress:
        return self._make(tuple(0 for _ in self.runs), (), None)

    def _make(self, met: tuple[int, ...], partial: tuple[tuple[int, int], ...],
              committed: tuple[int, int] | None, closing: bool = False) -> Progress:
        """The one :class:`Progress` of these values (equal states share one, and with it what is cached)."""
        key = (met, partial, committed, closing)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._new(met, partial, committed, closing)
        return made

    def _new(self, met: tuple[int, ...], partial: tuple[tuple[int, int], ...],
             committed: tuple[int, int] | None, closing: bool) -> Progress:
        done = all(m >= n for m, n in zip(met, self.need, strict=True))
        bank = sum(min(m, n) * len(run) for m, n, run in zip(met, self.need, self.runs, strict=True))
        return Progress(met, partial, committed, closing, done, bank + max((j for _, j in partial), default=0),
                        None if committed is None else self.runs[committed[0]][committed[1]],
                        self._tokens(met, partial, [True] * len(self.runs)))

    def _tokens(self, met: tuple[int, ...], partial: tuple[tuple[int, int], ...],
                startable: Sequence[bool]) -> frozenset[int]:
        """The next token of each run in ``partial``, the first of each unmet term that is ``startable``."""
        return frozenset({self.runs[c][j] for c, j in partial}
                         | {run[0] for run, m, n, on in zip(self.runs, met, self.need, startable, strict=True)
                            if m < n and on})

    def done(self, p: Progress) -> bool:
        return p.done

    def placed(self, peak: int | None) -> tuple[bool, ...]:
        """Per distinct term: whether the search may start it against the model's choice at a step whose
        attention over the source peaks at position ``peak``: where that lies in one of the term's occurrences
        in the source; every term without source spans or attention (``peak`` None)."""
        made = self._placed_at.get(peak)
        if made is None:
            if self.sources is None or peak is None:
                made = (True,) * len(self.runs)
            else:
                made = tuple(any(a <= peak < b for a, b in spans) for spans in self.sources)
            self._placed_at[peak] = made
        return made

    def wanted(self, p: Progress, peak: int | None = None, busy: frozenset[int] = frozenset()) -> frozenset[int]:
        """The tokens that advance an unmet term: the next token of each run in progress, the first of each term
        (of those :meth:`placed` allows at ``peak``, and not ``busy``: terms another hypothesis is committed to)."""
        if (peak is None or self.sources is None) and not busy:
            return p.wanted
        placed = self.placed(peak)
        tokens = p._placed.get((placed, busy))
        if tokens is None:
            partial = p.partial if p.committed is not None else tuple((c, j) for c, j in p.partial if c not in busy)
            tokens = p._placed[placed, busy] = self._tokens(
                p.met, partial, [on and c not in busy for c, on in enumerate(placed)])
        return tokens

    def advance(self, p: Progress, token: int, commit: bool = False) -> Progress:
        """``p`` after ``token`` (see the module docstring for the rules); ``commit``: the search took ``token``
        because it advances a term, so the hypothesis now writes the longest run it advances to its end."""
        if token not in p.wanted and p.committed is None:  # it breaks off whatever runs were in progress
            return self._make(p.met, (), None) if p.partial or p.closing else p
        after = p._after.get((token, commit))
        if after is None:
            after = p._after[token, commit] = self._advance(p, token, commit)
        return after

    def _advance(self, p: Progress, token: int, commit: bool) -> Progress:
        open_runs = [(c, j + 1) for c, j in p.partial if self.runs[c][j] == token]
        open_runs += [(c, 1) for c, (run, m, n) in enumerate(zip(self.runs, p.met, self.need, strict=True))
                      if m < n and run[0] == token and (c, 1) not in open_runs]
        complete = [(j, c) for c, j in open_runs if j == len(self.runs[c])]
        if complete:
            _, c = max(complete, key=lambda jc: (jc[0], -jc[1]))
            met = list(p.met)
            met[c] += 1
            return self._make(tuple(met), (), None, closing=bool(self.joiners))
        committed = None
        if p.committed is not None:
            committed = (p.committed[0], p.committed[1] + 1)
        elif commit and open_runs:
            committed = max(open_runs, key=lambda cj: (cj[1], -cj[0]))
        return self._make(p.met, tuple(sorted(open_runs)), committed)

    def follow(self, tokens: Sequence[int]) -> Progress:
        """The progress after ``tokens`` from the start (a forced pass's tokens)."""
        p = self.start()
        for token in tokens:
            p = self.advance(p, int(token))
        return p


@dataclass(frozen=True)
class ConstrainedRows:
    """One sentence's part of a step: its terms, its rows' progress and where its rows are."""

    terms: Terms
    states: Sequence[Progress]
    first: int  # its first row in the step's arrays
    given: bool  # the step is part of its forced prefix (its token adds nothing to the score)
    beam: int
    last: bool  # its last step: only EOS may follow
    source_length: int


@dataclass
class ConstrainedChoice:
    """One step's selection for one sentence."""

    finished: list[tuple[int, float, float, bool]]  # (row, summed score, EOS's log-probability, terms met)
    live: list[tuple[int, int, float, float, Progress]]  # (row, token, its log-probability, summed score,
    # progress), best first, at most ``beam``
    best_live: float  # the best live candidate's summed score (NEG_INF: none)


def select_constrained(sentences: Sequence[ConstrainedRows], totals: np.ndarray, log_probs: np.ndarray,
                       top_ids: np.ndarray, top_log_probs: np.ndarray, eos_id: int,
                       attention: np.ndarray | None = None) -> list[ConstrainedChoice]:
    """The next hypotheses of each sentence under its terms, from the rows' summed scores ``totals`` [R], the
    step's distribution ``log_probs`` [R, V] (the controls applied) and its best ``top_ids`` [R, k] with their
    ``top_log_probs``, best first, k at least ``2 x beam + 1``; rows are the sentence's own (local rows
    0..width-1 in its choice). At a sentence's ``last`` step every row ends, and a hypothesis that has not met
    its terms ends too, flagged (the caller returns such hypotheses only when none met them: a sentence whose
    terms cannot fit its output limit). ``attention`` [R, source]: the step's attention, which places the terms
    that have source spans (:meth:`Terms.placed`); a row whose best token is EOS may start any term (it would
    end otherwise).

    The sentence's ``2 x beam`` best continuations lie among its rows' best k (with EOS barred, one of them at
    most drops out), so the whole distribution is only read where a term wants a token: no pass over the
    vocabulary beyond the model's own top k."""
    choices = []
    for s in sentences:
        rows = slice(s.first, s.first + len(s.states))
        if s.last:
            eos = log_probs[rows, eos_id].tolist()
            t = totals[rows].tolist()
            finished = [(r, t[r] + (0.0 if s.given else eos[r]), eos[r], state.done)
                        for r, state in enumerate(s.states) if t[r] > NEG_INF and eos[r] > NEG_INF]
            choices.append(ConstrainedChoice(sorted(finished, key=lambda f: -f[1]), [], NEG_INF))
        else:
            peaks: list[int | None] = [None] * len(s.states)
            if attention is not None and s.terms.sources is not None:
                peaks = attention[rows, : s.source_length].argmax(axis=1).tolist()
            choices.append(_deal(s, totals[rows].tolist(), log_probs[rows], top_ids[rows].tolist(),
                                 top_log_probs[rows].tolist(), peaks, eos_id))
    return choices


def _deal(s: ConstrainedRows, totals: list[float], log_probs: np.ndarray, top_ids: list[list[int]],
          top_log_probs: list[list[float]], peaks: list[int | None], eos_id: int) -> ConstrainedChoice:
    """One sentence's selection: dynamic beam allocation over its banks (see :func:`select_constrained`)."""
    terms, states, beam, given = s.terms, s.states, s.beam, s.given
    scored: dict[tuple[int, int], float] = {}  # the model's own candidates (row, token) -> summed score
    pool: list[tuple[float, int, int]] = []  # the same, by score
    row_best: list[int] = []
    for r, state in enumerate(states):
        base = totals[r]
        if base == NEG_INF:
            row_best.append(-1)
            continue
        if state.next_token is not None:  # committed to a term: its next token only
            t = state.next_token
            lp = float(log_probs[r, t])
            v = base + (0.0 if given else lp) if lp > NEG_INF else NEG_INF
            row_best.append(t)
            scored[r, t] = v
            pool.append((-v, r, t))
            continue
        best = -1
        for t, lp in zip(top_ids[r], top_log_probs[r], strict=True):
            if lp == NEG_INF or (t == eos_id and not state.done):  # EOS only once the terms are met
                continue
            if state.closing and t in terms.joiners:  # a term stays a word of its own
                continue
            if best < 0 and t != eos_id:
                best = t
            v = base + (0.0 if given else lp)
            scored[r, t] = v
            pool.append((-v, r, t))
        row_best.append(best)
    pool.sort()
    value = {(r, t): -v for v, r, t in pool[: 2 * beam]}  # the candidates: the 2 x beam best, each row's best,
    natural = set(value)  # the tokens that advance a term, and EOS where the hypotheses that met their terms
    # would end it: among their own 2 x beam best (their scores, lower by what the terms cost, keep them out of
    # the sentence's best, and a hypothesis the model would end would go on writing whatever comes next)
    if any(state.done for state in states):
        for v, r, t in itertools.islice((c for c in pool if states[c[1]].done), 2 * beam):
            if t == eos_id:
                value[r, t] = -v
    advancing: list[frozenset[int]] = []  # per row: the tokens that advance one of its terms at all
    busy = frozenset(state.committed[0] for state, total in zip(states, totals, strict=True)
                     if state.committed is not None and total > NEG_INF)  # one forced copy of a term at a time
    for r, state in enumerate(states):
        if totals[r] == NEG_INF:
            advancing.append(frozenset())
            continue
        advancing.append(state.wanted)
        if row_best[r] >= 0:
            natural.add((r, row_best[r]))
            value[r, row_best[r]] = scored[r, row_best[r]]
        ending = top_ids[r][0] == eos_id
        for t in terms.wanted(state, None if ending else peaks[r], busy):
            if (r, t) not in value and (state.next_token is None or t == state.next_token):
                lp = float(log_probs[r, t])
                value[r, t] = totals[r] + (0.0 if given else lp) if lp > NEG_INF else NEG_INF
    ranked = sorted((c for c, v in value.items() if v > NEG_INF), key=lambda c: (-value[c], c))
    finished: list[tuple[int, float, float, bool]] = []
    banks: dict[int, list[tuple[int, int, Progress]]] = {}
    leader: int | None = None  # the bank of the best live candidate
    done_before = 0  # live candidates ranked ahead that have met their terms
    met_before = 0  # candidates ranked ahead that have met their terms, EOS included
    for r, t in ranked:
        if t == eos_id:  # EOS finishes as in the unconstrained selection, among the candidates that met the terms
            if met_before < 2 * beam and done_before < beam:
                finished.append((r, value[r, t], float(log_probs[r, t]), True))
            met_before += 1
            continue
        state = states[r]
        if t in advancing[r] or state.committed is not None or state.partial or state.closing:
            p = terms.advance(state, t, commit=(r, t) not in natural)
        else:  # a token no term wants, from a row in no run and not just past a term: nothing changes
            p = state
        banks.setdefault(p.bank, []).append((r, t, p))
        done_before += p.done
        met_before += p.done
        if leader is None:
            leader = p.bank
    dealt: list[tuple[int, int, Progress]] = []
    if leader is not None:  # the best candidate keeps its place, whatever its bank
        dealt.append(banks[leader].pop(0))
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
