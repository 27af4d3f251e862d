"""Decoding controls against CTranslate2 on the same weights (issue 15).

The Marian model of :mod:`tests.marian` is imported and served over gRPC (the shared fixtures of
``conftest.py``) and the same directory is converted for CTranslate2. On the 20 held-out sentences, at
beam 1 and 4, each control must give the pieces ``Translator.translate_batch`` gives with the matching
option, and the same scores within :data:`SCORE_TOLERANCE`; ``Score`` must give ``score_batch``'s
per-token log-probabilities. Greedy outputs are also checked against ``MarianMTModel.generate``.

CTranslate2 is asked for what our options mean: ``min_decoding_length=0`` unless a case sets it (its
default 1 bars an empty translation, ours allows it), ``max_decoding_length`` 64 (the model's
``max_length``), and at beam 4 ``patience`` 4 x ours: CTranslate2 stops as soon as it holds
beam x patience finished hypotheses, ours also goes on while a live beam can still beat them (README).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from server.protos import pb2
from tests.harness import ServerHarness
from tests.marian import dates_split, held_out

ctranslate2 = pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")

# The same float32 weights run by two runtimes (ONNX Runtime, CTranslate2's CPU kernels): per-token
# log-probabilities agree within 2e-6 and hypothesis scores within 6e-7 here. 1e-5 leaves a 5x margin,
# while a semantic difference (a prefix counted in the score, a penalty on log-probabilities instead of
# logits, an unrenormalised distribution) moves scores by 1e-3 or more.
SCORE_TOLERANCE = 1e-5
MAX_LENGTH = 64
SUPPRESSED = ["zweihundert", "19"]  # one piece, and two pieces ("▁", "19")
CT2_NAMES = {"min_length": "min_decoding_length"}  # the other options have CTranslate2's names

Output = tuple[list[str], float]  # best hypothesis: pieces (end of sentence excluded), score


def prefixes() -> list[str]:
    """One prefix per held-out text: the first word of another sentence's reference, so decoding is forced
    off its own path and must recover from there. It ends with a space: a complete word, as CTranslate2's
    target_prefix pieces are (without it the server takes the word as one being typed and lets the model
    spell it with any pieces, :mod:`server.completion`)."""
    references = [target for _, target in dates_split()[1]]
    return [references[(i + 1) % len(references)].split()[0] + " " for i in range(len(references))]


class Reference:
    """CTranslate2 on the converted directory, with the held-out sources and prefixes as its pieces."""

    def __init__(self, ct2_dir: Path, marian_dir: Path) -> None:
        self.translator = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1)
        self.tokenizer = transformers.MarianTokenizer.from_pretrained(marian_dir)
        self.sources = [self.tokenizer.convert_ids_to_tokens(self.tokenizer(text)["input_ids"]) for text in held_out()]
        self.prefixes = [self.pieces(prefix) for prefix in prefixes()]

    def pieces(self, text: str) -> list[str]:
        """``text``'s target pieces (our target tokenizer gives the same ids: tests/test_huggingface.py)."""
        return self.tokenizer.convert_ids_to_tokens(self.tokenizer(text_target=text)["input_ids"])[:-1]  # no </s>

    def translate(self, beam: int, prefixed: bool = False, **options: Any) -> list[Output]:
        """CTranslate2's best hypotheses for our ``options`` (translated to its names and meanings)."""
        kwargs = {CT2_NAMES.get(name, name): value for name, value in options.items()}
        kwargs.setdefault("min_decoding_length", 0)
        kwargs["patience"] = 4 * options.get("patience", 1.0) if beam > 1 else 1.0
        if "suppress_sequences" in kwargs:
            kwargs["suppress_sequences"] = [self.pieces(text) for text in kwargs["suppress_sequences"]]
        results = self.translator.translate_batch(
            self.sources, target_prefix=self.prefixes if prefixed else None, beam_size=beam, length_penalty=1.0,
            max_decoding_length=MAX_LENGTH, return_scores=True, **kwargs)
        return [(r.hypotheses[0], r.scores[0]) for r in results]


@pytest.fixture(scope="module")
def ct2(ct2_dir: Path, marian_dir: Path) -> Reference:
    return Reference(ct2_dir, marian_dir)


def ours(server: ServerHarness, beam: int, prefixed: bool = False, **options: Any) -> list[Output]:
    request = pb2.TranslateRequest(texts=held_out(), target_prefixes=prefixes() if prefixed else [],
                                   options=pb2.DecodingOptions(beam_size=beam, length_penalty=1.0,
                                                               return_scores=True, **options))
    response = server.stub.Translate(request, timeout=60)
    return [(list(t.hypotheses[0].subword_tokens), t.hypotheses[0].score) for t in response.translations]


def assert_same(ours_out: Sequence[Output], theirs_out: Sequence[Output]) -> None:
    assert [pieces for pieces, _ in ours_out] == [pieces for pieces, _ in theirs_out]
    assert [score for _, score in ours_out] == pytest.approx([score for _, score in theirs_out], abs=SCORE_TOLERANCE)


CASES = {  # name -> (target prefixes?, our options)
    "target_prefix": (True, {}),
    "min_length": (False, dict(min_length=12)),
    "min_length with a prefix (it counts)": (True, dict(min_length=12)),
    "repetition_penalty 1.5": (False, dict(repetition_penalty=1.5)),
    "repetition_penalty 5": (False, dict(repetition_penalty=5.0)),
    "repetition_penalty with a prefix (penalised)": (True, dict(repetition_penalty=2.0)),
    "no_repeat_ngram_size 1": (False, dict(no_repeat_ngram_size=1)),
    "no_repeat_ngram_size 1 with a prefix (its pieces count)": (True, dict(no_repeat_ngram_size=1)),
    "no_repeat_ngram_size 2 with a prefix": (True, dict(no_repeat_ngram_size=2)),
    "suppress_sequences": (False, dict(suppress_sequences=SUPPRESSED)),
    "patience 2": (False, dict(patience=2.0)),
    "all together": (True, dict(min_length=6, repetition_penalty=1.5, no_repeat_ngram_size=3, disable_unk=True,
                                suppress_sequences=SUPPRESSED)),
}


@pytest.mark.parametrize("beam", [1, 4])
def test_plain_and_disable_unk_equal_ctranslate2(marian_server: ServerHarness, ct2: Reference, beam: int) -> None:
    plain = ours(marian_server, beam)
    assert_same(plain, ct2.translate(beam))
    without_unk = ours(marian_server, beam, disable_unk=True)
    assert [p for p, _ in without_unk] == [p for p, _ in plain]  # this model never prefers <unk> here
    assert_same(without_unk, ct2.translate(beam, disable_unk=True))


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_control_equals_ctranslate2(marian_server: ServerHarness, ct2: Reference, case: str, beam: int) -> None:
    prefixed, options = CASES[case]
    got = ours(marian_server, beam, prefixed, **options)
    assert_same(got, ct2.translate(beam, prefixed, **options))
    if case != "patience 2":  # the others change outputs here (vs the same prefixes alone): not vacuous
        assert got != ours(marian_server, beam, prefixed and bool(options))
    if prefixed:
        assert all(pieces[: len(prefix)] == prefix for (pieces, _), prefix in zip(got, ct2.prefixes, strict=True))


def test_score_equals_score_batch(marian_server: ServerHarness, ct2: Reference) -> None:
    """Per-token log-probabilities of the end of sentence included, the decoder start token not scored;
    ``score`` is their mean (length_penalty 1), as ScoringResult's normalized score."""
    references = [target for _, target in dates_split()[1]]
    own = [ct2.tokenizer.convert_tokens_to_string(pieces) for pieces, _ in ours(marian_server, 4)]
    for targets in (references, own):
        response = marian_server.stub.Score(pb2.ScoreRequest(texts=held_out(), targets=targets, length_penalty=1.0),
                                            timeout=60)
        results = ct2.translator.score_batch(ct2.sources, [ct2.pieces(target) for target in targets])
        for translation, result in zip(response.translations, results, strict=True):
            [hypothesis] = translation.hypotheses
            assert [*hypothesis.subword_tokens, "</s>"] == result.tokens
            assert list(hypothesis.token_scores) == pytest.approx(result.log_probs, abs=SCORE_TOLERANCE)
            assert hypothesis.score == pytest.approx(sum(result.log_probs) / len(result.log_probs),
                                                     abs=SCORE_TOLERANCE)


@pytest.mark.parametrize("options, generate", [
    (dict(repetition_penalty=2.0), dict(repetition_penalty=2.0)),
    (dict(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=1)),
    (dict(min_length=12), dict(min_new_tokens=12)),  # its min_length counts the decoder start token
])
def test_greedy_controls_equal_transformers(marian_server: ServerHarness, marian_dir: Path, ct2: Reference,
                                            options: dict[str, Any], generate: dict[str, Any]) -> None:
    """A third reference: ``MarianMTModel.generate``'s logits processors (greedy; its beam search applies them
    to log-probabilities, not logits)."""
    model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    batch = ct2.tokenizer(held_out(), return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**batch, num_beams=1, do_sample=False, max_length=MAX_LENGTH, **generate)
    special = {model.config.pad_token_id, model.config.eos_token_id}
    expected = [ct2.tokenizer.convert_ids_to_tokens([int(i) for i in row if int(i) not in special]) for row in output]
    assert [pieces for pieces, _ in ours(marian_server, 1, **options)] == expected
