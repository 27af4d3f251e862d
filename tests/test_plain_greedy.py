"""Plain arg-max decoding on the in-place cache (:class:`server.engine.host_runs.GreedySteps`): the same
tokens and scores as the general search, with one model run per step and each row's token and score read."""

from __future__ import annotations

import random

import numpy as np
import onnxruntime as ort
import pytest

from server.engine import host_runs
from server.engine.decode import RunningDecode, beam_search
from server.engine.engine import Engine
from server.engine.host_runs import BoundSteps, GreedySteps
from server.engine.step_model import BeamSentence
from tests.harness import count_calls

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module", params=[False, True], ids=["host-state", "device-state"])
def engine(model_version_dir, request):
    """The tiny Transformer with its state in NumPy arrays, and as ``OrtValue`` buffers (the CUDA way)."""
    return Engine.load(model_version_dir, provider="cpu", intra_op_threads=1, device_state=request.param)


@pytest.fixture
def counted(monkeypatch, engine):
    """How many times the decode ran the model through each way: plain steps and the general step."""
    return count_calls(monkeypatch, {"plain": (GreedySteps, "run"), "general": (type(engine.model), "step")})


def batch(engine: Engine, seed: int, n: int) -> tuple[np.ndarray, list[BeamSentence]]:
    """``n`` random sentences of 1-14 words, with random output limits, some of which cut a translation
    short."""
    rng = random.Random(seed)
    ids = [engine.tokenize(" ".join(rng.choices(WORDS, k=rng.randint(1, 14)))) + [engine.eos_id] for _ in range(n)]
    src = np.zeros((n, max(map(len, ids))), dtype=np.int64)
    for row, sentence in zip(src, ids, strict=True):
        row[: len(sentence)] = sentence
    specs = [BeamSentence(len(sentence), max_length=rng.choice([3, 6, 40, 256])) for sentence in ids]
    return src, specs


def search(engine: Engine, src: np.ndarray, specs: list[BeamSentence], lean: bool) -> list:
    """Greedy search of ``src`` (encoded anew: the search writes its cache in place)."""
    return beam_search(engine.model, engine.model.encode(src), specs, beam_size=1, start_id=engine.start_id,
                       eos_id=engine.eos_id, lean_greedy=lean)


def same_best(results: list, reference: list, exact: bool = True) -> set[int]:
    """Each result's hypothesis against the reference's: the same tokens, and the same scores (``exact``:
    summed in the same order; else within 1e-5, as a batch of another size gives them). Returns their lengths."""
    lengths = set()
    for ours, expected in zip(results, reference, strict=True):
        [a], [b] = ours.hypotheses, expected.hypotheses
        assert a.tokens == b.tokens
        if exact:
            assert (a.score, a.token_scores) == (b.score, b.token_scores), "scores summed in the same order"
        else:
            assert (a.score, *a.token_scores) == pytest.approx((b.score, *b.token_scores), abs=1e-5)
        lengths.add(len(a.tokens))
    return lengths


@pytest.mark.parametrize("seed", range(4))
def test_plain_greedy_equals_the_general_search(engine, counted, seed):
    src, specs = batch(engine, seed, n=1 + 3 * seed)
    plain = search(engine, src, specs, lean=True)
    plain_counts = dict(counted)
    general = search(engine, src, specs, lean=False)
    steps = max(same_best(plain, general))
    # every step ran the model once; the general step ran only where a sentence left or reached its limit
    assert plain_counts["plain"] + plain_counts["general"] == steps
    assert plain_counts["general"] <= len(specs)
    assert plain_counts["plain"] >= steps - len(specs)


def test_a_sentence_cancelled_during_plain_steps_leaves_at_the_next_step(engine, counted):
    src, specs = batch(engine, seed=7, n=3)
    specs = [BeamSentence(s.source_length, max_length=256) for s in specs]
    reference = search(engine, src, specs, lean=False)
    polls = 0

    def cancelled() -> bool:
        nonlocal polls
        polls += 1
        return polls > 4

    specs[1] = BeamSentence(specs[1].source_length, max_length=256, is_cancelled=cancelled)
    results = search(engine, src, specs, lean=True)
    assert results[1] is None
    assert polls == 6, "polled once per step (the plain step that saw it, then its selection)"
    for i in (0, 2):
        assert results[i].hypotheses[0].tokens == reference[i].hypotheses[0].tokens


def held_search(engine: Engine, src: np.ndarray, specs: list[BeamSentence]) -> list:
    """:func:`search` through plain steps that hold an ended sentence's row until every row has ended, and the
    ``RunningDecode.step`` calls it took."""
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id, hold_ended=True)
    decode.admit(engine.model.encode(src), specs, range(len(specs)))
    results, calls = [None] * len(specs), 0
    while decode.rows:
        calls += 1
        for index, result in decode.step(until_leave=True):
            results[index] = result
    return results, calls


@pytest.mark.parametrize("seed", range(3))
def test_sentences_that_end_in_held_rows_leave_together_with_the_general_searchs_results(engine, counted, seed):
    """A static batch's plain steps hold the row of a sentence that chose EOS instead of ending the run: its
    hypothesis is made from the books when the run ends, token for token and score for score the general
    search's (scores up to the last bits the step graph's kernels give rows in a batch of another size), and
    every sentence leaves at the one general step that ends the run."""
    src, specs = batch(engine, seed, n=6)
    specs = [BeamSentence(s.source_length, max_length=256) for s in specs]  # no row's limit ends the run
    held, calls = held_search(engine, src, specs)
    counts = dict(counted)
    lengths = same_best(held, search(engine, src, specs, lean=False), exact=False)
    assert len(lengths) > 1, "sentences ended at different steps"
    assert calls == 1 and counts == {"plain": max(lengths), "general": 0}


@pytest.mark.parametrize("seed", range(3))
def test_sentences_that_reach_their_limit_in_held_rows_end_there(engine, counted, seed):
    """A held run goes on past a sentence's last step: there the row takes EOS with EOS's log-probability, as the
    general step forces it, and is held, its position no longer moving; the whole batch takes one run."""
    src, specs = batch(engine, seed, n=8)  # output limits of 3, 6, 40 and 256
    held, calls = held_search(engine, src, specs)
    counts = dict(counted)
    lengths = same_best(held, search(engine, src, specs, lean=False), exact=False)
    assert any(len(r.hypotheses[0].tokens) == s.limit() < max(lengths) for r, s in zip(held, specs, strict=True)), \
        "a sentence ended at its limit while others decoded on"
    assert calls == 1 and counts == {"plain": max(lengths), "general": 0}


def test_positions_stop_at_each_rows_ceiling():
    """A held row's position stops at its sentence's last step (its slot rewritten), never past the positions the
    model has: before each step and after the last."""
    moved = host_runs.moved_on(np.array([2, 5]), 4, np.array([3, 100]))
    assert moved.tolist() == [[2, 5], [3, 6], [3, 7], [3, 8], [3, 9]]
    assert host_runs.moved_on(np.array([2, 5]), 2, None).tolist() == [[2, 5], [3, 6], [4, 7]]


def test_a_held_row_that_stops_at_its_ceiling_does_not_grow_the_cache(engine):
    """The cache grows for the furthest position a row writes, and a row held at its ceiling writes no further:
    a row at position 15 held at 19 beside one that starts at 0 and runs 20 steps needs 21 positions, not 36."""
    src, _ = batch(engine, seed=5, n=2)
    model = engine.model
    encoded = model.encode(src)
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    tokens, positions = np.full(2, engine.start_id), np.array([15, 0], dtype=np.int64)
    with model.greedy_steps(tokens, static, state, positions, 20, np.array([19, 100])) as run:
        for _ in range(20):
            run.run()
        after = run.state()
    np.testing.assert_array_equal(after[model.positions], [19, 20])
    name, entry = next(iter(model.buffers.items()))
    value = after[name]
    assert (value.shape() if isinstance(value, ort.OrtValue) else value.shape)[entry.capacity_axis] == 32


def test_a_sentence_cancelled_while_others_are_held_leaves_without_a_result(engine):
    """A cancel ends a run that holds rows: the held sentences leave with their hypotheses, the cancelled one
    with None, the others decode on as they would alone."""
    src, specs = batch(engine, seed=4, n=4)
    specs = [BeamSentence(s.source_length, max_length=256) for s in specs]
    reference = search(engine, src, specs, lean=False)
    ends = [len(r.hypotheses[0].tokens) for r in reference]
    last = max(range(4), key=ends.__getitem__)
    polls = 0

    def cancelled() -> bool:  # polled once a step: the longest sentence is cancelled after the first one ended
        nonlocal polls
        polls += 1
        return polls > min(ends)

    specs[last] = BeamSentence(specs[last].source_length, max_length=256, is_cancelled=cancelled)
    results, _ = held_search(engine, src, specs)
    assert results[last] is None
    others = sorted(set(range(4)) - {last})
    same_best([results[i] for i in others], [reference[i] for i in others], exact=False)


def test_held_sentences_leave_when_the_caller_stops_the_run(engine):
    """``stop()`` ends a run that holds rows: the sentences that ended leave then with their hypotheses, and the
    others decode on from where the run stood."""
    src, specs = batch(engine, seed=4, n=4)
    specs = [BeamSentence(s.source_length, max_length=256) for s in specs]
    reference = search(engine, src, specs, lean=False)
    ends = sorted(len(r.hypotheses[0].tokens) for r in reference)
    assert ends[0] < ends[-1]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id, hold_ended=True)
    decode.admit(engine.model.encode(src), specs, range(4))
    first = dict(decode.step(until_leave=True, stop=lambda: decode.steps_run > ends[0]))
    assert decode.steps_run == ends[0] + 1 and set(first) == {i for i in range(4) if
                                                              len(reference[i].hypotheses[0].tokens) == ends[0]}
    results = first
    while decode.rows:
        results.update(decode.step(until_leave=True))
    same_best([results[i] for i in range(4)], reference, exact=False)


def test_held_sentences_are_handed_out_at_the_step_they_end(engine):
    """With ``on_ended`` (continuous batching) a held sentence's result goes out at the step its row chose EOS,
    equal to the general search's, while its row runs on unread to the end of the run; the decode does not
    return it again. A sentence handed out holds no rows for admission."""
    src, specs = batch(engine, seed=4, n=6)
    specs = [BeamSentence(s.source_length, max_length=256) for s in specs]
    reference = search(engine, src, specs, lean=False)
    handed: dict[int, tuple[int, object]] = {}  # sentence -> (steps run when it went out, result)
    reserved = []

    def on_ended(ended: list) -> None:
        for index, result in ended:
            handed[index] = (decode.steps_run, result)
        reserved.append(decode.reserved_rows)

    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id, hold_ended=True,
                           on_ended=on_ended)
    decode.admit(engine.model.encode(src), specs, range(6))
    returned = {}
    while decode.rows:
        returned.update(decode.step(until_leave=True))
    assert len(handed) >= 3 and not set(handed) & set(returned) and len(handed) + len(returned) == 6
    results = {**returned, **{i: result for i, (_, result) in handed.items()}}
    same_best([results[i] for i in range(6)], reference, exact=False)
    for i, (steps, _) in handed.items():
        assert steps == len(reference[i].hypotheses[0].tokens), "handed out at the step it ended"
    assert reserved == sorted(reserved, reverse=True) and reserved[-1] < 6


def test_single_steps_for_a_decode_that_others_join(engine, counted):
    """Without ``until_leave`` (continuous batching) a plain step is one step: sentences join between them."""
    src, specs = batch(engine, seed=3, n=2)
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    decode.admit(engine.model.encode(src[:1]), specs[:1], ["first"])
    decode.step()
    assert counted["plain"] == 1 and decode.steps() == [1]
    decode.admit(engine.model.encode(src[1:]), specs[1:], ["second"])
    results = {}
    while decode.rows:
        results.update(decode.step())
    reference = search(engine, src, specs, lean=False)
    # the joined sentence decodes as alone (rows at their own positions)
    assert results["second"].hypotheses[0].tokens == reference[1].hypotheses[0].tokens
    assert results["first"].hypotheses[0].tokens == reference[0].hypotheses[0].tokens


def test_plain_steps_run_on_until_the_caller_stops_them(engine, counted):
    """Continuous batching's way: ``until_leave`` with ``stop`` runs plain steps back to back, asks ``stop``
    after each, and sentences that join when it returns decode as they would alone."""
    src, specs = batch(engine, seed=3, n=2)
    specs = [BeamSentence(s.source_length, max_length=256) for s in specs]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    decode.admit(engine.model.encode(src[:1]), specs[:1], ["first"])
    asked = []

    def stop() -> bool:
        asked.append(decode.steps_run)
        return decode.steps_run >= 3

    assert decode.step(until_leave=True, stop=stop) == []
    assert asked == [1, 2, 3] and counted["plain"] == 3 and decode.steps() == [3]
    decode.admit(engine.model.encode(src[1:]), specs[1:], ["second"])
    results = {}
    while decode.rows:
        results.update(decode.step(until_leave=True, stop=lambda: False))
    assert decode.steps_run == counted["plain"] + counted["general"]
    reference = search(engine, src, specs, lean=False)
    for i, tag in enumerate(["first", "second"]):
        [ours], [expected] = results[tag].hypotheses, reference[i].hypotheses
        assert (ours.tokens, ours.token_scores) == (expected.tokens, expected.token_scores)


def test_plain_steps_grow_the_cache_and_match_the_step_graph(engine):
    """40 plain steps (the cache grows from 16 positions twice) give each row the tokens and scores of
    :meth:`OnnxStepModel.step` fed the same tokens, and leave the same state behind."""
    src, _ = batch(engine, seed=5, n=3)
    model = engine.model
    encoded, reference = model.encode(src), model.encode(src)  # the two runs write their caches in place
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    tokens, positions = np.full(3, engine.start_id), np.zeros(3, dtype=np.int64)
    reference_state = {name: reference[name] for name in model.state_names}
    with model.greedy_steps(tokens, static, state, positions, 40) as run:
        for step in range(40):
            fed = run.ids.copy()
            run.run()
            out = model.step(fed, static, reference_state, False, 1, positions=np.full(3, step))
            reference_state = out.state
            np.testing.assert_array_equal(run.ids, out.top_ids[:, 0])
            np.testing.assert_array_equal(run.scores, out.top_log_probs[:, 0])
            np.testing.assert_array_equal(run.eos_log_prob, out.eos_log_prob)
        # a step's outputs: the cache, written in place, and for the host each row's id, score and EOS log-prob
        outputs = [value.shape() for value in run._binding.get_outputs()]
        assert len(outputs) == len(model.buffers) + 3 and sorted(outputs)[:3] == [[3], [3, 1], [3, 1]]
        assert not any(model.manifest.vocab_size in shape for shape in outputs), "nothing of the [R, V] distribution"
        after = run.state()
        np.testing.assert_array_equal(after[model.positions], np.full(3, 40))
        for name, entry in model.buffers.items():
            ours, theirs = (value.numpy() if isinstance(value, ort.OrtValue) else value
                            for value in (after[name], reference_state[name]))
            assert ours.shape[entry.capacity_axis] >= 40
            np.testing.assert_array_equal(ours, theirs)


def test_ids_and_positions_bound_again_each_step_decode_alike(engine, monkeypatch):
    """On a device the steps bind their ids and positions again before every run (a binding copies a host
    value when it is bound: on CUDA every step read the first step's ids until that was found on an H200).
    Forced on the CPU, that path decodes exactly as binding them once: the code CUDA runs, without a GPU."""
    src, specs = batch(engine, seed=7, n=6)
    once = search(engine, src, specs, lean=True)
    monkeypatch.setattr(host_runs, "binds_each_step", lambda model: True)
    engine.model._bindings.__dict__.pop("greedy", None)  # the next plain steps are set up afresh, with the rule
    rebound = count_calls(monkeypatch, {"bind": (BoundSteps, "_bind_step_inputs"), "run": (GreedySteps, "run")})
    again = search(engine, src, specs, lean=True)
    engine.model._bindings.__dict__.pop("greedy", None)
    assert rebound["run"] > 2 and rebound["bind"] >= rebound["run"], "every plain step bound its inputs again"
    for ours, reference in zip(again, once, strict=True):
        [a], [b] = ours.hypotheses, reference.hypotheses
        assert (a.tokens, a.score, a.token_scores) == (b.tokens, b.score, b.token_scores)
