"""Hugging Face Marian (OPUS-MT) models, both ways, offline.

A small ``MarianMTModel`` trained on the dates corpus (:mod:`tests.marian`) is imported with ``nmt export``,
served over gRPC, and its greedy and beam-4 outputs (text and token ids) on 20 held-out sentences must
equal ``MarianMTModel.generate`` and CTranslate2 on the same directory. The tiny Transformer of the
session exported ``--to huggingface`` must translate under ``transformers`` as it does served.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import sentencepiece as spm

from clients.client import TranslatorClient
from common.errors import NmtError
from common.model_format.manifest import read_manifest
from common.model_format.tokenizer import WORD_START, MarianTokenizer
from export.options import ExportOptions
from export.pipeline import export_model
from nmt.cli import main as nmt_main
from server.alignment import segment_words
from server.engine.engine import Engine
from server.protos import pb2
from server.types import ScoredSequence, SearchResult, SentenceRequest
from tests.harness import ServerHarness
from tests.marian import LANGUAGES, MODEL, dates_split, held_out, write_tokenizer_files

transformers = pytest.importorskip("transformers")
LENGTH_PENALTY = 1.0


def served(server: ServerHarness, texts: list[str], beam: int, **request: Any) -> list[Any]:
    options = pb2.DecodingOptions(beam_size=beam, length_penalty=LENGTH_PENALTY)
    response = server.stub.Translate(pb2.TranslateRequest(texts=texts, options=options, **request), timeout=60)
    return [t.hypotheses[0] for t in response.translations]


def hf_generate(directory: Path, texts: list[str], beam: int) -> list[list[int]]:
    """``MarianMTModel.generate`` token ids (decoder start and EOS and padding stripped)."""
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    output = model.generate(**batch, num_beams=beam, length_penalty=LENGTH_PENALTY, do_sample=False)
    special = {model.config.pad_token_id, model.config.eos_token_id, model.config.decoder_start_token_id}
    return [[int(i) for i in row if int(i) not in special] for row in output]


def test_tokenizer_ids_equal_marian_tokenizers(marian_dir: Path) -> None:
    ours = MarianTokenizer.load(marian_dir)
    theirs = transformers.MarianTokenizer.from_pretrained(marian_dir)
    odd = "Straße £ 12 unknown ⁂ pieces"
    for source, target in [*dates_split()[1], (odd, odd)]:
        assert ours.encode(source) + [ours.eos_id] == theirs(source)["input_ids"]
        ids = theirs(text_target=target)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


SHARED_ONLY = ("\u2581w49772", "w49772", "\u2581Ökonomie", "<0x41>")  # in vocab.json, in neither SentencePiece model


def lacking_ids(directory: Path, pieces: list[str], special: set[int]) -> list[int]:
    """The ids of ``pieces`` (vocab.json's) that ``target.spm`` does not know, special ones left out."""
    target = spm.SentencePieceProcessor(model_file=str(directory / "target.spm"))
    return [i for i, piece in enumerate(pieces) if target.piece_to_id(piece) == target.unk_id() and i not in special]


def random_sequences(ids: list[int], lacking: list[int], count: int, seed: int = 34) -> list[list[int]]:
    """``count`` id sequences of 1-12 ids, about half of them ids ``target.spm`` lacks."""
    rng = random.Random(seed)
    return [[rng.choice(lacking if rng.random() < 0.5 else ids) for _ in range(rng.randrange(1, 13))]
            for _ in range(count)]


def test_detokenization_equals_marian_tokenizers_for_pieces_target_spm_lacks(tmp_path: Path) -> None:
    """Issue 34: a shared vocabulary's pieces that ``target.spm`` lacks came back glued with their \u2581 marks."""
    pieces = write_tokenizer_files(tmp_path, extra_pieces=SHARED_ONLY)
    ours = MarianTokenizer.load(tmp_path)
    theirs = transformers.MarianTokenizer(*(str(tmp_path / name) for name in MarianTokenizer.files))
    special = {ours.eos_id, ours.unk_id, ours.pad_id}
    lacking = lacking_ids(tmp_path, pieces, special)
    assert len(lacking) > 50 and {pieces.index(p) for p in SHARED_ONLY} <= set(lacking)
    w = pieces.index("\u2581w49772")
    assert ours.decode([w] * 3) == theirs.decode([w] * 3, skip_special_tokens=True) == "w49772 w49772 w49772"
    everything = list(range(len(pieces)))
    for ids in [[i] for i in everything] + random_sequences(everything, lacking, 1000):
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), [pieces[i] for i in ids]
    # the words of a hypothesis (one per piece group starting at \u2581) are the text's words
    plain = [i for i in everything if i not in special and pieces[i] != WORD_START]
    for ids in random_sequences(plain, [i for i in lacking if pieces[i] != WORD_START], 300):
        tokens = ours.pieces(ids)
        assert segment_words(tokens, ours.decode(ids)) == ours.decode(ids).split(), tokens


def test_import_records_its_origin_and_marian_settings(marian_repository: Path, marian_dir: Path) -> None:
    manifest = read_manifest(marian_repository / MODEL / "1")
    assert manifest.tokenizer_type == "marian"
    assert manifest.target_languages == list(LANGUAGES)
    assert {"source.spm", "target.spm", "vocab.json"} <= manifest.files.keys()
    config = json.loads((marian_dir / "config.json").read_text())
    assert manifest.special_ids == {"pad": config["pad_token_id"], "unk": 1, "bos": config["pad_token_id"],
                                    "eos": 0, "decoder_start": config["decoder_start_token_id"]}
    assert manifest.defaults == {"beam_size": 4, "length_penalty": 1.0, "max_length": 64}  # generation_config
    assert manifest.origin["format"] == "huggingface-marian"
    assert manifest.origin["suppressed_ids"] == [config["pad_token_id"]]  # bad_words_ids [[pad]]
    assert manifest.origin["max_logit_diff_vs_transformers"] <= 1e-4
    assert manifest.parity["greedy_match"] == manifest.parity["beam4_match"] == "20/20"
    assert manifest.attention_blocks["fused"] == manifest.attention_blocks["total"]


@pytest.mark.parametrize("beam", [1, 4])
def test_served_equals_transformers_and_ctranslate2(marian_server: ServerHarness, marian_dir: Path, beam: int,
                                                    ct2_dir: Path) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    texts = held_out()
    assert len(texts) == 20
    vocab = json.loads((marian_dir / "vocab.json").read_text())
    hypotheses = served(marian_server, texts, beam)
    ours = [[vocab[piece] for piece in h.subword_tokens] for h in hypotheses]
    assert ours == hf_generate(marian_dir, texts, beam)

    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1)
    tokenizer = transformers.MarianTokenizer.from_pretrained(marian_dir)
    sources = [tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"]) for text in texts]
    # CTranslate2 ends a beam search once it holds beam x patience finished hypotheses; transformers
    # (early_stopping=False) and this engine go on while an unfinished beam can still win. CTranslate2's
    # patience=4 goes on long enough (measured: with its default, 14 of 20 beam-4 outputs agree; with
    # patience 4, 20 of 20).
    results = translator.translate_batch(sources, beam_size=beam, length_penalty=LENGTH_PENALTY, max_batch_size=8,
                                         patience=4)
    assert [list(h.subword_tokens) for h in hypotheses] == [r.hypotheses[0] for r in results]
    references = [target for _, target in dates_split()[1]]
    texts_out = [h.text for h in hypotheses]
    assert texts_out == [tokenizer.decode([vocab[p] for p in r.hypotheses[0]], skip_special_tokens=True)
                         for r in results]
    assert sum(a == b for a, b in zip(texts_out, references, strict=True)) >= 12  # a trained model, not noise


def test_served_text_tokens_and_words_of_pieces_target_spm_lacks(marian_repository: Path, marian_dir: Path) -> None:
    """The engine's detokenizer on hypotheses holding vocab.json pieces that ``target.spm`` lacks (the English
    ones): text as ``MarianTokenizer.decode``, tokens the pieces, words and aligned words the text's words."""
    engine = Engine.load(marian_repository / MODEL / "1", provider="cpu", intra_op_threads=1)
    theirs = transformers.MarianTokenizer.from_pretrained(marian_dir)
    pieces = engine.tokenizer.pieces(range(engine.manifest.vocab_size))
    special = {engine.eos_id, engine.pad_id, engine.tokenizer.unk_id}
    lacking = [i for i in lacking_ids(marian_dir, pieces, special) if pieces[i] != WORD_START]
    assert "\u2581thousand" in [pieces[i] for i in lacking]
    plain = [i for i in range(len(pieces)) if i not in special and pieces[i] != WORD_START]
    request = SentenceRequest(source_ids=engine.tokenize(held_out()[0]), text=held_out()[0])
    width = len(request.source_ids) + 1
    for ids in random_sequences(plain, lacking, 200):
        length = len(ids) + 1
        result = SearchResult([ScoredSequence(tokens=[*ids, engine.eos_id], score=0.0, token_scores=[0.0] * length,
                                              attention=np.full((length, width), 1 / width, dtype=np.float32))])
        [hypothesis] = engine.to_translation(request, result).hypotheses
        assert hypothesis.text == theirs.decode(ids, skip_special_tokens=True)
        assert hypothesis.tokens == [pieces[i] for i in ids]
        assert hypothesis.words == hypothesis.attention.target_words == hypothesis.text.split()
        assert len(hypothesis.attention.alignments) == len(hypothesis.words)


def test_target_language_inserts_the_language_token(marian_server: ServerHarness, marian_dir: Path) -> None:
    [info] = marian_server.stub.ListModels(pb2.ListModelsRequest(), timeout=10).models
    assert list(info.target_languages) == list(LANGUAGES)
    texts = held_out()[:6]
    vocab = json.loads((marian_dir / "vocab.json").read_text())
    for language in LANGUAGES:
        hypotheses = served(marian_server, texts, 1, target_language=language)
        expected = hf_generate(marian_dir, [f">>{language}<< {text}" for text in texts], 1)
        assert [[vocab[piece] for piece in h.subword_tokens] for h in hypotheses] == expected
    with TranslatorClient(marian_server.address, timeout=30) as client:
        assert client.list_models()[0].target_languages == LANGUAGES
        [result] = client.translate(texts[0], beam_size=1, target_language="nld")
        assert result.best.text == served(marian_server, texts[:1], 1, target_language="nld")[0].text
    with pytest.raises(grpc.RpcError) as error:
        served(marian_server, texts, 1, target_language="fra")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND  # no model translates to it: the pairs are listed
    assert "en->deu, en->nld" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:  # the model named: its own languages are listed
        served(marian_server, texts, 1, target_language="fra", model=marian_server.model_version().name)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "choose deu, nld" in error.value.details()


def test_round_trip_to_huggingface(model_version_dir: Path, tiny_runs: dict[str, Path], tmp_path: Path) -> None:
    """The session's tiny Transformer written as a Marian directory translates under transformers as served."""
    from server.engine.engine import Engine

    out = tmp_path / "tiny-marian"
    assert nmt_main(["export", str(tiny_runs["transformer"]), "--to", "huggingface", "--out", str(out),
                     "--no-progress"]) == 0
    assert {"config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    texts = [line.split("\t")[0] for line in (tiny_runs["transformer"] / "test.tsv").read_text().splitlines()]
    engine = Engine.load(model_version_dir, provider="cpu", intra_op_threads=1, inter_op_threads=1)
    for beam in (1, 4):
        options = dataclasses.replace(engine.default_options(), beam_size=beam)
        expected = [t.hypotheses[0].token_ids for t in engine.translate(texts, options)]
        assert hf_generate(out, texts, beam) == expected
    assert nmt_main(["export", str(tiny_runs["transformer"]), "--to", "huggingface", "--out", str(out)]) != 0


def test_unsupported_config_and_missing_tokenizer_are_named(marian_dir: Path, tmp_path: Path) -> None:
    def broken(change: dict[str, Any], drop: str | None = None) -> Path:
        directory = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(marian_dir, directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        if drop:
            (directory / drop).unlink()
        return directory

    def export(directory: Path) -> None:
        export_model(ExportOptions(stage_processes=False,
                                   checkpoint=str(directory), name="x", model_repository=str(tmp_path / "repo"),
                                   progress=False))

    with pytest.raises(NmtError, match="normalize_before=true is not supported"):
        export(broken({"normalize_before": True}))
    with pytest.raises(NmtError, match="share_encoder_decoder_embeddings=false"):
        export(broken({"share_encoder_decoder_embeddings": False}))
    with pytest.raises(NmtError, match="decoder_ffn_dim"):
        export(broken({"decoder_ffn_dim": 256}))
    with pytest.raises(NmtError, match="model_type 'bart'"):
        export(broken({"model_type": "bart"}))
    with pytest.raises(NmtError, match="tokenizer file missing: .*target.spm"):
        export(broken({}, drop="target.spm"))
    assert not (tmp_path / "repo" / "x").exists()


def test_target_language_of_a_one_pair_model(model_version_dir: Path) -> None:
    """A model trained here takes its own target language or none; another is INVALID_ARGUMENT."""
    from server.engine.engine import Engine
    from server.errors import InvalidArgument
    from server.text import LanguageTokens

    engine = Engine.load(model_version_dir, provider="cpu", intra_op_threads=1, inter_op_threads=1)
    assert engine.language_tokens("", "") == engine.language_tokens("", "de") == LanguageTokens()
    with pytest.raises(InvalidArgument, match="choose de"):
        engine.language_tokens("", "deu")
