"""What the schedulers share: a queued sentence, and the rules that pick which queued sentences decode
next (:func:`form_batch` for a static batch, :func:`admit_to_decode` for a running decode). See
:mod:`server.core.scheduler` and :mod:`server.core.continuous` for the policies; a request's handle and the limits
are :mod:`server.policy`'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from server.policy import BatchPolicy, RequestHandle
from server.types import SearchResult, SentenceRequest

NO_DEADLINE_SECONDS = 60.0  # a request without a deadline is scheduled as if due this long after arrival
Answer = Callable[[list[SearchResult] | None, BaseException | None], None]  # (results, None) or (None, error)


class Call:
    """One request's sentences in a scheduler, answered once (``answer``, on the event loop): with every
    sentence's search result in order once the last is in, or with the first error. Once answered (or
    withdrawn), later results are ignored."""

    __slots__ = ("results", "left", "answer", "answered")

    def __init__(self, sentences: int, answer: Answer) -> None:
        self.results: list[SearchResult | None] = [None] * sentences
        self.left = sentences
        self.answer = answer
        self.answered = False

    def settle(self, index: int, result: SearchResult | None) -> None:
        if self.answered:
            return
        self.results[index] = result
        self.left -= 1
        if self.left == 0:
            self.answered = True
            self.answer(self.results, None)  # type: ignore[arg-type]  # every sentence's result is in

    def fail(self, error: BaseException) -> None:
        if not self.answered:
            self.answered = True
            self.answer(None, error)


@dataclass(eq=False)
class Pending:
    request: RequestHandle
    sentence: SentenceRequest
    tokens: int  # source tokens incl. EOS
    work: int  # decoder row-steps at most (server.frontend.validation.sentence_work)
    call: Call
    enqueued: float
    seq: int
    steps: int = 0  # decoding steps the running decode had run when the sentence was queued
    index: int = 0  # the sentence's place in its request
    key: tuple[int, bool] = field(init=False)
    due: float = field(init=False)  # the earliest-deadline-first order

    def __post_init__(self) -> None:
        self.key = (self.sentence.options.beam_size, self.sentence.options.return_attention)
        deadline = self.request.deadline
        self.due = self.enqueued + NO_DEADLINE_SECONDS if deadline is None else deadline

    @property
    def urgency(self) -> tuple[float, int]:
        return self.due, self.seq

    @property
    def cost(self) -> int:
        return self.tokens * self.sentence.options.beam_size


def by_request(batch: Sequence[Pending]) -> list[list[Pending]]:
    """The batch's sentences grouped by request, in batch order."""
    groups: dict[int, list[Pending]] = {}
    for p in batch:
        groups.setdefault(id(p.request), []).append(p)
    return list(groups.values())


def resolve(pending: Pending, *, result: SearchResult | None = None, error: BaseException | None = None) -> None:
    """Hand a sentence's search result (or error) to its request's :class:`Call`; a cancelled or expired
    request's error is its own (CANCELLED, DEADLINE_EXCEEDED), whatever ended the sentence."""
    if error is None:
        pending.call.settle(pending.index, result)
    else:
        pending.call.fail(pending.request.error() if pending.request.is_cancelled() else error)


def form_batch(candidates: Sequence[Pending], first: Pending, policy: BatchPolicy) -> list[Pending]:
    """The batch grown around ``first`` through ``candidates`` (same key) by length, within the policy."""
    ordered = sorted(candidates, key=lambda p: (p.tokens, p.seq))
    lo = hi = ordered.index(first)
    width = first.tokens  # longest in the window (the window is sorted: ordered[hi].tokens)
    work = first.work
    while True:
        count = hi - lo + 1
        if count >= policy.max_batch_sentences:
            break
        options: list[tuple[int, int, str]] = []
        if lo > 0 and (count + 1) * width <= policy.batch_tokens and work + ordered[lo - 1].work <= policy.batch_work:
            below = ordered[lo - 1]
            options.append((width - below.tokens, below.seq, "lo"))
        if (hi + 1 < len(ordered) and (count + 1) * ordered[hi + 1].tokens <= policy.batch_tokens
                and work + ordered[hi + 1].work <= policy.batch_work):
            above = ordered[hi + 1]
            options.append(((above.tokens - width) * count, above.seq, "hi"))
        if not options:
            break
        _, _, side = min(options)  # least added padding, then the older sentence
        if side == "lo":
            lo -= 1
            work += ordered[lo].work
        else:
            hi += 1
            width = ordered[hi].tokens
            work += ordered[hi].work
    return ordered[lo : hi + 1]




@dataclass(frozen=True)
class DecodeLoad:
    """What a running decode holds, as admission reads it."""

    rows: int = 0  # rows reserved (each sentence its beam size)
    source_width: int = 0  # widest source (EOS incl.): the width its encoder outputs are padded to
    target_length: int = 0  # longest target decoded so far


def admit_to_decode(queue: Sequence[Pending], load: DecodeLoad, policy: BatchPolicy) -> list[Pending]:
    """The queued sentences that join the running decode before its next step: in urgency order (earliest
    deadline, then oldest), while their rows fit in ``max_batch_rows``, the decode's tokens (rows x (widest
    source + longest target)) stay within ``decode_tokens`` and their encoder batch (longest x count) within
    ``batch_tokens`` and ``max_batch_sentences``. Admission stops at the first sentence that does not fit,
    so a long sentence is never overtaken for ever by shorter ones behind it; into an empty decode the most
    urgent sentence always goes."""
    admitted: list[Pending] = []
    rows, width, longest = load.rows, load.source_width, 0
    for p in sorted(queue, key=lambda p: p.urgency):
        beam = p.sentence.options.beam_size
        fits = (rows + beam <= policy.max_batch_rows
                and (rows + beam) * (max(width, p.tokens) + load.target_length) <= policy.decode_tokens
                and max(longest, p.tokens) * (len(admitted) + 1) <= policy.batch_tokens
                and len(admitted) < policy.max_batch_sentences)
        if not fits and (rows or admitted):
            break
        admitted.append(p)
        rows, width, longest = rows + beam, max(width, p.tokens), max(longest, p.tokens)
    return admitted
