"""Decoding controls, applied step by step to each row's next-token distribution.

Every control reads only the row's tokens so far and the step's log-probabilities (the repetition
penalty: its logits), so the search applies them one step at a time, whatever the batching (a row may
join or leave the batch between steps).
Controls that reshape the distribution follow CTranslate2's logits processors (``decoding_utils.cc``):
the repetition penalty scales the logits of tokens already in the hypothesis (forced prefix included;
negative ones multiplied by the penalty, the others divided), minimum length, no-repeat n-grams and
suppressed sequences set tokens to -inf, and the result is log-softmaxed, so reported scores are those
of the distribution searched. A forced target prefix keeps each forced token's model log-probability
unchanged in the token scores (a scored translation reports the model's own probabilities), though the
search does not add them to the hypothesis score; so does a partial word to complete
(:mod:`server.completion`), which only bars the pieces that do not spell it. Sampling draws from the
processed distribution after temperature, top-k and top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from server.completion import Completion

NEG_INF = -np.inf


@dataclass(frozen=True)
class Controls:
    """One sentence's controls (the defaults change nothing)."""

    min_length: int = 0  # EOS is barred before this many tokens (forced prefix included, EOS excluded)
    repetition_penalty: float = 1.0  # > 1: logits of tokens already generated: < 0 multiplied by it, else divided
    no_repeat_ngram_size: int = 0  # > 0: no n-gram of this size occurs twice in a hypothesis
    suppress: tuple[tuple[int, ...], ...] = ()  # token sequences never generated (one token: a banned token)
    forced: tuple[int, ...] = ()  # target prefix: the first tokens, whatever their probability
    completion: Completion | None = None  # the prefix ends inside this word: the next pieces spell it out
    sampling_topk: int = 1  # 1: arg-max / beam search; 0: sample from the whole vocabulary; k: from the k best
    sampling_topp: float = 1.0  # sample from the smallest set of tokens whose probability reaches this
    sampling_temperature: float = 1.0
    seed: int = 0  # sampling seed; 0: a fresh random seed
    # token runs every hypothesis must contain, one per occurrence (glossary terms: server.engine.constraints)
    constraints: tuple[tuple[int, ...], ...] = ()
    # each constraint's source tokens [start, end) (the term's occurrence in the source): the search starts a
    # term against the model's choice only where the step's attention is on it (none: anywhere)
    constraint_sources: tuple[tuple[int, int], ...] = ()

    @property
    def reshapes_until(self) -> float:
        """The steps before which the distribution is changed, apart from a forced prefix (the search then needs it
        whole): every step for the repetition penalty, n-gram and sequence bans and sampling; ``min_length``'s
        first steps only (after them EOS is allowed and nothing changes); 0 when nothing reshapes."""
        if self.repetition_penalty != 1.0 or self.no_repeat_ngram_size or self.suppress or self.samples:
            return math.inf
        return self.min_length

    @property
    def samples(self) -> bool:
        return self.sampling_topk != 1

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed or None)


def completing(c: Controls, step: int) -> bool:
    """Whether step ``step`` may still be spelling out ``c``'s partial word."""
    return c.completion is not None and c.completion.start <= step < c.completion.start + c.completion.steps()


def banned_tokens(c: Controls, history: np.ndarray, step: int, eos_id: int) -> list[int]:
    """Tokens a row with ``history`` (its ``step`` tokens so far) may not take next."""
    banned: list[int] = []
    if step < c.min_length:
        banned.append(eos_id)
    n = c.no_repeat_ngram_size
    if n and step >= n - 1:
        tail = history[step - n + 1: step].tolist()
        for i in range(step - n + 1):
            if history[i: i + n - 1].tolist() == tail:
                banned.append(int(history[i + n - 1]))
    for sequence in c.suppress:
        start = list(sequence[:-1])
        if step >= len(start) and history[step - len(start): step].tolist() == start:
            banned.append(sequence[-1])
    return banned


def process(log_probs: np.ndarray, history: np.ndarray, controls: Sequence[Controls], step: int,
            eos_id: int, logits: np.ndarray | None = None) -> np.ndarray:
    """``log_probs`` [R, V] of one step -> the distribution searched (float64), row ``r`` under
    ``controls[r]`` with ``history[r, :step]`` its tokens so far; ``logits`` [R, V] (the log-softmax's
    input) are needed when a row has a repetition penalty after its first step.

    A row whose only change is ``min_length`` barring EOS is renormalized by EOS's own probability
    (log-probabilities minus log(1 - p(EOS))), with no pass over its vocabulary, where p(EOS) < 1/2 keeps that
    exact to float rounding; other rows are log-softmaxed again after their changes."""
    out = log_probs.astype(np.float64)
    general = [r for r, c in enumerate(controls) if step < c.reshapes_until]
    bars_eos = np.array([r for r in general if controls[r].reshapes_until == controls[r].min_length], dtype=np.int64)
    if bars_eos.size:  # min_length alone, before its minimum
        eos = out[bars_eos, eos_id]
        cheap = bars_eos[eos < -math.log(2)]
        out[cheap] -= np.log1p(-np.exp(out[cheap, eos_id]))[:, None]
        out[cheap, eos_id] = NEG_INF
        general = sorted(set(general) - set(cheap.tolist()))
    for r in general:
        c, row = controls[r], out[r]
        if c.repetition_penalty != 1.0 and step:
            if logits is None:
                raise ValueError("the repetition penalty needs the step's logits")
            row[:] = logits[r]
            seen = np.unique(history[r, :step])
            row[seen] = np.where(row[seen] < 0, row[seen] * c.repetition_penalty,
                                 row[seen] / c.repetition_penalty)
        banned = banned_tokens(c, history[r], step, eos_id)
        if banned:
            row[banned] = NEG_INF
        if np.isfinite(row).any():
            top = row.max()
            row -= top + np.log(np.exp(row - top).sum())
    for r, c in enumerate(controls):
        if step < len(c.forced):
            token = c.forced[step]
            out[r] = NEG_INF
            out[r, token] = log_probs[r, token]
        elif completing(c, step):
            allowed = c.completion.allowed(history[r, c.completion.start: step])
            if allowed is not None:
                ids = list(allowed)
                kept = out[r, ids]
                out[r] = NEG_INF
                out[r, ids] = kept
    return out


def top_k(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best tokens of each row and their log-probabilities, best first, ties to the lower id
    (as the exported graphs' ``TopK``). A partition finds each row's ``k`` best in one pass over the vocabulary;
    only they are sorted (a row tied at the ``k``-th value sorts every id tied there, to keep the lower ids)."""
    rows, width = log_probs.shape
    k = min(k, width)
    if 4 * k >= width:  # a small vocabulary: sorting it whole is as cheap
        ids = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
        return ids, np.take_along_axis(log_probs, ids, 1)
    best = np.argpartition(log_probs, width - k, axis=1)[:, width - k:]
    values = np.take_along_axis(log_probs, best, 1)
    order = np.lexsort((best, -values), axis=-1)  # best first, then the lower id
    ids, values = np.take_along_axis(best, order, 1), np.take_along_axis(values, order, 1)
    tied = np.flatnonzero((log_probs >= values[:, -1:]).sum(axis=1) > k)  # more ids share the k-th value
    for row in tied:
        candidates = np.flatnonzero(log_probs[row] >= values[row, -1])  # in id order
        chosen = candidates[np.argsort(-log_probs[row, candidates], kind="stable")[:k]]
        ids[row], values[row] = chosen, log_probs[row, chosen]
    return ids, values


def sample(log_probs: np.ndarray, c: Controls, rng: np.random.Generator) -> int:
    """One token drawn from a row's processed distribution under ``c``'s temperature, top-k and top-p."""
    scaled = log_probs / c.sampling_temperature
    order = np.argsort(-scaled, kind="stable")
    if c.sampling_topk > 0:
        order = order[: c.sampling_topk]
    order = order[np.isfinite(scaled[order])]
    weights = np.exp(scaled[order] - scaled[order[0]])
    probs = weights / weights.sum()
    if c.sampling_topp < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), c.sampling_topp)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
