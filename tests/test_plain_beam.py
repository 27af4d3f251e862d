"""Plain beam steps on the in-place cache (:mod:`server.engine.host_runs`): the general search's hypotheses and
scores, exactly, with one model run per step, a selection in plain Python and cache rows copied only for an
origin's second and later continuations."""

from __future__ import annotations

import random

import numpy as np
import pytest

from server.engine import host_runs
from server.engine.decode import RunningDecode
from server.engine.engine import Engine
from server.engine.host_runs import BeamSteps, CacheBlock, GreedySteps, quiet_selection
from server.engine.row_layout import PLAIN_BEAM_SENTENCES
from server.engine.step_model import BeamSentence
from tests.harness import count_calls

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module")
def engine(model_version_dir):
    return Engine.load(model_version_dir, provider="cpu", intra_op_threads=1)


@pytest.fixture
def counted(monkeypatch, engine):
    """How many times the decode ran the model through each way: plain beam steps, plain arg-max steps (once
    only beam-1 sentences are left) and the general step."""
    return count_calls(monkeypatch, {"plain": (BeamSteps, "run"), "greedy": (GreedySteps, "run"),
                                     "general": (type(engine.model), "step")})


def batch(engine: Engine, seed: int, n: int) -> tuple[np.ndarray, list[BeamSentence]]:
    """``n`` random sentences of 1-14 words with random beams (1-8, the first wider than 1), hypotheses,
    length penalties, patience and output limits."""
    rng = random.Random(seed)
    ids = [engine.tokenize(" ".join(rng.choices(WORDS, k=rng.randint(1, 14)))) + [engine.eos_id] for _ in range(n)]
    src = np.zeros((n, max(map(len, ids))), dtype=np.int64)
    for row, sentence in zip(src, ids, strict=True):
        row[: len(sentence)] = sentence
    specs = []
    for sentence in ids:
        beam = rng.choice([1, 2, 3, 4, 5, 8] if specs else [2, 4])
        specs.append(BeamSentence(len(sentence), num_hypotheses=rng.randint(1, beam),
                                  max_length=rng.choice([3, 6, 40, 256]), length_penalty=rng.choice([0.0, 0.6, 1.0]),
                                  patience=rng.choice([1.0, 2.0]), beam_size=beam))
    return src, specs


def decode_all(engine: Engine, src: np.ndarray, specs: list[BeamSentence], plain: bool) -> tuple[list, int]:
    """The static batch of ``src`` (encoded anew: the search writes its cache in place) and its steps."""
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id, plain_beam=plain)
    decode.admit(engine.model.encode(src), specs, range(len(specs)))
    results = [None] * len(specs)
    while decode.rows:
        for index, result in decode.step(until_leave=True):
            results[index] = result
    return results, decode.steps_run


def hypotheses(result) -> list[tuple]:
    return [(h.tokens, h.score, h.token_scores) for h in result.hypotheses]


@pytest.mark.parametrize("seed", range(6))
def test_plain_beam_equals_the_general_search(engine, counted, seed):
    src, specs = batch(engine, seed, n=1 + 2 * seed)
    plain, steps = decode_all(engine, src, specs, plain=True)
    plain_counts = dict(counted)
    general, _ = decode_all(engine, src, specs, plain=False)
    for ours, reference in zip(plain, general, strict=True):
        assert hypotheses(ours) == hypotheses(reference), "the same hypotheses, scores summed in the same order"
    assert sum(plain_counts.values()) == steps, "the model ran once a step"
    assert plain_counts["plain"] > 0


def test_the_plain_beam_steps_decide_most_steps(engine, counted):
    """Across a batch of long sentences (as many as the plain beam steps take) most steps are plain: only a
    beam's first expansion and the steps where a sentence leaves go through the general selection."""
    rng = random.Random(11)
    src, specs = batch(engine, 11, n=PLAIN_BEAM_SENTENCES)
    specs = [BeamSentence(s.source_length, max_length=256, beam_size=rng.choice([2, 4])) for s in specs]
    _, steps = decode_all(engine, src, specs, plain=True)
    assert counted["plain"] + counted["general"] == steps
    assert counted["plain"] > steps / 2


def test_a_decode_of_more_sentences_keeps_the_general_step_until_some_leave(engine, counted):
    """Past :data:`PLAIN_BEAM_SENTENCES` every sentence that leaves would end a run of plain steps, and the
    runs no longer pay for their set-up: the general step decodes until enough sentences have left."""
    src, specs = batch(engine, 12, n=PLAIN_BEAM_SENTENCES + 2)
    specs = [BeamSentence(s.source_length, max_length=256, beam_size=4) for s in specs]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    decode.admit(engine.model.encode(src), specs, range(len(specs)))
    results = {}
    while decode.rows:
        plain_before = counted["plain"]
        many = decode.sentences > PLAIN_BEAM_SENTENCES
        results.update(decode.step())
        if many:
            assert counted["plain"] == plain_before
    reference, _ = decode_all(engine, src, specs, plain=False)
    assert [hypotheses(results[i]) for i in range(len(specs))] == [hypotheses(r) for r in reference]


def test_hypotheses_finish_within_the_plain_beam_steps(engine, monkeypatch):
    """A step where some hypotheses end in EOS stays a plain step while their sentences go on: the finished
    hypotheses are written with their tokens when the steps end, equal to the general search's."""
    finishing = []
    select = host_runs.quiet_selection

    def counted(*args):
        choice = select(*args)
        finishing.append(choice is not None and bool(choice.finished))
        return choice

    monkeypatch.setattr("server.engine.decode.quiet_selection", counted)  # where the decode looks it up
    src, specs = batch(engine, seed=4, n=6)
    specs = [BeamSentence(s.source_length, num_hypotheses=4, max_length=256, beam_size=4, patience=2.0)
             for s in specs]
    plain, _ = decode_all(engine, src, specs, plain=True)
    general, _ = decode_all(engine, src, specs, plain=False)
    assert any(finishing)
    assert [hypotheses(r) for r in plain] == [hypotheses(r) for r in general]


def test_a_beam_1_sentence_beside_a_wider_beam_takes_the_plain_beam_steps(engine, counted):
    """Continuous batching mixes beam sizes: a beam-1 sentence decodes in the plain beam steps as a beam of
    one row, with the arg-max path's tokens and scores."""
    src, specs = batch(engine, seed=9, n=2)
    specs = [BeamSentence(s.source_length, max_length=256, beam_size=beam) for s, beam in zip(specs, (4, 1),
                                                                                               strict=True)]
    plain, _ = decode_all(engine, src, specs, plain=True)
    assert counted["plain"] > 1
    general, _ = decode_all(engine, src, specs, plain=False)
    assert [hypotheses(r) for r in plain] == [hypotheses(r) for r in general]


def test_a_sentence_cancelled_during_plain_beam_steps_leaves_at_the_next_step(engine):
    src, specs = batch(engine, seed=7, n=3)
    specs = [BeamSentence(s.source_length, max_length=256, beam_size=4) for s in specs]
    reference, _ = decode_all(engine, src, specs, plain=False)
    polls = 0

    def cancelled() -> bool:
        nonlocal polls
        polls += 1
        return polls > 4

    specs[1] = BeamSentence(specs[1].source_length, max_length=256, beam_size=4, is_cancelled=cancelled)
    results, _ = decode_all(engine, src, specs, plain=True)
    assert results[1] is None
    assert polls == 6, "polled once per step (the plain step that saw it, then its selection)"
    for i in (0, 2):
        assert hypotheses(results[i]) == hypotheses(reference[i])


def test_sentences_join_between_single_plain_beam_steps(engine, counted):
    """Continuous batching's way: single steps, a sentence joining a decode in its plain beam steps decodes
    as it would alone, and so do the others."""
    src, specs = batch(engine, seed=3, n=2)
    specs = [BeamSentence(s.source_length, max_length=256, beam_size=beam)
             for s, beam in zip(specs, (4, 3), strict=True)]
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    decode.admit(engine.model.encode(src[:1]), specs[:1], ["first"])
    for _ in range(3):
        assert decode.step() == []
    assert counted["plain"] == 2, "the first step expands the beam through the general step"
    decode.admit(engine.model.encode(src[1:]), specs[1:], ["second"])
    results = {}
    while decode.rows:
        results.update(decode.step())
    for i, tag in enumerate(["first", "second"]):
        [alone], _ = decode_all(engine, src[i:i + 1], specs[i:i + 1], plain=False)
        assert hypotheses(results[tag]) == hypotheses(alone)


def test_plain_beam_steps_move_the_cache_like_select_rows(engine, monkeypatch):
    """40 beam steps (the cache grows from 16 positions twice) with random origins give each row the best
    tokens that :meth:`OnnxStepModel.step` gives with its rows moved by ``select_rows``, and leave the same
    state behind; a reorder copies cache rows only for an origin's second and later continuations."""
    src, _ = batch(engine, seed=5, n=1)
    src = np.repeat(src, 4, axis=0)  # one sentence's beam of 4: its rows share their source
    model = engine.model
    encoded, reference = model.encode(src), model.encode(src)  # the two runs write their caches in place
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    reference_state = {name: reference[name] for name in model.state_names}
    copies = []
    copy = CacheBlock.copy
    monkeypatch.setattr(CacheBlock, "copy", lambda self, rows, sources, used: (copies.append(len(rows)),
                                                                                 copy(self, rows, sources, used)))
    tokens = np.full(4, engine.start_id)
    run = model.beam_steps(tokens, static, state, np.zeros(4, dtype=np.int64), 8, 40)
    rng = random.Random(0)
    for step in range(40):
        run.run()
        out = model.step(tokens, static, reference_state, False, 8, positions=np.full(4, step))
        ids, scores = run.read()
        places = run.places
        np.testing.assert_array_equal(np.array(ids).reshape(4, -1)[places], out.top_ids)
        np.testing.assert_array_equal(np.array(scores, dtype=np.float32).reshape(4, -1)[places], out.top_log_probs)
        origin = [rng.randrange(4) for _ in range(4)]
        tokens = out.top_ids[origin, 0]
        copies.clear()
        run.advance(tokens.tolist(), origin)
        assert sum(copies) == 4 - len(set(origin))
        reference_state = model.select_rows(out.state, np.array(origin))
    after = run.state()
    np.testing.assert_array_equal(after[model.positions], np.full(4, 40))
    np.testing.assert_array_equal(run.ids, tokens)
    for name, entry in model.buffers.items():
        assert after[name].shape[entry.capacity_axis] >= 40
        np.testing.assert_array_equal(after[name][:, :, :40], reference_state[name][:, :, :40])
    # what a step hands the host: each row's 8 best ids and log-probabilities and its EOS log-probability
    outputs = sorted(value.shape() for value in run._binding.get_outputs())
    assert len(outputs) == len(model.buffers) + 3
    assert [shape for shape in outputs if len(shape) <= 2] == [[4], [4, 8], [4, 8]], "besides the cache in place"
    assert not any(model.manifest.vocab_size in shape for shape in outputs), "nothing of the [R, V] distribution"


def test_the_quiet_selection_walks_candidates_as_the_general_one():
    """:func:`quiet_selection` walks each sentence's candidates over its rows best first (summed scores, ties
    in row order): EOS finishes, the others live until the beam is full; it declines a step where a beam-1
    sentence chooses EOS or a sentence has fewer live continuations than its beam."""
    eos = 2
    # two rows of one beam-2 sentence, each with its 4 best tokens; row 1 sits in model row 0
    ids = [10, 11, 12, 13, 20, 21, 22, 23]
    scores = [-0.1, -0.5, -0.9, -1.0, -0.2, -0.3, -2.0, -3.0]
    totals = [-1.0, -0.5]  # the decode's rows 0 and 1
    places = [1, 0]
    choice = quiet_selection(ids, scores, totals, [(0, 2)], 4, eos, places)
    assert choice.origin == [1, 1] and choice.token == [10, 11] and choice.token_score == [-0.1, -0.5]
    assert choice.total == [-0.6, -1.0] and choice.finished == []
    ending = quiet_selection([eos, *ids[1:]], scores, totals, [(0, 2)], 4, eos, places)
    assert ending.finished == [(0, 1, -0.1, -0.6)], "the best candidate ends: it finishes"
    assert ending.origin == [1, 0] and ending.token == [11, 20] and ending.total == [-1.0, -1.2]
    assert quiet_selection([eos, 20], [-0.1, -0.2], [0.0], [(0, 1)], 2, eos, [0]) is None, "beam 1 ends at EOS"
    assert quiet_selection([eos, 20], [-0.1, -0.2], [0.0, 0.0], [(0, 2)], 1, eos, [0, 1]) is None, \
        "one live continuation for a beam of 2"
    tied = [-0.5, -0.9, -1.0, -1.1, -0.5, -1.1, -2.0, -3.0]  # both rows' best sum to -1.0
    assert quiet_selection(ids, tied, [-0.5, -0.5], [(0, 2)], 4, eos, [0, 1])[:2] == ([0, 1], [10, 20])
    assert quiet_selection(ids, tied, [-0.5, -0.5], [(0, 2)], 4, eos, [1, 0])[:2] == ([0, 1], [20, 10]), \
        "ties go in the decode's row order, wherever the rows lie in the model"


def test_a_device_state_keeps_the_general_step(model_version_dir):
    """The plain beam steps move host rows; a version whose state lives on the device does not take them."""
    engine = Engine.load(model_version_dir, provider="cpu", intra_op_threads=1, device_state=True)
    assert not engine.model.capabilities.beam_steps
    src, specs = batch(engine, seed=2, n=2)
    decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
    assert not decode.plain_beam
