"""SentencePiece tokenizer shared by training, export and serving (no torch).

One joint source+target model file (``spm.model``, a protobuf, never a pickle) travels with each
model version. Tokenizers trained here use the fixed special ids below, which model configs default
to; a tokenizer built elsewhere (e.g. with Marian's layout) keeps its own.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from nmt.model_format.layout import TOKENIZER_FILE

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """Encode text to subword ids and back; ids exclude BOS/EOS unless asked."""

    def __init__(self, model_proto: bytes) -> None:
        self._model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if self._sp.eos_id() < 0 or self._sp.pad_id() < 0:
            raise ValueError("a translation tokenizer needs end-of-sentence and padding pieces")
        self.pad_id, self.eos_id, self.bos_id = self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id()

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
        pieces = (self._sp.id_to_piece(i) for i in range(self.vocab_size))
        return max(5, *(len(piece.encode("utf-8")) for piece in pieces))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._sp.id_to_piece(int(i)) for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        special = (self.pad_id, self.bos_id, self.eos_id)
        return self._sp.decode([int(i) for i in ids if int(i) not in special])


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
