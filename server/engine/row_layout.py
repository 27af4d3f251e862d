"""How a running decode's sentences lie on its rows (:class:`server.engine.decode.RunningDecode`).

A sentence owns ``width`` contiguous rows: 1 before its first expansion, then its beam size.
:func:`lay_out` works out what a step reads of its sentences' settings (their rows, limits, the top-k
width, which selection each takes); the decode keeps that :class:`Layout` while the same sentences
decode and all have expanded, instead of rebuilding a dozen small arrays every step.
:func:`fill_holes` decides where the sentences that stay go when others leave.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# the plain beam steps pay for their set-up over runs of quiet steps; every sentence that leaves ends a run (the
# general step takes that step), so past a few sentences of short outputs they cost more than they save
# (benchmarks/README.md, "Plain beam steps": 1.05-1.21x at 1-4 sentences, 0.81-0.98x at 8-32 on the demo model)
PLAIN_BEAM_SENTENCES = 4


@dataclass(frozen=True)
class Layout:
    """What a step reads of its sentences' settings, worked out again only when sentences join, leave or
    first expand."""

    widths: np.ndarray  # [n] the rows each sentence holds this step
    starts: np.ndarray  # [n] its first row
    limits: np.ndarray  # [R] the step limit of each row's sentence
    k: int  # the best tokens the model returns for each row: 2 x the widest beam, one more under constraints
    attention: bool  # some sentence asks for attention: the attention graph runs
    lean: np.ndarray  # the beam-1 sentences that take the lean arg-max path
    groups: list[tuple[int, int, np.ndarray]]  # (beam, width, sentences) of the others
    settled: bool  # every sentence has expanded: the layout holds while nobody joins or leaves
    # counted in steps from the one the layout was worked out for (every sentence advances one a step):
    room: int  # steps before some row reaches its sentence's last step (there only EOS may follow)
    full_for: float  # steps during which some sentence needs the whole distribution (its ``full_until``)
    given_for: int  # steps during which some sentence decodes its forced prefix
    penalised: bool  # some sentence has a repetition penalty
    constrained: bool  # some sentence has constraints: it takes its own selection (server.engine.constraints)
    plain: bool  # every sentence is beam 1 on the lean path, without sampling, attention, penalty or streaming:
    # past its controls' and prefix's margins, its steps can be the model's own arg-max steps
    plain_beam: bool  # some sentence searches a beam > 1, every such sentence has expanded, none asks for
    # attention, a penalty, sampling or streaming, and the decode holds at most PLAIN_BEAM_SENTENCES: past the
    # controls' and prefixes' margins, the quiet steps can be plain beam steps (server.engine.host_runs; a beam-1
    # sentence there is a beam of one row)
    device_beam: bool  # every sentence searches one beam > 1 and has expanded, none asks for attention, a
    # penalty, sampling or streaming: on a model that keeps its state on a device, the quiet steps' selection
    # can run there (server.engine.device_runs), whatever the number of sentences


def lay_out(sentences: Sequence[Any], row_sentence: np.ndarray, lean_greedy: bool) -> Layout:
    """The layout of ``sentences`` (each with ``step``, ``joined_at``, ``beam``, ``limit``, ``attention``,
    ``full_until``, ``forced_length``, ``penalised``, ``terms``, ``rng`` and ``spec.on_stable``) on rows whose sentences
    are ``row_sentence``; ``lean_greedy``: beam-1 sentences take the lean path."""
    n = len(sentences)
    expanded = np.array([s.step > s.joined_at for s in sentences])
    beams = np.array([s.beam for s in sentences])
    if row_sentence.size == n:  # one row each
        starts, widths = np.arange(n), np.ones(n, dtype=np.int64)
    else:  # a sentence holds one row before its first step, then its beam
        widths = np.where(expanded, beams, 1)
        starts = np.cumsum(widths) - widths
    lean = (beams == 1) if lean_greedy else np.zeros(n, dtype=bool)
    pairs = sorted(set(zip(beams[~lean].tolist(), widths[~lean].tolist(), strict=True)))
    groups = [(beam, width, np.arange(n) if len(pairs) == 1 and not lean.any() else
               np.flatnonzero(~lean & (beams == beam) & (widths == width))) for beam, width in pairs]
    attention, penalised = any(s.attention for s in sentences), any(s.penalised for s in sentences)
    constrained = any(s.terms is not None for s in sentences)
    bare = not attention and not penalised and not constrained and all(
        s.rng is None and s.spec.on_stable is None for s in sentences)
    return Layout(widths=widths, starts=starts, limits=np.array([s.limit for s in sentences])[row_sentence],
                  k=2 * int(beams.max()) + constrained if (beams > 1).any() or not lean_greedy else 1,
                  attention=attention, lean=np.flatnonzero(lean), groups=groups,
                  settled=bool(expanded.all()), room=min(s.limit - 1 - s.step for s in sentences),
                  full_for=max(s.full_until - s.step for s in sentences),
                  given_for=max(s.forced_length - s.step for s in sentences), penalised=penalised,
                  constrained=constrained,
                  plain=bool(lean.all()) and bare,
                  plain_beam=bool((beams > 1).any() and ((beams == 1) | expanded).all()) and bare
                  and n <= PLAIN_BEAM_SENTENCES,
                  device_beam=bool(beams.min() > 1 and (beams == beams.max()).all() and expanded.all()) and bare)


def fill_holes(kept: list[int], widths: np.ndarray, beams: list[int], n: int) -> list[int]:
    """The row order of the sentences that stay for the next step: ``kept`` (indices into this step's
    ``n`` sentences; ``beams``: the rows each holds next step) in this step's order, except that when a
    sentence leaves and the last sentence still to place holds next step as many rows as the one that left
    held (``widths``), the last one takes its place. The sentences in between keep their rows, so a
    leaving sentence moves one sentence's rows, not every row behind it."""
    staying = sorted(kept)
    if len(staying) == n:  # nobody left
        return staying
    rows = dict(zip(kept, beams, strict=True))
    order: list[int] = []
    first, last = 0, len(staying) - 1
    for j in range(n):
        if first > last:
            break
        if staying[first] == j:
            order.append(j)
            first += 1
        elif j not in rows and staying[last] > j and rows[staying[last]] == widths[j]:
            order.append(staying[last])
            last -= 1
    return order
