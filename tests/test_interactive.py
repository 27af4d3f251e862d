"""Decoding for interactive UIs: target prefixes run as one forced pass, alternatives at the prefix's end,
prefixes ending inside a word, against the PyTorch reference search (``training/search.py``) on both tiny
architectures; the forced-pass graph and the fallback of versions exported without it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from nmt.cli import main as nmt_main
from nmt.model_format.layout import FORCED_GRAPH, OPTIONAL_GRAPH_FILES
from nmt.model_format.manifest import read_manifest, write_manifest
from server.completion import build_completion, piece_index, split_partial_word
from server.config import ServerConfig
from server.engine import Engine
from server.protos import pb2
from server.types import DecodingOptions, SentenceRequest, TargetPrefix
from server.validation import check_budget
from tests.conftest import number_pairs
from tests.harness import ServerHarness
from training.models.checkpoint import load_checkpoint
from training.search import translate_ids

ARCHS = ["transformer", "bahdanau"]
SOURCES = [source for source, _ in number_pairs(6, seed=5)]
TOLERANCE = 1e-4  # ONNX Runtime vs PyTorch log-probabilities


@pytest.fixture(scope="module")
def engines(tiny_models: dict[str, Path]) -> dict[str, Engine]:
    return {arch: Engine.load(tiny_models[arch], provider="cpu", intra_op_threads=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(tiny_runs: dict[str, Path]) -> dict:
    return {arch: load_checkpoint(tiny_runs[arch] / "best.pt")[0] for arch in ARCHS}


def search(engine: Engine, source: str, prefix: list[int], **options: object):
    request = SentenceRequest(engine.tokenize(source), DecodingOptions(**options), target_prefix=TargetPrefix(
        tuple(prefix)))
    [result] = engine.search([request])
    return result.hypotheses


def prefixes(reference: list[int], eos: int) -> list[list[int]]:
    """Half the model's own translation, and that half with its first two pieces swapped (an unlikely start)."""
    half = reference[: max(1, (len(reference) - 1) // 2)]
    swapped = [half[1], half[0], *half[2:]] if len(half) > 1 else [reference[-2] if len(reference) > 2 else 4]
    return [half, [t for t in swapped if t != eos] or [4]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beam", [1, 4])
def test_prefix_continuation_equals_the_reference_with_forced_tokens(engines, models, arch: str, beam: int) -> None:
    engine, model = engines[arch], models[arch]
    for source in SOURCES:
        ids = engine.tokenize(source) + [engine.eos_id]
        own = translate_ids(model, ids, beam_size=beam)[0].tokens
        for prefix in prefixes(own, engine.eos_id):
            [expected] = translate_ids(model, ids, beam_size=beam, forced=prefix)
            [got] = search(engine, source, prefix, beam_size=beam)
            assert got.tokens == expected.tokens, (source, prefix)
            assert got.token_scores == pytest.approx(expected.token_scores, abs=TOLERANCE)
            assert got.score == pytest.approx(expected.score, abs=TOLERANCE)


def boundary(model, ids: list[int], prefix: list[int]) -> torch.Tensor:
    """The reference model's log-probabilities of the token after ``prefix``."""
    with torch.no_grad():
        state = model.init_state(model.encode(torch.tensor([ids])))
        for token in [model.config.decoder_start_id, *prefix]:
            logits, _, state = model.decode_step(torch.tensor([token]), state)
    return logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beam", [1, 4])
def test_alternatives_are_the_top_n_at_the_boundary_each_continued(engines, models, arch: str, beam: int) -> None:
    engine, model = engines[arch], models[arch]
    for source in SOURCES[:4]:
        ids = engine.tokenize(source) + [engine.eos_id]
        own = translate_ids(model, ids, beam_size=beam)[0].tokens
        for prefix in ([], own[:1], own[:2]):
            got = search(engine, source, prefix, beam_size=beam, num_hypotheses=5, return_alternatives=True)
            top = boundary(model, ids, prefix).topk(5)
            assert [h.tokens[len(prefix)] for h in got] == top.indices.tolist()
            for hypothesis, token in zip(got, top.indices.tolist(), strict=True):
                [expected] = translate_ids(model, ids, beam_size=beam, forced=[*prefix, token])
                assert hypothesis.tokens == expected.tokens
                assert hypothesis.token_scores == pytest.approx(expected.token_scores, abs=TOLERANCE)


def test_forced_pass_is_one_graph_and_older_versions_fall_back(engines, tiny_models, tmp_path: Path) -> None:
    """A Transformer version exported before decoder_forced.onnx loads and gives the same results."""
    fast = engines["transformer"]
    assert FORCED_GRAPH in fast.model.sessions and FORCED_GRAPH not in engines["bahdanau"].model.sessions
    old = tmp_path / "old"
    shutil.copytree(tiny_models["transformer"], old)
    manifest = read_manifest(old)
    filename = manifest.graphs.pop(FORCED_GRAPH)
    assert filename == OPTIONAL_GRAPH_FILES[FORCED_GRAPH]
    del manifest.files[filename]
    (old / filename).unlink()
    write_manifest(manifest, old)
    slow = Engine.load(old, provider="cpu", intra_op_threads=1)
    assert FORCED_GRAPH not in slow.model.sessions
    bound = Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1, device_state=True)
    for source in SOURCES[:3]:
        own = search(fast, source, [], beam_size=1)[0].tokens
        for prefix, options in ((own, dict(beam_size=1, return_attention=True)),  # a whole target: Score
                                (own[:2], dict(beam_size=4, return_attention=True)),
                                (own[:1], dict(beam_size=1, num_hypotheses=3, return_alternatives=True))):
            expected = search(fast, source, prefix, **options)
            for other in (slow, bound):  # step-wise forcing; the forced pass through I/O binding
                for a, b in zip(expected, search(other, source, prefix, **options), strict=True):
                    assert a.tokens == b.tokens
                    assert a.token_scores == pytest.approx(b.token_scores, abs=1e-5)
                    if a.attention is not None:
                        np.testing.assert_allclose(a.attention, b.attention, atol=1e-5)


def test_split_partial_word_and_completion_automaton() -> None:
    assert split_partial_word("Dienstag, 25. Apr") == ("Dienstag, 25. ", "Apr")
    assert split_partial_word("Dienstag, 25.") == ("Dienstag, 25.", "")
    assert split_partial_word("zwei ") == ("zwei ", "")
    pieces = ["<pad>", "▁Apr", "▁A", "pr", "il", "▁April", "▁Ap", "x", "▁Aug"]
    completion = build_completion("Apr", True, 3, piece_index(pieces, excluded={0}))
    assert completion is not None and completion.text == "▁Apr" and completion.start == 3
    assert sorted(completion.allowed([])) == [1, 2, 5]  # not "▁Ap": no piece spells the "r" left after it
    assert completion.allowed([2]) == {3: 4}  # "▁A" then "pr"
    assert completion.allowed([2, 3]) is None and completion.allowed([5]) is None  # the word is complete
    assert completion.allowed([8]) == {}  # not a spelling: nothing (a dead beam row)
    assert build_completion("Qu", True, 0, piece_index(pieces, excluded=set())) is None  # no pieces spell it


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_ending_inside_a_word_completes_it(engines, arch: str) -> None:
    engine = engines[arch]
    source = "three four five six"
    own = engine.translate([source], DecodingOptions(beam_size=1))[0].hypotheses[0]
    words = own.text.split()
    typed = f"{words[0]} {words[1][:2]}"  # the translator is typing the second word
    target = engine.target_prefix(typed)
    assert target.completion is not None and target.ids == tuple(engine.tokenizer.encode_target(words[0]))
    request = SentenceRequest(engine.tokenize(source), DecodingOptions(beam_size=1), text=source, target_prefix=target)
    assert engine.translate_batch([request]).translations[0].hypotheses[0].text == own.text
    other = engine.target_prefix("ze")  # a word the model would not start with: completed, not cut
    request = replace(request, target_prefix=other)
    hypothesis = engine.translate_batch([request]).translations[0].hypotheses[0]
    assert hypothesis.tokens[0] == "▁zehn" and hypothesis.words[0] == "zehn"
    assert engine.target_prefix("zehn ").completion is None  # a boundary: nothing to complete


def test_the_work_budget_counts_the_prefix_and_alternatives() -> None:
    options = DecodingOptions(beam_size=2, max_length=16)
    [plain] = check_budget(["one"], [[5]], options, piece_bytes=8, max_work=10**6, max_response_bytes=10**9)
    [long] = check_budget(["one"], [[5]], options, piece_bytes=8, max_work=10**6, max_response_bytes=10**9,
                          prefix_steps=[40])
    assert plain == 2 * 14 and long == 2 * 41  # beam x min(16, 2 x 2 source tokens + 10), or the prefix + EOS
    alternatives = replace(options, num_hypotheses=3, return_alternatives=True)
    [three] = check_budget(["one"], [[5]], alternatives, piece_bytes=8, max_work=10**6, max_response_bytes=10**9)
    assert three == 3 * plain


# ---- over gRPC and the command line --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness(tiny_models: dict[str, Path], tiny_repository: Path) -> Iterator[ServerHarness]:
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="",
                          model_repository=str(tiny_repository), provider="cpu", intra_op_threads=1, grace_seconds=5,
                          reload_interval=0)
    h = ServerHarness(config)
    yield h
    h.close()


@pytest.mark.parametrize("model", ["tiny-transformer", "tiny-bahdanau"])
def test_alternatives_over_grpc(harness: ServerHarness, model: str) -> None:
    request = pb2.TranslateRequest(texts=["three four five six"], model=model, target_prefixes=["sechs "],
                                   options=pb2.DecodingOptions(beam_size=2, num_hypotheses=4, return_scores=True,
                                                               return_alternatives=True))
    [translation] = harness.stub.Translate(request, timeout=30).translations
    assert len(translation.hypotheses) == 4
    assert all(h.subword_tokens[0] == "▁sechs" for h in translation.hypotheses)  # the next piece may glue on
    assert len({h.subword_tokens[1] for h in translation.hypotheses}) == 4  # four different next pieces
    boundary = [h.token_scores[1] for h in translation.hypotheses]
    assert boundary == sorted(boundary, reverse=True)  # in the order of the next piece's probability


@pytest.mark.parametrize("options, message", [
    (dict(return_alternatives=True, sampling_topk=5), "excludes sampling"),
    (dict(return_alternatives=True, num_hypotheses=99), "alternatives returned"),
    (dict(num_hypotheses=5, beam_size=2), "larger than the beam size"),
])
def test_bad_alternatives_are_invalid_argument(harness: ServerHarness, options: dict, message: str) -> None:
    request = pb2.TranslateRequest(texts=["one"], model="tiny-transformer", options=pb2.DecodingOptions(**options))
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Translate(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()


def test_cli_alternatives_and_score(harness: ServerHarness, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert nmt_main(["translate", "--server", harness.address, "--model", "tiny-transformer", "--prefix", "sechs ",
                     "--alternatives", "3", "three four five six"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("1.", "2.", "3.")]
    assert len(lines) == 3 and all(line.split()[1] == "sechs" for line in lines)
    plot = tmp_path / "score.png"
    assert nmt_main(["score", "--server", harness.address, "--model", "tiny-bahdanau", "--attention", "--plot",
                     str(plot), "three four", "vier drei"]) == 0
    out = capsys.readouterr().out
    assert "vier drei" in out and "score" in out and plot.stat().st_size > 0
