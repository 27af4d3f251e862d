"""The engine's batched NumPy beam search: hand-written tables and agreement with the PyTorch reference."""

import math

import numpy as np
import pytest
import torch

from server.controls import Controls
from server.engine.beam_select import select_beam, sentence_done
from server.engine.decode import beam_search
from server.engine.step_model import BeamSentence, Capabilities, StepOutput, take_rows
from server.types import ScoredSequence
from tests.test_search import BOS, EOS, TABLE, VOCAB, A, B
from training.models.checkpoint import build_model
from training.search import translate_ids


def step_output(log_probs, k, eos_id, attention, state, logits=None):
    """A :class:`StepOutput` from a whole [R, V] distribution, as an exported decoder's ``TopK`` computes it
    (best first, ties to the lower id)."""
    ids = np.argsort(-log_probs, axis=1, kind="stable")[:, : min(k, log_probs.shape[1])]
    return StepOutput(ids, np.take_along_axis(log_probs, ids, 1).astype(np.float64), log_probs[:, eos_id].copy(),
                      attention, state, log_probs, logits)


class TableModel:
    """StepModel reading the reference test's probability table; the state is the generated prefix. Its
    logits are the log-probabilities plus ``logit_offset`` (any offset has the same softmax)."""

    static_names: list[str] = []
    state_names = ["prefix"]
    static_src_axes: dict[str, int] = {}
    capabilities = Capabilities()

    def __init__(self, logit_offset: float = 0.0) -> None:
        self.logit_offset = logit_offset

    def step(self, tokens, static, state, need_attention, k, full=False, logits=False):
        prefix = state["prefix"]
        if prefix.shape[1] or tokens[0] != BOS:
            prefix = np.concatenate([prefix, tokens[:, None]], 1)
        log_probs = np.full((len(prefix), VOCAB), -np.inf, dtype=np.float32)
        for r, row in enumerate(prefix.tolist()):
            for token, p in TABLE.get(tuple(row), {EOS: 1.0}).items():
                log_probs[r, token] = math.log(p)
        attention = np.full((len(prefix), 2), 0.5, dtype=np.float32)
        return step_output(log_probs, k, EOS, attention if need_attention else None, {"prefix": prefix},
                           log_probs + self.logit_offset if logits else None)

    def release(self):
        pass  # holds nothing between decodes

    def select_rows(self, tensors, rows, in_place=False):
        return take_rows(tensors, rows)


def table_search(beam, n, length_penalty, max_length=10, sentences=1, controls=None, logit_offset=0.0):
    encoded = {"prefix": np.zeros((sentences, 0), dtype=np.int64)}
    specs = [BeamSentence(source_length=2, num_hypotheses=n, max_length=max_length, length_penalty=length_penalty,
                          controls=controls or Controls())
             for _ in range(sentences)]
    return beam_search(TableModel(logit_offset), encoded, specs, beam_size=beam, start_id=BOS, eos_id=EOS,
                       need_attention=True)


def test_table_beam_search_exact_hypotheses_and_scores():
    [result] = table_search(beam=2, n=2, length_penalty=0.0)
    assert [h.tokens for h in result.hypotheses] == [[B, EOS], [A, A, EOS]]
    assert result.hypotheses[0].score == pytest.approx(math.log(0.4) + math.log(0.9), abs=1e-6)
    assert result.hypotheses[1].score == pytest.approx(math.log(0.6) + math.log(0.5), abs=1e-6)
    assert result.hypotheses[1].token_scores == pytest.approx([math.log(0.6), math.log(0.5), 0.0], abs=1e-6)
    assert result.hypotheses[1].attention.shape == (3, 2)


def test_table_length_penalty_and_greedy():
    [result] = table_search(beam=2, n=2, length_penalty=1.0)
    assert [h.tokens for h in result.hypotheses] == [[A, A, EOS], [A, B, EOS]]
    assert result.hypotheses[1].score == pytest.approx((math.log(0.6) + math.log(0.4)) / 3, abs=1e-6)
    [greedy] = table_search(beam=1, n=1, length_penalty=0.0)
    assert [h.tokens for h in greedy.hypotheses] == [[A, A, EOS]]
    [short] = table_search(beam=1, n=1, length_penalty=0.0, max_length=2)
    assert short.hypotheses[0].tokens == [A, EOS]


def test_cancelled_sentence_leaves_the_batch():
    calls = {"n": 0}

    def cancel_after_first_step():
        calls["n"] += 1
        return True

    for beam, best in ((2, [B, EOS]), (1, [A, A, EOS])):
        calls["n"] = 0
        encoded = {"prefix": np.zeros((2, 0), dtype=np.int64)}
        specs = [BeamSentence(1, 1, 10, 0.0), BeamSentence(1, 1, 10, 0.0, is_cancelled=cancel_after_first_step)]
        results = beam_search(TableModel(), encoded, specs, beam_size=beam, start_id=BOS, eos_id=EOS)
        assert results[1] is None and calls["n"] == 1
        assert [h.tokens for h in results[0].hypotheses] == [best]


class TorchStepModel:
    """Adapter running a PyTorch model through the NumPy search (tests the search, not ONNX)."""

    def __init__(self, model):
        self.model = model
        self.state_names = None
        self.static_src_axes: dict[str, int] = {}
        self.capabilities = Capabilities()

    def encode(self, src):
        with torch.no_grad():
            state = self.model.init_state(self.model.encode(torch.from_numpy(src)))
        self.state_names = list(state)
        self.static_names = []
        return {k: v.numpy() for k, v in state.items()}

    def step(self, tokens, static, state, need_attention, k):
        with torch.no_grad():
            logits, attention, new = self.model.decode_step(
                torch.from_numpy(tokens), {k: torch.from_numpy(v) for k, v in state.items()}, need_attention
            )
        log_probs = logits.float().log_softmax(-1).numpy()
        return step_output(log_probs, k, EOS, None if attention is None else attention.numpy(),
                                         {name: value.numpy() for name, value in new.items()})

    def release(self):
        pass  # holds nothing between decodes

    def select_rows(self, tensors, rows, in_place=False):
        return take_rows(tensors, rows)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
@pytest.mark.parametrize("beam", [1, 3])
def test_batched_search_matches_reference_one_by_one(arch, beam):
    torch.manual_seed(1)
    small = dict(d_model=32, heads=4, ffn_dim=64, encoder_layers=2, decoder_layers=2) if arch == "transformer" \
        else dict(embed_dim=16, encoder_hidden=16, decoder_hidden=32, attention_dim=16)
    model = build_model(arch, vocab_size=12, dropout=0.0, **small).eval()
    with torch.no_grad():  # make EOS likely enough that hypotheses end at different lengths
        bias = model.final_logits_bias if arch == "transformer" else model.generator.bias
        bias[..., EOS] += 2.5
    sources = [[5, 6, 7, 8, EOS], [9, EOS], [4, 4, 10, EOS], [11, 6, EOS]]
    width = max(map(len, sources))
    src = np.array([s + [0] * (width - len(s)) for s in sources], dtype=np.int64)
    adapter = TorchStepModel(model)
    encoded = adapter.encode(src)
    specs = [BeamSentence(len(s), num_hypotheses=beam, max_length=8, length_penalty=1.0) for s in sources]
    results = beam_search(adapter, encoded, specs, beam_size=beam, start_id=BOS, eos_id=EOS, need_attention=True)
    for source, result in zip(sources, results, strict=True):
        reference = translate_ids(model, source, beam_size=beam, num_hypotheses=beam, max_length=8,
                                  need_attention=True)
        assert [h.tokens for h in result.hypotheses] == [h.tokens for h in reference]
        for ours, theirs in zip(result.hypotheses, reference, strict=True):
            assert ours.score == pytest.approx(theirs.score, abs=1e-5)
            np.testing.assert_allclose(ours.attention[:, : len(source)], theirs.attention.numpy(), atol=1e-5)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_greedy_loop_equals_the_general_search_at_beam_1(arch):
    torch.manual_seed(2)
    small = dict(d_model=32, heads=4, ffn_dim=64, encoder_layers=2, decoder_layers=2) if arch == "transformer" \
        else dict(embed_dim=16, encoder_hidden=16, decoder_hidden=32, attention_dim=16)
    model = build_model(arch, vocab_size=12, dropout=0.0, **small).eval()
    with torch.no_grad():
        bias = model.final_logits_bias if arch == "transformer" else model.generator.bias
        bias[..., EOS] += 2.0
    sources = [[5, 6, 7, 8, 9, 10, EOS], [9, EOS], [4, 4, 10, EOS], [11, 6, EOS], [7, EOS]]
    width = max(map(len, sources))
    src = np.array([s + [0] * (width - len(s)) for s in sources], dtype=np.int64)
    adapter = TorchStepModel(model)
    specs = [BeamSentence(len(s), 1, max_length=[3, 9, 9, 2, 9][i], length_penalty=[1.0, 0.6, 0.0, 1.0, 2.0][i])
             for i, s in enumerate(sources)]
    kwargs = dict(beam_size=1, start_id=BOS, eos_id=EOS, need_attention=True)
    lean = beam_search(adapter, adapter.encode(src), specs, **kwargs)
    general = beam_search(adapter, adapter.encode(src), specs, lean_greedy=False, **kwargs)
    assert {len(r.hypotheses[0].tokens) for r in lean} != {len(lean[0].hypotheses[0].tokens)}  # lengths differ
    for ours, reference in zip(lean, general, strict=True):
        [a], [b] = ours.hypotheses, reference.hypotheses
        assert a.tokens == b.tokens
        assert a.score == pytest.approx(b.score, abs=1e-9)
        assert a.token_scores == pytest.approx(b.token_scores, abs=1e-9)
        np.testing.assert_array_equal(a.attention, b.attention)


@pytest.mark.parametrize("beam", [1, 2])
def test_table_forced_prefix_keeps_model_log_probs(beam):
    [result] = table_search(beam=beam, n=1, length_penalty=0.0, controls=Controls(forced=(B, A)))
    assert result.hypotheses[0].tokens == [B, A, EOS]
    assert result.hypotheses[0].token_scores == pytest.approx([math.log(0.4), math.log(0.05), 0.0], abs=1e-6)
    # the score counts only what follows the prefix (given, as in CTranslate2), over the whole length
    [result] = table_search(beam=beam, n=1, length_penalty=1.0, controls=Controls(forced=(B,)))
    assert result.hypotheses[0].tokens == [B, EOS]
    assert result.hypotheses[0].token_scores == pytest.approx([math.log(0.4), math.log(0.9)], abs=1e-6)
    assert result.hypotheses[0].score == pytest.approx(math.log(0.9) / 2, abs=1e-6)


@pytest.mark.parametrize("beam", [1, 2])
def test_table_min_length_bars_eos_and_renormalises(beam):
    [result] = table_search(beam=beam, n=1, length_penalty=0.0, controls=Controls(min_length=2))
    best = result.hypotheses[0]
    assert len(best.tokens) >= 3
    if beam == 1:  # (A,): EOS barred -> A 0.5/0.9
        assert best.tokens == [A, A, EOS]
        assert best.token_scores[1] == pytest.approx(math.log(0.5 / 0.9), abs=1e-6)


def test_table_suppressed_token_and_sequence():
    [result] = table_search(beam=1, n=1, length_penalty=0.0, controls=Controls(suppress=((A,),)))
    assert result.hypotheses[0].tokens == [B, EOS]
    [result] = table_search(beam=1, n=1, length_penalty=0.0, controls=Controls(suppress=((A, A),)))
    assert result.hypotheses[0].tokens == [A, B, EOS]


def test_table_no_repeat_ngram_and_repetition_penalty():
    [result] = table_search(beam=1, n=1, length_penalty=0.0, controls=Controls(no_repeat_ngram_size=1))
    assert result.hypotheses[0].tokens == [A, B, EOS]
    # the penalty scales logits: negative ones are multiplied by it. (A,) with logits = log-probabilities:
    # A 0.5 -> log(0.5) * 3, softmaxed against B 0.4 and EOS 0.1: B wins
    [result] = table_search(beam=1, n=1, length_penalty=0.0, controls=Controls(repetition_penalty=3.0))
    assert result.hypotheses[0].tokens == [A, B, EOS]
    weights = np.array([0.5 ** 3, 0.4, 0.1])
    assert result.hypotheses[0].token_scores[1] == pytest.approx(math.log(0.4 / weights.sum()), abs=1e-6)
    # positive ones are divided by it: logits 1 + log p make A's 0.307 / 3 = 0.102, still above B's 0.084
    [result] = table_search(beam=1, n=1, length_penalty=0.0, controls=Controls(repetition_penalty=3.0),
                            logit_offset=1.0)
    assert result.hypotheses[0].tokens == [A, A, EOS]
    logits = np.array([(1 + math.log(0.5)) / 3, 1 + math.log(0.4), 1 + math.log(0.1)])
    assert result.hypotheses[0].token_scores[1] == pytest.approx(logits[0] - np.log(np.exp(logits).sum()), abs=1e-6)


def test_table_sampling_with_a_seed_is_reproducible():
    runs = [[h.tokens for r in table_search(beam=1, n=1, length_penalty=0.0, sentences=4,
                                            controls=Controls(sampling_topk=0, seed=7)) for h in r.hypotheses]
            for _ in range(2)]
    assert runs[0] == runs[1]
    [top1] = table_search(beam=1, n=1, length_penalty=0.0, controls=Controls(sampling_topk=0, sampling_topp=0.5))
    assert top1.hypotheses[0].tokens == [A, A, EOS]


def test_select_beam_walks_candidates_in_order_and_keeps_beam_live() -> None:
    """The selection rule on hand-made numbers: one sentence of beam 2 holding two rows. Its four best
    continuations, best first: row 1 + EOS (finishes), row 0 + token 5, row 1 + token 6 (both live), row 0 +
    EOS (behind the second live one: neither finishes nor lives)."""
    totals = np.array([-1.0, -0.5])
    tokens = np.array([[5, EOS, 7, 8], [EOS, 6, 9, 4]])
    scores = np.log(np.array([[0.5, 0.3, 0.1, 0.05], [0.6, 0.2, 0.1, 0.05]]))
    choice = select_beam(totals, tokens, scores, np.array([[0, 1]]), np.array([False]), beam=2, eos_id=EOS)
    np.testing.assert_allclose(choice.scores[0], [-0.5 + np.log(0.6), -1.0 + np.log(0.5), -0.5 + np.log(0.2),
                                                  -1.0 + np.log(0.3)])
    assert choice.tokens[0].tolist() == [EOS, 5, 6, EOS] and choice.origins[0].tolist() == [1, 0, 1, 0]
    assert choice.finish[0].tolist() == [True, False, False, False]
    assert choice.chosen[0].tolist() == [1, 2] and choice.best_live[0] == choice.scores[0, 1]
    # a forced prefix's token adds nothing to the summed score: row 1's four tokens all rank first
    given = select_beam(totals, tokens, scores, np.array([[0, 1]]), np.array([True]), beam=2, eos_id=EOS)
    assert given.scores[0].tolist() == [-0.5] * 4 and given.origins[0].tolist() == [1] * 4


def test_sentence_done_needs_its_quota_and_no_better_live_hypothesis() -> None:
    finished = [ScoredSequence([EOS], -1.0, [-1.0]), ScoredSequence([A, EOS], -2.0, [-1.0, -3.0])]
    assert sentence_done(-np.inf, [], quota=2, length=3, length_penalty=1.0)  # nothing live
    assert not sentence_done(-9.0, finished[:1], quota=2, length=3, length_penalty=1.0)  # quota not reached
    assert sentence_done(-6.0, finished, quota=2, length=3, length_penalty=1.0)  # -6/3 = -2: no better
    assert not sentence_done(-5.9, finished, quota=2, length=3, length_penalty=1.0)
