"""Continuous batching in the server (``--batching continuous``): real engines, a real gRPC server on loopback.

Sentences join the running decode between steps and leave when done; a short request overtakes a long
one; cancellation and deadlines free rows between steps; a fault fails only its request; a model that
cannot decode rows at different steps falls back to static batching."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.errors import NmtError
from server.config import ServerConfig
from server.controls import Controls
from server.core import continuous as continuous_module
from server.core.admission import DecodeLoad, Pending, admit_to_decode
from server.core.continuous import Progress, RunningBatch
from server.core.scheduler import ModelScheduler
from server.engine import cuda_graphs
from server.engine.engine import Engine
from server.engine.step_model import Capabilities
from server.errors import Cancelled, DeadlineExceeded, Internal
from server.frontend.translate import translate_texts
from server.metrics import ServerMetrics
from server.policy import BatchPolicy, RequestHandle
from server.protos import pb2
from server.types import DecodingOptions, SentenceRequest
from tests.harness import ServerHarness
from tests.test_server import default_loader, test_config, wait_for

LONG = " ".join(["one two three four five six seven eight nine ten"] * 3)
SHORT = ["two", "seven three", "four four five", "nine"]
MIN_LENGTH = 60  # the tiny models end LONG after a few tokens: keep it decoding


def long_options(beam: int = 1) -> DecodingOptions:
    return DecodingOptions(beam_size=beam, controls=Controls(min_length=MIN_LENGTH))


@pytest.fixture(scope="module")
def mixed_repository(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<repo>/rnn/1`` (Bahdanau) and ``<repo>/transformer/1``."""
    root = tmp_path_factory.mktemp("continuous")
    shutil.copytree(tiny_models["bahdanau"], root / "rnn" / "1")
    shutil.copytree(tiny_models["transformer"], root / "transformer" / "1")
    return root


class StepModel:
    """An engine's step model whose steps take ``delay`` seconds longer and whose encoder raises on a
    source holding ``poison`` (as a session run that fails on one input)."""

    def __init__(self, model: Any, delay: float = 0.0, poison: list[int] | None = None) -> None:
        self.model, self.delay, self.poison = model, delay, poison
        self.static_names, self.state_names = model.static_names, model.state_names
        # every step through step() (no plain runs, which would bypass the delay and the fault)
        self.capabilities = Capabilities(per_row_positions=model.capabilities.per_row_positions)
        self.static_src_axes = model.static_src_axes
        self.most_rows = 0

    def encode(self, src: np.ndarray) -> Any:
        if self.poison and any(row[: len(self.poison)].tolist() == self.poison for row in src):
            raise RuntimeError("injected fault: session run failed")
        return self.model.encode(src)

    def step(self, tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        self.most_rows = max(self.most_rows, tokens.size)
        time.sleep(self.delay)
        return self.model.step(tokens, *args, **kwargs)

    def force(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.force(*args, **kwargs)

    def release(self) -> None:
        pass  # holds nothing between decodes

    def select_rows(self, tensors: Any, rows: np.ndarray, in_place: bool = False) -> Any:
        return self.model.select_rows(tensors, rows, in_place)

    def concat_rows(self, first: Any, second: Any) -> Any:
        return self.model.concat_rows(first, second)


def engine_with(version_dir: Path, device_state: bool = False, **model_options: Any) -> Engine:
    base = Engine.load(version_dir, provider="cpu", intra_op_threads=1, device_state=device_state)
    return Engine(base.manifest, base.tokenizer, StepModel(base.model, **model_options), base.provider)


async def until(condition: Any, timeout: float = 10) -> None:
    """Wait on the event loop until ``condition()`` holds; fail (not hang) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the running decode never got there"
        await asyncio.sleep(0.005)


def translate(scheduler: ModelScheduler, texts: list[str], options: DecodingOptions,
              request: RequestHandle | None = None) -> Any:
    """The texts through ``scheduler`` as the servicer sends them (tokenized, submitted, detokenized)."""
    return translate_texts(scheduler.engine.text, scheduler.submit, texts, options, request)


def continuous(engine: Engine, **policy: Any) -> ModelScheduler:
    return ModelScheduler(engine, policy=BatchPolicy(batching="continuous", **policy))


@pytest.mark.parametrize("model", ["rnn", "transformer"])
def test_server_translations_equal_one_by_one(mixed_repository: Path, model: str) -> None:
    h = ServerHarness(test_config(mixed_repository, batching="continuous", max_batch_rows=12), default_loader())
    try:
        assert h.scheduler(model).batching == "continuous"
        calls = []
        for i, text in enumerate([LONG, *SHORT, LONG, *SHORT]):
            options = pb2.DecodingOptions(beam_size=[1, 4, 2][i % 3], num_hypotheses=1, return_attention=i % 2 == 0,
                                          return_scores=True, min_length=MIN_LENGTH if text == LONG else 0)
            calls.append((text, options, h.stub.Translate.future(
                pb2.TranslateRequest(texts=[text], model=model, options=options), timeout=60)))
        engine = h.engine(model)
        for text, options, future in calls:
            [got] = future.result().translations
            [alone] = engine.translate([text], DecodingOptions(
                beam_size=options.beam_size, return_attention=options.return_attention,
                controls=Controls(min_length=options.min_length)))
            assert list(got.hypotheses[0].subword_tokens) == alone.hypotheses[0].tokens
            assert got.hypotheses[0].score == pytest.approx(alone.hypotheses[0].score, abs=1e-5)
            assert got.hypotheses[0].HasField("attention") == options.return_attention
            if options.return_attention:
                weights = np.array(got.hypotheses[0].attention.weights).reshape(len(got.hypotheses[0].tokens), -1)
                np.testing.assert_allclose(weights, alone.hypotheses[0].attention.weights, atol=1e-5)
        labels = {"model": model, "version": "1"}
        assert h.metric("nmt_admission_wait_steps_count", labels) == len(calls)
        assert h.metric("nmt_admission_wait_steps_sum", labels) > 0  # the rows were full: some waited
        wait_for(lambda: h.metric("nmt_running_rows", labels) == 0)
        # min_length is a control: the general selection chose every step while the long sentences decoded
        assert h.metric("nmt_decode_steps_total", {**labels, "selection": "general"}) >= MIN_LENGTH
        # every admission times its encoder call and, apart, the joining of its rows to the running decode
        stage = {"encode": {**labels, "stage": "encode"}, "join": {**labels, "stage": "join"}}
        admissions = h.metric("nmt_inference_duration_seconds_count", stage["encode"])
        assert admissions >= 1 and h.metric("nmt_inference_duration_seconds_count", stage["join"]) == admissions
        assert h.metric("nmt_inference_duration_seconds_sum", stage["join"]) > 0
    finally:
        h.close()


@pytest.mark.parametrize(("model", "device_state"), [("rnn", False), ("transformer", False), ("transformer", True)],
                         ids=["rnn", "transformer", "transformer-device-state"])
def test_sentences_encoded_beside_the_decode_equal_one_by_one(mixed_repository: Path, model: str,
                                                              device_state: bool) -> None:
    """The encoder beside the decode (``encoder_overlap="on"``, a device rule): the sentences that join a running
    decode are encoded on the encoder's own thread while the worker steps on (the offer carries their encoder
    outputs: ``OrtValue`` s where the state is kept as on a device), and decode as they do alone."""
    engine = engine_with(mixed_repository / model / "1", device_state=device_state, delay=0.002)
    threads = set()
    encode = engine.model.encode

    def on_which_thread(src: np.ndarray) -> Any:
        threads.add(threading.current_thread().name.split("_")[0])
        return encode(src)

    engine.model.encode = on_which_thread

    async def scenario() -> list[Any]:
        scheduler = continuous(engine, encoder_overlap="on", max_wait_seconds=0.0)
        scheduler.start()
        long = asyncio.ensure_future(translate(scheduler, [LONG], long_options(2)))
        await until(lambda: scheduler._continuous.batch.steps)
        outcomes = await asyncio.gather(long, *(translate(scheduler, [t], DecodingOptions(beam_size=b))
                                                for t, b in zip(SHORT, [1, 4, 2, 1], strict=True)))
        await scheduler.close(timeout=5)
        return outcomes

    long, *short = asyncio.run(scenario())
    assert threads == {"engine--", "encoder--"}, "the first sentence encoded by the worker, the joining ones apart"
    for got, (text, beam) in zip([long, *short], [(LONG, 2), *zip(SHORT, [1, 4, 2, 1], strict=True)], strict=True):
        options = long_options(beam) if text == LONG else DecodingOptions(beam_size=beam)
        [alone] = engine.translate([text], options)
        assert got[0].hypotheses[0].tokens == alone.hypotheses[0].tokens
        assert got[0].hypotheses[0].score == pytest.approx(alone.hypotheses[0].score, abs=1e-5)


def test_after_shutdown_the_worker_encodes_what_joins(tiny_models: dict[str, Path]) -> None:
    """Once the encoder's thread has stopped (the scheduler closing), an answer still reaches the worker: the
    sentences as they are, for it to encode."""
    scheduler = continuous(engine_with(tiny_models["transformer"]), encoder_overlap="on")
    batcher = scheduler._continuous
    batcher.close()
    sentence = SentenceRequest([5, 6], DecodingOptions())
    pending = Pending(RequestHandle(), sentence, 3, 1, None, 0.0, 0)  # type: ignore[arg-type]
    batcher._answer(batcher.batch, [pending])
    assert batcher.batch._offers.get_nowait() == ([sentence], [pending], None)


class _CapturesTimed:
    """A decoder session whose runs that may capture a CUDA graph (a graph id's first ``CAPTURE_CALLS``) take
    ``seconds`` and record when they ran; it stands in for CUDA's graph-enabled session on the CPU."""

    def __init__(self, session: Any, seconds: float, spans: list[tuple[float, float]]) -> None:
        self.session, self.seconds, self.spans, self.calls = session, seconds, spans, Counter()
        self.started = threading.Event()  # some run that may capture has begun

    def run_with_iobinding(self, binding: Any, options: Any = None) -> None:
        graph_id = options.get_run_config_entry("gpu_graph_id") if options is not None else str(cuda_graphs.SKIP)
        if graph_id != str(cuda_graphs.SKIP) and self.calls[graph_id] < cuda_graphs.CAPTURE_CALLS:
            self.calls[graph_id] += 1
            self.started.set()
            start = time.perf_counter()
            time.sleep(self.seconds)
            self.session.run_with_iobinding(binding, options)
            self.spans.append((start, time.perf_counter()))
            return
        self.session.run_with_iobinding(binding, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def test_encoder_calls_beside_the_decode_wait_for_cuda_graph_captures(tiny_models: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--cuda-graphs`` the encoder still runs on its own thread (a device rule), but never while the
    worker's session run may be capturing a graph (a capture is global to the process: another thread's device
    allocation spoils it): the two take turns at ``CAPTURE_GATE``. On the CPU's sessions, captures forced as a
    CUDA version's would be, both slowed so that they would overlap without the gate; the short sentences'
    encoder calls start once the decode has begun to capture (the long sentence's plain steps after its
    min_length: they ask for the gate only after one has started), whatever the host's speed. The translations
    stay those of the sentences alone."""
    engine = Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1, device_state=True,
                         device_search=True, cuda_graphs=True)
    model = engine.model
    captures: list[tuple[float, float]] = []
    encoder_calls: list[tuple[float, float]] = []
    timed = model.sessions["decoder_graphs"] = _CapturesTimed(model.sessions["decoder"], 0.004, captures)
    model.capture.reason = ""  # as a CUDA version's would be
    encode = model.encode
    shorts = threading.Event()  # the short sentences are on their way

    beside_captures = continuous_module.beside_captures

    def gate_after_a_capture_began(model: Any) -> Any:  # the encoder thread asks for the gate
        if shorts.is_set() and threading.current_thread().name.startswith("encoder"):
            assert timed.started.wait(timeout=30), "no run that may capture began"
        return beside_captures(model)

    monkeypatch.setattr(continuous_module, "beside_captures", gate_after_a_capture_began)

    def slow_encode(src: np.ndarray) -> Any:
        start = time.perf_counter()
        time.sleep(0.01)
        try:
            return encode(src)
        finally:
            if threading.current_thread().name.startswith("encoder"):
                encoder_calls.append((start, time.perf_counter()))

    model.encode = slow_encode
    texts = [" ".join(SHORT[: 1 + i % 4]) + " " + SHORT[i % 4] for i in range(12)]

    async def scenario() -> list[Any]:
        scheduler = continuous(engine, encoder_overlap="on", max_wait_seconds=0.0)
        scheduler.start()
        long = asyncio.ensure_future(translate(scheduler, [LONG], long_options(1)))
        await until(lambda: scheduler._continuous.batch.steps)
        shorts.set()
        calls = []
        for i, text in enumerate(texts):
            calls.append(asyncio.ensure_future(translate(scheduler, [text], DecodingOptions(beam_size=1 + i % 2 * 3))))
            await asyncio.sleep(0.006)
        outcomes = await asyncio.gather(long, *calls)
        await scheduler.close(timeout=5)
        return outcomes

    long, *short = asyncio.run(scenario())
    assert encoder_calls and captures, "encoder calls on the encoder's thread, and runs that may capture"
    overlapping = [(c, e) for c in captures for e in encoder_calls if c[0] < e[1] and e[0] < c[1]]
    assert not overlapping, f"{len(overlapping)} captures overlapped an encoder call"
    for got, (text, beam) in zip([long, *short], [(LONG, 1), *((t, 1 + i % 2 * 3) for i, t in enumerate(texts))],
                                 strict=True):
        options = long_options(beam) if text == LONG else DecodingOptions(beam_size=beam)
        [alone] = engine.translate([text], options)
        assert got[0].hypotheses[0].tokens == alone.hypotheses[0].tokens


class SharedPosition(StepModel):
    """A step model that decodes all rows at one position (as a Transformer exported before the in-place cache)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.capabilities = Capabilities()


def test_a_model_without_per_row_positions_batches_statically(tiny_models: dict[str, Path],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    base = Engine.load(tiny_models["bahdanau"], provider="cpu", intra_op_threads=1)
    engine = Engine(base.manifest, base.tokenizer, SharedPosition(base.model), base.provider)

    async def scenario() -> tuple[str, Any]:
        scheduler = ModelScheduler(engine, policy=BatchPolicy(batching="continuous"), model="old", version="1")
        scheduler.start()
        result = await asyncio.gather(*(translate(scheduler, [t], DecodingOptions()) for t in SHORT))
        await scheduler.close(timeout=5)
        return scheduler.batching, result

    with caplog.at_level(logging.INFO, logger="nmt.server"):
        batching, results = asyncio.run(scenario())
    assert batching == "static" and len(results) == len(SHORT)
    [line] = [r for r in caplog.records if r.getMessage().startswith("continuous batching needs")]
    assert line.fields == {"model": "old", "version": "1"}


def test_short_request_joins_and_finishes_before_the_long_one(tiny_models: dict[str, Path]) -> None:
    engine = engine_with(tiny_models["bahdanau"], delay=0.005)
    beam = DecodingOptions(beam_size=4)

    async def scenario() -> tuple[list[str], Any, Any]:
        scheduler = continuous(engine)
        scheduler.start()
        done: list[str] = []

        async def call(name: str, text: str, options: DecodingOptions) -> Any:
            [translation] = await translate(scheduler, [text], options)
            done.append(name)
            return translation

        long = asyncio.ensure_future(call("long", LONG, long_options(4)))
        await until(lambda: scheduler._continuous.batch.steps)
        short = await call("short", SHORT[0], beam)
        result = await long
        await scheduler.close(timeout=5)
        return done, short, result

    done, short, long = asyncio.run(scenario())
    assert done == ["short", "long"]
    [short_alone] = engine.translate([SHORT[0]], beam)
    [long_alone] = engine.translate([LONG], long_options(4))
    assert short.hypotheses[0].token_ids == short_alone.hypotheses[0].token_ids
    assert long.hypotheses[0].token_ids == long_alone.hypotheses[0].token_ids
    assert len(long.hypotheses[0].token_ids) >= MIN_LENGTH


def test_held_rows_hand_out_their_translations_at_once(tiny_models: dict[str, Path]) -> None:
    """Ended rows held (``hold_ended="on"``, a device rule): a sentence that ends in a run of plain arg-max steps
    (by EOS, or at its output limit) goes to its caller from the step it ended (the decode's ``on_ended``) while its
    row runs on to the run's end; every translation equals the sentence's lone decode."""
    engine = Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1)
    texts = [*SHORT, LONG, *SHORT[::-1], "five six seven eight nine ten one two"]
    options = [DecodingOptions(max_length=[256, 2, 4][i % 3]) for i in range(len(texts))]

    metrics = ServerMetrics()

    async def scenario() -> tuple[list[Any], list[Any]]:
        scheduler = ModelScheduler(engine, policy=BatchPolicy(batching="continuous", hold_ended="on",
                                                              max_wait_seconds=0.0), metrics=metrics)
        scheduler.start()
        decode, handed = scheduler._continuous.batch.decode, []
        deliver = decode.on_ended

        def recorded(ended: list[Any]) -> None:
            handed.extend(ended)
            deliver(ended)

        decode.on_ended = recorded
        outcomes = await asyncio.gather(*(translate(scheduler, [text], o) for text, o in zip(texts, options,
                                                                                             strict=True)))
        await scheduler.close(timeout=5)
        return outcomes, handed

    def steps() -> dict[str, float]:
        return {s.labels["selection"]: s.value for family in metrics.registry.collect() for s in family.samples
                if s.name == "nmt_decode_steps_total"}

    outcomes, handed = asyncio.run(scenario())
    assert handed, "some sentences ended in plain steps that held their rows"
    counted = steps()
    assert counted["plain"] > counted["general"], "most steps' hypotheses chosen in the runs of plain steps"
    for [got], text, o in zip(outcomes, texts, options, strict=True):
        [alone] = engine.translate([text], o)
        assert got.hypotheses[0].token_ids == alone.hypotheses[0].token_ids
        assert got.hypotheses[0].score == pytest.approx(alone.hypotheses[0].score, abs=1e-5)


def test_close_waits_for_the_workers_run_and_keeps_its_metrics(tiny_models: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A run can outlast its sentences (held rows are handed out before the run ends, and its stretch is reported
    as it ends): closing right after the last caller's translation waits for the run, so its steps are counted.
    The report is slowed (as a busy host slows it) so that closing comes first; before, the report was dropped."""
    engine = Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1)
    report = RunningBatch._report

    def slow_report(progress: Progress, to: Any) -> None:
        time.sleep(0.2)
        report(progress, to)

    monkeypatch.setattr(RunningBatch, "_report", staticmethod(slow_report))
    metrics = ServerMetrics()

    async def scenario() -> None:
        scheduler = ModelScheduler(engine, policy=BatchPolicy(batching="continuous", hold_ended="on"), metrics=metrics)
        scheduler.start()
        await asyncio.gather(*(translate(scheduler, [text], DecodingOptions(max_length=3)) for text in SHORT))
        await scheduler.close(timeout=5)
        await scheduler.close(timeout=5)  # a second close does nothing (its worker takes no more runs)

    asyncio.run(scenario())
    steps = sum(s.value for family in metrics.registry.collect() for s in family.samples
                if s.name == "nmt_decode_steps_total")
    assert steps >= 3


def test_cancelled_and_expired_requests_free_their_rows(tiny_models: dict[str, Path]) -> None:
    engine = engine_with(tiny_models["bahdanau"], delay=0.01)

    async def scenario() -> list[Any]:
        scheduler = continuous(engine)
        scheduler.start()
        handle = RequestHandle()
        cancelled = asyncio.ensure_future(translate(scheduler, [LONG], long_options(4), handle))
        expired = asyncio.ensure_future(translate(scheduler, [LONG], long_options(2), RequestHandle.with_timeout(0.3)))
        decode = scheduler._continuous.batch.decode
        await until(lambda: decode.rows >= 6)
        handle.cancel()
        outcomes = await asyncio.gather(cancelled, expired, return_exceptions=True)
        rows_after = decode.rows
        await scheduler.close(timeout=5)
        return [*outcomes, rows_after, scheduler.cancelled_sentences]

    cancelled, expired, rows_after, count = asyncio.run(scenario())
    assert isinstance(cancelled, asyncio.CancelledError | Cancelled)
    assert isinstance(expired, DeadlineExceeded)
    assert rows_after == 0 and count == 2


def test_rows_are_bounded_and_reused(tiny_models: dict[str, Path]) -> None:
    engine = engine_with(tiny_models["bahdanau"])

    async def scenario() -> list[Any]:
        scheduler = continuous(engine, max_batch_rows=6)
        scheduler.start()
        texts = [LONG, *SHORT] * 2
        results = await asyncio.gather(*(translate(scheduler, [t], long_options(2) if t == LONG else
                                                             DecodingOptions(beam_size=2)) for t in texts))
        await scheduler.close(timeout=5)
        return [r[0] for r in results]

    results = asyncio.run(scenario())
    assert engine.model.most_rows == 6
    alone = [engine.translate([t], long_options(2) if t == LONG else DecodingOptions(beam_size=2))[0]
             for t in [LONG, *SHORT] * 2]
    assert [r.hypotheses[0].token_ids for r in results] == [a.hypotheses[0].token_ids for a in alone]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_fault_while_joining_fails_only_its_request(tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture,
                                                    overlap: str) -> None:
    """An encoder call that raises fails only its request, whether the worker made it or the encoder's own
    thread (the encoder beside the decode): the worker raises it as its own, and the running decode's requests run
    again one by one."""
    base = Engine.load(tiny_models["bahdanau"], provider="cpu", intra_op_threads=1)
    poison = base.tokenize("nine nine nine nine nine")
    engine = engine_with(tiny_models["bahdanau"], delay=0.005, poison=poison)

    async def scenario() -> list[Any]:
        scheduler = continuous(engine, encoder_overlap=overlap)
        assert (scheduler._continuous._encoder is not None) == (overlap == "on")
        scheduler.start()
        long = asyncio.ensure_future(translate(scheduler, [LONG], long_options(2)))
        await until(lambda: scheduler._continuous.batch.steps)
        calls = [translate(scheduler, ["nine nine nine nine nine"], DecodingOptions(),
                                     RequestHandle(request_id="poisoned-1")),
                 *(translate(scheduler, [t], DecodingOptions()) for t in SHORT)]
        outcomes = await asyncio.gather(long, *calls, return_exceptions=True)
        await scheduler.close(timeout=5)
        return outcomes

    with caplog.at_level(logging.INFO, logger="nmt.server"):
        long, poisoned, *good = asyncio.run(scenario())
    assert isinstance(poisoned, Internal) and "request poisoned-1" in str(poisoned)
    assert long[0].hypotheses and all(g[0].hypotheses for g in good)
    assert any(r.getMessage() == "inference failed" and r.fields["request_id"] == "poisoned-1"
               for r in caplog.records)


def test_admission_is_oldest_first_within_rows_and_token_budgets() -> None:
    def pending(tokens: int, seq: int, beam: int = 1) -> Pending:
        sentence = SentenceRequest([5] * (tokens - 1), DecodingOptions(beam_size=beam))
        return Pending(RequestHandle(), sentence, tokens, 1, None, 0.0, seq)  # type: ignore[arg-type]

    queue = [pending(10, 0, beam=4), pending(50, 1, beam=2), pending(5, 2)]
    policy = BatchPolicy(max_batch_rows=8, decode_tokens=10_000)
    assert admit_to_decode(queue, DecodeLoad(), policy) == queue  # 4 + 2 + 1 rows
    assert admit_to_decode(queue, DecodeLoad(rows=3), policy) == queue[:1]  # 2 more rows would be 9
    assert admit_to_decode(queue[::-1], DecodeLoad(rows=3), policy) == queue[:1]  # urgency, not queue order
    assert admit_to_decode(queue, DecodeLoad(rows=5), policy) == []  # the oldest does not fit: nobody overtakes
    tight = BatchPolicy(max_batch_rows=64, decode_tokens=200)
    assert admit_to_decode(queue, DecodeLoad(rows=4, source_width=20, target_length=10), tight) == []  # 8 x 30
    assert admit_to_decode(queue, DecodeLoad(), tight) == queue[:1]  # 6 x 60 > 200
    huge = [pending(100, 0, beam=8)]
    assert admit_to_decode(huge, DecodeLoad(), tight) == huge  # into an empty decode the first always goes


def test_batching_flag_environment_and_validation(tmp_path: Path) -> None:
    assert ServerConfig().batching == "auto"
    assert ServerConfig.from_env({"NMT_BATCHING": "static"}).batching == "static"
    assert ServerConfig.from_env({"NMT_BATCHING": "Continuous"}).batching == "continuous"
    with pytest.raises(Exception, match="batching must be one of"):
        ServerConfig(batching="dynamic").validate()
    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser, environ={})
    for removed in ("--hold-ended", "--encoder-overlap", "--device-search", "--gc-freeze"):  # rules, not flags
        with pytest.raises(SystemExit):
            parser.parse_args([removed, "on"] if removed != "--gc-freeze" else [removed])
    with pytest.raises(Exception, match="max_batch_rows"):
        ServerConfig(max_batch_rows=4, max_beam=8).validate()
    with pytest.raises(Exception, match="decode_tokens"):
        ServerConfig(decode_tokens=100).validate()


def test_auto_batching_rows_and_budgets_follow_the_device() -> None:
    """``--batching auto`` (the default) is continuous on CUDA and static on the CPU, as measured
    (benchmarks/README.md), and the row limit and the token and work budgets left at 0 (the defaults) take the
    device's values; explicit ones stay as given on every device."""
    policy = BatchPolicy.from_config(ServerConfig())
    assert (policy.batching, policy.max_batch_rows, policy.batch_tokens, policy.batch_work,
            policy.decode_tokens) == ("auto", 0, 0, 0, 0)
    on_cpu, on_cuda = policy.for_device("cpu"), policy.for_device("cuda:1")
    assert (on_cpu.batching, on_cpu.max_batch_rows, on_cpu.batch_tokens, on_cpu.batch_work,
            on_cpu.decode_tokens) == ("static", 32, 4096, 16384, 65536)
    assert (on_cuda.batching, on_cuda.max_batch_rows, on_cuda.batch_tokens, on_cuda.batch_work,
            on_cuda.decode_tokens) == ("continuous", 512, 32768, 262144, 262144)
    assert (on_cpu.encoder_overlap, on_cuda.encoder_overlap) == ("off", "on")
    assert (on_cpu.hold_ended, on_cuda.hold_ended) == ("off", "on")
    assert BatchPolicy(encoder_overlap="off").for_device("cuda:0").encoder_overlap == "off"
    assert on_cuda.for_device("cpu") == on_cuda  # resolved once, for good
    explicit = BatchPolicy(batching="static", max_batch_rows=64, batch_tokens=1000, batch_work=2000,
                           decode_tokens=3000).for_device("cuda:0")
    assert (explicit.batching, explicit.max_batch_rows, explicit.batch_tokens, explicit.batch_work,
            explicit.decode_tokens) == ("static", 64, 1000, 2000, 3000)
    from_env = ServerConfig.from_env({"NMT_BATCH_WORK": "5000", "NMT_DECODE_TOKENS": "70000"})
    assert BatchPolicy.from_config(from_env).for_device("cuda:0").batch_work == 5000
    assert BatchPolicy.from_config(from_env).for_device("cuda:0").decode_tokens == 70000


def test_a_budget_left_to_the_device_is_checked_at_its_smallest() -> None:
    """At 0 a budget is checked against the smallest of its device values, so a configuration that validates holds
    one sentence on every device; negative values are refused."""
    ServerConfig().validate()
    with pytest.raises(NmtError, match="batch_tokens"):
        ServerConfig(max_tokens=5000, max_chars=20000).validate()  # the CPU's 4096 cannot hold one such text
    with pytest.raises(NmtError, match="batch_work"):
        ServerConfig(batch_work=-1).validate()


def test_grpc_cancel_leaves_the_running_decode(mixed_repository: Path) -> None:
    def slow_loader(path: Path, **kwargs: Any) -> Engine:
        engine = default_loader()(path, **kwargs)
        if engine.model.capabilities.per_row_positions:
            engine.model = StepModel(engine.model, delay=0.02)
        return engine

    h = ServerHarness(test_config(mixed_repository, batching="continuous"), slow_loader)
    try:
        future = h.stub.Translate.future(pb2.TranslateRequest(
            texts=[LONG], model="rnn", options=pb2.DecodingOptions(min_length=MIN_LENGTH)), timeout=30)
        wait_for(lambda: h.scheduler("rnn").running)
        started = threading.Event()
        short = h.stub.Translate.future(pb2.TranslateRequest(texts=[SHORT[0]], model="rnn"), timeout=30)
        short.add_done_callback(lambda _: started.set())
        assert started.wait(20) and not future.done()  # the short one was done while the long one decoded
        future.cancel()
        labels = {"model": "rnn", "version": "1"}
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", labels) == 1)
        wait_for(lambda: h.scheduler("rnn").running == 0)
        assert future.cancelled()
        cancelled = {"model": "rnn", "method": "Translate", "code": "CANCELLED"}
        wait_for(lambda: h.metric("nmt_requests_total", cancelled) == 1)
    finally:
        h.close()


