"""Many-to-many Hugging Face models (NLLB-200, M2M-100, mBART-50), imported and served, offline.

Small models of each family (:mod:`tests.multilingual_dirs`: a SentencePiece model trained here, the family's own
``transformers`` tokenizer, a few hundred training steps of copying sentences into each language) are imported
with ``nmt export``. Served outputs must equal ``generate(forced_bos_token_id=...)`` token for token, greedy and
beam 4, with several language pairs in one batch, static and continuous; the text must equal the tokenizer's
decode of those tokens.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.model_format.decoding import max_target_length
from common.model_format.manifest import read_manifest
from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.engine.engine import Engine
from server.protos import pb2
from server.types import DecodingOptions, SentenceRequest, TargetPrefix
from tests.harness import ServerHarness
from tests.multilingual_dirs import M2M100_CODES, MBART_CODES, NLLB_CODES, m2m100_dir, mbart50_dir, nllb_dir, sentences

transformers = pytest.importorskip("transformers")
def legacy_copy(nllb: Path, directory: Path) -> Path:
    """The NLLB directory ``nllb`` copied to ``directory`` with ``legacy_behaviour: true``: the source code after
    EOS."""
    shutil.copytree(nllb, directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "legacy_behaviour": True}))
    return directory


FAMILIES = {"nllb": (nllb_dir, NLLB_CODES), "nllb-legacy": (legacy_copy, NLLB_CODES),
            "m2m": (m2m100_dir, M2M100_CODES), "mbart": (mbart50_dir, MBART_CODES)}
TEXTS = sentences(12, seed=5)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("many-to-many")
    built: dict[str, Path] = {}
    for name, (build, _) in FAMILIES.items():
        built[name] = legacy_copy(built["nllb"], root / name) if build is legacy_copy else build(root / name)
    return built


@pytest.fixture(scope="module")
def repository(family_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("many-to-many-models")
    for name, directory in family_dirs.items():
        assert nmt_main(["export", str(directory), "--name", name, "--model-repository", str(repository),
                         "--no-stage-processes", "--no-progress", "--parity-sentences", "6"]) == 0
    return repository


@pytest.fixture(scope="module")
def server(repository: Path) -> Any:
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="", model_repository=str(repository),
                          provider="cpu", intra_op_threads=1, grace_seconds=1, batching="continuous",
                          default_model="nllb", cache_mb=0).validate()
    harness = ServerHarness(config)
    yield harness
    harness.close()


def pairs(codes: list[str]) -> list[tuple[str, str]]:
    """One (source, target) pair per text, every ordered pair of ``codes`` in turn."""
    every = [(s, t) for s in codes for t in codes if s != t]
    return [every[i % len(every)] for i in range(len(TEXTS))]


def generate(directory: Path, text: str, source: str, target: str, beam: int) -> tuple[list[int], list[int]]:
    """(source ids, generated ids without the decoder start, the language token and EOS) of ``generate``, its
    output limit the engine's (HF's ``max_length`` counts the decoder start too; its forced EOS ends there)."""
    model, tokenizer = _reference(directory)
    tokenizer.src_lang = source
    ids = tokenizer(text, return_tensors="pt").input_ids
    language = tokenizer.get_lang_id(target) if hasattr(tokenizer, "get_lang_id") else \
        tokenizer.convert_tokens_to_ids(target)
    limit = max_target_length(ids.shape[1], 256) + 1  # the engine's limit counts the language token: + start
    out = model.generate(ids, forced_bos_token_id=language, num_beams=beam, max_length=limit, length_penalty=1.0,
                         early_stopping=False, do_sample=False, forced_eos_token_id=model.config.eos_token_id)
    tokens = out[0].tolist()
    assert tokens[:2] == [model.config.decoder_start_token_id, language]
    return ids[0].tolist(), tokens[2:-1] if tokens[-1] == model.config.eos_token_id else tokens[2:]


_REFERENCES: dict[Path, Any] = {}


def _reference(directory: Path) -> Any:
    if directory not in _REFERENCES:
        _REFERENCES[directory] = (transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval(),
                                  transformers.AutoTokenizer.from_pretrained(directory))
    return _REFERENCES[directory]


def decode(directory: Path, ids: list[int]) -> str:
    """The family's tokenizer's text of ``ids``, language tokens left out as the service leaves them out."""
    _, tokenizer = _reference(directory)
    languages = {i for i in tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens)}
    return tokenizer.decode([i for i in ids if i not in languages], skip_special_tokens=True)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_served_equals_generate_with_several_pairs_in_one_batch(repository: Path, family_dirs: dict[str, Path],
                                                                family: str, beam: int) -> None:
    """One static batch holds every ordered pair of the family's codes: each sentence's tokens equal
    ``generate``'s for its pair, its source ids the tokenizer's, its text the tokenizer's decode."""
    engine = Engine.load(repository / family / "1", provider="cpu", intra_op_threads=1, inter_op_threads=1)
    options = DecodingOptions(beam_size=beam, num_hypotheses=1, length_penalty=1.0, max_length=256)
    chosen = pairs(FAMILIES[family][1])
    requests = []
    for text, (source, target) in zip(TEXTS, chosen, strict=True):
        languages = engine.language_tokens(source, target)
        requests.append(SentenceRequest([*languages.source, *engine.tokenize(text)], options, text=text,
                                        target_prefix=TargetPrefix().led(languages.lead),
                                        source_end=languages.source_end))
    translations = engine.translate_batch(requests).translations
    directory = family_dirs[family]
    for request, translation, text, (source, target) in zip(requests, translations, TEXTS, chosen, strict=True):
        source_ids, expected = generate(directory, text, source, target, beam)
        assert request.source(engine.eos_id) == source_ids
        best = translation.hypotheses[0]
        assert best.token_ids == expected, (family, beam, text, source, target)
        assert best.text == decode(directory, expected)
        assert len(best.token_scores) == len(best.tokens) + 1  # the language token's left out, EOS kept


def test_import_records_languages_and_the_pre_norm_shape(repository: Path, family_dirs: dict[str, Path]) -> None:
    for family, (_, codes) in FAMILIES.items():
        manifest = read_manifest(repository / family / "1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(family_dirs[family])
        assert set(codes) <= set(manifest.source_languages) == set(manifest.target_languages)
        assert manifest.target_language_token == "decoder"
        assert manifest.source_language_token == ("end" if family == "nllb-legacy" else "")
        assert manifest.source_language == tokenizer.src_lang
        assert manifest.dimensions["pre_norm"] is True
        assert manifest.dimensions["position_encoding"] == ("learned" if family == "mbart" else "fairseq")
        assert manifest.origin["max_logit_diff_vs_transformers"] <= 1e-4
        assert manifest.attention_blocks["fused"] == manifest.attention_blocks["total"]


def test_grpc_languages_pairs_and_errors(server: ServerHarness) -> None:
    """ListModels lists the languages; a request names its pair by codes (any case; the model chosen by the pair
    when it names none); an unknown code is INVALID_ARGUMENT naming the valid ones."""
    models = {m.name: m for m in server.stub.ListModels(pb2.ListModelsRequest(), timeout=30).models}
    assert set(NLLB_CODES) == set(models["nllb"].source_languages) == set(models["nllb"].target_languages)

    def translate(**fields: Any) -> Any:
        options = pb2.DecodingOptions(beam_size=4)
        return server.stub.Translate(pb2.TranslateRequest(texts=[TEXTS[0]], options=options, **fields), timeout=60)

    named = translate(model="nllb", source_language="fra_Latn", target_language="deu_Latn")
    routed = translate(source_language="FRA_LATN", target_language="deu_latn")
    assert routed.translations[0].hypotheses[0].text == named.translations[0].hypotheses[0].text
    assert routed.model == "nllb"
    default_source = translate(model="nllb", target_language="deu_Latn")
    explicit = translate(model="nllb", source_language="eng_Latn", target_language="deu_Latn")
    assert default_source.translations[0].hypotheses[0].text == explicit.translations[0].hypotheses[0].text
    pieces = explicit.translations[0].hypotheses[0].subword_tokens
    assert not set(pieces) & set(NLLB_CODES)
    for fields, field in (({"target_language": "xx_Latn"}, "target_language"),
                          ({"source_language": "xx_Latn", "target_language": "deu_Latn"}, "source_language")):
        with pytest.raises(grpc.RpcError) as error:
            translate(model="nllb", **fields)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in error.value.details() and "eng_Latn, deu_Latn, fra_Latn" in error.value.details()


def test_continuous_batching_mixes_target_languages(server: ServerHarness, repository: Path) -> None:
    """Concurrent requests of different pairs share the continuous decode: each equals its static result."""
    engine = Engine.load(repository / "nllb" / "1", provider="cpu", intra_op_threads=1, inter_op_threads=1)
    chosen = pairs(NLLB_CODES)

    def served(i: int) -> str:
        source, target = chosen[i]
        request = pb2.TranslateRequest(texts=[TEXTS[i]], model="nllb", source_language=source, target_language=target,
                                       options=pb2.DecodingOptions(beam_size=4))
        return server.stub.Translate(request, timeout=60).translations[0].hypotheses[0].text

    with ThreadPoolExecutor(len(TEXTS)) as pool:
        texts = list(pool.map(served, range(len(TEXTS))))
    options = DecodingOptions(beam_size=4, num_hypotheses=1, length_penalty=1.0, max_length=256)
    for i, (source, target) in enumerate(chosen):
        languages = engine.language_tokens(source, target)
        request = SentenceRequest([*languages.source, *engine.tokenize(TEXTS[i])], options, text=TEXTS[i],
                                  target_prefix=TargetPrefix().led(languages.lead))
        assert texts[i] == engine.translate_batch([request]).translations[0].hypotheses[0].text


def test_streaming_leaves_the_language_token_out(server: ServerHarness) -> None:
    request = pb2.TranslateRequest(texts=[TEXTS[3]], model="nllb", target_language="fra_Latn",
                                   options=pb2.DecodingOptions(beam_size=1))
    whole = server.stub.Translate(request, timeout=60).translations[0].hypotheses[0]
    deltas = list(server.stub.TranslateStreaming(request, timeout=60))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.subword_tokens] == list(whole.subword_tokens)


def test_other_architectures_are_refused_naming_those_supported(family_dirs: dict[str, Path], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    other = shutil.copytree(family_dirs["m2m"], tmp_path / "t5")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    code = nmt_main(["export", str(other), "--name", "t5", "--model-repository", str(tmp_path / "repo"),
                     "--no-stage-processes", "--no-progress"])
    assert code != 0
    message = capsys.readouterr().err
    assert "model_type 't5' is not supported" in message and "m2m_100" in message and "mbart" in message
    assert not (tmp_path / "repo" / "t5").exists()
