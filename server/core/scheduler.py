"""Dynamic batching of sentences for one model version, with cancellation and deadline-aware admission.

The one way into a model version: :func:`server.frontend.translate.translate_texts` tokenizes a request's texts
and hands the sentences (token ids, resolved options, target prefixes) and the request's
:class:`RequestHandle` to :meth:`ModelScheduler.submit` (in this process; in the engine core,
:mod:`server.ipc` calls :meth:`ModelScheduler.enqueue` with a callback that sends the answer, so no task
waits per call), which queues them in this model version's queue. One batcher task forms batches
and runs :meth:`Engine.search_batch` on the version's own single worker thread, so the event loop never
blocks on inference and one version's batches never overlap. Search results (token ids, scores,
attention) go back to each request's :class:`server.core.admission.Call`, which answers once, in request
order; the caller detokenizes them.

Continuous batching
    With ``--batching continuous`` and a model that decodes rows at different steps, the batcher task
    runs :class:`server.core.continuous.ContinuousBatcher` instead of forming batches: sentences join the
    version's running decode between steps and leave as soon as they finish (see that module). The
    queue, its bound, the request checks, deadline admission, cancellation, fault isolation and the
    metrics below are shared; the batch key, ``max_wait`` and ``batch_work`` apply to static batches only.

Bounded work
    Before submitting, :func:`server.frontend.validation.check_budget` refuses (INVALID_ARGUMENT) a request whose
    decoder work (row-steps: beam size x longest allowed output, summed over its texts) exceeds
    ``max_request_work`` or whose response could exceed ``max_response_bytes``. A batch holds at most
    ``batch_work`` row-steps (its most urgent sentence always goes in), so no batch holds the worker
    for long: a large request is decoded as several batches, and other requests' sentences are
    scheduled between them.

Batching policy
    * Earliest deadline first: the next batch is built around the most urgent queued sentence, the
      one whose request is due first (its deadline; a request without a deadline is due
      ``NO_DEADLINE_SECONDS`` after it arrived), oldest first among equals.
    * Sentences batch together only when they share the *batch key* ``(beam_size, return_attention)``
      (the engine could mix them, but a greedy sentence would then wait for beam searches and every
      sentence would pay for the attention graph); ``num_hypotheses``,
      ``max_length`` and ``length_penalty`` vary per sentence.
    * A batch starts only when the worker is free: sentences arriving while a batch runs accumulate,
      so batches grow with load. The batcher then waits for companions only as long as it has reason
      to expect them: the *expected concurrency* is the most sentences outstanding (queued or
      running) at any moment since the previous batch started. The batch starts as soon as the
      queue holds that many sentences of its key (or a full batch), else once ``max_wait`` (a few
      ms) has passed since the worker became free or the oldest sentence arrived, whichever is later.
      A lone caller (expected concurrency 1) therefore never waits, while the callers of a batch
      that just finished get ``max_wait`` to send their next sentences and join the queued ones,
      instead of the load splitting into half-size batches that alternate.
    * The most urgent queued sentence always goes into the next batch; the batch is grown around it
      through the sentences of the same key sorted by length, each time taking the neighbour that
      adds the least padding, while ``longest x count <= batch_tokens`` (source tokens incl. EOS and
      padding), ``count <= max_batch_sentences`` and the work stays within ``batch_work``.
    * The queue is bounded: a request whose sentences do not fit in ``queue_size`` is refused whole
      with RESOURCE_EXHAUSTED.

Cancellation
    Every sentence carries its request's :meth:`RequestHandle.is_cancelled`, True once the RPC was
    cancelled or its deadline passed. Queued sentences of such a request are withdrawn at once (or
    dropped when a batch is formed); running ones leave the batch at the next decoding step (the
    engine polls the callback) and count in ``nmt_cancelled_sentences_total``. When one sentence of a
    request fails, the request's other sentences are withdrawn too.

Fault isolation
    When the engine raises on a batch that holds several requests, each request's sentences are
    decoded again on their own: the request whose sentence breaks inference gets INTERNAL naming its
    request id (the exception goes to the log under that id, never to the client), the others get
    their translations. A batch failing with a :class:`server.errors.ServingError` (the engine's
    :class:`server.errors.DeviceMemoryExhausted` when the device arena cannot hold it) fails its
    sentences with that status (RESOURCE_EXHAUSTED) and counts as no engine failure. After
    ``FAILURES_BEFORE_PROBE`` failed runs in a row the engine is probed with a known-good sentence
    (:func:`smoke_test`, as every version is before it serves); if that fails too, the engine itself
    is broken and ``on_broken`` is called (the repository then marks the version NOT_SERVING and
    reloads it from its directory).

Deadline admission (kept deliberately simple, and optimistic so it never refuses what could make it)
    ``cost`` of a sentence = source tokens (EOS included) x beam size. After each batch the scheduler
    updates an exponential moving average (alpha 0.2) of *compute seconds per unit of cost*
    (encode + decode seconds / batch cost). A request with a deadline is refused with
    DEADLINE_EXCEEDED before any compute when::

        remaining < rate x (cost queued ahead + own cost) + remaining time of the running batch

    where "ahead" means due no later than this request, and the running batch's remaining time is
    ``rate x its cost - time it has run`` (at least 0).
    Before the first batch has been measured every request is admitted. Since the rate is amortised
    over whole batches, the estimate is a lower bound for lightly loaded servers; the in-batch
    cancellation catches the requests that still run out of time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from server.core.admission import Answer, Call, Pending, by_request, form_batch, resolve
from server.core.continuous import ContinuousBatcher
from server.errors import DeadlineExceeded, Internal, ResourceExhausted, ServingError, Unavailable
from server.policy import BatchPolicy, RequestHandle
from server.types import DecodingOptions, SearchResult, SentenceRequest

log = logging.getLogger("nmt.server")

EMA_ALPHA = 0.2
FAILURES_BEFORE_PROBE = 3  # failed request runs in a row before the engine is probed with smoke_test
SMOKE_TEXT = "Hello, world."  # translated by every version before it serves (any text the tokenizer takes)
SMOKE_OPTIONS = DecodingOptions(beam_size=1, num_hypotheses=1, max_length=8)


def smoke_test(engine: Any) -> None:
    """Translate :data:`SMOKE_TEXT` greedily through ``engine``; raise unless it yields a hypothesis (blocking)."""
    ids = engine.tokenize(SMOKE_TEXT)
    results = list(engine.search_batch([SentenceRequest(list(ids), SMOKE_OPTIONS, None, SMOKE_TEXT)]).results)
    if len(results) != 1 or results[0] is None or not results[0].hypotheses:
        raise RuntimeError(f"the engine returned no translation of {SMOKE_TEXT!r}")


class ModelScheduler:
    """Queue, batcher task and worker thread of one model version."""

    def __init__(self, engine: Any, *, policy: BatchPolicy | None = None, metrics: Any = None,
                 model: str = "", version: str = "", on_broken: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_broken = on_broken  # called (on the event loop) when the engine fails a known-good sentence
        self.failures = 0  # request runs failed in a row
        self.policy = (policy or BatchPolicy()).for_device(str(getattr(engine, "device", "cpu")))
        self.labels = (model, version)
        self.series = metrics.version_series(model, version) if metrics is not None else None  # None: no metrics
        self._queue: list[Pending] = []  # arrival order
        self._seq = itertools.count()
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{model}-{version}")
        self._task: asyncio.Task | None = None
        self._closed = False  # refusing new work
        self._executor_down = False  # closed: the worker thread takes no more runs
        self._running: list[Pending] = []
        self._running_since = 0.0
        self._free_since = 0.0  # when the worker last finished a batch
        self._expected = 0  # most sentences outstanding since the last batch started (see the docstring)
        self.seconds_per_cost: float | None = None  # EMA, see the module docstring
        self.batches = 0
        self.cancelled_sentences = 0
        self._graph_counts = (0, 0, 0)  # the engine's CUDA graph counts as last recorded (record_graphs)
        self._continuous: ContinuousBatcher | None = None
        if self.policy.batching == "continuous":
            if engine.model is not None and engine.model.capabilities.per_row_positions:
                self._continuous = ContinuousBatcher(self)
            else:
                log.info("continuous batching needs a model that decodes rows at different steps; this version "
                         "batches statically", extra={"fields": {"model": model, "version": version}})

    @property
    def batching(self) -> str:
        """How this version batches: "continuous" or "static"."""
        return "static" if self._continuous is None else "continuous"

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"batcher-{self.labels}")

    async def close(self, timeout: float | None = None) -> None:
        """Refuse new work, let queued and running sentences finish and the worker end its run (up to ``timeout``),
        then stop; the sentences still queued or running then get UNAVAILABLE (their callers never hang).

        The worker's run can outlast its sentences (rows held to the end of a run, on a device; the
        stretch's metrics are reported as the run ends): waiting for it keeps the last stretch's metrics. Closing
        a closed scheduler does nothing."""
        if self._executor_down:
            return
        self._closed = True
        self._arrived.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._finish(), timeout)
        left = [*self._queue, *self._running]  # out of time: queued, and in the batch still running
        self._queue.clear()
        self._update_depth()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for pending in left:
            resolve(pending, error=Unavailable("server is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor_down = True
        if self._continuous is not None:
            self._continuous.close()

    async def _finish(self) -> None:
        """Wait until no sentence is queued or running, then for the worker thread's run to end (the single worker
        takes a no-op after it; what the run handed to the event loop comes before the no-op's answer)."""
        while self._queue or self._running:
            self._idle.clear()
            await self._idle.wait()
        await asyncio.get_running_loop().run_in_executor(self._executor, lambda: None)

    @property
    def queue_depth(self) -> int:
        """Sentences waiting for a batch."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Sentences in the batch being decoded now."""
        return len(self._running)

    # ---- requests --------------------------------------------------------------------------------

    async def submit(self, sentences: Sequence[SentenceRequest], work: Sequence[int],
                     request: RequestHandle | None = None) -> list[SearchResult]:
        """Decode the tokenized sentences of one request (``work``: each one's decoder row-steps at most,
        :func:`server.frontend.validation.check_budget`) and return their search results in order; raises
        what :meth:`enqueue` raises, or the request's error. Cancelling the awaiting task withdraws the
        request (:meth:`withdraw`). Tokenizing and detokenizing are the caller's
        (:func:`server.frontend.translate.translate_texts`)."""
        request = request or RequestHandle()
        future: asyncio.Future[list[SearchResult]] = asyncio.get_running_loop().create_future()

        def answer(results: list[SearchResult] | None, error: BaseException | None) -> None:
            if future.done():  # the awaiting task was cancelled
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(results)  # type: ignore[arg-type]  # results are given whenever error is not

        call = self.enqueue(sentences, work, request, answer)
        try:
            return await future
        except asyncio.CancelledError:
            self.withdraw(request, call)
            raise

    def enqueue(self, sentences: Sequence[SentenceRequest], work: Sequence[int], request: RequestHandle,
                answer: Answer) -> Call:
        """Queue the tokenized sentences of one request; ``answer`` gets their search results in order, or
        the first error (the request is then cancelled and its other sentences withdrawn), once, on the
        event loop. Refuses the request whole when the queue cannot hold it (RESOURCE_EXHAUSTED) or its
        deadline cannot be met (DEADLINE_EXCEEDED). The request's cancellation drops its queued sentences
        when a batch is formed and stops its running ones at the next step."""
        if self._closed:
            raise Unavailable("server is shutting down")
        if request.is_cancelled():
            raise request.error()
        if len(self._queue) + len(sentences) > self.policy.queue_size:
            raise ResourceExhausted(
                f"queue full for model {self.labels[0]} version {self.labels[1]}: {len(self._queue)} sentences "
                f"queued, limit {self.policy.queue_size}; this request has {len(sentences)}; retry later")

        def answered(results: list[SearchResult] | None, error: BaseException | None) -> None:
            if error is not None:
                self.withdraw(request, call)
            answer(results, error)

        call = Call(len(sentences), answered)
        now = time.monotonic()
        steps = 0 if self._continuous is None else self._continuous.batch.steps
        pendings = [
            Pending(request, replace(sentence, is_cancelled=request.is_cancelled), len(sentence.source_ids) + 1,
                    units, call, now, next(self._seq), steps, index)
            for index, (sentence, units) in enumerate(zip(sentences, work, strict=True))
        ]
        self._admit_deadline(request, sum(p.cost for p in pendings), pendings[0].due)
        self._queue.extend(pendings)
        self._expected = max(self._expected, len(self._queue) + len(self._running))
        self._update_depth()
        self._arrived.set()
        return call

    def withdraw(self, request: RequestHandle, call: Call) -> None:
        """Cancel a request and take its queued sentences out of the queue (its running ones leave the
        decode at the next step); ``call`` is answered no more."""
        request.cancel()
        call.answered = True
        before = len(self._queue)
        self._queue = [p for p in self._queue if p.call is not call]
        if len(self._queue) != before:
            self._update_depth()
        self._notify_idle()

    def estimate_seconds(self, cost: int, due: float = math.inf) -> float | None:
        """Seconds until a new request of ``cost`` due at ``due`` would be done (the sentences due no later
        go first), or None before the first batch."""
        rate = self.seconds_per_cost
        if rate is None:
            return None
        ahead = sum(p.cost for p in self._queue if p.due <= due)
        running = sum(p.cost for p in self._running)
        running_left = max(0.0, rate * running - (time.monotonic() - self._running_since)) if running else 0.0
        return rate * (ahead + cost) + running_left

    def _admit_deadline(self, request: RequestHandle, cost: int, due: float) -> None:
        remaining = request.remaining()
        if remaining is None:
            return
        estimate = self.estimate_seconds(cost, due)
        if estimate is not None and estimate > remaining:
            raise DeadlineExceeded(
                f"deadline cannot be met: {remaining * 1000:.0f} ms left, estimated {estimate * 1000:.0f} ms "
                f"with {len(self._queue)} sentences queued ahead for model {self.labels[0]} "
                f"version {self.labels[1]}; allow more time or send fewer texts")

    def _update_depth(self) -> None:
        if self.series is not None:
            self.series.queue_depth.set(len(self._queue))

    def _notify_idle(self) -> None:
        if not self._queue and not self._running:
            self._idle.set()

    # ---- the batcher -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await (self._step() if self._continuous is None else self._continuous.step())
            except Exception as error:  # noqa: BLE001 - a bug here must not strand every queued request
                log.exception("batcher error", extra={"fields": {"model": self.labels[0], "version": self.labels[1]}})
                for pending in self._queue:
                    resolve(pending, error=Internal(f"scheduler error: {type(error).__name__}: {error}"))
                self._queue.clear()
                self._update_depth()

    async def _step(self) -> None:
        """Wait for work, then form and run one batch (see the module docstring)."""
        self._drop_cancelled()
        if not self._queue:
            self._notify_idle()
            self._arrived.clear()
            await self._arrived.wait()
            return
        first = min(self._queue, key=lambda p: p.urgency)
        wait = max(first.enqueued, self._free_since) + self.policy.max_wait_seconds - time.monotonic()
        if wait > 0 and not self._closed and not self._enough_queued(first.key):
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), wait)
            return
        batch = form_batch([p for p in self._queue if p.key == first.key], first, self.policy)
        await self._execute(batch)

    def _enough_queued(self, key: tuple[int, bool]) -> bool:
        """Whether the queue holds the expected concurrency or a full batch of ``key``."""
        same = [p for p in self._queue if p.key == key]
        if len(same) >= min(self._expected, self.policy.max_batch_sentences):
            return True
        return sum(p.tokens for p in same) >= self.policy.batch_tokens

    def _drop_cancelled(self) -> None:
        dropped = [p for p in self._queue if p.request.is_cancelled()]
        if dropped:
            self._queue = [p for p in self._queue if not p.request.is_cancelled()]
            for p in dropped:
                resolve(p, error=p.request.error())
            self._update_depth()

    async def _execute(self, batch: list[Pending]) -> None:
        """Run one batch on the worker thread and resolve its futures; never raises (the batcher lives on).

        When the batch fails and holds several requests, each request's sentences run again on their
        own, so a sentence that breaks inference fails its own request only (see the module docstring).
        """
        in_batch = set(map(id, batch))
        self._queue = [p for p in self._queue if id(p) not in in_batch]
        self._update_depth()
        now = time.monotonic()
        self._running, self._running_since = batch, now
        self._expected = len(self._queue) + len(batch)
        try:
            if self.series is not None:
                for p in batch:
                    self.series.queue_duration.observe(now - p.enqueued)
            error = await self._decode(batch)
            if error is not None:
                await self._recover(batch, error)
        finally:
            self._running = []
            self._free_since = time.monotonic()
            self._notify_idle()

    async def _recover(self, batch: list[Pending], error: Exception) -> None:
        """``batch`` failed with ``error``: fail it with a :class:`ServingError`'s status, or decode each of its
        requests on its own (see the module docstring)."""
        labels = self.labels
        groups = by_request(batch)
        if isinstance(error, ServingError):  # e.g. out of device memory: the batch's fault, not the engine's
            log.warning("batch refused", extra={"fields": {
                "model": labels[0], "version": labels[1], "sentences": len(batch), "error": str(error)}})
            for p in batch:
                resolve(p, error=error)
        elif len(groups) > 1:
            log.warning("batch failed; running its requests one by one", extra={"fields": {
                "model": labels[0], "version": labels[1], "sentences": len(batch), "requests": len(groups),
                "error": f"{type(error).__name__}: {error}"}})
            for group in groups:
                if group[0].request.is_cancelled():
                    for p in group:
                        resolve(p, error=p.request.error())
                elif (group_error := await self._decode(group)) is not None:
                    await self._fail(group, group_error)
        else:
            await self._fail(batch, error)

    async def _decode(self, batch: list[Pending]) -> Exception | None:
        """Decode ``batch`` on the worker thread and resolve its futures; return the error when it failed."""
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.search_batch, [p.sentence for p in batch])
            if len(result.results) != len(batch):
                raise RuntimeError(f"the engine returned {len(result.results)} results for {len(batch)} "
                                   "sentences")
        except Exception as error:  # noqa: BLE001 - a failing batch fails its requests, not the batcher
            return error
        self.failures = 0
        self._record(batch, result)
        for p, searched in zip(batch, result.results, strict=True):
            if searched is None:
                resolve(p, error=p.request.error())
            else:
                resolve(p, result=searched)
        return None

    async def _fail(self, group: list[Pending], error: Exception) -> None:
        """Fail one request's sentences with INTERNAL (the details go to the log, with the request id);
        after ``FAILURES_BEFORE_PROBE`` failures in a row, probe the engine (see the module docstring)."""
        request_id = group[0].request.request_id
        log.error("inference failed", exc_info=error, extra={"fields": {
            "model": self.labels[0], "version": self.labels[1], "request_id": request_id, "sentences": len(group)}})
        for p in group:
            resolve(p, error=Internal(f"inference failed for request {request_id} ({type(error).__name__}); "
                                       "the server logged the details under this request id"))
        self.failures += 1
        if self.failures >= FAILURES_BEFORE_PROBE and self.on_broken is not None:
            self.failures = 0
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, smoke_test, self.engine)
            except Exception as probe_error:  # noqa: BLE001 - the engine cannot translate anything any more
                log.error("engine broken: a known-good sentence fails too", extra={"fields": {
                    "model": self.labels[0], "version": self.labels[1],
                    "error": f"{type(probe_error).__name__}: {probe_error}"}})
                self.on_broken()

    def observe_rate(self, sample: float) -> None:
        """Fold one measurement of compute seconds per unit of cost into the rate estimate."""
        rate = self.seconds_per_cost
        self.seconds_per_cost = sample if rate is None else (1 - EMA_ALPHA) * rate + EMA_ALPHA * sample

    def record_graphs(self) -> None:
        """The CUDA graph metrics of the engine's kept beam runs (``--cuda-graphs``), brought up to date."""
        model, series = self.engine.model, self.series
        if series is None or model is None or not model.capabilities.kept_runs:
            return
        capture, pool = model.capture, model.pool
        counts = (capture.captured_runs, capture.failures, pool.reused)
        for counter, now, before in zip((series.cuda_graph_runs, series.cuda_graph_failures, series.cuda_graph_reuses),
                                        counts, self._graph_counts, strict=True):
            if now > before:
                counter.inc(now - before)
        self._graph_counts = counts
        series.cuda_graph_pool_bytes.set(pool.held)

    def _record(self, batch: list[Pending], result: Any) -> None:
        """Update the cost-rate estimate and the batch metrics from one engine result."""
        self.batches += 1
        self.cancelled_sentences += result.cancelled
        compute = result.encode_seconds + result.decode_seconds
        cost = sum(p.cost for p in batch)
        if cost and result.cancelled == 0:  # cancelled sentences would make the batch look cheap
            self.observe_rate(compute / cost)
        series = self.series
        if series is None:
            return
        series.encode_duration.observe(result.encode_seconds)
        series.decode_duration.observe(result.decode_seconds)
        series.batch_sentences.observe(len(batch))
        series.batch_tokens.observe(len(batch) * max(p.tokens for p in batch))
        series.padding_ratio.observe(result.padding_ratio)
        series.generated_tokens.inc(result.generated_tokens)
        series.source_tokens.inc(result.source_tokens)
        if result.cancelled:
            series.cancelled_sentences.inc(result.cancelled)
        self.record_graphs()
