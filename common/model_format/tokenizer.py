"""Tokenizers shared by training, export and serving (no torch); the manifest names the kind.

* ``sentencepiece`` (:class:`Tokenizer`): one joint source+target model file (``spm.model``, a protobuf,
  never a pickle), as trained here, with the fixed special ids below, which model configs default to;
* ``marian`` (:class:`MarianTokenizer`): Hugging Face Marian's (OPUS-MT) separate ``source.spm`` and
  ``target.spm`` and the shared ``vocab.json`` mapping pieces to model ids (M2M-100's SentencePiece model and
  vocabulary are stored the same way, one model on both sides);
* ``huggingface`` (:class:`HfTokenizer`): a Hugging Face ``tokenizer.json`` (NLLB-200's and mBART-50's), run
  by the ``tokenizers`` library as ``transformers`` runs it.

Both expose the same methods (``encode`` source text, ``pieces``/``decode`` ids), so the engine and the
server do not care which kind a version has; :func:`load_tokenizer` picks it.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from common.errors import NmtError
from common.model_format.layout import (
    HF_TOKENIZER_FILE,
    MARIAN_SOURCE_SPM,
    MARIAN_TARGET_SPM,
    MARIAN_VOCAB,
    TOKENIZER_FILE,
)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
LANGUAGE_TOKEN = re.compile(r"^>>([^<>\s]+)<<$")  # Marian's target-language tokens, e.g. >>deu<<
WORD_START = "\u2581"  # SentencePiece's word-boundary mark


class Tokenizer:
    """Encode text to subword ids and back; ids exclude BOS/EOS unless asked."""

    kind = "sentencepiece"
    files = (TOKENIZER_FILE,)

    def __init__(self, model_proto: bytes) -> None:
        self._model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if self._sp.eos_id() < 0 or self._sp.pad_id() < 0:
            raise ValueError("a translation tokenizer needs end-of-sentence and padding pieces")
        self.pad_id, self.eos_id, self.bos_id = self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id()
        self.unk_id = self._sp.unk_id()

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load ``spm.model`` from a checkpoint or model-version directory."""
        return cls((Path(directory) / TOKENIZER_FILE).read_bytes())

    def save(self, directory: str | Path) -> Path:
        """Write ``spm.model`` into ``directory`` and return its path."""
        path = Path(directory) / TOKENIZER_FILE
        path.write_bytes(self._model_proto)
        return path

    @property
    def model_proto(self) -> bytes:
        return self._model_proto

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @functools.cached_property
    def max_piece_bytes(self) -> int:
        """The most UTF-8 bytes one id can add to a decoded text or a piece list (at least 5: " ⁇ " for
        an unknown piece)."""
        return max(5, *(len(piece.encode("utf-8")) for piece in self._piece_table))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids of ``text`` (a target prefix, a translation to score): the joint model's."""
        return self._sp.encode(text)

    def pieces(self, ids: Iterable[int]) -> list[str]:
        table = self._piece_table
        return [table[i] for i in ids]

    @functools.cached_property
    def _piece_table(self) -> list[str]:
        """Every id's piece, read from the model once: a lookup per id costs ~0.1 us here, ~1 us through it."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    target_languages: list[str] = []  # a joint model trained here serves one language pair

    def language_id(self, language: str) -> int | None:
        """No target-language tokens in a joint model trained here."""
        return None

    def decode(self, ids: Iterable[int]) -> str:
        special = (self.pad_id, self.bos_id, self.eos_id)
        return self._sp.decode([int(i) for i in ids if int(i) not in special])


class MarianTokenizer:
    """Marian's tokenization, as ``transformers.MarianTokenizer`` does it: the source SentencePiece model
    splits source text into pieces, ``vocab.json`` maps each piece to its id (unknown pieces to
    ``<unk>``); target ids map back to pieces through the same vocabulary and the target model joins them.
    EOS is appended by the engine, as for every tokenizer."""

    kind = "marian"
    files = (MARIAN_SOURCE_SPM, MARIAN_TARGET_SPM, MARIAN_VOCAB)

    def __init__(self, source_proto: bytes, target_proto: bytes, vocab: dict[str, int], *,
                 eos: str = "</s>", unk: str = "<unk>", pad: str = "<pad>") -> None:
        self._protos = (source_proto, target_proto)
        self._source = spm.SentencePieceProcessor(model_proto=source_proto)
        self._target = spm.SentencePieceProcessor(model_proto=target_proto)
        self.vocab = vocab
        self._pieces = {i: piece for piece, i in vocab.items()}
        missing = [piece for piece in (eos, unk, pad) if piece not in vocab]
        if missing:
            raise ValueError(f"{MARIAN_VOCAB} lacks the special pieces {', '.join(missing)}")
        self.eos_id, self.unk_id, self.pad_id = vocab[eos], vocab[unk], vocab[pad]
        self.bos_id = self.pad_id  # Marian has no BOS; decoding starts from pad

    @classmethod
    def load(cls, directory: str | Path) -> MarianTokenizer:
        """Load the three files from a Marian or model-version directory."""
        directory = Path(directory)
        for name in cls.files:
            if not (directory / name).is_file():
                raise NmtError(f"tokenizer file missing: {directory / name}")
        try:
            vocab = json.loads((directory / MARIAN_VOCAB).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise NmtError(f"cannot read {directory / MARIAN_VOCAB}: {error}") from error
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise NmtError(f"{directory / MARIAN_VOCAB} must map pieces to integer ids")
        return cls((directory / MARIAN_SOURCE_SPM).read_bytes(), (directory / MARIAN_TARGET_SPM).read_bytes(),
                   vocab)

    def save(self, directory: str | Path) -> Path:
        """Write the three files into ``directory``; returns the vocabulary's path."""
        directory = Path(directory)
        for name, proto in zip(self.files[:2], self._protos, strict=True):
            (directory / name).write_bytes(proto)
        path = directory / MARIAN_VOCAB
        path.write_text(json.dumps(self.vocab, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        return path

    @property
    def vocab_size(self) -> int:
        return max(self.vocab.values()) + 1

    @functools.cached_property
    def target_languages(self) -> list[str]:
        """The language codes of the vocabulary's ``>>xx<<`` tokens (multilingual models), sorted."""
        return sorted(m.group(1) for m in map(LANGUAGE_TOKEN.match, self.vocab) if m)

    @functools.cached_property
    def max_piece_bytes(self) -> int:
        return max(5, *(len(piece.encode("utf-8")) for piece in self.vocab))

    def encode(self, text: str) -> list[int]:
        return self._ids(self._source.encode(text, out_type=str))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._ids(pieces) for pieces in self._source.encode(list(texts), out_type=str)]

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids of ``text`` (a target prefix, a translation to score): the target model's pieces."""
        return self._ids(self._target.encode(text, out_type=str))

    def _ids(self, pieces: Iterable[str]) -> list[int]:
        return [self.vocab.get(piece, self.unk_id) for piece in pieces]

    def language_id(self, language: str) -> int | None:
        """The id of the ``>>language<<`` token, or None if the vocabulary has none."""
        return self.vocab.get(f">>{language}<<")

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._pieces.get(int(i), "<unk>") for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Target text, as ``transformers.MarianTokenizer.decode(ids, skip_special_tokens=True)``: special pieces
        (``<unk>`` too) are left out, the target model joins the rest, and then, as there, every ``▁`` left
        becomes a space and the text is stripped. The target model writes pieces it does not know as they
        are, marks included: a shared vocabulary (OPUS-MT's) holds many, the source language's."""
        special = (self.pad_id, self.eos_id, self.unk_id)
        text = self._target.decode_pieces(self.pieces(i for i in ids if int(i) not in special))
        return text.replace(WORD_START, " ").strip()


class HfTokenizer:
    """A Hugging Face ``tokenizer.json``, as ``transformers``' tokenizers of NLLB-200 and mBART-50 run it: text to
    ids without special tokens (the language tokens are the model's, placed by :class:`server.text.TextCodec`;
    EOS is appended by the engine), ids to text with special tokens left out."""

    kind = "huggingface"
    files = (HF_TOKENIZER_FILE,)

    def __init__(self, definition: str, *, eos: str = "</s>", unk: str = "<unk>", pad: str = "<pad>",
                 bos: str = "<s>") -> None:
        from tokenizers import Tokenizer as Backend

        self._definition = definition
        self._backend = Backend.from_str(definition)
        ids = {piece: self._backend.token_to_id(piece) for piece in (eos, unk, pad, bos)}
        missing = [piece for piece, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"{HF_TOKENIZER_FILE} lacks the special pieces {', '.join(missing)}")
        self.eos_id, self.unk_id, self.pad_id, self.bos_id = ids[eos], ids[unk], ids[pad], ids[bos]

    @classmethod
    def load(cls, directory: str | Path) -> HfTokenizer:
        path = Path(directory) / HF_TOKENIZER_FILE
        if not path.is_file():
            raise NmtError(f"tokenizer file missing: {path}")
        try:
            return cls(path.read_text(encoding="utf-8"))
        except Exception as error:
            raise NmtError(f"cannot read {path}: {error}") from error

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / HF_TOKENIZER_FILE
        path.write_text(self._definition, encoding="utf-8")
        return path

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    target_languages: list[str] = []  # the model's language tokens are in its manifest (language_tokens)

    @functools.cached_property
    def max_piece_bytes(self) -> int:
        return max(5, *(len(piece.encode("utf-8")) for piece in self._piece_table))

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids of ``text``: one model serves both sides."""
        return self.encode(text)

    @functools.cached_property
    def _piece_table(self) -> list[str]:
        return [self._backend.id_to_token(i) or "<unk>" for i in range(self.vocab_size)]

    def pieces(self, ids: Iterable[int]) -> list[str]:
        table = self._piece_table
        return [table[i] if 0 <= i < len(table) else "<unk>" for i in map(int, ids)]

    def language_id(self, language: str) -> int | None:
        """The id of the token spelt ``language`` (NLLB's ``deu_Latn``), if the vocabulary has one."""
        return self._backend.token_to_id(language)

    def decode(self, ids: Iterable[int]) -> str:
        """As ``transformers``' ``decode(ids, skip_special_tokens=True)``."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=True)


AnyTokenizer = Tokenizer | MarianTokenizer | HfTokenizer
TOKENIZERS: dict[str, type[AnyTokenizer]] = {Tokenizer.kind: Tokenizer, MarianTokenizer.kind: MarianTokenizer,
                                             HfTokenizer.kind: HfTokenizer}


def load_tokenizer(directory: str | Path, kind: str = Tokenizer.kind) -> AnyTokenizer:
    """The tokenizer of ``kind`` (a manifest's ``tokenizer_type``) stored in ``directory``."""
    if kind not in TOKENIZERS:
        raise NmtError(f"unknown tokenizer type {kind!r}; known: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[kind].load(directory)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8000, character_coverage: float = 1.0) -> Tokenizer:
    """Train a joint unigram SentencePiece model in memory on ``texts`` (both languages).

    ``vocab_size`` is an upper bound: small corpora (the generated dates) cannot fill a large
    vocabulary, so the trainer is told to shrink it (``hard_vocab_limit=False``).
    """
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_writer=model,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        model_type="unigram",
        character_coverage=character_coverage,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        num_threads=2,
        minloglevel=2,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
    )
    return Tokenizer(model.getvalue())
