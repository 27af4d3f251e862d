"""The running decode on exported tiny models: sentences that join and leave between steps get exactly
what they get decoded alone (tokens, scores, attention), whatever their companions and arrival step."""

from __future__ import annotations

import random

import numpy as np
import pytest

from server.controls import Controls
from server.engine.decode import RunningDecode
from server.engine.engine import Engine
from server.engine.row_layout import fill_holes, lay_out
from server.engine.step_model import Capabilities, concat_rows
from server.types import DecodingOptions, SentenceRequest, TargetPrefix

CONTINUOUS = ["bahdanau", "transformer"]  # both step models take per-row positions
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module")
def engines(tiny_models):
    return {arch: Engine.load(path, provider="cpu", intra_op_threads=1) for arch, path in tiny_models.items()}


def request(engine: Engine, text: str, **options) -> SentenceRequest:
    return SentenceRequest(engine.tokenize(text), DecodingOptions(**options), text=text)


def alone(engine: Engine, r: SentenceRequest):
    [result] = engine.search([r])
    return result


def run_continuous(engine: Engine, arrivals: list[tuple[int, SentenceRequest]], max_rows: int = 10**9):
    """Decode ``arrivals`` (step, request) in one running decode, each admitted at its step (or later, once
    its beam fits in ``max_rows``); returns each request's result, the step it finished at and the most rows
    used."""
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    results, finished_at, most_rows, step = {}, {}, 0, 0
    while pending or decode.rows:
        ready, reserved = [], decode.reserved_rows
        while pending and arrivals[pending[0]][0] <= step and (
                reserved + arrivals[pending[0]][1].options.beam_size <= max_rows):
            reserved += arrivals[pending[0]][1].options.beam_size
            ready.append(pending.pop(0))
        if ready:
            encoded, sentences, _ = engine.encode([arrivals[i][1] for i in ready])
            decode.admit(encoded, sentences, ready)
        most_rows = max(most_rows, decode.rows)
        if decode.rows:
            for index, result in decode.step():
                results[index], finished_at[index] = result, step
        step += 1
    return [results[i] for i in range(len(arrivals))], finished_at, most_rows


def assert_same(ours, reference) -> None:
    assert [h.tokens for h in ours.hypotheses] == [h.tokens for h in reference.hypotheses]
    for a, b in zip(ours.hypotheses, reference.hypotheses, strict=True):
        assert a.score == pytest.approx(b.score, abs=1e-5)
        np.testing.assert_allclose(a.token_scores, b.token_scores, atol=1e-5)
        if b.attention is None:
            assert a.attention is None
        else:
            np.testing.assert_allclose(a.attention, b.attention, atol=1e-5)


@pytest.mark.parametrize("arch", CONTINUOUS)
@pytest.mark.parametrize("beam", [1, 4])
def test_short_sentence_joining_a_long_one_finishes_first_with_its_own_output(arch, beam, engines):
    engine = engines[arch]
    # the lengths are set, not left to the tiny model (whose outputs differ from host to host)
    long = request(engine, " ".join(WORDS * 3), beam_size=beam, num_hypotheses=beam, return_attention=True,
                   controls=Controls(min_length=16))
    short = request(engine, "two", beam_size=beam, num_hypotheses=beam, return_attention=True, max_length=4)
    results, finished_at, _ = run_continuous(engine, [(0, long), (3, short)])
    assert finished_at[1] < finished_at[0]
    assert_same(results[0], alone(engine, long))
    assert_same(results[1], alone(engine, short))


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_random_mix_of_arrivals_equals_one_by_one(arch, engines):
    engine = engines[arch]
    rng = random.Random(7)
    arrivals = []
    for i in range(24):
        beam = rng.choice([1, 1, 2, 4])
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        controls = Controls(min_length=2) if i % 7 == 3 else Controls()
        r = request(engine, text, beam_size=beam, num_hypotheses=rng.randint(1, beam),
                    max_length=rng.choice([3, 8, 64]), length_penalty=rng.choice([0.0, 0.6, 1.0, 2.0]),
                    return_attention=rng.random() < 0.4, controls=controls, patience=rng.choice([1.0, 1.5]))
        if i % 5 == 2:
            r.target_prefix = TargetPrefix(tuple(engine.tokenize(rng.choice(WORDS))))
        arrivals.append((rng.randint(0, 30), r))
    results, _, _ = run_continuous(engine, arrivals)
    for (_, r), result in zip(arrivals, results, strict=True):
        assert_same(result, alone(engine, r))
        for hypothesis in result.hypotheses:  # attention only where asked, over the sentence's own source
            if r.options.return_attention:
                assert hypothesis.attention.shape == (len(hypothesis.tokens), len(r.source_ids) + 1)
            else:
                assert hypothesis.attention is None


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_rows_are_freed_at_once_and_reused(arch, engines):
    engine = engines[arch]
    texts = [" ".join(WORDS[: 1 + i % 9]) for i in range(12)]
    arrivals = [(0, request(engine, text, beam_size=2, num_hypotheses=1)) for text in texts]
    results, finished_at, most_rows = run_continuous(engine, arrivals, max_rows=4)
    assert most_rows == 4
    assert len(set(finished_at.values())) > 1
    for (_, r), result in zip(arrivals, results, strict=True):
        assert_same(result, alone(engine, r))


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_cancelled_sentence_leaves_between_steps(arch, engines):
    engine = engines[arch]
    flag = {"cancel": False}
    long = request(engine, " ".join(WORDS * 3), beam_size=4)
    doomed = SentenceRequest(engine.tokenize(" ".join(WORDS * 2)), DecodingOptions(beam_size=4),
                             is_cancelled=lambda: flag["cancel"])
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    encoded, sentences, _ = engine.encode([long, doomed])
    decode.admit(encoded, sentences, ["long", "doomed"])
    for _ in range(3):
        assert decode.step() == []
    assert decode.rows == 8
    flag["cancel"] = True
    assert decode.step() == [("doomed", None)]
    assert decode.rows == 4 and decode.tags() == ["long"]
    while decode.rows:
        left = decode.step()
    assert left[0][0] == "long"
    assert_same(left[0][1], alone(engine, long))


def test_bahdanau_treats_zero_padding_as_padding(engines):
    """A row's step outputs do not depend on how far its encoder outputs were zero-padded to join others."""
    model = engines["bahdanau"].model
    short, long = (np.array([ids + [engines["bahdanau"].eos_id]]) for ids in ([5, 6], [5, 6, 7, 8, 9, 10, 11]))
    one, two = model.encode(short), model.encode(long)
    joined = concat_rows(two, one)
    assert joined["src_mask"].shape == (2, 8) and joined["src_mask"][1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    tokens = np.full(1, engines["bahdanau"].start_id, dtype=np.int64)
    static_names, state_names = model.static_names, model.state_names
    ref = model.step(tokens, {n: one[n] for n in static_names}, {n: one[n] for n in state_names}, True, 4, full=True)
    both = model.step(np.repeat(tokens, 2), {n: joined[n] for n in static_names}, {n: joined[n] for n in state_names},
                      True, 4, full=True)
    # float rounding apart (a kernel may sum in another order for two rows than for one)
    np.testing.assert_allclose(both.log_probs[1], ref.log_probs[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(both.attention[1, :3], ref.attention[0], rtol=1e-6, atol=1e-6)
    assert both.attention[1, 3:].max() == 0.0
    for name in state_names:
        np.testing.assert_allclose(both.state[name][1], ref.state[name][0], atol=1e-6)


def test_device_concat_rows_matches_numpy(tiny_models, engines):
    bound = Engine.load(tiny_models["bahdanau"], provider="cpu", intra_op_threads=1, device_state=True)
    src_a, src_b = np.array([[5, 6, 3]]), np.array([[7, 8, 9, 10, 3], [4, 3, 0, 0, 0]])
    on_device = bound.model.concat_rows(bound.model.encode(src_a), bound.model.encode(src_b))
    on_host = concat_rows(engines["bahdanau"].model.encode(src_a), engines["bahdanau"].model.encode(src_b))
    for name, value in on_host.items():
        np.testing.assert_allclose(on_device[name].numpy(), value, atol=1e-6)
    r = request(bound, "one two three")
    late = request(bound, "four five", beam_size=2, return_attention=True)
    results, _, _ = run_continuous(bound, [(0, r), (2, late)])
    assert_same(results[0], alone(engines["bahdanau"], r))
    assert_same(results[1], alone(engines["bahdanau"], late))


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_the_last_sentence_takes_the_rows_of_one_that_left(arch, engines):
    engine = engines[arch]
    texts = ["one two three", "four", "five six", "seven eight nine"]
    reqs = [request(engine, text, beam_size=2, num_hypotheses=2, max_length=3 if i == 1 else 64,
                    controls=Controls() if i == 1 else Controls(min_length=6)) for i, text in enumerate(texts)]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    encoded, sentences, _ = engine.encode(reqs)
    given = {name: encoded[name].copy() for name in engine.model.static_names}
    decode.admit(encoded, sentences, [0, 1, 2, 3])
    left = []
    while not left:
        static = dict(decode._static)
        left = decode.step()
    assert [tag for tag, _ in left] == [1]
    assert decode.tags() == [0, 3, 2]  # sentence 3 moved into sentence 1's rows; 0 and 2 kept theirs
    # the decode's own static inputs (selected at the beams' first expansion) moved rows in their memory
    assert all(np.shares_memory(decode._static[name], static[name]) for name in engine.model.static_names)
    results = dict(left)
    while decode.rows:
        results.update(decode.step())
    for i, r in enumerate(reqs):
        assert_same(results[i], alone(engine, r))
    for name, value in given.items():  # the caller's static arrays were never written
        np.testing.assert_array_equal(encoded[name], value)


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_static_inputs_moved_within_the_same_arrays_reach_the_model(arch, engines):
    """A sentence leaves as two join-ups expand, the row count stays: the static inputs move within the
    very arrays the step's I/O binding holds (not bound again), and every output still equals its lone decode."""
    engine = engines[arch]
    first = [request(engine, "one two three", beam_size=2, num_hypotheses=2, max_length=3,
                     controls=Controls(min_length=2)),  # leaves at its third step, not before
             request(engine, "four five", beam_size=2, num_hypotheses=2, controls=Controls(min_length=8))]
    later = [request(engine, text, beam_size=2, num_hypotheses=2, controls=Controls(min_length=4))
             for text in ("six seven eight nine", "ten")]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    decode.admit(*engine.encode(first)[:2], [0, 1])
    results = {}
    for _ in range(2):
        results.update(decode.step())
    decode.admit(*engine.encode(later)[:2], [2, 3])
    assert decode.rows == 6 and not results
    static = dict(decode._static)
    results.update(decode.step())
    assert list(results) == [0] and decode.rows == 6 and decode.tags() == [3, 1, 2]
    assert any(decode._static[name] is static[name] for name in engine.model.static_names)
    while decode.rows:
        results.update(decode.step())
    for i, r in enumerate(first + later):
        assert_same(results[i], alone(engine, r))


def test_layout_margins_count_steps_from_the_step_it_was_worked_out_for():
    """The margins a step compares its age with: out of room at the first row's ``limit - 1``, the whole
    distribution while any sentence's ``full_until`` is ahead, a forced prefix while any is decoding one."""
    from types import SimpleNamespace

    def sentence(step, limit, full_until=0, forced_length=0, penalised=False):
        return SimpleNamespace(step=step, joined_at=0, beam=1, limit=limit, attention=False,
                               full_until=full_until, forced_length=forced_length, penalised=penalised, terms=None,
                               rng=None, spec=SimpleNamespace(on_stable=None))

    layout = lay_out([sentence(5, 8, forced_length=7), sentence(1, 30, full_until=4)], np.arange(2), True)
    assert (layout.room, layout.full_for, layout.given_for, layout.penalised) == (2, 3, 2, False)
    layout = lay_out([sentence(3, 10, full_until=float("inf"), penalised=True), sentence(0, 4)], np.arange(2), True)
    assert (layout.room, layout.full_for, layout.given_for, layout.penalised) == (3, float("inf"), 0, True)


def test_fill_holes_moves_only_a_last_sentence_of_the_hole_s_width():
    # sentences 0..4 held 4, 4, 1, 4, 1 rows (2 and 4 joined this step); 1 and 3 leave
    widths = np.array([4, 4, 1, 4, 1])
    assert fill_holes([0, 2, 4], widths, [4, 4, 4], 5) == [0, 4, 2]  # 4 (now 4 rows) fills 1's 4 rows
    assert fill_holes([0, 2, 4], widths, [4, 4, 2], 5) == [0, 2, 4]  # 4 needs 2 rows: nothing moves
    assert fill_holes([0, 1, 2, 3], np.array([1, 1, 1, 1, 1]), [1, 1, 1, 1], 5) == [0, 1, 2, 3]  # the last left
    assert fill_holes([2, 3, 4], np.ones(5), [1, 1, 1], 5) == [4, 3, 2]


class SharedPosition:
    """A step model that decodes all rows at one position (as a Transformer exported before the in-place cache)."""

    capabilities = Capabilities()  # no per-row positions, no plain runs

    def __init__(self, model) -> None:
        self.model, self.static_names, self.state_names = model, model.static_names, model.state_names
        self.static_src_axes = model.static_src_axes

    def step(self, *args, **kwargs):
        assert "positions" not in kwargs
        return self.model.step(*args, **kwargs)

    def release(self):
        pass  # holds nothing between decodes

    def select_rows(self, tensors, rows, in_place=False):
        return self.model.select_rows(tensors, rows, in_place)


def test_a_model_without_per_row_positions_admits_only_at_the_first_step(engines):
    engine = engines["bahdanau"]
    decode = RunningDecode(SharedPosition(engine.model), start_id=engine.start_id, eos_id=engine.eos_id)
    encoded, sentences, _ = engine.encode([request(engine, "one two")])
    decode.admit(encoded, sentences, [0])
    decode.step()
    with pytest.raises(ValueError, match="at one step"):
        decode.admit(*engine.encode([request(engine, "four")])[:2], [1])


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_padding_is_cut_when_the_widest_sentence_leaves(arch, engines):
    engine = engines[arch]
    wide = request(engine, " ".join(WORDS * 2), max_length=3)
    narrow = request(engine, "one two", controls=Controls(min_length=8))
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    encoded, sentences, _ = engine.encode([wide, narrow])
    decode.admit(encoded, sentences, ["wide", "narrow"])
    left = []
    while not left:
        left = decode.step()
    assert left[0][0] == "wide" and decode.tags() == ["narrow"]
    width = len(narrow.source_ids) + 1
    assert all(value.shape[axis] == width for name, axis in engine.model.static_src_axes.items()
               for value in [decode._static[name]])
    while decode.rows:
        left = decode.step()
    assert_same(left[0][1], alone(engine, narrow))


@pytest.mark.parametrize("arch", CONTINUOUS)
def test_given_tokens_in_a_running_decode_equal_the_static_path(arch, engines):
    """Through the continuous batcher's worker side (RunningBatch): sentences with a target prefix (one
    with a repetition penalty, one ending inside a word) join a decode already running after one forced
    pass over their prefix; a whole target (Score) and alternatives run apart through the forced pass.
    Each gets what the static path (forced pass, then the search) gives it alone."""
    from server.core.continuous import RunningBatch

    engine = engines[arch]
    own = engine.search([request(engine, "three four five", beam_size=1)])[0].hypotheses[0].tokens
    long = [request(engine, " ".join(WORDS * 2), beam_size=beam) for beam in (1, 4)]
    joining = [
        request(engine, "six seven eight", beam_size=4, num_hypotheses=2),
        request(engine, "six seven eight", beam_size=1, controls=Controls(repetition_penalty=1.5)),
        request(engine, "nine ten", beam_size=4, return_attention=True),
        request(engine, "three four five", beam_size=1, return_attention=True),  # Score: the whole target
        request(engine, "two three", beam_size=4, num_hypotheses=3, return_alternatives=True),
        request(engine, "one two", beam_size=1),
    ]
    prefix = TargetPrefix(tuple(engine.tokenize("six seven")))
    for r in joining[:3]:
        r.target_prefix = prefix
    joining[3].target_prefix = TargetPrefix(tuple(own))
    joining[4].target_prefix = TargetPrefix(tuple(engine.tokenize("two")))
    joining[5].target_prefix = engine.target_prefix("one tw")
    assert joining[5].target_prefix.completion is not None

    batch, delivered = RunningBatch(engine), {}
    requests = dict(zip(["long-1", "long-4", *[f"joining-{i}" for i in range(len(joining))]], [*long, *joining],
                        strict=True))

    def deliver(finished):
        delivered.update({tag: engine.to_translation(requests[tag], result) for tag, result in finished})

    batch.advance(long, ["long-1", "long-4"], lambda: batch.steps >= 3, deliver)
    assert batch.decode.rows > 0 and not delivered  # running when the others join
    tags = [f"joining-{i}" for i in range(len(joining))]
    batch.advance(joining, tags, lambda: False, deliver)
    assert batch.decode.rows == 0
    for tag, r in zip(["long-1", "long-4", *tags], [*long, *joining], strict=True):
        [expected] = engine.translate_batch([r]).translations
        got = delivered[tag]
        assert [h.token_ids for h in got.hypotheses] == [h.token_ids for h in expected.hypotheses]
        for a, b in zip(got.hypotheses, expected.hypotheses, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)
            np.testing.assert_allclose(a.token_scores, b.token_scores, atol=1e-5)
            assert (a.attention is None) == (b.attention is None)
    assert 1 <= len(delivered["joining-4"].hypotheses) <= 3  # one per next word above the floor
    assert delivered["joining-3"].hypotheses[0].token_ids == own[:-1]  # the target, EOS dropped


@pytest.mark.parametrize("arch", CONTINUOUS)
@pytest.mark.parametrize("beam", [1, 4])
def test_a_forced_pass_state_joins_a_running_decode(arch, beam, engines):
    """A sentence whose prefix ran as one forced pass (the Transformer's decoder_forced: its K/V copied
    into the in-place buffers, every row's position set) joins a decode already running through
    ``admit(resume=)`` (Resume without a first step: the search feeds the prefix's last piece) and gets
    what the static path gives it alone; so does the sentence it joined."""
    from server.engine.step_model import Resume

    engine = engines[arch]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    running = request(engine, " ".join(WORDS * 2), beam_size=4, num_hypotheses=2, return_attention=True)
    encoded, sentences, _ = engine.encode([running])
    decode.admit(encoded, sentences, ["running"])
    results = {}
    for _ in range(3):
        results.update(decode.step())
    joining = request(engine, "six seven eight", beam_size=beam, num_hypotheses=beam, return_attention=True)
    joining.target_prefix = TargetPrefix(tuple(engine.tokenize("six seven")))
    encoded, sentences, _ = engine.encode([joining])
    prefix = np.array([joining.target_prefix.ids], dtype=np.int64)
    inputs = np.concatenate([[[engine.start_id]], prefix[:, :-1]], 1)
    model = engine.model
    out = model.force(inputs, prefix, {name: encoded[name] for name in model.static_names},
                      {name: encoded[name] for name in model.state_names}, True)
    decode.admit(encoded, sentences, ["joining"], Resume(prefix, out.target_log_probs, out.attention, out.state))
    while decode.rows:
        results.update(decode.step())
    for tag, r in (("running", running), ("joining", joining)):
        assert_same(results[tag], alone(engine, r))


@pytest.mark.parametrize("beam", [1, 2])
def test_the_batching_benchmarks_bare_loop_runs_both_modes(tiny_models, beam) -> None:
    """``benchmarks/batching.py``'s ceiling (the bare engine under callers that never wait) on the tiny
    Transformer: both modes decode every sentence, the running decode within its rows, and the decoder
    and encoder calls are counted (greedy's plain steps too)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "batching.py"
    spec = importlib.util.spec_from_file_location("batching_benchmark", path)
    batching = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(batching)
    version = tiny_models["transformer"]
    texts = batching.workload(12, 0, 0.25, 2)
    result = batching.bare_closed_loop(str(version.parent.parent), version.parent.name, texts, beam=beam, callers=4,
                                       max_rows=8, threads=1, repeats=1)
    for mode in ("static", "continuous"):
        assert result[mode]["sentences_s"] > 0 and result[mode]["steps"] > 0
    assert result["static"]["encodes"] >= 3  # 12 sentences, 4 at a time
    assert result["continuous"]["encodes"] >= 3  # admitted as others left
    assert 0 < result["continuous"]["rows"] <= 8


def test_the_core_profile_finds_the_core_and_sums_each_threads_samples(tmp_path) -> None:
    """``benchmarks/core_profile.py`` (``nmt bench batching --profile-core``): a process without an engine-core child
    is its own core, and the summary gives each thread's frames as shares of that thread's samples."""
    import importlib.util
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "core_profile.py"
    spec = importlib.util.spec_from_file_location("core_profile", path)
    core_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core_profile)
    assert core_profile.core_pid(os.getpid()) == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "server.core.process"])
    try:
        cmdline = Path(f"/proc/{child.pid}/cmdline")
        for _ in range(500):  # right after the fork /proc shows no command line yet
            if b"server.core.process" in cmdline.read_bytes():
                break
            time.sleep(0.01)
        assert core_profile.core_pid(os.getpid()) == child.pid
    finally:
        child.kill()
        child.wait()
    stacks = tmp_path / "core.txt"
    stacks.write_text("process 1:\"python\";thread (7): engine-x-1_0;decode (a.py:1);Session.run (b.py:2) 30\n"
                      "process 1:\"python\";thread (7): engine-x-1_0;decode (a.py:1);select (c.py:3) 10\n"
                      "process 1:\"python\";thread (8): MainThread;EpollSelector.select (s.py:9) 40\n")
    text = core_profile.summary(stacks)
    assert "engine-x-1_0 (40 samples)" in text and "75.0%  Session.run (b.py:2)" in text
    assert "25.0%  select (c.py:3)" in text and "100.0%  EpollSelector.select (s.py:9)" in text
    assert text.index("engine-x-1_0") < text.index("MainThread")


@pytest.mark.parametrize("encoded", [False, True], ids=["encoded-by-the-worker", "encoded-ahead"])
@pytest.mark.parametrize("arch", CONTINUOUS)
def test_the_worker_asks_for_sentences_and_decodes_on_while_the_answer_comes(arch, engines, encoded):
    """The continuous scheduler's hand-off (RunningBatch.advance with ``ask``): once ``until()`` holds, the
    worker asks once, with the decode's load, and goes on decoding; the sentences offered from another
    thread join at the next step, encoded by the worker or already encoded by the thread that offers them
    (the encoder beside the decode); an emptied decode waits for the answer instead of returning, and returns once it is
    empty with nothing asked. Everyone gets what they get alone."""
    import threading

    from server.core.continuous import RunningBatch, encode

    engine = engines[arch]
    first = [request(engine, " ".join(WORDS * 2), beam_size=beam) for beam in (1, 4)]
    later = [request(engine, "six seven eight", beam_size=4, num_hypotheses=2), request(engine, "one two")]
    batch, delivered, asks, reports = RunningBatch(engine), {}, [], []
    requests = dict(zip(["first-1", "first-4", "later-4", "later-1"], [*first, *later], strict=True))

    def deliver(finished):
        delivered.update({tag: result for tag, result in finished})

    def answer() -> None:  # from another thread after a while, as the event loop (or the encoder's thread) would
        if len(asks) > 1:
            batch.offer([], [])
        else:
            batch.offer(later, ["later-4", "later-1"], encode(engine, later) if encoded else None)

    def ask(load):
        asks.append((load, batch.steps))
        threading.Timer(0.05, answer).start()

    batch.advance(first, ["first-1", "first-4"], lambda: batch.steps >= 2, deliver, ask, reports.append)
    assert batch.decode.rows == 0 and not batch.awaiting
    assert len(asks) >= 1 and asks[0][0].rows == 5 and asks[0][1] == 2, "asked once at step 2, with its load"
    assert asks[0][0].source_width == len(first[0].source_ids) + 1
    # the first stretch is the admission of the two first sentences; the offer opened a second one
    assert [r.sentences for r in reports][:2] == [2, 2] and sum(r.steps for r in reports) == batch.steps
    for tag, r in requests.items():
        assert_same(delivered[tag], alone(engine, r))


def test_an_encoder_error_offered_is_raised_by_the_worker(engines):
    """An encoder call that failed on the encoder's own thread fails the worker's ``advance`` as its own call
    would (the scheduler then runs the decode's requests one by one)."""
    from server.core.continuous import RunningBatch, encode

    engine = engines["transformer"]
    batch = RunningBatch(engine)
    bad = SentenceRequest([engine.manifest.dimensions["vocab_size"] + 5], DecodingOptions())  # past the embeddings
    offered = encode(engine, [bad])
    assert isinstance(offered, Exception)
    batch.offer([bad], ["bad"], offered)
    with pytest.raises(type(offered)):
        batch.advance([request(engine, "three")], ["first"], lambda: False, lambda finished: None)


def test_an_emptied_decode_waits_for_the_answer_and_a_late_one_is_taken_next_time(engines, monkeypatch):
    import server.core.continuous as continuous

    engine = engines["transformer"]
    monkeypatch.setattr(continuous, "OFFER_WAIT_SECONDS", 0.05)
    batch, delivered = continuous.RunningBatch(engine), {}
    short = request(engine, "one")
    batch.advance([short], ["short"], lambda: True, lambda finished: delivered.update(finished),
                  lambda load: None)  # asked after the first step; no answer comes in time
    assert "short" in delivered and batch.decode.rows == 0 and batch.awaiting, "returned, the ask still out"
    late = request(engine, "two three")
    batch.offer([late], ["late"])  # the answer comes after the return: the next advance takes it first
    batch.advance([], [], lambda: False, lambda finished: delivered.update(finished))
    assert not batch.awaiting
    assert_same(delivered["late"], alone(engine, late))
