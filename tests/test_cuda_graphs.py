"""CUDA graphs for beam search's runs on the device (:mod:`server.engine.cuda_graphs`), their CPU side: the shape
buckets, the pool of runs kept for reuse (the fixed buffers a replay needs), the graph ids, and the fallback to
ordinary runs where nothing can capture, said once. The device step model runs on the CPU here
(``Engine.load(device_state=True)``, the code path CUDA versions take); ``tests/test_gpu.py`` captures on CUDA."""

from __future__ import annotations

import logging
import random

import numpy as np
import onnxruntime as ort
import pytest

from server.engine import cuda_graphs
from server.engine.cuda_graphs import GraphCapture, RunPool, bucket, bucketed_shape, graph_options
from server.engine.decode import RunningDecode
from server.engine.device_runs import DeviceBeamRun, DeviceGreedyRun, RunShapes
from server.engine.engine import Engine
from server.types import DecodingOptions, SentenceRequest
from tests.harness import live_ortvalues
from tests.test_device_search import WORDS, assert_same, batch, decode

NOT_CAPTURED = "CUDA graphs: not captured (the sessions run on the CPU provider)"


@pytest.fixture(scope="module", params=["transformer", "bahdanau"])
def engines(request, tiny_models) -> tuple[Engine, Engine]:
    """The host search's engine and one whose beam runs are kept for CUDA graphs, on one version."""
    path = tiny_models[request.param]
    return (Engine.load(path, provider="cpu", intra_op_threads=1),
            Engine.load(path, provider="cpu", intra_op_threads=1, device_state=True, device_search=True,
                        cuda_graphs=True, graph_pool_mib=64))


@pytest.fixture
def runs(monkeypatch) -> list[tuple[int, int, RunShapes, int]]:
    """(the run's identity, its history buffer's address, its shapes, the decode's sentences) of every run
    started."""
    started: list[tuple[int, int, RunShapes, int]] = []
    start = DeviceBeamRun.start

    def recorded(self, books, *args, **kwargs):
        started.append((id(self), self.sets[0]["history"].data_ptr(), self.shapes, len(books.steps)))
        return start(self, books, *args, **kwargs)

    monkeypatch.setattr(DeviceBeamRun, "start", recorded)
    return started


def test_lengths_round_up_to_powers_of_two_and_one_and_a_half_times_them():
    assert [bucket(n) for n in (1, 16, 17, 24, 25, 33, 49, 65, 97, 129, 200, 300)] == [
        16, 16, 24, 24, 32, 48, 64, 96, 128, 192, 256, 384]
    assert all(n <= bucket(n) <= max(16, 1.5 * n) for n in range(1, 2000))


def test_only_the_source_and_capacity_axes_are_rounded():
    assert bucketed_shape([8, 4, 21, 8], ["batch", 4, "capacity", 8]) == (8, 4, 24, 8)
    assert bucketed_shape([8, 13], ["batch", "src_len"]) == (8, 16)
    assert bucketed_shape([8, 32], ["batch", 32]) == (8, 32)
    assert bucketed_shape([8, 13], None) == (8, 13)  # a graph that does not name its dimensions: as it is


def test_graphs_are_enabled_for_the_cuda_provider_only():
    providers = [("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"]
    assert graph_options(providers) == [("CUDAExecutionProvider", {"device_id": "0", "enable_cuda_graph": "1"}),
                                        ("CPUExecutionProvider", {})]


class _Kept:
    """Something the pool keeps: its size, and whether it was let go."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.dropped = nbytes, False

    def drop(self) -> None:
        self.dropped = True


def test_the_pool_hands_runs_out_once_and_lets_the_least_recently_used_go():
    pool = RunPool(budget=100)
    a, b, c = _Kept(40), _Kept(40), _Kept(40)
    pool.keep("a", a)
    pool.keep("b", b)
    assert pool.take("a") is a and pool.take("a") is None  # handed out: not kept while in use
    pool.keep("a", a)  # now the most recently used
    pool.keep("c", c)  # 120 bytes: "b" goes
    assert b.dropped and not a.dropped and not c.dropped and pool.held == 80 and len(pool) == 2
    big = _Kept(500)
    pool.keep("big", big)  # larger than the budget alone: it goes, and everything older with it
    assert big.dropped and a.dropped and c.dropped and pool.held == 0 and len(pool) == 0
    unbounded = RunPool(budget=0)
    run = _Kept(1)
    unbounded.keep("x", run)
    assert run.dropped and unbounded.take("x") is None  # no budget: nothing is kept


def test_graph_ids_stop_where_the_runtime_cannot_release_graphs(monkeypatch, caplog):
    monkeypatch.setattr(cuda_graphs, "MAX_CAPTURED_RUNS", 2)
    capture = GraphCapture("")
    assert capture.ids(can_release=False) == (1, 2) and capture.ids(can_release=False) == (3, 4)
    with caplog.at_level(logging.WARNING, logger="nmt.server"):
        assert capture.ids(can_release=False) is None and capture.ids(can_release=False) is None
    assert sum("cannot release a graph" in r.getMessage() for r in caplog.records) == 1
    assert capture.ids(can_release=True) == (5, 6)  # never reused: a graph id names one run's buffers
    assert GraphCapture("no CUDA").ids(can_release=True) is None


@pytest.mark.parametrize("seed", range(6))
def test_kept_runs_in_buckets_find_the_general_searchs_hypotheses(engines, runs, seed):
    """Padded to their buckets (source, cache and history) and started again from the pool, runs decode as the
    host's search."""
    host, device = engines
    src, specs = batch(host, seed)
    for _ in range(2):
        assert_same(decode(host, src, specs, plain=False), decode(device, src, specs, plain=True))
    assert runs
    for _, _, shapes, sentences in runs:
        assert shapes.length == bucket(shapes.length) and shapes.sentences == bucket(sentences, floor=1)
        source = {name: shape for name, shape, _ in shapes.static}["src_mask"][1]
        assert source == bucket(source)


@pytest.mark.parametrize("seed", range(2))
def test_sentences_joining_a_running_decode_in_kept_runs(engines, runs, seed):
    """Sentences join between runs (continuous batching's admissions): each join starts a run of another bucket,
    or the same one again, and the hypotheses stay the host's."""
    host, device = engines
    if not host.model.capabilities.per_row_positions:
        pytest.skip("this model decodes all rows at one step: sentences join only an empty decode")
    src, specs = batch(host, 300 + seed)
    src, specs = np.concatenate([src, src]), specs + specs
    assert_same(decode(host, src, specs, plain=False, join_at=2), decode(device, src, specs, plain=True, join_at=2))
    assert len({shapes for _, _, shapes, _ in runs}) >= 1


def test_a_bucket_reuses_its_run_and_its_buffers(engines, runs):
    """Sentences of other lengths in the same bucket start the kept run again: the same buffers, at the same
    addresses, which is what a captured graph replays."""
    host, device = engines
    options = DecodingOptions(beam_size=4, num_hypotheses=2)
    calls = []
    for texts in (["one two three", "four five"], ["six seven eight nine", "ten one"]):
        assert [[h.tokens for h in t.hypotheses] for t in device.translate(texts, options)] == [
            [h.tokens for h in t.hypotheses] for t in host.translate(texts, options)]
        calls.append({shapes: (run, address) for run, address, shapes, _ in runs})
        runs.clear()
    shared = calls[0].keys() & calls[1].keys()
    assert shared and all(calls[0][shapes] == calls[1][shapes] for shapes in shared)


def test_sentences_padded_to_the_bucket_are_never_done_and_never_come_back(engines, runs):
    """Five sentences run as six: the sixth copies the first one's rows, is never done, and its rows and books stay
    in the run."""
    host, device = engines
    texts = ["one two three", "four five", "six", "seven eight nine ten", "one three five seven nine"]
    options = DecodingOptions(beam_size=3, num_hypotheses=3, length_penalty=1.0)
    for want, got in zip(host.translate(texts, options), device.translate(texts, options), strict=True):
        assert [h.tokens for h in got.hypotheses] == [h.tokens for h in want.hypotheses]
        assert [h.score for h in got.hypotheses] == pytest.approx([h.score for h in want.hypotheses], abs=1e-5)
    assert (6, 5) in {(shapes.sentences, sentences) for _, _, shapes, sentences in runs}


def test_where_nothing_can_capture_runs_go_on_and_say_so_once(tiny_models, engines, caplog):
    host, _ = engines
    with caplog.at_level(logging.WARNING, logger="nmt.server"):
        device = Engine.load(tiny_models[host.manifest.architecture], provider="cpu", intra_op_threads=1,
                             device_state=True, device_search=True, cuda_graphs=True)
        assert not device.model.capture.enabled
        rng = random.Random(5)
        for _ in range(3):
            texts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 9))) for _ in range(3)]
            options = DecodingOptions(beam_size=3, num_hypotheses=1)
            assert [t.hypotheses[0].tokens for t in device.translate(texts, options)] == [
                t.hypotheses[0].tokens for t in host.translate(texts, options)]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CUDA graphs")]
    assert len(said) == 1 and NOT_CAPTURED in said[0]


class _CaptureFailsOnce:
    """A step graph's session whose first run naming a CUDA graph fails as a spoiled capture does, then runs as the
    session it wraps (which ignores graph ids on the CPU)."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session, self.graph_runs, self.failed = session, 0, False

    def run_with_iobinding(self, binding: ort.IOBinding, options: ort.RunOptions | None = None) -> None:
        if options is not None and options.get_run_config_entry("gpu_graph_id") != str(cuda_graphs.SKIP):
            self.graph_runs += 1
            if not self.failed:
                self.failed = True
                raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")
        self.session.run_with_iobinding(binding, options)

    def __getattr__(self, name: str):
        return getattr(self.session, name)


def test_runs_name_their_graphs_and_a_failed_capture_falls_back_once(tiny_models, engines, caplog):
    """The graph path as CUDA takes it, on the CPU's sessions: each kept run names graph ids of its own; a capture
    that fails sends its bucket to ordinary runs, said once, the step run again and the results the host's."""
    host, _ = engines
    engine = Engine.load(tiny_models[host.manifest.architecture], provider="cpu", intra_op_threads=1,
                         device_state=True, device_search=True, cuda_graphs=True)
    model = engine.model
    step = _CaptureFailsOnce(model.sessions["decoder"])
    model.sessions["decoder_graphs"], model.capture.reason = step, ""  # as a CUDA version's would be
    options = DecodingOptions(beam_size=4, num_hypotheses=2)
    texts = [["one two three", "four five"], ["six seven eight", "nine ten one two"], ["three four five six"]]
    with caplog.at_level(logging.WARNING, logger="nmt.server"):
        for batch_texts in texts * 2:
            assert [[h.tokens for h in t.hypotheses] for t in engine.translate(batch_texts, options)] == [
                [h.tokens for h in t.hypotheses] for t in host.translate(batch_texts, options)]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CUDA graphs")]
    assert len(said) == 1 and "a capture failed (CUDA failure 900" in said[0]
    assert model.capture.failures == 1 and model.capture.captured_runs >= 2 and step.graph_runs > 1
    kept = [run for runs in model.pool._runs.values() for run in runs]
    ids = [graph_id for run in kept for graph_id in run.graph_ids]
    assert kept and len(ids) == len(set(ids)) == 2 * len(kept)  # two each, none shared
    assert sum(not run.capturing for run in kept) == 1  # the bucket whose capture failed runs ordinarily


def test_greedy_runs_in_buckets_decode_as_the_host_and_fall_back_once(tiny_models, engines, monkeypatch, caplog):
    """Arg-max steps in kept runs (:class:`server.engine.device_runs.DeviceGreedyRun`: ids and positions written
    into device buffers, best tokens read back, padded rows never read): the host's tokens and scores, a bucket
    started again on the same buffers, and a capture failing once falling back, said once."""
    host, _ = engines
    engine = Engine.load(tiny_models[host.manifest.architecture], provider="cpu", intra_op_threads=1,
                         device_state=True, device_search=True, cuda_graphs=True)
    model = engine.model
    if not model.capabilities.greedy_steps:
        pytest.skip("this model has no in-place cache: its greedy steps are the general step's")
    step = _CaptureFailsOnce(model.sessions["decoder"])
    model.sessions["decoder_graphs"], model.capture.reason = step, ""  # as a CUDA version's would be
    started: list[tuple[int, int]] = []
    start = DeviceGreedyRun.start

    def recorded(self, tokens, *args, **kwargs):
        started.append((id(self), self._feeds.data_ptr()))
        return start(self, tokens, *args, **kwargs)

    monkeypatch.setattr(DeviceGreedyRun, "start", recorded)
    rng = random.Random(11)
    options = DecodingOptions(beam_size=1)
    with caplog.at_level(logging.WARNING, logger="nmt.server"):
        for size in (1, 3, 5, 3, 1):
            texts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 9))) for _ in range(size)]
            for want, got in zip(host.translate(texts, options), engine.translate(texts, options), strict=True):
                assert got.hypotheses[0].tokens == want.hypotheses[0].tokens
                assert got.hypotheses[0].score == pytest.approx(want.hypotheses[0].score, abs=1e-5)
    assert started and len(started) > len(set(started)), "a kept greedy run started again"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CUDA graphs")]
    assert len(said) == 1 and "a capture failed" in said[0] and model.capture.failures == 1
    assert step.graph_runs > 1


def test_held_greedy_runs_in_blocks_end_rows_at_their_limits(engines, tiny_models):
    """A held run of arg-max steps in blocks (:class:`DeviceGreedyRun`, as a static batch on a device runs it): rows
    whose sentence reaches its output limit take EOS there and run on at their last position until every row has
    ended, in one ``step()`` call; each sentence gets the host's general search's tokens and scores."""
    host, _ = engines
    engine = Engine.load(tiny_models[host.manifest.architecture], provider="cpu", intra_op_threads=1,
                         device_state=True, cuda_graphs=True)
    if not engine.model.capabilities.greedy_steps:
        pytest.skip("this model has no in-place cache: its greedy steps are the general step's")
    rng = random.Random(5)
    requests = [SentenceRequest(host.tokenize(" ".join(rng.choices(WORDS, k=rng.randint(2, 9)))),
                                DecodingOptions(max_length=rng.choice([2, 3, 5, 9, 64]))) for _ in range(7)]
    encoded, sentences, _ = engine.encode(requests)
    held = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id, hold_ended=True)
    held.admit(encoded, sentences, range(len(requests)))
    results, calls = {}, 0
    while held.rows:
        calls += 1
        results.update(held.step(until_leave=True))
    assert calls == 1
    limited = 0
    for i, expected in enumerate(host.search(requests)):
        [ours], [theirs] = results[i].hypotheses, expected.hypotheses
        assert ours.tokens == theirs.tokens
        assert ours.score == pytest.approx(theirs.score, abs=1e-5)
        limited += len(ours.tokens) == sentences[i].limit()
    assert 0 < limited < len(requests), "some sentences ended at their limits, others by EOS"


def test_greedy_blocks_read_in_part_continue_from_the_last_step_read(engines):
    """A block of arg-max steps launched together and read step by step: the host's steps' tokens and scores,
    whether a block is read whole or only in part; an unread rest is undone (the next block starts after the
    last step read), and the state handed back stands there."""
    host, device = engines
    model = device.model
    if not model.capabilities.greedy_steps:
        pytest.skip("this model has no in-place cache: its greedy steps are the general step's")
    src, _ = batch(host, seed=3)
    rows = len(src)
    tokens, positions = np.full(rows, host.start_id), np.zeros(rows, dtype=np.int64)
    expected = []
    encoded = host.model.encode(src)
    with host.model.greedy_steps(tokens, {n: encoded[n] for n in host.model.static_names},
                                 {n: encoded[n] for n in host.model.state_names}, positions, 30) as run:
        for _ in range(30):
            run.run()
            expected.append(run.read())
    encoded = model.encode(src)
    got, reads = [], [3, 8, 1, 8, 8, 2]  # steps read of each block (a block runs up to 8)
    with model.greedy_steps(tokens, {n: encoded[n] for n in model.static_names},
                            {n: encoded[n] for n in model.state_names}, positions, 30) as run:
        assert isinstance(run, DeviceGreedyRun)
        for wanted in reads:
            ran = run.run_block(30 - len(got))
            assert ran == min(8, 30 - len(got))
            got += [run.read(step) for step in range(min(wanted, ran))]
        state = run.state()
    assert len(got) == sum(reads) == 30
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    np.testing.assert_allclose([scores for _, scores in got], [scores for _, scores in expected], atol=1e-6)
    np.testing.assert_array_equal(state[model.positions], np.full(rows, 30))


def test_a_slot_binds_its_part_of_the_buffer_and_nothing_else() -> None:
    """A :class:`cuda_graphs.Slot` binds one slot of a [slots, ...] buffer under the shape it is given: a run reads
    and writes that slot only, and a slot of another size or past the buffer is refused."""
    import onnx

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.INT64, [3, 1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [3])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Squeeze", ["x", "axes"], ["y"])], "g", [x], [y],
                                   [onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    buffer = ort.OrtValue.ortvalue_from_numpy(np.arange(12, dtype=np.int64).reshape(4, 3))
    binding = session.io_binding()
    cuda_graphs.bind(binding, "x", cuda_graphs.Slot(buffer, 1, (3, 1)))
    cuda_graphs.bind(binding, "y", cuda_graphs.Slot(buffer, 3, (3,)), output=True)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(buffer.numpy(), [[0, 1, 2], [3, 4, 5], [6, 7, 8], [3, 4, 5]])
    for bad in (cuda_graphs.Slot(buffer, 1, (4,)), cuda_graphs.Slot(buffer, 4, (3,))):
        with pytest.raises(ValueError, match="slot"):
            cuda_graphs.bind(session.io_binding(), "x", bad)


def test_the_pool_holds_its_runs_and_nothing_more(engines):
    """Kept runs stay within the budget, and repeated decodes of one shape allocate nothing new."""
    _, device = engines

    options = DecodingOptions(beam_size=4, num_hypotheses=2)
    device.translate(["one two three", "four five"], options)
    before = live_ortvalues()
    for _ in range(3):
        device.translate(["one two three", "four five"], options)
    assert live_ortvalues() == before
    assert 0 < device.model.pool.held <= device.model.pool.budget


def test_without_cuda_graphs_runs_are_exact_and_not_kept(tiny_models):
    engine = Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1, device_state=True,
                         device_search=True)
    engine.translate(["one two three"], DecodingOptions(beam_size=4))
    assert len(engine.model.pool) == 0 and engine.model.pool.reused == 0


def test_the_servers_flags_reach_the_engine_and_its_metrics_show_the_kept_runs(repository):
    """``--cuda-graphs`` and ``--cuda-graph-pool-mib`` (and their environment variables) reach every version's engine,
    which keeps its beam runs; ``nmt_cuda_graph_*`` follow them (on the CPU nothing captures: no runs given graph
    ids, no failures). The flag also moves beam search's selection onto the device, which the graphs capture."""
    from server.config import ServerConfig
    from server.core.repository import default_engine_loader
    from server.protos import pb2
    from tests.harness import ServerHarness

    config = ServerConfig.from_env({"NMT_CUDA_GRAPHS": "true", "NMT_CUDA_GRAPH_POOL_MIB": "32"})
    assert config.cuda_graphs and config.cuda_graph_pool_mib == 32
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="", model_repository=str(repository),
                          cuda_graphs=True, cuda_graph_pool_mib=32, intra_op_threads=1, cache_mb=0)
    harness = ServerHarness(config, lambda path, **settings: default_engine_loader(path, device_state=True, **settings))
    try:
        options = pb2.DecodingOptions(beam_size=4, num_hypotheses=2, max_length=30)
        for _ in range(2):
            reply = harness.stub.Translate(pb2.TranslateRequest(texts=["three four five"], options=options), timeout=30)
            assert len(reply.translations[0].hypotheses) == 2
        model = harness.engine().model
        assert model.capabilities.device_beam and model.pool.budget == 32 << 20 and model.pool.reused >= 1
        version = harness.model_version("", "")
        labels = {"model": version.name, "version": version.version}
        assert harness.metric("nmt_cuda_graph_run_reuses_total", labels) == model.pool.reused
        assert harness.metric("nmt_cuda_graph_pool_bytes", labels) == model.pool.held > 0
        assert harness.metric("nmt_cuda_graph_runs_total", labels) == harness.metric(
            "nmt_cuda_graph_capture_failures_total", labels) == 0
    finally:
        harness.close()


def test_the_state_a_run_hands_back_is_not_its_own(engines, monkeypatch):
    """A run copies the decode's state in at its start and out at its end: what the decode holds afterwards is
    never a kept run's buffer (the next run of the bucket writes those)."""
    _, device = engines
    handed: list[tuple[set[int], set[int]]] = []
    state, output = DeviceBeamRun.state, DeviceBeamRun.output

    def own(run: DeviceBeamRun) -> set[int]:
        return {value.data_ptr() for values in (*run.states, run.static, *run.sets) for value in values.values()}

    def checked_state(self):
        values = state(self)
        handed.append((own(self), {v.data_ptr() for v in values.values() if isinstance(v, ort.OrtValue)}))
        return values

    def checked_output(self):
        *heads, values = output(self)
        handed.append((own(self), {v.data_ptr() for v in values.values() if isinstance(v, ort.OrtValue)}))
        return (*heads, values)

    monkeypatch.setattr(DeviceBeamRun, "state", checked_state)
    monkeypatch.setattr(DeviceBeamRun, "output", checked_output)
    device.translate(["one two three", "four five six seven"], DecodingOptions(beam_size=4, num_hypotheses=2))
    assert handed and all(values and not mine & values for mine, values in handed)
