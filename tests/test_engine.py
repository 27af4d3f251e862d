"""The ONNX Runtime engine on exported tiny models: agreement with PyTorch, batching, attention, words."""

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.model_format.manifest import LOGITS_OUTPUT, TOP_K_OUTPUTS, ManifestError
from server.alignment import merge_to_words, segment_words, word_groups, words
from server.controls import Controls
from server.engine.engine import Engine, OnnxStepModel, length_runs
from server.types import DecodingOptions, SentenceRequest
from training.models.checkpoint import load_checkpoint
from training.search import translate_ids

TEXTS = ["one two", "three four five six", "seven", "eight nine ten one two", "two two three"]


@pytest.fixture(scope="module")
def engines(tiny_models):
    return {arch: Engine.load(path, provider="cpu", intra_op_threads=1) for arch, path in tiny_models.items()}


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
@pytest.mark.parametrize("beam", [1, 4])
def test_engine_matches_pytorch_reference(arch, beam, engines, tiny_runs):
    engine = engines[arch]
    model, _ = load_checkpoint(tiny_runs[arch] / "best.pt")
    options = DecodingOptions(beam_size=beam, num_hypotheses=beam, length_penalty=1.0, return_attention=True)
    translations = engine.translate(TEXTS, options)
    for text, translation in zip(TEXTS, translations, strict=True):
        reference = translate_ids(model, engine.tokenize(text) + [engine.eos_id], beam_size=beam,
                                  num_hypotheses=beam, need_attention=True)
        assert [h.token_ids + [engine.eos_id] for h in translation.hypotheses] == [h.tokens for h in reference]
        for ours, theirs in zip(translation.hypotheses, reference, strict=True):
            assert ours.score == pytest.approx(theirs.score, abs=1e-4)
            np.testing.assert_allclose(ours.attention.subword_weights, theirs.attention.numpy(), atol=1e-4)
        scores = [h.score for h in translation.hypotheses]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_device_state_decodes_like_numpy_state(arch, engines, tiny_models):
    """The I/O-binding model (the CUDA path: encoder outputs and KV cache stay in ONNX Runtime as
    OrtValues, rows are selected by a Gather graph) gives the NumPy model's results; run here on the CPU."""
    bound = Engine.load(tiny_models[arch], provider="cpu", intra_op_threads=1, device_state=True)
    src = np.array([bound.tokenize("three four five") + [bound.eos_id]], dtype=np.int64)
    encoded = bound.model.encode(src)  # the rows' positions stay on the host (they size the cache buffers)
    assert all(isinstance(value, ort.OrtValue) for name, value in encoded.items() if name != bound.model.positions)
    controls = Controls(min_length=2, repetition_penalty=1.5)  # the full log-probabilities and the logits, bound
    for beam, with_controls in ((1, False), (4, False), (1, True), (4, True)):
        options = DecodingOptions(beam_size=beam, num_hypotheses=beam, return_attention=True,
                                  controls=controls if with_controls else Controls())
        expected, got = engines[arch].translate(TEXTS, options), bound.translate(TEXTS, options)
        for theirs, ours in zip(expected, got, strict=True):
            assert [h.token_ids for h in ours.hypotheses] == [h.token_ids for h in theirs.hypotheses]
            for a, b in zip(ours.hypotheses, theirs.hypotheses, strict=True):
                assert a.score == pytest.approx(b.score, abs=1e-6)
                np.testing.assert_allclose(a.attention.subword_weights, b.attention.subword_weights, atol=1e-6)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_in_graph_top_k_matches_the_full_distribution(arch, engines):
    """The decoder's TopK outputs agree with picking from ``log_probs``; a decoder without them is refused."""
    engine = engines[arch]
    model = engine.model
    src = np.array([engine.tokenize("three four five") + [engine.eos_id]], dtype=np.int64)
    encoded = model.encode(src)
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    tokens = np.full(1, engine.start_id, dtype=np.int64)
    session = model.sessions["decoder"]
    log_probs, ids, scores, eos, logits = session.run(
        ["log_probs", "top_ids", "top_log_probs", "eos_log_prob", LOGITS_OUTPUT],
        {"input_ids": tokens, **static, **state, "top_k": np.array([5])})
    shifted = logits - logits.max(axis=1, keepdims=True)  # the logits are what log_probs is the log-softmax of
    np.testing.assert_allclose(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)), log_probs, atol=1e-5)
    assert not np.allclose(logits, log_probs, atol=1e-3)  # not merely the log-probabilities again
    assert ids.shape == (1, 5) and (np.diff(scores, axis=1) <= 0).all()
    np.testing.assert_array_equal(scores, np.take_along_axis(log_probs, ids, 1))
    assert scores[0, 0] == log_probs.max() and eos[0] == log_probs[0, engine.eos_id]
    assert set(ids[0]) == set(np.argsort(-log_probs[0], kind="stable")[:5])

    class WithoutTopK:  # a decoder session as graphs exported before the in-graph TopK looked
        def __init__(self, session):
            self.session = session

        def get_outputs(self):
            return [o for o in self.session.get_outputs() if o.name not in TOP_K_OUTPUTS]

    sessions = {**model.sessions, "decoder": WithoutTopK(session)}
    with pytest.raises(ManifestError, match="top_ids"):
        OnnxStepModel(model.manifest, sessions)


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_mixed_length_batch_equals_one_by_one(arch, engines):
    engine = engines[arch]
    options = DecodingOptions(beam_size=3, num_hypotheses=2, return_attention=True)
    batched = engine.translate(TEXTS, options)
    for text, together in zip(TEXTS, batched, strict=True):
        [alone] = engine.translate([text], options)
        assert [h.token_ids for h in together.hypotheses] == [h.token_ids for h in alone.hypotheses]
        for a, b in zip(together.hypotheses, alone.hypotheses, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)
            np.testing.assert_allclose(a.attention.weights, b.attention.weights, atol=1e-5)


def test_length_runs_group_similar_lengths_and_count_each_call() -> None:
    lengths = np.array([13, 57, 12, 14, 56, 13, 11, 55])
    runs = length_runs(lengths, call_tokens=64)
    assert [sorted(lengths[r].tolist()) for r in runs] == [[11, 12, 13, 13, 14], [55, 56, 57]]
    assert sorted(np.concatenate(runs).tolist()) == list(range(8))  # every row once
    assert len(length_runs(lengths, call_tokens=10**6)) == 1  # calls too dear: one padded batch
    assert [r.tolist() for r in length_runs(np.array([10, 30]), call_tokens=64)] == [[0, 1]]  # 60 + 64 > 2 x 30
    assert [r.tolist() for r in length_runs(np.array([60, 10]), call_tokens=32)] == [[1], [0]]  # 70 + 64 < 120 + 32
    assert [r.tolist() for r in length_runs(np.array([7]), call_tokens=64)] == [[0]]


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_a_batch_encoded_in_length_runs_decodes_as_one_padded_batch(arch, engines, monkeypatch):
    """Each run of similar lengths is encoded on its own and the outputs are zero-padded back into the
    batch's row order: every sentence's outputs (on its own source positions) and translations equal those
    of the one padded batch; the padding the batch reports is the runs' own."""
    engine = engines[arch]
    texts = ["one", " ".join(["three four five six seven"] * 4), "two three", " ".join(["eight nine ten"] * 5)]
    requests = [SentenceRequest(engine.tokenize(t), DecodingOptions(beam_size=3, return_attention=True), text=t)
                for t in texts]
    monkeypatch.setattr("server.engine.engine.ENCODER_CALL_TOKENS", 10**6)
    one, _, padded = engine.encode(requests)
    expected = engine.translate_batch(requests).translations
    calls = []
    encode = engine.model.encode
    monkeypatch.setattr(engine.model, "encode", lambda batch: calls.append(batch.shape) or encode(batch))
    monkeypatch.setattr("server.engine.engine.ENCODER_CALL_TOKENS", 8)
    runs, _, source = engine.encode(requests)
    lengths = [len(r.source_ids) + 1 for r in requests]
    assert sorted(calls) == [(2, max(lengths[0], lengths[2])), (2, max(lengths[1], lengths[3]))]  # short, long
    assert padded.tokens == source.tokens == sum(lengths)
    assert padded.positions == padded.encoded_positions == source.positions == 4 * max(lengths)
    assert source.encoded_positions == sum(2 * max(pair) for pair in (lengths[0::2], lengths[1::2]))
    assert 0 < source.padding_ratio < padded.padding_ratio
    for name, value in one.items():
        assert runs[name].shape == value.shape and runs[name].dtype == value.dtype
        axis = engine.model.static_src_axes.get(name)
        for row, length in enumerate(lengths):
            mine = (row,) + (slice(None),) * (axis - 1) + (slice(0, length),) if axis else (row,)
            np.testing.assert_allclose(runs[name][mine], value[mine], atol=1e-5)
    got = engine.translate_batch(requests).translations
    for a, b in zip(got, expected, strict=True):
        assert [h.token_ids for h in a.hypotheses] == [h.token_ids for h in b.hypotheses]
        assert a.hypotheses[0].score == pytest.approx(b.hypotheses[0].score, abs=1e-5)
        np.testing.assert_allclose(a.hypotheses[0].attention.weights, b.hypotheses[0].attention.weights, atol=1e-5)


def test_per_sentence_options_and_batch_report(engines):
    engine = engines["transformer"]
    requests = [
        SentenceRequest(engine.tokenize("one two three"), DecodingOptions(beam_size=2, num_hypotheses=2)),
        SentenceRequest(engine.tokenize("four"), DecodingOptions(beam_size=2, num_hypotheses=1, max_length=2)),
    ]
    result = engine.translate_batch(requests)
    assert len(result.translations[0].hypotheses) == 2
    assert len(result.translations[1].hypotheses) == 1
    assert len(result.translations[1].hypotheses[0].token_ids) <= 1  # max_length 2 counts EOS
    assert result.source_tokens == sum(len(r.source_ids) + 1 for r in requests)
    assert 0 < result.padding_ratio < 1 and result.cancelled == 0 and result.generated_tokens > 0
    greedy = SentenceRequest([5], DecodingOptions(beam_size=1, return_attention=True))  # beams and graphs mix
    mixed = engine.translate_batch([requests[0], greedy]).translations
    assert mixed[0].hypotheses[0].token_ids == result.translations[0].hypotheses[0].token_ids
    assert mixed[1].hypotheses[0].attention is not None and mixed[0].hypotheses[0].attention is None


def test_cancelled_sentences_leave_the_batch(engines):
    engine = engines["bahdanau"]
    polls = []

    def cancelled():
        polls.append(1)
        return True

    requests = [SentenceRequest(engine.tokenize(t), DecodingOptions(beam_size=2)) for t in TEXTS[:2]]
    requests.append(SentenceRequest(engine.tokenize(TEXTS[2]), DecodingOptions(beam_size=2), is_cancelled=cancelled))
    result = engine.translate_batch(requests)
    assert result.translations[2] is None and result.cancelled == 1 and len(polls) == 1
    assert all(t is not None for t in result.translations[:2])


def test_attention_is_word_level_and_rows_sum_to_one(engines):
    for engine in engines.values():
        [translation] = engine.translate(["eight nine ten"], DecodingOptions(beam_size=2, return_attention=True))
        hypothesis = translation.hypotheses[0]
        attention = hypothesis.attention
        assert attention.weights.shape == (len(attention.target_words), len(attention.source_words))
        assert attention.source_words == ["eight", "nine", "ten"]
        np.testing.assert_allclose(attention.weights.sum(axis=1), 1.0, atol=1e-5)
        assert [a.target_index for a in attention.alignments] == list(range(len(attention.target_words)))
        assert attention.pharaoh().count("-") == len(attention.target_words)


def test_word_merging_on_a_hand_made_example():
    source = ["\u2581Diens", "tag", ",", "\u25812", "5", "."]  # "Dienstag, 25." (3 words)
    target = ["\u2581Tues", "day", "\u258125"]  # "Tuesday 25" (2 words)
    # rows: 3 target pieces + EOS; columns: 6 source pieces + EOS
    sub = np.array([
        [0.5, 0.3, 0.1, 0.0, 0.0, 0.0, 0.1],
        [0.3, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.6, 0.3, 0.1, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    ])
    assert word_groups(source) == [[0, 1, 2], [3, 4, 5]]
    attention = merge_to_words(sub, source, target)
    assert attention.source_words == ["Dienstag,", "25."] and attention.target_words == ["Tuesday", "25"]
    # "Tuesday" = mean of its two rows over the source words (EOS column dropped, then renormalised)
    np.testing.assert_allclose(attention.weights, [[1.0, 0.0], [0.0, 1.0]], atol=1e-6)
    assert attention.pharaoh() == "0-0 1-1"


def test_bare_word_marks_make_no_empty_word():
    """SentencePiece emits a bare '▁' before digits and sometimes alone: it spells no word of its own (a lone
    '▁' output is the empty text with no words, not one empty word)."""
    assert segment_words(["\u2581"], "") == [] and word_groups(["\u2581"]) == []
    assert segment_words(["\u2581", "9"], "9") == ["9"]
    assert word_groups(["\u2581", "\u2581nine", "\u2581"]) == [[0, 1, 2]]
    attention = merge_to_words(np.full((2, 2), 0.5), ["\u2581nine"], ["\u2581"])
    assert attention.target_words == [] and attention.alignments == [] and attention.weights.shape == (0, 1)


@given(st.lists(st.sampled_from(["\u2581a", "d", "\u2581", "\u2581\u2581"]), max_size=8))
def test_every_word_spells_something_and_every_piece_of_a_word_is_kept(pieces):
    groups = word_groups(pieces)
    assert all(word for word in words(pieces, groups))
    spelled = [i for i, piece in enumerate(pieces) if piece.strip("\u2581")]
    assert sorted(i for group in groups for i in group) == (list(range(len(pieces))) if spelled else [])


PIECES = st.lists(st.sampled_from(["\u2581a", "\u2581bc", "d", "e\u2581", "\u2581", ",", "<unk>"]), max_size=8)


@given(PIECES, st.lists(st.sampled_from(["a", "bc", "d,", "x"]), max_size=6))
def test_segment_words_is_the_text_split_when_it_has_a_word_per_group(pieces, text_words):
    """The words of a text: its own split when that has one word per word group of its pieces (counted, not
    built), else the pieces merged at word starts, as :func:`word_groups` groups them."""
    merged = words(pieces, word_groups(pieces))
    text = " ".join(text_words)
    assert segment_words(pieces, text) == (text.split() if len(text.split()) == len(merged) else merged)


def test_thread_spinning_only_within_a_run_unless_turned_off(tiny_models):
    """Each session has its own thread pool: pools left spinning between runs would fight for the cores."""
    def spinning(engine: Engine) -> set[tuple[str, str]]:
        return {(options.get_session_config_entry("session.intra_op.allow_spinning"),
                 options.get_session_config_entry("session.force_spinning_stop"))
                for options in (session.get_session_options() for session in engine.model.sessions.values())}

    assert spinning(Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1)) == {("1", "1")}
    quiet = Engine.load(tiny_models["transformer"], provider="cpu", intra_op_threads=1, spinning=False)
    assert spinning(quiet) == {("0", "0")}
