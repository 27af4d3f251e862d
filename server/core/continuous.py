"""Continuous (iteration-level) batching: one running decode per model version (``--batching continuous``).

Where the static batcher (:mod:`server.core.scheduler`) decodes a batch to its end while later sentences
wait behind its longest sentence, here sentences join the version's running decode
(:class:`server.engine.decode.RunningDecode`) between two decoding steps and leave it as soon as they finish:
a sentence's latency is its own decoding length plus at most about one step of waiting.

The loop (the scheduler's batcher task; inference on the version's single worker thread):

1. Drop cancelled and expired queued sentences (their callers get CANCELLED / DEADLINE_EXCEEDED).
2. Admission (:func:`server.core.admission.admit_to_decode`): queued sentences in urgency order (earliest
   deadline first, then oldest, as the static batcher), while their rows (beam size each) fit in
   ``max_batch_rows``, the decode's tokens, rows x (widest source + longest target so far), stay within
   ``decode_tokens`` (bounding its memory) and the one encoder call for all of them stays within
   ``batch_tokens`` / ``max_batch_sentences``. It stops at the first sentence that does not fit: a long
   sentence waits for rows to free, and the shorter sentences behind it wait with it, so it is never
   starved. Sentences of any beam size, options and attention share the decode.
3. On the worker thread: encode the admitted sentences (one encoder call), insert them into free rows,
   then decode steps. Every step polls each sentence's cancellation: a cancelled or expired sentence
   leaves at once and frees its rows. Plain greedy steps run back to back within
   :meth:`RunningDecode.step` (``stop`` asked after each), as in a static batch.
4. Admission while the decode runs: once the oldest queued sentence fits in the free rows and has waited
   ``max_wait`` (``--max-wait-ms``, 5 ms: about a step, so that sentences arriving close together join
   in one encoder call instead of one each), the worker *asks* the event loop for sentences
   (``call_soon_threadsafe``, with the decode's load) and goes on decoding. The loop admits what fits
   (step 2) and offers it (:meth:`RunningBatch.offer`, a thread-safe queue); the worker takes the offer
   before its next step and encodes it in. On a device (``BatchPolicy.encoder_overlap``, a device rule) the offer
   is encoded first, on a thread of its own, while the worker decodes on: a GPU's steps leave it idle enough
   to run the encoder beside them, and the worker only joins the encoded rows. So the worker never stops for the
   event loop while it has rows: returning to the loop for every admission would leave it idle for as long as
   the busy loop takes to come back to it.
   A decode that empties waits for the answer to its ask (``OFFER_WAIT_SECONDS`` at most), and returns
   to the loop only when empty with nothing asked; the loop then waits for arrivals.
5. A sentence that ends leaves at once, on the CPU. On a device (``BatchPolicy.hold_ended``, a device rule) one
   that ends in a run of plain arg-max steps (by EOS, or at its output limit) gets its result at once (the decode's
   ``on_ended``) while its row runs on unread until the run ends, which an admission's ``stop()`` does: the
   sentences that end between two admissions leave the decode in one selection and one move of the rows, as a
   static batch on a device leaves them (``RunningDecode.hold_ended``), and a held sentence's rows do not count
   against the next admission. The CPU does not hold: its step costs its rows. ``nmt_decode_steps_total``
   counts the steps by selection.
6. The sentences that leave are handed to the event loop right after their step
   (``call_soon_threadsafe``): their callers get their translations (or errors) at once, while the
   worker goes on decoding; so is each stretch's :class:`Progress` (an admission and the steps after
   it), for the metrics.

Given target tokens (:mod:`server.engine.forced`): sentences with a target prefix run one forced pass per
prefix length right after their encoder call (a Transformer's ``decoder_forced``: the prefix in one call,
its K/V copied into the in-place buffers) and join the running decode from the state it leaves
(:func:`server.engine.forced.admit`); the search then feeds the prefix's last piece with the other rows (one
decoder row-step more than the static path, whose first step is read off the pass, which only works
when every row starts there together). Whole targets (Score: the forced pass is their result) and
alternatives (the pass branches a sentence into several) do not join: right after their encoder call
the worker runs them through :func:`server.engine.forced.decode_batch` on their own and delivers them, then decodes
on; an alternatives request holds the running decode for its own (short) search.

Attention: the attention graph runs while any sentence in the decode asked for it, which costs the
others the measured cost of the attention output (0-3 %, benchmarks/README.md); the rows that did not
ask get none.

Fault isolation: when a step raises, the running decode is discarded and each request that was in it
runs again on its own through the static path (:meth:`ModelScheduler._decode`), exactly as a failing
static batch: the request that breaks inference gets INTERNAL, the others their translations (equal
by construction); a :class:`server.errors.ServingError` (out of device memory) fails them all with its
status. The rate estimate of deadline admission is updated from compute seconds per unit of cost of
the sentences that finish.

Metrics: ``nmt_running_rows`` (rows in the decode), ``nmt_admission_wait_steps`` (steps the decode ran
while a sentence waited to join), and the batch families per admission (one encoder call): sentences,
source positions, padding; ``nmt_inference_duration_seconds`` per encoder call (stage ``encode``), per joining
of an admission's rows to the decode after it (``join``) and per run of steps (``decode``).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.core.admission import DecodeLoad, Pending, admit_to_decode, resolve
from server.engine.cuda_graphs import beside_captures
from server.engine.decode import RunningDecode
from server.engine.engine import SourceBatch, generated_tokens
from server.engine.forced import admit, decode_batch, runs_apart
from server.engine.step_model import BeamSentence
from server.types import SearchResult, SentenceRequest


@dataclass
class Progress:
    """One stretch of :meth:`RunningBatch.advance`: an admission (one encoder call, or none) and the steps
    run after it until the next admission or the return."""

    sentences: int = 0  # sentences admitted (0: none, no encoder call)
    source: SourceBatch | None = None  # their encoder batch
    encode_seconds: float = 0.0  # the encoder call (on this thread, or on the encoder's own)
    join_seconds: float = 0.0  # the rest of the admission on this thread: the rows joined, sentences run apart
    decode_seconds: float = 0.0
    steps: int = 0
    selections: int = 0  # of the steps, those whose hypotheses the general selection chose


Finished = list[tuple[Any, "SearchResult | None"]]  # (tag, search result or None if cancelled)
# sentences encoded before they were offered: Engine.encode's outputs and its seconds, or the error it raised
Encoded = tuple[tuple[dict, list[BeamSentence], SourceBatch], float] | Exception
Offer = tuple[list[SentenceRequest], list[Any], Encoded | None]  # an answer to the ask: requests, tags, encoded
OFFER_WAIT_SECONDS = 0.5  # an empty decode waits this long for the answer to its ask, then returns


class RunningBatch:
    """An engine's running decode of :class:`SentenceRequest` s, driven from the worker thread."""

    def __init__(self, engine: Any, hold_ended: bool = False) -> None:
        self.engine = engine
        self.decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id,
                                    hold_ended=hold_ended, on_ended=self._ended if hold_ended else None,
                                    joiners=engine.words.joiners)
        self._deliver: Callable[[Finished], None] | None = None  # the current advance's
        self.left = 0  # sentences that left so far
        self._offers: queue.SimpleQueue[Offer] = queue.SimpleQueue()
        self._asked = False  # an ask is out and its answer not yet taken

    @property
    def steps(self) -> int:
        """Decoding steps run so far."""
        return self.decode.steps_run

    @property
    def awaiting(self) -> bool:
        """Whether sentences offered (or about to be) are not yet in the decode: admission waits for them."""
        return self._asked or not self._offers.empty()

    def load(self) -> DecodeLoad:
        """What the decode holds now (read on the worker thread, or on the event loop while it is idle)."""
        widths = self.decode.source_lengths()
        return DecodeLoad(self.decode.reserved_rows, max(widths, default=0), max(self.decode.steps(), default=0))

    def offer(self, requests: Sequence[SentenceRequest], tags: Sequence[Any], encoded: Encoded | None = None) -> None:
        """Answer the decode's ask (from any thread): the sentences to admit before its next step, maybe none;
        ``encoded``: already encoded (:func:`encode`), else the worker encodes them when it takes them."""
        self._offers.put((list(requests), list(tags), encoded))

    def advance(self, requests: Sequence[SentenceRequest], tags: Sequence[Any], until: Callable[[], bool],
                deliver: Callable[[Finished], None], ask: Callable[[DecodeLoad], None] | None = None,
                report: Callable[[Progress], None] | None = None) -> None:
        """Admit ``requests`` (one encoder call) and the sentences offered, then decode steps; the sentences
        that leave go to ``deliver`` with their search results after each step. Without ``ask``, return
        once the decode is empty or ``until()`` is true. With ``ask``, ``until()`` being true calls
        ``ask(load)`` instead (once, until the answer, :meth:`offer`, is taken) and the decode goes on; the
        sentences offered join at the next step, and the decode returns only once it is empty and no answer
        is due within ``OFFER_WAIT_SECONDS``. ``report`` gets each stretch's :class:`Progress`."""
        engine, stop = self.engine, self._stop(until)
        self._deliver = deliver
        try:
            progress = self._join(requests, tags, None, deliver)
            while True:
                while not self._offers.empty():  # the answer to an ask (this advance's or an earlier one's)
                    self._report(progress, report)
                    progress = self._join(*self._take(), deliver=deliver)
                start, steps, selections = time.perf_counter(), self.steps, self.decode.selections_run
                while self.decode.rows:
                    left = self.decode.step(until_leave=True, stop=stop)
                    if left:
                        self.left += len(left)
                        deliver([(tag, result) for (tag, _request), result in left])
                    if self._asked:
                        if not self._offers.empty():
                            break  # the answer: its sentences join now
                    elif self.decode.rows and until():
                        if ask is None:
                            break
                        self._asked = True
                        ask(self.load())
                progress.decode_seconds, progress.steps = time.perf_counter() - start, self.steps - steps
                progress.selections = self.decode.selections_run - selections
                if self._offers.empty() and (self.decode.rows or not self._asked or not self._wait_offer()):
                    self._report(progress, report)
                    return
        except Exception as error:
            exhausted = engine.memory_error(error, self.decode.sentences + len(requests))
            if exhausted is None:
                raise
            raise exhausted from error

    def _ended(self, ended: list[tuple[Any, SearchResult]]) -> None:
        """Deliver the sentences whose rows the decode holds after they ended (its ``on_ended``)."""
        self.left += len(ended)
        self._deliver([(tag, result) for (tag, _request), result in ended])

    def _stop(self, until: Callable[[], bool]) -> Callable[[], bool]:
        """When plain greedy steps should stop: the answer to the ask came, or (none out) ``until()``."""
        return lambda: not self._offers.empty() if self._asked else until()

    def _take(self) -> Offer:
        self._asked = False
        return self._offers.get_nowait()

    def _wait_offer(self) -> bool:
        """Wait (briefly) for the answer to the ask; whether it came."""
        try:
            self._offers.put(self._offers.get(timeout=OFFER_WAIT_SECONDS))
        except queue.Empty:
            return False
        return True

    @staticmethod
    def _report(progress: Progress, report: Callable[[Progress], None] | None) -> None:
        if report is not None and (progress.sentences or progress.steps):
            report(progress)

    def _join(self, requests: Sequence[SentenceRequest], tags: Sequence[Any], ready: Encoded | None,
              deliver: Callable[[Finished], None]) -> Progress:
        """Encode ``requests`` (one encoder call; ``ready``: encoded already) and add them to the decode; a new
        stretch's progress."""
        progress = Progress(len(requests))
        if not requests:
            return progress
        engine = self.engine
        if isinstance(ready, Exception):  # fails as an encoder call on this thread does
            raise ready
        (encoded, sentences, progress.source), progress.encode_seconds = ready or encode_now(engine, requests)
        start = time.perf_counter()
        tagged = list(zip(tags, requests, strict=True))
        apart = [i for i, s in enumerate(sentences) if runs_apart(s, engine.eos_id)]
        if apart:  # whole targets and alternatives: their forced pass (and search) now, on their own
            encoded, sentences, tagged = self._run_apart(encoded, sentences, tagged, apart, deliver)
        admit(self.decode, encoded, sentences, tagged, start_id=engine.start_id)
        progress.join_seconds = time.perf_counter() - start
        return progress

    def _run_apart(self, encoded: dict[str, Any], sentences: list[BeamSentence], tagged: list[tuple[Any, Any]],
                   apart: list[int], deliver: Callable[[Finished], None],
                   ) -> tuple[dict[str, Any], list[BeamSentence], list[tuple[Any, Any]]]:
        """Decode sentences ``apart`` through :func:`server.engine.forced.decode_batch` and deliver them; returns the
        encoder outputs, settings and tags of the others, which join the running decode."""
        engine, model = self.engine, self.engine.model
        results = decode_batch(model, model.select_rows(encoded, np.array(apart)), [sentences[i] for i in apart],
                               start_id=engine.start_id, eos_id=engine.eos_id, pad_id=engine.pad_id,
                               joiners=engine.words.joiners)
        self.left += len(apart)
        deliver([(tagged[i][0], result) for i, result in zip(apart, results, strict=True)])
        rest = [i for i in range(len(sentences)) if i not in set(apart)]
        encoded = model.select_rows(encoded, np.array(rest, dtype=np.int64)) if rest else {}
        return encoded, [sentences[i] for i in rest], [tagged[i] for i in rest]


def encode_now(engine: Any, requests: Sequence[SentenceRequest]) -> tuple[tuple[dict, list[BeamSentence],
                                                                              SourceBatch], float]:
    """``engine.encode(requests)`` and its seconds."""
    start = time.perf_counter()
    return engine.encode(requests), time.perf_counter() - start


def encode(engine: Any, requests: Sequence[SentenceRequest]) -> Encoded:
    """:func:`encode_now`, or the error it raised: what :meth:`RunningBatch.offer` takes from the encoder's own
    thread (on a device), never during the worker's CUDA graph captures (:func:`beside_captures`)."""
    try:
        with beside_captures(engine.model):
            return encode_now(engine, requests)
    except Exception as error:  # noqa: BLE001 - raised on the worker, where an encoder call's error goes
        return error


class ContinuousBatcher:
    """The continuous batching loop of one :class:`server.core.scheduler.ModelScheduler` (see the module docstring)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.batch = self._new_batch()
        self._blocked: Pending | None = None  # the queue's head when it last did not fit
        self._left_at = 0  # sentences that had left the decode then
        self._cost_done = 0  # cost of the sentences finished since the rate was last updated
        self._compute = 0.0  # compute seconds since then
        self._cancelled = False  # a sentence was cancelled since then (the work would look cheap)
        self._encoder = self._encoder_thread()  # None: the worker encodes what joins

    def _new_batch(self) -> RunningBatch:
        """An empty running decode on the scheduler's engine, holding ended rows where the policy says."""
        return RunningBatch(self.scheduler.engine, self.scheduler.policy.hold_ended == "on")

    def _encoder_thread(self) -> ThreadPoolExecutor | None:
        """The thread that encodes the sentences offered to the decode (on a device), if any."""
        s = self.scheduler
        if s.policy.encoder_overlap != "on":
            return None
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"encoder-{s.labels[0]}-{s.labels[1]}")

    def close(self) -> None:
        """Stop the encoder's thread (the scheduler's close); an answer it no longer gives, the worker stops
        waiting for after ``OFFER_WAIT_SECONDS``."""
        if self._encoder is not None:
            self._encoder.shutdown(wait=False, cancel_futures=True)

    async def step(self) -> None:
        """Wait for work, or admit what fits and run the decode until it is empty (see the module docstring)."""
        s, batch = self.scheduler, self.batch
        s._drop_cancelled()
        if not s._queue and not batch.decode.rows and not batch.awaiting:
            s._notify_idle()
            s._arrived.clear()
            await s._arrived.wait()
            return
        admitted = self._admit(batch.load()) if not batch.awaiting else []
        loop = asyncio.get_running_loop()

        def call(method: Callable[..., None]) -> Callable[..., None]:  # a method of ours, run on the event loop
            def on_loop(*args: Any) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits any more
                    loop.call_soon_threadsafe(method, *args)
            return on_loop

        try:
            await loop.run_in_executor(s._executor, batch.advance, [p.sentence for p in admitted], admitted,
                                       self._until, call(self._deliver), call(self._offer), call(self._record))
        except Exception as error:  # noqa: BLE001 - a failing step fails its requests, not the batcher
            await self._recover(error)
            return
        s.failures = 0

    def _admit(self, load: DecodeLoad) -> list[Pending]:
        """Take the queued sentences that join a decode holding ``load`` out of the queue (on the event loop)."""
        s = self.scheduler
        s._drop_cancelled()
        admitted = admit_to_decode(s._queue, load, s.policy) if s._queue else []
        now = time.monotonic()
        if admitted:
            joined = set(map(id, admitted))
            s._queue = [p for p in s._queue if id(p) not in joined]
            s._update_depth()
            if not s._running:
                s._running_since = now
            s._running.extend(admitted)
            if s.series is not None:
                for p in admitted:
                    s.series.queue_duration.observe(now - p.enqueued)
                    s.series.admission_wait_steps.observe(self.batch.steps - p.steps)
        self._blocked = s._queue[0] if s._queue else None  # did not fit: it waits for a sentence to leave
        self._left_at = self.batch.left
        return admitted

    def _until(self) -> bool:
        """Whether to admit now (asked on the worker thread after each step): the oldest queued sentence fits in
        the free rows and has waited ``max_wait``, and it is not one that did not fit while no sentence left."""
        s, batch = self.scheduler, self.batch
        queue = s._queue
        if not queue or (queue[0] is self._blocked and batch.left == self._left_at):
            return False
        head = queue[0]
        return (batch.decode.reserved_rows + head.sentence.options.beam_size <= s.policy.max_batch_rows
                and time.monotonic() - head.enqueued >= s.policy.max_wait_seconds)

    def _offer(self, load: DecodeLoad) -> None:
        """Answer the worker's ask: admit what fits in the decode holding ``load`` (on the event loop)."""
        admitted: list[Pending] = []
        batch = self.batch  # the answer goes to the batch that asked, even if a failure replaces it meanwhile
        try:
            admitted = self._admit(load)
        finally:  # always an answer: the worker waits for it once its decode is empty
            self._answer(batch, admitted)

    def _answer(self, batch: RunningBatch, admitted: list[Pending]) -> None:
        """Offer ``admitted`` to ``batch``: encoded first on the encoder's thread (on a device), or as
        they are, for the worker to encode (also once that thread has stopped, at shutdown)."""
        requests = [p.sentence for p in admitted]
        if admitted and self._encoder is not None:
            with contextlib.suppress(RuntimeError):  # shut down: no new work
                self._encoder.submit(lambda: batch.offer(requests, admitted, encode(batch.engine, requests)))
                return
        batch.offer(requests, admitted)

    def _deliver(self, finished: Finished) -> None:
        """Resolve the sentences that left the decode (on the event loop, as soon as they left)."""
        s = self.scheduler
        series = s.series
        for pending, result in finished:
            if pending not in s._running:
                continue  # the decode failed meanwhile and its requests were answered
            s._running.remove(pending)
            if result is None:
                s.cancelled_sentences += 1
                self._cancelled = True
                resolve(pending, error=pending.request.error())
                if series is not None:
                    series.cancelled_sentences.inc()
            else:
                self._cost_done += pending.cost
                resolve(pending, result=result)
                if series is not None:
                    series.generated_tokens.inc(generated_tokens(result))
        if not s._running:
            s._free_since = time.monotonic()
            s._notify_idle()

    def _record(self, progress: Progress) -> None:
        """Metrics of one stretch of the decode, and the cost-rate estimate once the decode is empty."""
        s = self.scheduler
        self._compute += progress.encode_seconds + progress.join_seconds + progress.decode_seconds
        if not self.batch.decode.rows:
            if self._cost_done and not self._cancelled:
                s.observe_rate(self._compute / self._cost_done)
            self._compute, self._cost_done, self._cancelled = 0.0, 0, False
        if progress.source is not None:  # sentences were admitted (one encoder call)
            s.batches += 1
        series = s.series
        if series is None:
            return
        series.running_rows.set(self.batch.decode.rows)
        if progress.source is not None:
            series.encode_duration.observe(progress.encode_seconds)
            series.join_duration.observe(progress.join_seconds)
            series.batch_sentences.observe(progress.sentences)
            series.batch_tokens.observe(progress.source.positions)
            series.padding_ratio.observe(progress.source.padding_ratio)
            series.source_tokens.inc(progress.source.tokens)
        if progress.steps:
            series.decode_duration.observe(progress.decode_seconds)
            series.plain_steps.inc(progress.steps - progress.selections)
            series.general_steps.inc(progress.selections)
        s.record_graphs()

    async def _recover(self, error: Exception) -> None:
        """A step failed: discard the running decode and decode each of its requests on its own (see the
        module docstring)."""
        s = self.scheduler
        running, s._running = list(s._running), []
        self.batch = self._new_batch()
        self._compute, self._cost_done, self._cancelled = 0.0, 0, False
        if s.series is not None:
            s.series.running_rows.set(0)
        try:
            await s._recover(running, error)
        finally:
            s._free_since = time.monotonic()
            s._notify_idle()

