"""Beam search's selection on the device (:mod:`server.engine.device_runs`), run on the CPU through the device
step model (``Engine.load(device_state=True)``, the code path CUDA versions take): the general search's
hypotheses and scores for both architectures, beams 2-8, n-best, length penalties, patience, output limits,
target prefixes and sentences joining a running decode; the host reading one byte per sentence a quiet step;
every node of the selection graph with a CUDA kernel."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from server.engine.decode import RunningDecode
from server.engine.device import nodes_without_cuda_kernel
from server.engine.device_runs import DeviceBeamRun, selection_graph
from server.engine.engine import Engine
from server.engine.step_model import BeamSentence
from server.types import DecodingOptions, SentenceRequest
from tests.harness import live_ortvalues

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module", params=["transformer", "bahdanau"])
def engines(request, tiny_models) -> tuple[Engine, Engine]:
    """The host search's engine and the device step model's, on one version."""
    path = tiny_models[request.param]
    return (Engine.load(path, provider="cpu", intra_op_threads=1),
            Engine.load(path, provider="cpu", intra_op_threads=1, device_state=True, device_search=True))


@pytest.fixture
def selections(monkeypatch) -> list[tuple[int, int]]:
    """(sentences, bytes read) of every selection run on the device."""
    runs: list[tuple[int, int]] = []
    step = DeviceBeamRun.step

    def counted(self):
        before = self.bytes_read
        done = step(self)
        runs.append((len(self.done), self.bytes_read - before))
        return done

    monkeypatch.setattr(DeviceBeamRun, "step", counted)
    return runs


def batch(engine: Engine, seed: int) -> tuple[np.ndarray, list[BeamSentence]]:
    """1-9 random sentences of one random beam (2-8), with random hypotheses, penalties, patience and limits."""
    rng = random.Random(seed)
    n, beam = rng.randint(1, 9), rng.choice([2, 3, 4, 5, 8])
    ids = [engine.tokenize(" ".join(rng.choices(WORDS, k=rng.randint(1, 14)))) + [engine.eos_id] for _ in range(n)]
    src = np.zeros((n, max(map(len, ids))), dtype=np.int64)
    for row, sentence in zip(src, ids, strict=True):
        row[: len(sentence)] = sentence
    return src, [BeamSentence(len(sentence), num_hypotheses=rng.randint(1, beam),
                              max_length=rng.choice([4, 9, 40, 256]), length_penalty=rng.choice([0.0, 0.6, 1.0, 2.0]),
                              patience=rng.choice([1.0, 2.0]), beam_size=beam) for sentence in ids]


def decode(engine: Engine, src: np.ndarray, specs: list[BeamSentence], plain: bool, join_at: int = 0,
           eos_id: int | None = None) -> list:
    """The sentences ``specs`` decoded together (``join_at`` > 0: the second half joins after that many steps;
    ``eos_id``: the token that ends a hypothesis, the model's EOS unless given)."""
    d = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id if eos_id is None else eos_id,
                      plain_beam=plain)
    half = len(specs) // 2 if join_at else len(specs)
    d.admit(engine.model.encode(src[:half]), specs[:half], range(half))
    results = [None] * len(specs)
    steps = 0
    while d.rows or steps < join_at:
        if steps == join_at and half < len(specs):
            d.admit(engine.model.encode(src[half:]), specs[half:], range(half, len(specs)))
        for index, result in d.step():
            results[index] = result
        steps += 1
    return results


def assert_same(expected: list, got: list) -> None:
    for want, have in zip(expected, got, strict=True):
        assert len(want.hypotheses) == len(have.hypotheses)
        for a, b in zip(want.hypotheses, have.hypotheses, strict=True):
            assert a.tokens == b.tokens
            assert b.score == pytest.approx(a.score, abs=1e-5)
            assert np.allclose(a.token_scores, b.token_scores, atol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_the_device_selection_finds_the_general_searchs_hypotheses(engines, selections, seed):
    host, device = engines
    src, specs = batch(host, seed)
    assert_same(decode(host, src, specs, plain=False), decode(device, src, specs, plain=True))
    assert selections, "the selection ran on the device"


@pytest.mark.parametrize("seed", range(4))
def test_long_runs_of_quiet_steps_with_hypotheses_finishing_on_the_way(engines, selections, seed):
    """The tiny models end their outputs within a few steps; with a frequent word's token standing for EOS, the
    hypotheses run for many steps, finish now and then, and fill their sentences' quotas on the device."""
    host, device = engines
    src, specs = batch(host, 200 + seed)
    specs = [replace(s, max_length=40) for s in specs]
    eos = host.translate(["three four five six"], DecodingOptions(beam_size=1))[0].hypotheses[0].tokens[1]
    eos_id = host.tokenize(eos)[0]
    assert_same(decode(host, src, specs, plain=False, eos_id=eos_id),
                decode(device, src, specs, plain=True, eos_id=eos_id))
    assert len(selections) >= 3


@pytest.mark.parametrize("seed", range(3))
def test_sentences_joining_a_running_decode_get_the_same_hypotheses(engines, selections, seed):
    host, device = engines
    if not host.model.capabilities.per_row_positions:
        pytest.skip("this model decodes all rows at one step: sentences join only an empty decode")
    src, specs = batch(host, 100 + seed)
    src, specs = np.concatenate([src, src]), specs + [replace(s, max_length=256) for s in specs]
    assert_same(decode(host, src, specs, plain=False, join_at=3), decode(device, src, specs, plain=True, join_at=3))
    assert selections


def test_a_target_prefix_then_the_device_selection(engines, selections):
    host, device = engines
    text = "three four five six"
    prefix = host.translate([text], DecodingOptions(beam_size=1))[0].hypotheses[0].tokens[:2]
    requests = [SentenceRequest(host.tokenize(text), DecodingOptions(beam_size=4, num_hypotheses=2),
                                target_prefix=host.target_prefix(" ".join(prefix)), text=text),
                SentenceRequest(host.tokenize("one two"), DecodingOptions(beam_size=4), text="one two")]
    assert_same(host.search(requests), device.search(requests))
    assert selections


def test_a_quiet_step_reads_one_byte_a_sentence(engines, selections):
    _, device = engines
    src, specs = batch(device, 7)
    specs = [replace(s, max_length=256, beam_size=4, num_hypotheses=1) for s in specs]
    decode(device, src, specs, plain=True)
    assert len(selections) >= 3
    assert all(read == sentences for sentences, read in selections)  # the done flags, nothing else


@pytest.mark.parametrize("score_type", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_every_node_of_the_selection_graph_has_a_cuda_kernel(score_type):
    model = onnx.load_from_string(selection_graph(4, 2, 1, score_type, 8))
    onnx.checker.check_model(model, full_check=True)
    assert nodes_without_cuda_kernel(model) == []


def test_mixed_beams_and_attention_keep_the_hosts_selection_while_they_last(engines, selections):
    """The selection runs on the device only once every sentence left holds one beam, and never for attention."""
    host, device = engines
    src, specs = batch(host, 3)
    mixed = [replace(s, beam_size=2 + i % 2, num_hypotheses=1) for i, s in enumerate(specs)]
    assert_same(decode(host, src, mixed, plain=False), decode(device, src, mixed, plain=True))
    selections.clear()
    decode(device, src, [replace(s, need_attention=True) for s in specs], plain=True)
    assert not selections


def test_a_runs_buffers_go_with_it(engines, selections):
    """Every buffer a run of device steps allocates is freed when the decode ends: a second decode leaves as many
    ``OrtValue`` s alive as the first."""
    _, device = engines

    options = DecodingOptions(beam_size=4, num_hypotheses=2)
    device.translate(["one two three", "four five"], options)
    before = live_ortvalues()
    device.translate(["one two three", "four five"], options)
    assert live_ortvalues() == before
    assert selections
