"""Decoding for interactive UIs: target prefixes run as one forced pass, alternatives at the prefix's end (the
next words, :mod:`server.engine.forced`: on hand-written tables, against the PyTorch reference on both tiny
architectures, and on the small dates models), prefixes ending inside a word or with a space, against the
PyTorch reference search (``training/search.py``); the forced-pass graph and the fallback of versions exported
without it."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from common.model_format.layout import FORCED_GRAPH, OPTIONAL_GRAPH_FILES
from common.model_format.manifest import read_manifest, write_manifest
from nmt.cli import main as nmt_main
from server.completion import WordPieces, build_completion, piece_index, split_partial_word
from server.config import ServerConfig
from server.controls import Controls
from server.engine.engine import Engine
from server.engine.forced import FLOOR, decode_batch, stepwise_force
from server.engine.step_model import Alternatives, BeamSentence, Capabilities, take_rows
from server.frontend.validation import check_budget
from server.protos import pb2
from server.types import DecodingOptions, SentenceRequest, TargetPrefix
from tests.conftest import number_pairs
from tests.harness import ServerHarness
from tests.test_beam import step_output
from training.data import generate_dates_corpus
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


# ---- alternatives: the next words ------------------------------------------------------------------------------

PIECES = ["<pad>", "<unk>", "<s>", "</s>", "▁", "▁25.", "▁April", "▁Apr", "il", "▁Mai", "x", "▁2045", "▁2046", "i"]
PAD, UNK, START, EOS, MARK, P25, APRIL, APR, IL, MAI, X, Y2045, Y2046, GLUED = range(len(PIECES))
# next-piece probabilities given the target pieces so far; unlisted pieces have probability 0, unlisted rows end
NEXT: dict[tuple[int, ...], dict[int, float]] = {
    (): {P25: 1.0},
    (P25,): {APRIL: 0.5, APR: 0.3, MAI: 0.1, MARK: 0.06, GLUED: 0.035, EOS: 0.005},
    (P25, APRIL): {Y2045: 0.9, EOS: 0.1},  # a word: "April"
    (P25, APR): {IL: 0.9, Y2045: 0.1},  # no word: a word start (0.1) is less likely than "il" (0.9)
    (P25, APR, IL): {Y2045: 1.0},  # "April" again, spelt "▁Apr" "il"
    (P25, MAI): {X: 0.45, Y2045: 0.3, Y2046: 0.25},  # a word (0.55 for a word start), and "Maix"
    (P25, MAI, X): {Y2045: 1.0},
    (P25, MARK): {X: 0.5, Y2045: 0.5},  # the mark alone is no word: "x" (spelt "▁" "x")
    (P25, GLUED): {Y2045: 1.0},  # "25.i", glued on
    (P25, APRIL, Y2045): {EOS: 0.95, Y2046: 0.05},
}


class NextPieceTable:
    """:class:`server.engine.step_model.StepModel` of :data:`NEXT`; its state is each row's pieces so far."""

    static_names: list[str] = []
    state_names = ["pieces"]
    static_src_axes: dict[str, int] = {}
    capabilities = Capabilities()

    def step(self, tokens, static, state, need_attention, k, full=False, positions=None, logits=False):
        pieces = np.concatenate([state["pieces"], tokens[:, None]], 1)
        log_probs = np.full((len(pieces), len(PIECES)), -np.inf)
        for r, row in enumerate(pieces[:, 1:].tolist()):
            for token, p in NEXT.get(tuple(row), {EOS: 1.0}).items():
                log_probs[r, token] = math.log(p)
        attention = np.full((len(pieces), 2), 0.5, dtype=np.float32) if need_attention else None
        return step_output(log_probs, k, EOS, attention, {"pieces": pieces})

    def release(self):
        pass  # holds nothing between decodes

    def select_rows(self, tensors, rows, in_place=False):
        return take_rows(tensors, rows)

    def force(self, inputs, targets, static, state, need_attention):
        return stepwise_force(self, inputs, targets, static, state, need_attention)


def next_words(prefix: tuple[int, ...], count: int, *, space: bool, beam: int = 1):
    """The alternatives after ``prefix``: ``space``: it ends with whitespace (the next piece starts a word)."""
    words = WordPieces(PIECES, EOS)
    sentence = BeamSentence(source_length=2, beam_size=beam, alternatives=Alternatives(count, words),
                            controls=Controls(forced=prefix, completion=words.boundary(len(prefix)) if space else None))
    [result] = decode_batch(NextPieceTable(), {"pieces": np.zeros((1, 0), dtype=np.int64)}, [sentence], start_id=START,
                      eos_id=EOS, pad_id=PAD)
    return result.hypotheses


@pytest.mark.parametrize("beam", [1, 2])
def test_next_words_on_a_table(beam: int) -> None:
    """Whole words ranked by their probability (spellings added up, their end included), the mark alone and
    a piece more likely to go on being no word, the floor, the end of the sentence, the continuation."""
    got = next_words((P25,), 5, space=True, beam=beam)
    assert [h.tokens for h in got] == [
        [P25, APRIL, Y2045, EOS],  # 0.5 x (0.9 + 0.1) + 0.3 x 0.9 x 1.0 ("▁Apr" "il", the same word)
        [P25, MAI, Y2045, EOS],  # 0.1 x 0.55; the next word starts a word: "▁2045" (0.3), not "x" (0.45)
        [P25, MAI, X, Y2045, EOS],  # 0.1 x 0.45
        [P25, MARK, X, EOS],  # 0.06 x 0.5; the end of the sentence (0.005) is under the floor
    ]
    assert [h.score for h in got] == pytest.approx([math.log(p) for p in (0.77, 0.055, 0.045, 0.03)], abs=1e-9)
    assert got[1].token_scores == pytest.approx([0.0, math.log(0.1), math.log(0.3), 0.0], abs=1e-9)
    assert 0.005 < FLOOR * 0.77 < 0.03
    assert [h.tokens[1:3] for h in next_words((P25,), 2, space=True, beam=beam)] == [[APRIL, Y2045], [MAI, Y2045]]
    glued = next_words((P25,), 5, space=False, beam=beam)  # after punctuation the word may go on: "25.i"
    assert [h.tokens[1] for h in glued] == [APRIL, MAI, MAI, GLUED, MARK]
    assert glued[3].score == pytest.approx(math.log(0.035), abs=1e-9)
    ended = next_words((P25, APRIL, Y2045), 3, space=True, beam=beam)  # the translation may end at the prefix
    assert [h.tokens for h in ended] == [[P25, APRIL, Y2045, EOS], [P25, APRIL, Y2045, Y2046, EOS]]
    assert [h.score for h in ended] == pytest.approx([math.log(0.95), math.log(0.05)], abs=1e-9)


def reference_scores(model, ids: list[int], tokens: list[int]) -> tuple[list[float], torch.Tensor]:
    """The reference model's log-probability of each of ``tokens`` after those before it, and its
    log-probabilities of the token after them all."""
    scores = []
    with torch.no_grad():
        state = model.init_state(model.encode(torch.tensor([ids])))
        for i, token in enumerate([model.config.decoder_start_id, *tokens]):
            logits, _, state = model.decode_step(torch.tensor([token]), state)
            log_probs = logits[0].float().log_softmax(-1)
            if i < len(tokens):
                scores.append(float(log_probs[tokens[i]]))
    return scores, log_probs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beam", [1, 4])
def test_alternatives_are_whole_next_words_scored_as_the_reference(engines, models, arch: str, beam: int) -> None:
    """After an empty prefix, one ending with a space and one inside a word: each alternative is the prefix
    and one more word; its pieces carry the reference model's log-probabilities; its score is the word's
    (its pieces and the end that follows, a word start or EOS, at least as likely there as any one piece
    going on with it); the words are distinct, ranked, within the floor."""
    engine, model = engines[arch], models[arch]
    words = engine.words
    for source in SOURCES[:4]:
        ids = engine.tokenize(source) + [engine.eos_id]
        own = engine.translate([source], DecodingOptions(beam_size=beam))[0].hypotheses[0].text.split()
        for typed in ("", f"{own[0]} ", f"{own[0]} {own[1][:2]}" if len(own) > 1 else own[0][:2]):
            target = engine.target_prefix(typed) if typed else TargetPrefix()
            request = SentenceRequest(ids[:-1], DecodingOptions(beam_size=beam, num_hypotheses=4,
                                                                return_alternatives=True), text=source,
                                      target_prefix=target)
            hypotheses = engine.translate_batch([request]).translations[0].hypotheses
            n, seen = len(target.ids), set()
            assert 1 <= len(hypotheses) <= 4
            for h in hypotheses:
                tokens = [*h.token_ids, engine.eos_id]
                assert tokens[:n] == list(target.ids) and (h.text + " ").startswith(typed)
                if not typed.strip() or typed.endswith(" "):
                    assert words.starts[tokens[n]] or tokens[n] == engine.eos_id  # a word of its own
                scores, _ = reference_scores(model, ids, tokens)
                assert h.token_scores == pytest.approx(scores, abs=TOLERANCE)
                end = n + 1 + (int(np.flatnonzero(words.ends[tokens[n + 1:]])[0]) if tokens[n] != engine.eos_id else 0)
                word = tokens[n:end]
                expected = sum(scores[n:end])
                if tokens[n] != engine.eos_id:
                    _, after = reference_scores(model, ids, tokens[:end])
                    ending = float(after[torch.from_numpy(words.ends)].logsumexp(0))
                    assert ending >= float(after[torch.from_numpy(~words.ends)].max()) - TOLERANCE
                    expected += ending
                assert h.score == pytest.approx(expected, abs=TOLERANCE)
                assert words.spell(word) not in seen
                seen.add(words.spell(word))
            scores = [h.score for h in hypotheses]
            assert scores == sorted(scores, reverse=True) and scores[-1] >= scores[0] + math.log(FLOOR)


@pytest.fixture(scope="module")
def dates_engines(dates_models: dict[str, Path]) -> dict[str, Engine]:
    return {arch: Engine.load(dates_models[arch], provider="cpu", intra_op_threads=1) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_alternatives_of_the_dates_models_are_words(dates_engines, arch: str) -> None:
    """Issue 30: after "Dienstag, 25. " the demo models offered "25.achtundneunzigil" and the like (pieces glued
    onto the prefix's last word). Now every alternative is the prefix and a word of the corpus's German side,
    each once, the most likely first, and none under the floor."""
    engine = dates_engines[arch]
    vocabulary = {word for pair in generate_dates_corpus(20000) for word in pair.target.split()}
    for source, typed, first in (("Tuesday, April 25, 2045", "Dienstag, 25. ", "April"),
                                 ("three hundred and twelve", "", "dreihundertzwölf"),
                                 ("ninety-seven", "", "siebenundneunzig")):
        request = SentenceRequest(engine.tokenize(source), DecodingOptions(beam_size=4, num_hypotheses=5,
                                                                           return_alternatives=True),
                                  text=source, target_prefix=engine.target_prefix(typed) if typed else TargetPrefix())
        hypotheses = engine.translate_batch([request]).translations[0].hypotheses
        offered = [h.text[len(typed):].split(" ")[0] for h in hypotheses]
        assert all(h.text.startswith(typed) for h in hypotheses), [h.text for h in hypotheses]
        assert set(offered) <= vocabulary and len(set(offered)) == len(offered) and offered[0] == first, offered
        scores = [h.score for h in hypotheses]
        assert scores == sorted(scores, reverse=True) and scores[-1] >= scores[0] + math.log(FLOOR)
    assert len(offered) > 1  # several numbers are likely enough


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
    spaced = engine.target_prefix("zehn ")  # a boundary: nothing to complete; alternatives start a word there
    assert spaced.completion is None and spaced.spaced and spaced.ids == engine.target_prefix("zehn", whole=True).ids
    assert sorted(engine.words.boundary(3).allowed([])) == np.flatnonzero(engine.words.ends).tolist()


def test_the_work_budget_counts_the_prefix_and_alternatives() -> None:
    options = DecodingOptions(beam_size=2, max_length=16)
    [plain] = check_budget(["one"], [[5]], options, piece_bytes=8, max_work=10**6, max_response_bytes=10**9)
    [long] = check_budget(["one"], [[5]], options, piece_bytes=8, max_work=10**6, max_response_bytes=10**9,
                          prefix_steps=[40])
    assert plain == 2 * 14 and long == 2 * 41  # beam x min(16, 2 x 2 source tokens + 10), or the prefix + EOS
    alternatives = replace(options, num_hypotheses=3, return_alternatives=True)
    [three] = check_budget(["one"], [[5]], alternatives, piece_bytes=8, max_work=10**6, max_response_bytes=10**9)
    assert three == 3 * (2 + 2) * 14  # three searches of beam 2 and the word search, 2 x 3 rows wide


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
    assert 1 <= len(translation.hypotheses) <= 4
    assert all(h.subword_tokens[0] == "▁sechs" for h in translation.hypotheses)
    assert all(h.subword_tokens[1].startswith("▁") for h in translation.hypotheses if len(h.subword_tokens) > 1)
    assert len({h.text for h in translation.hypotheses}) == len(translation.hypotheses)
    scores = [h.score for h in translation.hypotheses]
    assert scores == sorted(scores, reverse=True)  # in the order of the next word's probability


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
    assert 1 <= len(lines) <= 3 and all(line.split()[1] == "sechs" for line in lines)
    plot = tmp_path / "score.png"
    assert nmt_main(["score", "--server", harness.address, "--model", "tiny-bahdanau", "--attention", "--plot",
                     str(plot), "three four", "vier drei"]) == 0
    out = capsys.readouterr().out
    assert "vier drei" in out and "score" in out and plot.stat().st_size > 0
